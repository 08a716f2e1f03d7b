"""LayerNorm forward and backward in Triton: one row per program forward (mean and rstd saved in
fp32); backward writes per-program fp32 partials of the weight and bias gradients, summed after
(no atomics, deterministic)."""
from __future__ import annotations

from typing import Any, Callable

import torch
import triton
import triton.language as tl

from ...bucket import Bucket
from ..layer_norm import reference
from ._common import (as_rows, cdiv, dense, either, next_pow2, reference_grads, row_limit,
                      rows_per_program, warps_for, zeros_or_none)
from ._report import Reporter
from ._variant import resolve


@triton.jit
def _forward(X, Y, W, B, MEAN, RSTD, stride_x, stride_y, n_cols, eps,
             BLOCK: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    xc = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _backward(DY, X, W, MEAN, RSTD, DX, DW, DB, stride_dy, stride_x, stride_dx, n_rows, n_cols,
              ROWS: tl.constexpr, BLOCK: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    else:
        w = tl.full((BLOCK,), 1.0, tl.float32)
    dw = tl.zeros((BLOCK,), tl.float32)
    db = tl.zeros((BLOCK,), tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        mask = cols < row_limit(row, n_rows, n_cols)
        last = tl.minimum(row, n_rows - 1)
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + last)
        xhat = tl.where(mask, (x - tl.load(MEAN + last)) * rstd, 0.0)
        wdy = w * dy
        dx = rstd * (wdy - (tl.sum(wdy, axis=0) + xhat * tl.sum(wdy * xhat, axis=0)) / n_cols)
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    if HAS_W:
        tl.store(DW + pid * n_cols + cols, dw, mask=col_mask)
    if HAS_B:
        tl.store(DB + pid * n_cols + cols, db, mask=col_mask)


def heuristic(bucket: Bucket) -> dict:
    return {"num_warps": warps_for(next_pow2(bucket.dim("hidden"))),
            "rows_per_program": rows_per_program(bucket.dim("rows"), bucket.device)}


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                eps: float, config: dict, reporter: Reporter) -> torch.Tensor:
        hidden = x.shape[-1]
        x2 = as_rows(x, hidden)
        rows = x2.shape[0]
        # the output is the buffer itself, not a view of it: a view made in here could not be
        # changed in place by the job (torch's own output can)
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        if rows:
            reporter.launch(_forward, (rows,), x2, y.view(rows, hidden), either(dense(weight), x2),
                            either(dense(bias), x2), mean, rstd, x2.stride(0), hidden, hidden, eps,
                            BLOCK=next_pow2(hidden), HAS_W=weight is not None,
                            HAS_B=bias is not None, num_warps=config["num_warps"])
        # the job's own tensors (not x2, made here without a graph): a backward under
        # create_graph recomputes through them
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.eps, ctx.config, ctx.reporter = eps, config, reporter
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, weight, bias, mean, rstd = ctx.saved_tensors
        hidden = x.shape[-1]
        if torch.is_grad_enabled():   # create_graph: gradients that are differentiable themselves
            grads = reference_grads(lambda x, w, b: reference(x, (hidden,), w, b, ctx.eps),
                                    (x, weight, bias), (dy,), ctx.needs_input_grad[:3])
            return (*grads, None, None, None)
        x2 = as_rows(x, hidden)
        rows = x2.shape[0]
        if rows == 0:
            return (torch.zeros_like(x), zeros_or_none(weight), zeros_or_none(bias),
                    None, None, None)
        dy2 = as_rows(dy, hidden)
        dx = torch.empty_like(x2)
        per = min(ctx.config["rows_per_program"], rows)
        programs = cdiv(rows, per)

        def partial(wanted: bool) -> torch.Tensor | None:
            return (torch.empty((programs, hidden), dtype=torch.float32, device=x2.device)
                    if wanted else None)

        dw, db = partial(weight is not None), partial(bias is not None)
        ctx.reporter.launch(_backward, (programs,), dy2, x2, either(dense(weight), x2), mean, rstd,
                            dx, either(dw, rstd), either(db, rstd), dy2.stride(0), x2.stride(0),
                            dx.stride(0), rows, hidden, ROWS=per, BLOCK=next_pow2(hidden),
                            HAS_W=weight is not None, HAS_B=bias is not None,
                            num_warps=ctx.config["num_warps"])
        dweight = dw.sum(0).to(weight.dtype) if dw is not None else None
        dbias = db.sum(0).to(bias.dtype) if db is not None else None
        return dx.view(x.shape), dweight, dbias, None, None, None


def build(config: dict, bucket: Bucket) -> Callable[..., torch.Tensor]:
    resolved = resolve(config, heuristic(bucket))
    reporter = Reporter("layer_norm", "triton", bucket.id, config, resolved)

    def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-05):
        return LayerNormFunction.apply(input, weight, bias, eps, resolved, reporter)

    return layer_norm
