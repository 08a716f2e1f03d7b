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
    order = sorted(range(like.dim()), key=lambda d: -like.stride(d))  # stable: ties keep order
    if out.dim() != like.dim() or order == list(range(like.dim())):
        return out.to(dtype)
    laid = torch.empty([out.shape[d] for d in order], dtype=dtype, device=out.device)
    return laid.permute([order.index(d) for d in range(len(order))]).copy_(out)
