"""Shared builder for ``torch.compile`` variants, compiled once per bucket."""
from __future__ import annotations

import types
from typing import Callable

import torch

from ..bucket import Bucket
from ..spec import Variant

COMPILE_SPACE = {"mode": ["default", "max-autotune-no-cudagraphs"], "dynamic": [False, True]}


def _fresh_copy(fn: Callable) -> Callable:
    # Dynamo keys its cache (and its recompile limit) on the code object: a copy per bucket keeps
    # buckets from evicting each other.
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compiled_variant(op: str, fn: Callable, description: str = "", **kwargs) -> Variant:
    """A variant that runs ``torch.compile(fn)`` built for each bucket."""

    def build(config: dict, bucket: Bucket) -> Callable:
        return torch.compile(
            _fresh_copy(fn), mode=config.get("mode", "default"), dynamic=config.get("dynamic", False)
        )

    return Variant(
        op, "compiled", "compiled", build, config_space=dict(COMPILE_SPACE),
        description=description or f"torch.compile of the {op} math, one graph per bucket", **kwargs,
    )
