"""Shared launch plumbing of the elementwise kernels (swiglu, gelu, GeGLU): flat contiguous views,
one ``block``-wide tile per program, outputs in their input's layout."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ...bucket import Bucket
from .._layout import stride_order
from ._common import cdiv

DEFAULT_BLOCK = 1024


def heuristic(bucket: Bucket | None = None) -> dict:
    """Elementwise tiles do not depend on the shape; the bucket is accepted for uniformity."""
    return {"block": DEFAULT_BLOCK, "num_warps": 4}


def flat(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Contiguous versions (copies only for non-contiguous inputs): the kernels index flat."""
    return [t.contiguous() for t in tensors]


def grid(n: int, config: dict) -> tuple[int]:
    return (cdiv(n, config["block"]),)


def in_input_layout(fn: Callable[..., torch.Tensor], first: torch.Tensor, *rest: Any) -> torch.Tensor:
    """``fn(first, *rest)`` with its output laid out as torch lays out an elementwise op's: in the
    order of ``first``'s strides (a channels-last or transposed input gives the same layout out).
    The kernels see the tensors permuted into that order, where they are contiguous or copied
    once; the permutations are outside ``fn``'s autograd.Function, so the output is the job's to
    change in place."""
    order = stride_order(first)
    if order == list(range(first.dim())):
        return fn(first, *rest)
    back = [order.index(d) for d in range(len(order))]
    moved = [t.permute(order) if isinstance(t, torch.Tensor) and t.dim() == len(order) else t
             for t in rest]
    return fn(first.permute(order), *moved).permute(back)
