"""cross_entropy over (N, C) logits and class-index targets:
``l_i = (1 - e) * (lse(x_i) - x_i[t_i]) + e * (lse(x_i) - mean(x_i))`` with ``e = label_smoothing``,
``l_i = 0`` where ``t_i == ignore_index``; 'mean' divides the sum by the number of kept rows.
The input gradient of ``l_i`` is ``softmax(x_i) - (1 - e) * onehot(t_i) - e / C``."""
from __future__ import annotations

import torch

from .. import originals
from ..bucket import Bucket, device_type, pow2
from ..spec import OpSpec, Variant
from ._compiled import compiled_variant
from .triton import variants as triton_variants

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}
_REDUCTION_NAMES = {v: k for k, v in _REDUCTIONS.items()}


def reference(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
              reduction="mean", label_smoothing=0.0):
    return originals.cross_entropy(input, target, weight, size_average, ignore_index, reduce,
                                   reduction, label_smoothing)


def key(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
        reduction="mean", label_smoothing=0.0):
    try:
        return (input.shape, input.dtype, True if input.is_cpu else input.device, target.shape,
                target.dtype, weight is None, size_average, reduce, reduction, label_smoothing,
                ignore_index)
    except AttributeError:
        return None


def bucket(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
           reduction="mean", label_smoothing=0.0):
    if (
        weight is not None
        or size_average is not None
        or reduce is not None
        or type(reduction) is not str
        or type(ignore_index) is not int
        or type(label_smoothing) not in (float, int)
        or not 0.0 <= label_smoothing <= 1.0
        or not isinstance(target, torch.Tensor)
        or target.dtype != torch.int64
    ):
        return None
    shape = input.shape
    if len(shape) != 2 or target.shape != shape[:1] or input.dtype not in _FLOATS:
        return None
    rows, vocab = shape
    mode = _REDUCTIONS.get(reduction)
    if mode is None or rows == 0 or vocab == 0:
        return None
    return (input.dtype, device_type(input), vocab, pow2(rows), mode, int(label_smoothing > 0))


