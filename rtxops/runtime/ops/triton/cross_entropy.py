"""Cross-entropy in Triton: one program per row streams the vocab in ``block_v`` tiles twice (online
max and sum of exponentials, then the gradient), so no (rows, vocab) fp32 temporary exists.

The forward writes the input gradient (already divided by the kept-row count for 'mean') into a
buffer of the logits' dtype; backward scales it in place by the incoming gradient (a second
backward of a retained graph, and one under create_graph, take the reference's gradient). Rows whose
target is ``ignore_index`` get loss 0 and gradient 0. The gradient buffer may alias the logits
(the fused linear + cross-entropy does so): each tile is read before it is written.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import triton
import triton.language as tl

from ...bucket import Bucket
from ..cross_entropy import reference
from ._common import as_rows, cdiv, next_pow2, reference_grads, warps_for
from ._report import Reporter
from ._variant import resolve

MAX_BLOCK = 32768


@triton.jit
def _rows_forward(X, T, LOSS, GRAD, SCALE, stride_x, stride_g, n_cols, ignore_index, smoothing,
                  BLOCK: tl.constexpr, HAS_SMOOTHING: tl.constexpr, WRITE_GRAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    g_row = GRAD + row * stride_g
    target = tl.load(T + row)
    if target == ignore_index:
        if WRITE_GRAD:
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                zero = tl.zeros((BLOCK,), tl.float32)
                tl.store(g_row + cols, zero.to(GRAD.dtype.element_ty), mask=cols < n_cols)
        tl.store(LOSS + row, 0.0)
        return
    m = float("-inf")
    s = 0.0
    x_sum = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # while every logit so far is -inf (masked vocab), exp(-inf - -inf) would be NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
        m = m_new
        if HAS_SMOOTHING:
            x_sum += tl.sum(tl.where(mask, x, 0.0), axis=0)
    lse = m + tl.log(s)
    x_target = tl.load(x_row + target).to(tl.float32)
    if HAS_SMOOTHING:
        loss = lse - (1.0 - smoothing) * x_target - smoothing * (x_sum / n_cols)
    else:
        loss = lse - x_target
    tl.store(LOSS + row, loss)
    if WRITE_GRAD:
        scale = tl.load(SCALE)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) - tl.where(cols == target, 1.0 - smoothing, 0.0)
            if HAS_SMOOTHING:
                g -= smoothing / n_cols
            tl.store(g_row + cols, (g * scale).to(GRAD.dtype.element_ty), mask=mask)


@triton.jit
def _scale_rows(GRAD, G, stride_g, g_stride, n_cols, BLOCK: tl.constexpr):
    """``GRAD[row] *= G[row * g_stride]`` in place (``g_stride`` 0: one scalar for every row)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * g_stride).to(tl.float32)
    ptrs = GRAD + row * stride_g + cols
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (x * g).to(GRAD.dtype.element_ty), mask=mask)


def heuristic(bucket: Bucket) -> dict:
    block = min(next_pow2(bucket.dim("vocab")), MAX_BLOCK)
    return {"block_v": block, "num_warps": warps_for(block), "num_stages": 3}


def loss_rows(x2: torch.Tensor, target: torch.Tensor, grad: torch.Tensor | None,
              scale: torch.Tensor, ignore_index: int, smoothing: float, config: dict,
              reporter: Reporter) -> torch.Tensor:
    """Per-row fp32 losses of (rows, vocab) logits ``x2``; writes ``scale *`` the input gradient
    into ``grad`` when given (``grad`` may be ``x2`` itself)."""
    rows, vocab = x2.shape
    target = target.contiguous()   # the kernel reads target[row] at row (labels[:, 1] has stride 3)
    loss = torch.empty(rows, dtype=torch.float32, device=x2.device)
    block = min(config["block_v"], next_pow2(vocab))
    reporter.launch(_rows_forward, (rows,), x2, target, loss, grad if grad is not None else x2,
                    scale, x2.stride(0), (grad if grad is not None else x2).stride(0), vocab,
                    ignore_index, smoothing, BLOCK=block, HAS_SMOOTHING=smoothing > 0,
                    WRITE_GRAD=grad is not None, num_warps=config["num_warps"],
                    num_stages=config["num_stages"])
    return loss


