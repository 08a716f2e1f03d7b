"""Small helpers shared by the kernel modules: launch-size heuristics, 2-D row views, and the
autograd gradients a backward falls back on."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .._grads import reference_grads  # noqa: F401 (the kernels' backward uses it from here)

INTERPRETER_SMS = 8  # stand-in for the SM count when kernels run on the CPU interpreter


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def warps_for(block: int) -> int:
    """The usual num_warps for a one-row-per-program kernel whose row tile is ``block`` wide."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


@functools.lru_cache(maxsize=8)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: str) -> int:
    if device == "cuda" and torch.cuda.is_available():
        return _sms(torch.cuda.current_device())
    return INTERPRETER_SMS


def rows_per_program(rows: int, device: str) -> int:
    """Enough rows per program that one wave of programs covers every row (weight-grad partials)."""
    return max(1, -(-rows // sm_count(device)))


def as_rows(x: torch.Tensor, hidden: int) -> torch.Tensor:
    """``x`` as (rows, hidden) with a unit stride on the last dim (copies only when it must)."""
    flat = x.reshape(-1, hidden)
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def dense(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` with unit strides (kernels index weights as ``W + cols``: an expanded or sliced
    weight is copied)."""
    return t.contiguous() if t is not None else None


def either(t: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """A tensor argument for a pointer the kernel never reads (its HAS_* flag is off)."""
    return t if t is not None else placeholder


def zeros_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    return torch.zeros_like(t) if t is not None else None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@triton.jit
def row_limit(row, n_rows, n_cols):
    """Column bound for row ``row``: ``n_cols`` for a real row, 0 past the last one.

    Written as arithmetic because the interpreter mis-types ``block_mask & (scalar < scalar)``.
    """
    return tl.minimum((n_rows - row) * n_cols, n_cols)


