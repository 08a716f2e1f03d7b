"""GELU and GeGLU (``gelu(a) * b``) in Triton, exact (erf) or tanh-approximated; one elementwise
kernel pair serves both (``GATED``), and the backward recomputes from the saved inputs.

GeGLU has no op in the registry yet (no torch function or module pattern routes to it):
:func:`geglu` is the kernel's entry point for callers and the bench.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import triton
import triton.language as tl

from ...bucket import Bucket
from ..gelu import reference
from ._common import reference_grads
from ._elementwise import flat, grid, heuristic, in_input_layout
from ._report import Reporter
from ._variant import resolve

@triton.jit
def _gelu_and_slope(x, TANH: tl.constexpr):
    """gelu(x) and d gelu / dx in fp32; tanh(z) as 2 * sigmoid(2z) - 1."""
    if TANH:
        k: tl.constexpr = 0.7978845608028654  # sqrt(2 / pi)
        inner = k * (x + 0.044715 * x * x * x)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        y = 0.5 * x * (1.0 + t)
        slope = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        y = x * cdf
        slope = cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327  # x * pdf(x)
    return y, slope


@triton.jit
def _forward(A, B, Y, n, BLOCK: tl.constexpr, TANH: tl.constexpr, GATED: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    y, _ = _gelu_and_slope(a, TANH)
    if GATED:
        y = y * tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _backward(DY, A, B, DA, DB, n, BLOCK: tl.constexpr, TANH: tl.constexpr, GATED: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    y, slope = _gelu_and_slope(a, TANH)
    if GATED:
        b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DB + offs, (dy * y).to(DB.dtype.element_ty), mask=mask)
        dy = dy * b
    tl.store(DA + offs, (dy * slope).to(DA.dtype.element_ty), mask=mask)


class GeluFunction(torch.autograd.Function):
    """gelu(a) when ``b`` is None, else gelu(a) * b."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor | None, tanh: bool, config: dict,
                reporter: Reporter) -> torch.Tensor:
        (fa,) = flat(a)
        fb = flat(b)[0] if b is not None else None
        y = torch.empty_like(fa)
        if y.numel():
            reporter.launch(_forward, grid(fa.numel(), config), fa, fb if fb is not None else fa,
                            y, fa.numel(), BLOCK=config["block"], TANH=tanh, GATED=b is not None,
                            num_warps=config["num_warps"])
        # the job's tensors, not the flat copies: a backward under create_graph recomputes
        # through their graphs
        ctx.save_for_backward(a, b)
        ctx.tanh, ctx.config, ctx.reporter = tanh, config, reporter
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        a, b = ctx.saved_tensors
        if torch.is_grad_enabled():   # create_graph: gradients that are differentiable themselves
            approximate = "tanh" if ctx.tanh else "none"
            grads = reference_grads(lambda a, b: _gelu_times(a, b, approximate), (a, b), (dy,),
                                    ctx.needs_input_grad[:2])
            return (*grads, None, None, None)
        a, = flat(a)
        b = flat(b)[0] if b is not None else None
        (dy,) = flat(dy)
        da = torch.empty_like(a)
        db = torch.empty_like(b) if b is not None else None
        if a.numel():
            ctx.reporter.launch(_backward, grid(a.numel(), ctx.config), dy, a,
                                b if b is not None else a, da, db if db is not None else da,
                                a.numel(), BLOCK=ctx.config["block"], TANH=ctx.tanh,
                                GATED=b is not None, num_warps=ctx.config["num_warps"])
        return da, db, None, None, None


def _gelu_times(a: torch.Tensor, b: torch.Tensor | None, approximate: str) -> torch.Tensor:
    y = reference(a, approximate)
    return y if b is None else y * b


def build(config: dict, bucket: Bucket) -> Callable[..., torch.Tensor]:
    resolved = resolve(config, heuristic(bucket))
    reporter = Reporter("gelu", "triton", bucket.id, config, resolved)

    def gelu(input, approximate="none"):
        return in_input_layout(
            lambda a: GeluFunction.apply(a, None, approximate == "tanh", resolved, reporter), input)

    return gelu


def geglu(a: torch.Tensor, b: torch.Tensor, approximate: str = "none",
          config: dict | None = None) -> torch.Tensor:
    """``gelu(a, approximate) * b`` (a and b of one shape and dtype) with autograd."""
    resolved = resolve(config or {}, heuristic())
    reporter = Reporter("geglu", "triton", "", config or {}, resolved)
    return in_input_layout(
        lambda a, b: GeluFunction.apply(a, b, approximate == "tanh", resolved, reporter), a, b)
