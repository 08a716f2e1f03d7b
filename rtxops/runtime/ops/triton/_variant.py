"""The Triton variant type: CUDA-only, built lazily, heuristic defaults for an untuned bucket.

Kernel modules import triton and decorate kernels at import time; whether ``@triton.jit`` makes a
compiled or an interpreted kernel depends on ``TRITON_INTERPRET`` *then*. So registration only
names the module, and :meth:`TritonVariant.build` imports it on the first build.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ...bucket import Bucket
from ...spec import Variant

AUTO = "auto"  # first choice of every tunable: the kernel module's heuristic for the bucket
INTERPRET_FLAG = "RTXOPS_TRITON_INTERPRET"


def interpreter_enabled() -> bool:
    """Tests only: CPU tensors are accepted when both this flag and ``TRITON_INTERPRET`` are 1."""
    return os.environ.get(INTERPRET_FLAG) == "1" and os.environ.get("TRITON_INTERPRET") == "1"


def resolve(config: dict, heuristic: dict) -> dict:
    """``config`` with every ``auto`` replaced by the heuristic's value (the config actually used)."""
    return {k: heuristic[k] if config.get(k, AUTO) == AUTO else config[k] for k in heuristic}


def kernel_module(name: str) -> Any:
    return importlib.import_module(f"{__package__}.{name}")


@dataclass
class TritonVariant(Variant):
    """A variant whose ``build`` lives in ``rtxops.runtime.ops.triton.<module>``.

    Registered for CUDA only; on CPU it is never chosen unless the interpreter flag is set (tests).
    """

    module: str = ""

    def supports(self, bucket: Bucket) -> bool:
        if bucket.torch_dtype not in self.dtypes:
            return False
        return bucket.device == "cuda" or (bucket.device == "cpu" and interpreter_enabled())

    @property
    def source_hash(self) -> str:
        """sha256 of the kernel module's source and of the modules it imports relatively
        (``from ._common import …``, ``from ..rms_norm import …``), and theirs in turn, read
        without importing triton."""
        spec = importlib.util.find_spec(f"{__package__}.{self.module}")
        origin = Path(spec.origin) if spec and spec.origin else None
        if origin is None:
            return hashlib.sha256(self.name.encode()).hexdigest()
        digest = hashlib.sha256(origin.read_bytes())
        seen, queue = {origin}, [origin]
        while queue:
            source = queue.pop(0)
            data = source.read_bytes()
            for dots, name in sorted(set(_RELATIVE_IMPORT.findall(data))):
                folder = source.parent if dots == b"." else source.parent.parent
                path = folder / (name.decode() + ".py")
                if path.is_file() and path not in seen:
                    seen.add(path)
                    queue.append(path)
                    digest.update(b"\0" + dots + name + b"\0" + path.read_bytes())
        return digest.hexdigest()


_RELATIVE_IMPORT = re.compile(rb"^from (\.\.?)(\w+) import", re.MULTILINE)


def triton_variant(op: str, module: str, space: dict[str, list], description: str,
                   name: str = "triton", **kwargs: Any) -> TritonVariant:
    """A CUDA-only Triton variant of ``op`` built by ``<module>.build(config, bucket)``."""

    def build(config: dict, bucket: Bucket) -> Callable[..., Any]:
        return kernel_module(module).build(config, bucket)

    return TritonVariant(op, name, "triton", build, config_space=space,
                         devices=frozenset({"cuda"}), description=description, module=module,
                         **kwargs)