def example_inputs(b: Bucket, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    vocab, rows = b.dim("vocab"), b.dim("rows")
    x = (2 * torch.randn(rows, vocab, generator=g)).to(b.torch_dtype)
    t = torch.randint(0, vocab, (rows,), generator=g)
    t[1:][torch.rand(rows - 1, generator=g) < 0.1] = -100
    kwargs = {"reduction": _REDUCTION_NAMES[b.dim("reduction")],
              "label_smoothing": 0.1 if b.dim("smoothing") else 0.0}
    return (x.to(b.device).requires_grad_(), t.to(b.device)), kwargs


def _reduce(loss, keep, reduction):
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / keep.sum()


def logsoftmax_nll(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    """Explicit fp32 log_softmax, gather of the target column, smoothing term, masked reduction."""
    logp = torch.log_softmax(input.float(), -1)
    keep = target != ignore_index
    loss = -logp.gather(1, torch.where(keep, target, 0).unsqueeze(1)).squeeze(1)
    if label_smoothing > 0:
        loss = (1 - label_smoothing) * loss - (label_smoothing / input.shape[1]) * logp.sum(-1)
    loss = torch.where(keep, loss, 0.0)
    return _reduce(loss, keep, reduction).to(input.dtype)


def _chunked_loss(input, target, ignore_index, smoothing: float, chunk_rows: int,
                  grad: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row losses and the kept rows, chunk by chunk; fills ``grad`` (d loss_i / d input_i)
    when given."""
    vocab = input.shape[1]
    loss = torch.empty(input.shape[0], dtype=torch.float32, device=input.device)
    keep = target != ignore_index
    for start in range(0, input.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        x, k = input[rows].float(), keep[rows]
        t = torch.where(k, target[rows], 0).unsqueeze(1)
        lse = x.logsumexp(-1, keepdim=True)
        l = (lse - x.gather(1, t)).squeeze(1)
        if smoothing > 0:
            l = (1 - smoothing) * l + smoothing * (lse.squeeze(1) - x.mean(-1))
        loss[rows] = torch.where(k, l, 0.0)
        if grad is not None:
            p = (x - lse).exp_()
            p.scatter_add_(1, t, torch.full_like(t, smoothing - 1, dtype=p.dtype))
            if smoothing > 0:
                p.sub_(smoothing / vocab)
            grad[rows] = p.mul_(k.unsqueeze(1))
    return loss, keep


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, target, ignore_index, reduction, smoothing, chunk_rows):
        grad = torch.empty(input.shape, dtype=input.dtype, device=input.device)
        loss, keep = _chunked_loss(input, target, ignore_index, smoothing, chunk_rows, grad)
        ctx.reduction, ctx.smoothing = reduction, smoothing
        ctx.save_for_backward(grad, keep.sum(), target, keep)
        # the input too, for a backward that must itself be differentiable; not saved for
        # backward, which would refuse a plain backward after the job changed the logits in
        # place, as torch's own (it saves its output) does not. A plain backward lets go of it:
        # anything holding the loss (`total += loss`) held the logits too
        ctx.input, ctx.input_version = input, input._version
        return _reduce(loss, keep, reduction).to(input.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        grad, count, target, keep = ctx.saved_tensors
        if not torch.is_grad_enabled():
            ctx.input = None
        elif ctx.input is None:
            raise RuntimeError("cross_entropy (rtxops chunked variant): a differentiable "
                               "backward after a plain one of the same graph (which let go of "
                               "the logits) is not supported; route cross_entropy to another "
                               "variant")
        else:
            # create_graph (a gradient penalty): the gradient made in forward is a constant to
            # autograd, so it is made again from the input with differentiable ops
            if ctx.input._version != ctx.input_version:
                raise RuntimeError("one of the variables needed for gradient computation has been "
                                   "modified by an inplace operation: the logits of cross_entropy "
                                   "(rtxops chunked variant), needed for its double backward")
            grad = _differentiable_grad(ctx.input, target, keep, ctx.smoothing)
        g = grad_out.float()
        if ctx.reduction == "none":
            g = g.unsqueeze(1)
        elif ctx.reduction == "mean":
            g = torch.where(count > 0, g / count, 0.0)
        return (grad.float() * g).to(grad.dtype), None, None, None, None, None


def _differentiable_grad(input, target, keep, smoothing: float):
    """d loss_i / d input_i of each row, as the chunked forward makes it, from autograd's ops."""
    x = input.float()
    onehot = torch.zeros_like(x).scatter(1, torch.where(keep, target, 0).unsqueeze(1), 1.0)
    grad = torch.softmax(x, -1) - (1 - smoothing) * onehot - smoothing / x.shape[1]
    return (grad * keep.unsqueeze(1)).to(input.dtype)


def _build_chunked(config, b: Bucket):
    chunk_rows = config["chunk_rows"]

    def chunked(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                reduction="mean", label_smoothing=0.0):
        if not (torch.is_grad_enabled() and input.requires_grad):
            # evaluation (no_grad, inference_mode): the loss alone, no gradient buffer, and no
            # version counter read (inference tensors have none)
            loss, keep = _chunked_loss(input, target, ignore_index, float(label_smoothing),
                                       chunk_rows)
            return _reduce(loss, keep, reduction).to(input.dtype)
        return _ChunkedCE.apply(input, target, ignore_index, reduction, float(label_smoothing),
                                chunk_rows)

    return chunked


SPEC = OpSpec(
    key=key,
    name="cross_entropy",
    reference=reference,
    bucket=bucket,
    dims=("vocab", "rows", "reduction", "smoothing"),
    example_inputs=example_inputs,
    description="cross entropy of (N, C) logits against class indices (F.cross_entropy)",
)

VARIANTS = [
    Variant("cross_entropy", "logsoftmax_nll", "eager", lambda c, b: logsoftmax_nll,
            description="fp32 log_softmax + gather + smoothing term"),
    Variant("cross_entropy", "chunked", "chunked", _build_chunked,
            config_space={"chunk_rows": [256, 1024, 4096]},
            description="row chunks compute loss and input gradient in the forward; "
                        "only the gradient (input dtype) is kept for backward"),
    compiled_variant("cross_entropy", logsoftmax_nll),
] + triton_variants("cross_entropy")


def cases(dtype: torch.dtype):
    """Named (args, kwargs) cases for tests: typical and edge shapes."""
    g = torch.Generator().manual_seed(1)

    def x(rows, vocab):
        return (2 * torch.randn(rows, vocab, generator=g)).to(dtype).requires_grad_()

    def t(rows, vocab, ignored=()):
        out = torch.randint(0, vocab, (rows,), generator=g)
        out[list(ignored)] = -100
        return out

    wide = (2 * torch.randn(6, 2 * 37, generator=g)).to(dtype)
    return [
        ("mean", (x(8, 50), t(8, 50)), {}),
        ("sum_odd_vocab", (x(5, 33), t(5, 33)), {"reduction": "sum"}),
        ("one_row", (x(1, 17), t(1, 17)), {}),
        ("none", (x(7, 40), t(7, 40, ignored=(2,))), {"reduction": "none"}),
        ("ignored_rows_mean", (x(9, 31), t(9, 31, ignored=(0, 4, 8))), {}),
        ("ignore_index_in_range", (x(6, 20), torch.tensor([0, 3, 0, 5, 19, 0])),
         {"ignore_index": 0, "reduction": "sum"}),
        ("all_ignored_sum", (x(4, 12), t(4, 12, ignored=range(4))), {"reduction": "sum"}),
        ("all_ignored_none", (x(3, 12), t(3, 12, ignored=range(3))), {"reduction": "none"}),
        ("smoothing_mean", (x(10, 64), t(10, 64, ignored=(3,))), {"label_smoothing": 0.1}),
        ("smoothing_none", (x(5, 21), t(5, 21, ignored=(1,))),
         {"reduction": "none", "label_smoothing": 0.25}),
        ("smoothing_sum", (x(4, 9), t(4, 9)), {"reduction": "sum", "label_smoothing": 1.0}),
        ("non_contiguous", (wide[:, ::2].requires_grad_(), t(6, 37)), {}),
        ("many_rows", (x(600, 24), t(600, 24, ignored=range(0, 600, 7))),
         {"label_smoothing": 0.05}),
    ]
