"""Rotary position embedding (Hugging Face ``apply_rotary_pos_emb``) in Triton: one program per
(batch, position) rotates every head of one tensor; strided, so both head layouts (``unsqueeze_dim``
1 and 2) are read in place without copies.

In-place safe: a program loads both halves of its tile before it stores, so the output may alias
the input (the backward rotates the incoming gradient by the transposed rotation into a fresh
buffer). Gradients of cos and sin, when asked for, are computed with torch ops.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import triton
import triton.language as tl

from ...bucket import Bucket
from .._layout import empty_in_layout_of
from ..rope import reference, rotate_half
from ._common import next_pow2, reference_grads, warps_for
from ._report import Reporter
from ._variant import resolve


@triton.jit
def _rotate(X, Y, COS, SIN, sxb, sxs, sxh, syb, sys, syh, scb, scs, n_heads, half,
            BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, TRANSPOSE: tl.constexpr):
    # seq on the grid's first axis: CUDA allows 2^31 - 1 programs there, 65535 on the second
    s = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None].to(tl.int64)   # h * sxh passes 2^31 in (batch, heads, seq, dim)
    d = tl.arange(0, BLOCK_D)[None, :]
    d_mask = d < half
    mask = (h < n_heads) & d_mask
    cs = b * scb + s * scs + d
    c1 = tl.load(COS + cs, mask=d_mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + cs + half, mask=d_mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + cs, mask=d_mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + cs + half, mask=d_mask, other=0.0).to(tl.float32)
    x_ptr = X + b * sxb + s * sxs + h * sxh + d
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + half, mask=mask, other=0.0).to(tl.float32)
    if TRANSPOSE:  # gradient: the rotation's transpose
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    y_ptr = Y + b * syb + s * sys + h * syh + d
    tl.store(y_ptr, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(y_ptr + half, y2.to(Y.dtype.element_ty), mask=mask)


def heuristic(bucket: Bucket) -> dict:
    tile = next_pow2(bucket.dim("head_dim") // 2) * next_pow2(bucket.dim("rows"))
    return {"num_warps": min(8, warps_for(tile))}


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rotate(x: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           unsqueeze_dim: int, transpose: bool, config: dict, reporter: Reporter) -> torch.Tensor:
    """Rotate ``x`` into ``out`` (which may be ``x``); cos and sin are (1 or batch, seq, dim)."""
    seq_dim, head_dim = (2, 1) if unsqueeze_dim == 1 else (1, 2)
    batch, seq, heads, dim = x.shape[0], x.shape[seq_dim], x.shape[head_dim], x.shape[-1]
    cos_b = 0 if cos.shape[0] == 1 else cos.stride(0)
    reporter.launch(_rotate, (seq, batch), x, out, cos, sin,
                    x.stride(0), x.stride(seq_dim), x.stride(head_dim),
                    out.stride(0), out.stride(seq_dim), out.stride(head_dim),
                    cos_b, cos.stride(1), heads, dim // 2,
                    BLOCK_H=next_pow2(heads), BLOCK_D=next_pow2(dim // 2), TRANSPOSE=transpose,
                    num_warps=config["num_warps"])
    return out


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                unsqueeze_dim: int, config: dict, reporter: Reporter) -> tuple:
        uq, uk = _unit_last(q), _unit_last(k)
        ucos, usin = cos.contiguous(), sin.contiguous()
        # outputs laid out as torch's elementwise ops lay them out: in the inputs' stride order
        q_out = rotate(uq, empty_in_layout_of(q), ucos, usin, unsqueeze_dim, False, config,
                       reporter)
        k_out = rotate(uk, empty_in_layout_of(k), ucos, usin, unsqueeze_dim, False, config,
                       reporter)
        trig_grads = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        # the job's tensors, not the copies made here: a backward under create_graph
        # recomputes through their graphs
        ctx.save_for_backward(cos, sin, *((q, k) if trig_grads else ()))
        ctx.unsqueeze_dim, ctx.config, ctx.reporter = unsqueeze_dim, config, reporter
        return q_out, k_out

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor) -> tuple:
        cos, sin, *qk = ctx.saved_tensors
        ud, config, reporter = ctx.unsqueeze_dim, ctx.config, ctx.reporter
        if torch.is_grad_enabled():   # create_graph: gradients that are differentiable themselves
            # q and k are saved only for the trig gradients; the rotation's gradient does not
            # depend on their values (it is linear), so stand-ins take their place otherwise
            q, k = qk if qk else (torch.zeros_like(dq).requires_grad_(),
                                  torch.zeros_like(dk).requires_grad_())
            grads = reference_grads(lambda q, k, c, s: reference(q, k, c, s, None, ud),
                                    (q, k, cos, sin), (dq, dk), ctx.needs_input_grad[:4])
            return (*grads, None, None, None)
        cos, sin = cos.contiguous(), sin.contiguous()
        dq, dk = _unit_last(dq), _unit_last(dk)
        dq_in = rotate(dq, torch.empty_like(dq), cos, sin, ud, True, config, reporter)
        dk_in = rotate(dk, torch.empty_like(dk), cos, sin, ud, True, config, reporter)
        dcos = dsin = None
        if qk:
            q, k = (t.float() for t in qk)
            dqf, dkf = dq.float(), dk.float()
            dcos = (dqf * q).sum(ud) + (dkf * k).sum(ud)
            dsin = (dqf * rotate_half(q)).sum(ud) + (dkf * rotate_half(k)).sum(ud)
            if cos.shape[0] == 1:
                dcos, dsin = dcos.sum(0, keepdim=True), dsin.sum(0, keepdim=True)
            dcos, dsin = dcos.to(cos.dtype), dsin.to(sin.dtype)
        return dq_in, dk_in, dcos, dsin, None, None, None


def build(config: dict, bucket: Bucket) -> Callable[..., tuple]:
    resolved = resolve(config, heuristic(bucket))
    reporter = Reporter("rope", "triton", bucket.id, config, resolved)

    def rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return RopeFunction.apply(q, k, cos, sin, unsqueeze_dim, resolved, reporter)

    return rope
