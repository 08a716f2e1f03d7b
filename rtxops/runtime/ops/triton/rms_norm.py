"""RMSNorm forward and backward in Triton: one row per program forward; backward writes a partial
weight gradient per program (summed in fp32 afterwards: no atomics, deterministic)."""
from __future__ import annotations

from typing import Any, Callable

import torch
import triton
import triton.language as tl

from ...bucket import Bucket
from ..rms_norm import eps_or_default, reference
from ._common import (as_rows, cdiv, dense, either, next_pow2, reference_grads, row_limit,
                      rows_per_program, warps_for, zeros_or_none)
from ._report import Reporter
from ._variant import resolve


@triton.jit
def _forward(X, Y, W, RSTD, stride_x, stride_y, n_cols, eps,
             BLOCK: tl.constexpr, HAS_W: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    y = x * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _backward(DY, X, W, RSTD, DX, DW, stride_dy, stride_x, stride_dx, n_rows, n_cols,
              ROWS: tl.constexpr, BLOCK: tl.constexpr, HAS_W: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    else:
        w = tl.full((BLOCK,), 1.0, tl.float32)
    dw = tl.zeros((BLOCK,), tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        mask = cols < row_limit(row, n_rows, n_cols)
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + tl.minimum(row, n_rows - 1))
        xhat = x * rstd
        wdy = w * dy
        dx = rstd * (wdy - xhat * (tl.sum(wdy * xhat, axis=0) / n_cols))
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
    if HAS_W:
        tl.store(DW + pid * n_cols + cols, dw, mask=col_mask)


def heuristic(bucket: Bucket) -> dict:
    block = next_pow2(bucket.dim("hidden"))
    return {"num_warps": warps_for(block),
            "rows_per_program": rows_per_program(bucket.dim("rows"), bucket.device)}


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, eps: float, config: dict,
                reporter: Reporter) -> torch.Tensor:
        hidden = x.shape[-1]
        x2 = as_rows(x, hidden)
        rows = x2.shape[0]
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # not a view: see layer_norm.py
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        if rows:
            reporter.launch(_forward, (rows,), x2, y.view(rows, hidden), either(dense(weight), x2),
                            rstd, x2.stride(0), hidden, hidden, eps, BLOCK=next_pow2(hidden),
                            HAS_W=weight is not None, num_warps=config["num_warps"])
        ctx.save_for_backward(x, weight, rstd)   # the job's tensors: see layer_norm.py
        ctx.eps, ctx.config, ctx.reporter = eps, config, reporter
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, weight, rstd = ctx.saved_tensors
        hidden = x.shape[-1]
        if torch.is_grad_enabled():   # create_graph: gradients that are differentiable themselves
            grads = reference_grads(lambda x, w: reference(x, (hidden,), w, ctx.eps), (x, weight),
                                    (dy,), ctx.needs_input_grad[:2])
            return (*grads, None, None, None)
        x2 = as_rows(x, hidden)
        rows = x2.shape[0]
        if rows == 0:
            return (torch.zeros_like(x), zeros_or_none(weight), None, None, None)
        dy2 = as_rows(dy, hidden)
        dx = torch.empty_like(x2)
        per = min(ctx.config["rows_per_program"], rows)
        programs = cdiv(rows, per)
        dw = (torch.empty((programs, hidden), dtype=torch.float32, device=x2.device)
              if weight is not None else None)
        ctx.reporter.launch(_backward, (programs,), dy2, x2, either(dense(weight), x2), rstd, dx,
                            either(dw, rstd), dy2.stride(0), x2.stride(0), dx.stride(0), rows,
                            hidden, ROWS=per, BLOCK=next_pow2(hidden), HAS_W=weight is not None,
                            num_warps=ctx.config["num_warps"])
        dweight = dw.sum(0).to(weight.dtype) if dw is not None else None
        return dx.view(x.shape), dweight, None, None, None


def build(config: dict, bucket: Bucket) -> Callable[..., torch.Tensor]:
    resolved = resolve(config, heuristic(bucket))
    reporter = Reporter("rms_norm", "triton", bucket.id, config, resolved)

    def rms_norm(input, normalized_shape, weight=None, eps=None):
        if weight is not None and weight.dtype != input.dtype:
            return reference(input, normalized_shape, weight, eps)  # mixed dtypes: not this kernel
        e = eps_or_default(input, eps)
        return RMSNormFunction.apply(input, weight, e, resolved, reporter)

    return rms_norm
