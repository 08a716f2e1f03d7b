"""Fused linear + cross-entropy, chunked over rows so the (rows, vocab) logits never exist whole.

For each chunk of ``chunk_rows`` rows: logits = x_chunk @ W^T (+ b) by the GEMM library, the
cross-entropy kernel writes the loss and, in place over those logits, their gradient; then
grad_x_chunk = dlogits @ W and grad_W += dlogits^T @ x_chunk. Everything is done in the forward;
backward only scales by the incoming gradient. Peak extra memory: one chunk of logits plus the
weight gradient (fp32 or the weight's dtype: ``grad_accum``). Reductions: 'mean' and 'sum'.

Not a registry op: no torch function or module pattern routes an LM head and its loss together
yet, so this is an entry point (:func:`linear_cross_entropy`) with its config space (``SPACE``).
"""
from __future__ import annotations

from typing import Any

import torch

from ... import originals
from ._common import cdiv, next_pow2, reference_grads
from ._report import Reporter
from ._variant import AUTO
from .cross_entropy import heuristic as ce_heuristic
from .cross_entropy import check_targets, loss_rows

SPACE: dict[str, list] = {
    "chunk_rows": [AUTO, 256, 1024, 4096],
    "grad_accum": [AUTO, "fp32", "weight"],
    "block_v": [AUTO, 1024, 4096, 16384, 32768],
    "num_warps": [AUTO, 4, 8, 16, 32],
}


def heuristic(rows: int, hidden: int, vocab: int, device: str) -> dict:
    """Chunks whose logits are about the size of the input rows (as Liger-Kernel sizes them)."""
    ce = ce_heuristic(_VocabBucket(vocab))
    return {"chunk_rows": next_pow2(cdiv(rows, cdiv(vocab, hidden))), "grad_accum": "fp32",
            "block_v": ce["block_v"], "num_warps": ce["num_warps"], "num_stages": ce["num_stages"]}


class _VocabBucket:
    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def dim(self, name: str) -> int:
        return self.vocab


def _accumulate_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` kept in ``acc``'s dtype. On CUDA, 16-bit operands go to the GEMM as they
    are, with an fp32 output (``out_dtype``): cast to fp32 first, the product runs without tensor
    cores, 6x slower than the whole eager linear + cross-entropy on an H200 (bench/gpu_kernels.py)."""
    if acc.dtype != a.dtype and a.is_cuda:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError):   # a torch or dtype without the mixed-output GEMM
            pass
    acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                target: torch.Tensor, ignore_index: int, reduction: str, smoothing: float,
                config: dict, reporter: Reporter, grad_wanted: bool = True) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        rows, vocab = x2.shape[0], weight.shape[0]
        keep = target != ignore_index
        kept = keep.sum()
        scale = (1.0 / kept.clamp(min=1).float() if reduction == "mean"
                 else torch.ones((), dtype=torch.float32, device=x.device))
        # (needs_input_grad stays True under no_grad: the caller says whether grad mode is on)
        need_x, need_w = (ctx.needs_input_grad[i] and grad_wanted for i in (0, 1))
        need_b = bias is not None and ctx.needs_input_grad[2] and grad_wanted
        accum = torch.float32 if config["grad_accum"] == "fp32" else weight.dtype
        grad_x = torch.empty_like(x2) if need_x else None
        grad_w = torch.zeros(weight.shape, dtype=accum, device=x.device) if need_w else None
        grad_b = torch.zeros(vocab, dtype=accum, device=x.device) if need_b else None
        any_grad = need_x or need_w or need_b
        loss = torch.empty(rows, dtype=torch.float32, device=x.device)
        step = config["chunk_rows"]
        for start in range(0, rows, step):
            end = min(rows, start + step)
            xc = x2[start:end]
            logits = xc @ weight.t() if bias is None else torch.addmm(bias, xc, weight.t())
            loss[start:end] = loss_rows(logits, target[start:end], logits if any_grad else None,
                                        scale, ignore_index, smoothing, config, reporter)
            if need_x:
                torch.mm(logits, weight, out=grad_x[start:end])
            if need_w:
                _accumulate_product(grad_w, logits.t(), xc)
            if need_b:
                grad_b += logits.sum(0, dtype=accum)
        ctx.grads = [grad_x, grad_w, grad_b]
        ctx.shape, ctx.dtypes = x.shape, (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        # the job's tensors, for a backward that cannot use the gradients made here: under
        # create_graph, or once they were scaled in place
        ctx.save_for_backward(x, weight, bias, target)
        ctx.ignore_index, ctx.reduction, ctx.smoothing = ignore_index, reduction, smoothing
        total = loss.sum()
        return (total / kept if reduction == "mean" else total).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        grads = ctx.grads
        if grads is None or torch.is_grad_enabled():
            x, weight, bias, target = ctx.saved_tensors

            def unfused(x, weight, bias):
                logits = originals.linear(x, weight, bias).flatten(0, -2)
                return originals.cross_entropy(logits, target, ignore_index=ctx.ignore_index,
                                               reduction=ctx.reduction,
                                               label_smoothing=ctx.smoothing)

            grads = reference_grads(unfused, (x, weight, bias), (grad_out,),
                                    ctx.needs_input_grad[:3])
            return (*grads, None, None, None, None, None, None, None)
        ctx.grads = None   # scaled in place below
        g = grad_out.float()
        out = [None if t is None else t.mul_(g.to(t.dtype)).to(dtype)
               for t, dtype in zip(grads, ctx.dtypes)]
        grad_x = None if out[0] is None else out[0].view(ctx.shape)
        return grad_x, out[1], out[2], None, None, None, None, None, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0,
                         config: dict | None = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(x, weight, bias).flatten(0, -2), target, ...)`` without the
    full logits. ``config`` keys come from ``SPACE`` (missing or ``"auto"``: the heuristic)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy supports reduction 'mean' or 'sum', "
                         f"not {reduction!r}")
    hidden, vocab = weight.shape[1], weight.shape[0]
    rows = x.numel() // hidden
    device = "cuda" if x.is_cuda else "cpu"
    requested = config or {}
    auto = heuristic(rows, hidden, vocab, device)
    resolved = {k: auto[k] if requested.get(k, AUTO) == AUTO else requested[k] for k in auto}
    reporter = Reporter("linear_cross_entropy", "triton", f"rows={rows},vocab={vocab}",
                        requested, resolved)
    check_targets(target, vocab, ignore_index, "linear_cross_entropy")
    return LinearCrossEntropyFunction.apply(x, weight, bias, target.reshape(-1), ignore_index,
                                            reduction, float(label_smoothing), resolved, reporter,
                                            torch.is_grad_enabled())
