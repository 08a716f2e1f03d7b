"""The two contracts of the runtime: :class:`OpSpec` (what an op is) and :class:`Variant` (one way
to compute it)."""
from __future__ import annotations

import hashlib
import inspect
import itertools
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
    calls run the reference untouched. Without ``key``, ``bucket`` is used on the hot path.
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


def _source_modules(fn: Callable, depth: int = 0, found: dict | None = None) -> dict:
    """The modules of ``fn`` and of the functions it closes over or names, within ``fn``'s own
    top-level package (torch and the standard library are versions of their own)."""
    found = {} if found is None else found
    module = inspect.getmodule(fn)
    if module is None or module.__name__ in found and depth:
        return found
    found[module.__name__] = module
    package = module.__name__.split(".")[0]
    code = getattr(fn, "__code__", None)
    if code is None or depth >= 4:
        return found
    cells = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    names = set(code.co_names)
    for const in code.co_consts:  # nested functions and lambdas
        if isinstance(const, types.CodeType):
            names.update(const.co_names)
    used = cells + [fn.__globals__.get(n) for n in names]
    for value in used:
        if isinstance(value, types.FunctionType) and value.__module__ \
                and value.__module__.split(".")[0] == package and value.__module__ not in found:
            _source_modules(value, depth + 1, found)
        elif isinstance(value, types.ModuleType) and value.__name__.split(".")[0] == package:
            found.setdefault(value.__name__, value)
    return found
