"""SwiGLU ``silu(a) * b`` in Triton: elementwise forward; the backward recomputes the sigmoid
instead of saving it (two saved inputs, nothing else)."""
from __future__ import annotations

from typing import Any, Callable

import torch
import triton
import triton.language as tl

from ...bucket import Bucket
from ..swiglu import reference
from ._common import reference_grads
from ._elementwise import flat, grid, heuristic, in_input_layout
from ._report import Reporter
from ._variant import resolve


@triton.jit
def _forward(A, B, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (a * tl.sigmoid(a) * b).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _backward(DY, A, B, DA, DB, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)
    silu = a * s
    tl.store(DA + offs, (dy * b * (s + silu * (1.0 - s))).to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offs, (dy * silu).to(DB.dtype.element_ty), mask=mask)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, config: dict,
                reporter: Reporter) -> torch.Tensor:
        fa, fb = flat(a, b)
        y = torch.empty_like(fa)
        if y.numel():
            reporter.launch(_forward, grid(fa.numel(), config), fa, fb, y, fa.numel(),
                            BLOCK=config["block"], num_warps=config["num_warps"])
        ctx.save_for_backward(a, b)   # the job's tensors: see gelu.py
        ctx.config, ctx.reporter = config, reporter
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        a, b = ctx.saved_tensors
        if torch.is_grad_enabled():   # create_graph: gradients that are differentiable themselves
            grads = reference_grads(reference, (a, b), (dy,), ctx.needs_input_grad[:2])
            return (*grads, None, None)
        a, b = flat(a, b)
        (dy,) = flat(dy)
        da, db = torch.empty_like(a), torch.empty_like(b)
        if a.numel():
            ctx.reporter.launch(_backward, grid(a.numel(), ctx.config), dy, a, b, da, db,
                                a.numel(), BLOCK=ctx.config["block"],
                                num_warps=ctx.config["num_warps"])
        return da, db, None, None


def build(config: dict, bucket: Bucket) -> Callable[..., torch.Tensor]:
    resolved = resolve(config, heuristic(bucket))
    reporter = Reporter("swiglu", "triton", bucket.id, config, resolved)

    def swiglu(a, b):
        return in_input_layout(lambda a, b: SwiGLUFunction.apply(a, b, resolved, reporter), a, b)

    return swiglu
