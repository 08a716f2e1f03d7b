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
from ._elementwise import flat, grid, heuristic
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
        (a,) = flat(a)
        b = flat(b)[0] if b is not None else None
        y = torch.empty_like(a)
        reporter.launch(_forward, grid(a.numel(), config), a, b if b is not None else a, y,
                        a.numel(), BLOCK=config["block"], TANH=tanh, GATED=b is not None,
                        num_warps=config["num_warps"])
        ctx.save_for_backward(a, b)
        ctx.tanh, ctx.config, ctx.reporter = tanh, config, reporter
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        a, b = ctx.saved_tensors
        (dy,) = flat(dy)
        da = torch.empty_like(a)
        db = torch.empty_like(b) if b is not None else None
        ctx.reporter.launch(_backward, grid(a.numel(), ctx.config), dy, a,
                            b if b is not None else a, da, db if db is not None else da,
                            a.numel(), BLOCK=ctx.config["block"], TANH=ctx.tanh,
                            GATED=b is not None, num_warps=ctx.config["num_warps"])
        return da, db, None, None, None


def build(config: dict, bucket: Bucket) -> Callable[..., torch.Tensor]:
    resolved = resolve(config, heuristic(bucket))
    reporter = Reporter("gelu", "triton", bucket.id, config, resolved)

    def gelu(input, approximate="none"):
        return GeluFunction.apply(input, None, approximate == "tanh", resolved, reporter)

    return gelu


def geglu(a: torch.Tensor, b: torch.Tensor, approximate: str = "none",
          config: dict | None = None) -> torch.Tensor:
    """``gelu(a, approximate) * b`` (a and b of one shape and dtype) with autograd."""
    resolved = resolve(config or {}, heuristic())
    reporter = Reporter("geglu", "triton", "", config or {}, resolved)
    return GeluFunction.apply(a, b, approximate == "tanh", resolved, reporter)
