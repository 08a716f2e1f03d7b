"""Softmax over the last dim in Triton: one row per program, the row held in one tile; the
backward uses the saved output, ``dx = y * (dy - sum(dy * y))``."""
from __future__ import annotations

from typing import Any, Callable

import torch
import triton
import triton.language as tl

from ...bucket import Bucket
from ._common import as_rows, next_pow2, warps_for
from ._report import Reporter
from ._variant import resolve


@triton.jit
def _forward(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(Y + row * stride_y + cols, (e / tl.sum(e, axis=0)).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _backward(DY, Y, DX, stride_dy, stride_y, stride_dx, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    dx = y * (dy - tl.sum(dy * y, axis=0))
    tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)


def heuristic(bucket: Bucket) -> dict:
    return {"num_warps": warps_for(next_pow2(bucket.dim("cols")))}


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, config: dict, reporter: Reporter) -> torch.Tensor:
        cols = x.shape[-1]
        x2 = as_rows(x, cols)
        rows = x2.shape[0]
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # not a view: in-place stays legal
        if rows:
            reporter.launch(_forward, (rows,), x2, y.view(rows, cols), x2.stride(0), cols, cols,
                            BLOCK=next_pow2(cols), num_warps=config["num_warps"])
        ctx.save_for_backward(y)
        ctx.config, ctx.reporter = config, reporter
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        (y,) = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph: torch's formula on the saved output, whose graph leads back to x
            yf = y.float()
            dyf = dy.float()
            return (yf * (dyf - (dyf * yf).sum(-1, keepdim=True))).to(y.dtype), None, None
        cols = y.shape[-1]
        y2 = y.view(-1, cols)
        rows = y2.shape[0]
        if rows == 0:
            return torch.zeros_like(y), None, None
        dy2 = as_rows(dy, cols)
        dx = torch.empty_like(y)
        ctx.reporter.launch(_backward, (rows,), dy2, y2, dx.view(rows, cols), dy2.stride(0),
                            cols, cols, cols, BLOCK=next_pow2(cols),
                            num_warps=ctx.config["num_warps"])
        return dx, None, None


def build(config: dict, bucket: Bucket) -> Callable[..., torch.Tensor]:
    resolved = resolve(config, heuristic(bucket))
    reporter = Reporter("softmax", "triton", bucket.id, config, resolved)

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        return SoftmaxFunction.apply(input, resolved, reporter)

    return softmax
