"""The two contracts of the runtime: :class:`OpSpec` (what an op is) and :class:`Variant` (one way
to compute it)."""
from __future__ import annotations

import hashlib
import inspect
import itertools
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from .bucket import Bucket
from .errors import PlanError

Args = tuple[tuple, dict]
REFERENCE = "reference"


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


DEFAULT_TOLERANCES = {
    torch.float32: Tolerance(1e-5, 1.3e-5),
    torch.float64: Tolerance(1e-7, 1e-7),
    torch.bfloat16: Tolerance(1.6e-2, 1.6e-2),
    torch.float16: Tolerance(1e-3, 1e-3),
}
DEFAULT_GRAD_TOLERANCES = {
    torch.float32: Tolerance(1e-4, 1e-4),
    torch.float64: Tolerance(1e-7, 1e-7),
    torch.bfloat16: Tolerance(3e-2, 3e-2),
    torch.float16: Tolerance(2e-3, 2e-3),
}


@dataclass
class OpSpec:
    """An op: its reference, how calls map to buckets, and how close other variants must come.

    ``key(*args, **kwargs)`` runs on every call (hot path): it receives the call exactly as the
    caller made it (the reference's signature) and returns a cheap hashable signature of everything
    ``bucket`` looks at (shapes, dtypes, devices, flags), or None for calls it cannot describe.
    ``bucket(*args, **kwargs)`` runs once per new signature: it returns the bucket key
    ``(dtype, device_type, *dims)`` or None when the call is outside what the variants take; such
    calls run the reference untouched. Without ``key``, ``bucket`` is used on the hot path. The
    ops' keys hold a CPU tensor's device as ``True`` (``t.is_cpu``), other devices as
    ``t.device``: reading ``t.device`` makes a device object, which a call pays for several
    times over with its caches cold, as between a step's ops (``bench/dispatch_cold.py``).
    ``example_inputs(bucket, seed)`` makes real inputs for a bucket (correctness gate, tests).
    """

    name: str
    reference: Callable[..., Any]
    bucket: Callable[..., tuple | None]
    dims: tuple[str, ...]
    example_inputs: Callable[[Bucket, int], Args]
    tolerances: dict[torch.dtype, Tolerance] = field(default_factory=lambda: dict(DEFAULT_TOLERANCES))
    grad_tolerances: dict[torch.dtype, Tolerance] = field(
        default_factory=lambda: dict(DEFAULT_GRAD_TOLERANCES)
    )
    description: str = ""
    key: Callable[..., Any] | None = None

    @property
    def call_key(self) -> Callable[..., Any]:
        return self.key or self.bucket

    def to_bucket(self, key: tuple) -> Bucket:
        return Bucket.from_key(self.name, self.dims, key)

    def parse_bucket(self, text: str) -> Bucket:
        """Parse a bucket of this op written by hand; PlanError unless it names exactly the op's
        dims. Its :attr:`Bucket.id` is the one the runtime keys on (dims in the op's order)."""
        bucket = Bucket.parse(self.name, text)
        given = dict(bucket.dims)
        if len(given) != len(bucket.dims) or set(given) != set(self.dims):
            raise PlanError(f"bucket {text!r} for op {self.name!r} must give each of "
                            f"{', '.join(self.dims)} once")
        return Bucket(self.name, bucket.dtype, bucket.device, tuple((d, given[d]) for d in self.dims))

    def tolerance(self, dtype: torch.dtype, grad: bool = False) -> Tolerance:
        table = self.grad_tolerances if grad else self.tolerances
        return table.get(dtype, table[torch.float32])


@dataclass
class Variant:
    """One implementation of an op.

    ``build(config, bucket)`` returns a callable with the reference's signature that supports
    autograd. Built callables are cached by the dispatcher per (variant, config, bucket).
    """

    op: str
    name: str
    family: str
    build: Callable[[dict, Bucket], Callable[..., Any]]
    config_space: dict[str, list] = field(default_factory=dict)
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.bfloat16, torch.float16})
    deterministic: bool = True
    description: str = ""
    # whether the gradients its backward returns can be differentiated again (a job's
    # ``create_graph=True``); torch.compile's backward cannot (see second_order.py)
    double_backward: bool = True

    @property
    def default_config(self) -> dict:
        return {k: v[0] for k, v in self.config_space.items()}

    def configs(self) -> Iterator[dict]:
        """Every point of the config space (one empty config when there is none)."""
        keys = sorted(self.config_space)
        for values in itertools.product(*(self.config_space[k] for k in keys)):
            yield dict(zip(keys, values))

    def check_config(self, config: dict) -> str | None:
        """Return why ``config`` is outside the space, or None when it is inside."""
        for k, v in config.items():
            if k not in self.config_space:
                return f"unknown config key {k!r} (space: {sorted(self.config_space) or 'none'})"
            if v not in self.config_space[k]:
                return f"config {k}={v!r} not in {self.config_space[k]!r}"
        return None

    def supports(self, bucket: Bucket) -> bool:
        return bucket.device in self.devices and bucket.torch_dtype in self.dtypes

    @property
    def source_hash(self) -> str:
        """sha256 of the source files the variant's code comes from (telemetry, tuning DB,
        bundles): the module defining ``build`` and those of the functions it uses (a compiled
        variant's math lives in the op's file, shared helpers in their own)."""
        modules = _source_modules(self.build)
        if not modules:
            return hashlib.sha256(self.name.encode()).hexdigest()
        digest = hashlib.sha256()
        for name in sorted(modules):
            digest.update(name.encode() + b"\0" + inspect.getsource(modules[name]).encode())
        return digest.hexdigest()


def _source_modules(fn: Callable) -> dict:
    """The modules of ``fn`` and of every function it reaches, transitively: by closure, by a
    global name, through a module (``_layout.in_layout_of``) or a class's methods, within
    ``fn``'s own top-level package (torch and the standard library are versions of their own).
    Functions are followed wherever they live: a helper beside ``build`` in its own module
    calls helpers of other modules."""
    module = inspect.getmodule(fn)
    if module is None:
        return {}
    package = module.__name__.split(".")[0]
    found = {module.__name__: module}

    def ours(value) -> bool:
        name = getattr(value, "__module__", None) if not isinstance(value, types.ModuleType) \
            else value.__name__
        return isinstance(name, str) and name.split(".")[0] == package

    seen: set[int] = set()
    stack: list = [fn]
    while stack:
        value = stack.pop()
        if id(value) in seen or not ours(value):
            continue
        seen.add(id(value))
        if isinstance(value, types.ModuleType):
            found.setdefault(value.__name__, value)
            continue
        owner = sys.modules.get(value.__module__)
        if owner is not None:
            found.setdefault(owner.__name__, owner)
        if isinstance(value, type):   # an autograd.Function, a kernel's helper class
            stack.extend(getattr(m, "__func__", m) for m in vars(value).values())
            continue
        if not isinstance(value, types.FunctionType):
            stack.extend(w for w in (getattr(value, "func", None), getattr(value, "fn", None))
                         if isinstance(w, types.FunctionType))   # functools.partial, a JIT kernel
            continue
        names, codes = set(), [value.__code__]
        while codes:   # the function's own code and its nested functions', at every depth
            code = codes.pop()
            names.update(code.co_names)
            codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        for cell in value.__closure__ or ():
            try:
                stack.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        for name in names:
            target = value.__globals__.get(name)
            if isinstance(target, types.ModuleType) and ours(target):
                stack.extend(getattr(target, n, None) for n in names)   # module.attribute
            stack.append(target)
    return found
