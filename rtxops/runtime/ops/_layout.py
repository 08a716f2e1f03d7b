"""Outputs in the layout torch's own kernels give them.

torch lays an output out in the order of its input's strides: a (B, L, H, E) view transposed to
(B, H, L, E) goes in, and the output is the same kind of view, which the job may ``.view()`` back
(``y.transpose(1, 2).view(B, L, H * E)``). A variant built from matmuls, ``cat`` or ``stack``
answers contiguous instead; :func:`in_layout_of` copies its output into torch's layout, so the
first-call check (which compares layouts) keeps it.
"""
from __future__ import annotations

import torch


def in_layout_of(out: torch.Tensor, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out`` (in ``dtype``, default its own) laid out with its dimensions in the order of
    ``like``'s strides; no copy beyond the dtype's when that order is the plain one."""
    dtype = out.dtype if dtype is None else dtype
    if out.dim() != like.dim() or stride_order(like) == list(range(like.dim())):
        return out.to(dtype)
    return empty_in_layout_of(like, out.shape, dtype).copy_(out)


def empty_in_layout_of(like: torch.Tensor, shape: torch.Size | None = None,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialized dense tensor of ``shape`` (default ``like``'s) whose dimensions are laid
    out in the order of ``like``'s strides (``torch.empty_like`` does so only for a dense
    ``like``; a sliced one gets a contiguous tensor)."""
    shape = like.shape if shape is None else shape
    strides = [0] * len(shape)
    step = 1
    for d in reversed(stride_order(like)):   # innermost first
        strides[d] = step
        step *= max(shape[d], 1)
    # empty_strided, not a permuted view: an autograd.Function may return it, and the job may
    # then change it in place
    return torch.empty_strided(tuple(shape), tuple(strides), dtype=dtype or like.dtype,
                               device=like.device)


def stride_order(t: torch.Tensor) -> list[int]:
    """``t``'s dimensions, outermost (largest stride) first; ties keep their order (torch's
    kernels lay their outputs out in this order of their input's)."""
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


def is_dense(t: torch.Tensor, order: list[int]) -> bool:
    """Whether ``t`` fills its memory without gaps or overlaps in ``order`` (its stride order)."""
    step = 1
    for d in reversed(order):
        if t.shape[d] != 1 and t.stride(d) != step:
            return False
        step *= t.shape[d]
    return True


def layout_kind(t: torch.Tensor) -> tuple:
    """What sets apart the strided layouts a variant may answer differently: the order of the
    dimensions in memory, and whether they fill it (sliced ones do not)."""
    order = stride_order(t)
    return tuple(order), is_dense(t, order)


def suggested_memory_format(t: torch.Tensor) -> torch.memory_format:
    """The memory format torch's C++ ``suggest_memory_format`` gives ``t`` (ops that copy their
    input dense, as rms_norm does, keep it): channels-last for a 4-D (5-D) tensor laid out so,
    else contiguous (a transposed view's copy is contiguous)."""
    if t.is_contiguous():
        return torch.contiguous_format
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def layout_key(t: torch.Tensor):
    """``t``'s layout as a call key part: True when contiguous, else its strides. Each strided
    layout gets a route of its own, checked on its own first call (a variant may answer one
    layout as torch does and another not)."""
    return True if t.is_contiguous() else t.stride()
