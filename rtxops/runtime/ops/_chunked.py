"""Shared by the chunked variants: apply an op slice by slice so its fp32 temporaries stay small."""
from __future__ import annotations

from typing import Callable

import torch

from ._layout import is_dense, stride_order


def over_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int) -> torch.Tensor:
    """``fn`` over chunks of ``rows`` rows of ``x`` (all dims but the last flattened)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= rows:
        return fn(x)
    return torch.cat([fn(c) for c in flat.split(rows)]).view(x.shape)


def over_elements(fn: Callable[..., torch.Tensor], n: int, *tensors: torch.Tensor) -> torch.Tensor:
    """``fn`` over matching flat slices of ``n`` elements of same-shaped ``tensors``, in the first
    one's memory order: the result is laid out as torch's elementwise kernels lay theirs (a
    transposed input gives a transposed output, which a job may ``.view()`` as such)."""
    first = tensors[0]
    if first.numel() <= n:
        return fn(*tensors)
    order = stride_order(first)
    # torch keeps the order of the input's strides, a sliced input's too (its answer is dense
    # in that order); a broadcast one (a stride 0) goes the plain way, whose layout matches
    # torch's only sometimes (the first-call check tells)
    if order != list(range(first.dim())) and (is_dense(first, order) or 0 not in first.stride()):
        back = sorted(range(first.dim()), key=order.__getitem__)
        return over_elements(fn, n, *(t.permute(order) for t in tensors)).permute(back)
    slices = zip(*(t.reshape(-1).split(n) for t in tensors))
    return torch.cat([fn(*s) for s in slices]).view(first.shape)