def scale_rows_(grad: torch.Tensor, g: torch.Tensor, config: dict, reporter: Reporter) -> None:
    """Multiply each row of ``grad`` in place by ``g`` (a scalar or one value per row)."""
    rows, vocab = grad.shape
    block = min(config["block_v"], next_pow2(vocab))
    g = g.contiguous()
    reporter.launch(_scale_rows, (rows, cdiv(vocab, block)), grad, g, grad.stride(0),
                    0 if g.numel() == 1 else 1, vocab, BLOCK=block,
                    num_warps=config["num_warps"])


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                reduction: str, smoothing: float, config: dict, reporter: Reporter,
                grad_wanted: bool = True) -> torch.Tensor:
        x2 = as_rows(logits, logits.shape[-1])
        keep = target != ignore_index
        kept = keep.sum()
        scale = (1.0 / kept.clamp(min=1).float() if reduction == "mean"
                 else torch.ones((), dtype=torch.float32, device=logits.device))
        # (needs_input_grad stays True under no_grad: the caller says whether grad mode is on)
        grad = torch.empty_like(x2) if ctx.needs_input_grad[0] and grad_wanted else None
        loss = loss_rows(x2, target, grad, scale, ignore_index, smoothing, config, reporter)
        # the logits themselves (a reference: the job made them) for a backward that cannot use
        # the gradient buffer: under create_graph, or once the buffer was scaled
        ctx.save_for_backward(logits, target)
        ctx.grad, ctx.ignore_index, ctx.smoothing = grad, ignore_index, smoothing
        ctx.reduction, ctx.config, ctx.reporter = reduction, config, reporter
        if reduction == "none":
            return loss.to(logits.dtype)
        total = loss.sum()
        return (total / kept if reduction == "mean" else total).to(logits.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        grad = ctx.grad
        if grad is None or torch.is_grad_enabled():
            # a second backward of a retained graph (the buffer is scaled already), or
            # create_graph (the buffer is a constant to autograd): the reference's gradient
            logits, target = ctx.saved_tensors
            (dx,) = reference_grads(
                lambda x: reference(x, target, None, None, ctx.ignore_index, None, ctx.reduction,
                                    ctx.smoothing), (logits,), (grad_out,), ctx.needs_input_grad[:1])
            return dx, None, None, None, None, None, None, None
        ctx.grad = None   # scaled in place below: its memory is the gradient the job gets
        scale_rows_(grad, grad_out, ctx.config, ctx.reporter)
        return grad, None, None, None, None, None, None, None


def check_targets(target: torch.Tensor, vocab: int, ignore_index: int, name: str) -> None:
    """The kernel reads the target's logit unchecked: a target out of range must fail as torch's
    does (asynchronously on a GPU, as torch's device assert), not read elsewhere."""
    out_of_range = ((target < 0) | (target >= vocab)) & (target != ignore_index)
    torch._assert_async(~out_of_range.any(), f"{name}: a target is out of bounds (0 to {vocab - 1})")


def build(config: dict, bucket: Bucket) -> Callable[..., torch.Tensor]:
    resolved = resolve(config, heuristic(bucket))
    reporter = Reporter("cross_entropy", "triton", bucket.id, config, resolved)

    def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100,
                      reduce=None, reduction="mean", label_smoothing=0.0):
        check_targets(target, input.shape[-1], ignore_index, "cross_entropy")
        return CrossEntropyFunction.apply(input, target, ignore_index, reduction,
                                          float(label_smoothing), resolved, reporter,
                                          torch.is_grad_enabled())

    return cross_entropy
