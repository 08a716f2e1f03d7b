"""The registry of ops and their variants."""
from __future__ import annotations

import importlib
import os
from typing import Iterable

from .errors import RegistryError
from .spec import REFERENCE, OpSpec, Variant

OP_MODULES = (
    "rms_norm",
    "layer_norm",
    "softmax",
    "gelu",
    "silu",
    "swiglu",
    "cross_entropy",
    "rope",
    "attention",
    "linear",
)


class Registry:
    """Ops by name and, per op, variants by name. Every op has a ``reference`` variant."""

    def __init__(self) -> None:
        self._ops: dict[str, OpSpec] = {}
        self._variants: dict[str, dict[str, Variant]] = {}

    def add_op(self, spec: OpSpec, variants: Iterable[Variant] = ()) -> None:
        self._ops[spec.name] = spec
        self._variants[spec.name] = {}
        reference = spec.reference   # (closed over: its module is then part of the source hash)
        self.add_variant(
            Variant(spec.name, REFERENCE, "reference", lambda config, bucket: reference,
                    dtypes=frozenset(spec.tolerances), description="what the job would have run")
        )
        for v in variants:
            self.add_variant(v)

    def add_variant(self, variant: Variant) -> None:
        if variant.op not in self._ops:
            raise RegistryError(f"cannot add variant {variant.name!r}: unknown op {variant.op!r}")
        self._variants[variant.op][variant.name] = variant

    def remove_variant(self, op: str, name: str) -> None:
        if name == REFERENCE:
            raise RegistryError("the reference variant cannot be removed")
        self._variants[op].pop(name, None)

    def op(self, name: str) -> OpSpec:
        try:
            return self._ops[name]
        except KeyError:
            raise RegistryError(f"unknown op {name!r} (known: {', '.join(sorted(self._ops))})") from None

    def variant(self, op: str, name: str) -> Variant:
        variants = self._variants.get(op)
        if variants is None:
            self.op(op)
        try:
            return variants[name]
        except KeyError:
            raise RegistryError(
                f"unknown variant {name!r} for op {op!r} (known: {', '.join(sorted(variants))})"
            ) from None

    def variants(self, op: str) -> list[Variant]:
        self.op(op)
        return list(self._variants[op].values())

    def ops(self) -> list[OpSpec]:
        return list(self._ops.values())


def load_builtin(registry: Registry | None = None) -> Registry:
    """A registry holding every built-in op (one module per op under ``rtxops.runtime.ops``),
    plus the variants of the plugin modules named in ``RTXOPS_VARIANT_MODULES``."""
    registry = registry or Registry()
    for name in OP_MODULES:
        module = importlib.import_module(f"rtxops.runtime.ops.{name}")
        registry.add_op(module.SPEC, module.VARIANTS)
    load_plugins(registry, os.environ.get("RTXOPS_VARIANT_MODULES", ""))
    return registry


def load_plugins(registry: Registry, modules: str) -> None:
    """Add the ``VARIANTS`` of each module in the comma-separated ``modules`` (a user's own
    kernels: the job and the daemon both load them, so the evolve loop can tune them)."""
    for name in filter(None, (m.strip() for m in modules.split(","))):
        try:
            module = importlib.import_module(name)
        except Exception as e:   # missing, or failing on import: said, not a traceback
            raise RegistryError(f"variant module {name!r} (RTXOPS_VARIANT_MODULES) cannot be "
                                f"imported: {type(e).__name__}: {e}") from None
        for variant in getattr(module, "VARIANTS", ()):
            registry.add_variant(variant)


_default: Registry | None = None


def default_registry() -> Registry:
    """The process-wide registry the dispatcher uses."""
    global _default
    if _default is None:
        _default = load_builtin()
    return _default
