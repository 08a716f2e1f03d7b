"""Cross-entropy kernel edge cases beyond the op's own cases: vocab streamed over many tiles, large
logits, all-ignored batches, smoothing with ignored rows, and the single-use gradient buffer."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rtxops.runtime.registry import default_registry

from .compare import assert_matches, build_for, clone_args, run

SPEC = default_registry().op("cross_entropy")


def logits(rows: int, vocab: int, dtype: torch.dtype, scale: float = 2.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(rows, vocab, generator=g)).to(dtype).requires_grad_()


def targets(rows: int, vocab: int, ignored=(), seed: int = 1):
    t = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(seed))
    t[list(ignored)] = -100
    return t


def small_tiles(args, kwargs, block_v: int = 16):
    """The Triton build with ``block_v`` tiles, so a 200-column row takes 13 tiles."""
    from rtxops.runtime.ops.triton.cross_entropy import CrossEntropyFunction
    from rtxops.runtime.ops.triton._report import Reporter

    config = {"block_v": block_v, "num_warps": 4, "num_stages": 1}
    reporter = Reporter("cross_entropy", "triton", "test", config, config)

    def fn(input, target, ignore_index=-100, reduction="mean", label_smoothing=0.0):
        return CrossEntropyFunction.apply(input, target, ignore_index, reduction,
                                          float(label_smoothing), config, reporter)
    return fn


CASES = [
    ("mean", {}),
    ("sum", {"reduction": "sum"}),
    ("none", {"reduction": "none"}),
    ("smoothing_mean", {"label_smoothing": 0.1}),
    ("smoothing_sum", {"reduction": "sum", "label_smoothing": 0.3}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name,kwargs", CASES, ids=[c[0] for c in CASES])
def test_vocab_streamed_over_many_tiles_with_ignored_rows(name, kwargs, dtype):
    args = (logits(7, 200, dtype), targets(7, 200, ignored=(0, 5)))
    assert_matches(SPEC, small_tiles(args, kwargs), args, kwargs, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_large_logits_do_not_overflow(dtype):
    x = logits(5, 150, dtype, scale=1.0)
    with torch.no_grad():
        x += 3e4 * torch.arange(150, dtype=dtype)[None, :] / 150  # exp() of these overflows fp32
        x[:, 7] = 5e4
    args, kwargs = (x, targets(5, 150, ignored=(2,))), {"label_smoothing": 0.1}
    out, grads = run(small_tiles(args, kwargs), *clone_args(args, kwargs))
    assert torch.isfinite(out[0]).all() and torch.isfinite(grads[0]).all()
    assert_matches(SPEC, small_tiles(args, kwargs), args, kwargs, "large")
    assert_matches(SPEC, build_for("cross_entropy", args, kwargs), args, kwargs, "large/default")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_batch(reduction):
    args, kwargs = (logits(4, 40, torch.float32), targets(4, 40, ignored=range(4))), \
        {"reduction": reduction}
    out, grads = run(build_for("cross_entropy", args, kwargs), *clone_args(args, kwargs))
    ref = F.cross_entropy(*clone_args(args, kwargs)[0], **kwargs)
    torch.testing.assert_close(out[0], ref, equal_nan=True)  # mean over no rows: nan, like torch
    assert not grads[0].any()


def test_one_row_odd_vocab_with_smoothing_bf16():
    args, kwargs = (logits(1, 97, torch.bfloat16), targets(1, 97)), {"label_smoothing": 0.2}
    assert_matches(SPEC, build_for("cross_entropy", args, kwargs), args, kwargs, "one_row")


def test_no_gradient_buffer_without_grad_and_a_retained_graph_backpropagates_twice():
    """The second backward of a retained graph raised (the buffer is scaled in place by the
    first); it now takes the reference's gradient."""
    x, t = logits(3, 30, torch.float32), targets(3, 30)
    fn = build_for("cross_entropy", (x, t), {})
    with torch.no_grad():
        torch.testing.assert_close(fn(x, t), F.cross_entropy(x, t))
    loss = fn(x, t)
    first, = torch.autograd.grad(loss, x, retain_graph=True)
    again, = torch.autograd.grad(loss * 3, x)
    torch.testing.assert_close(again, 3 * first)
    torch.testing.assert_close(first, torch.autograd.grad(F.cross_entropy(x, t), x)[0])


def test_a_target_out_of_range_fails_as_torchs_does():
    """The kernel read the logit at the target unchecked: a target past the vocab gave a loss
    (on a GPU, a read of other memory) where torch raises."""
    x = logits(4, 10, torch.float32)
    fn = build_for("cross_entropy", (x, targets(4, 10)), {})
    for bad in (torch.tensor([1, 2, 10, 3]), torch.tensor([1, -1, 2, 3])):
        with pytest.raises(IndexError):
            F.cross_entropy(x, bad)
        with pytest.raises(RuntimeError, match="out of bounds"):
            fn(x, bad)
    ignored = torch.tensor([1, -100, 2, 3])
    torch.testing.assert_close(fn(x, ignored), F.cross_entropy(x, ignored))


def test_a_strided_target_is_read_row_by_row():
    """``labels[:, 1]`` (stride 3) was read as if contiguous: other rows' labels, wrong loss."""
    x = logits(6, 50, torch.float32)
    labels = torch.randint(0, 50, (6, 3), generator=torch.Generator().manual_seed(4))
    args = (x, labels[:, 1])
    assert not args[1].is_contiguous()
    for kwargs in ({}, {"reduction": "none"}):
        assert_matches(SPEC, build_for("cross_entropy", (x, labels[:, 1].contiguous()), kwargs),
                       args, kwargs, "strided_target")


@pytest.mark.parametrize("masked", [16, 48])
def test_rows_whose_first_tiles_are_all_masked(masked):
    """A row's leading vocab tiles all -inf (a masked vocabulary) made the online softmax take
    exp(-inf - -inf): NaN loss and gradient where torch has a finite one."""
    x = logits(3, 200, torch.float32)
    with torch.no_grad():
        x[0, :masked] = float("-inf")
    t = targets(3, 200)
    t[0] = masked + 5
    args = (x, t)
    out, grads = run(small_tiles(args, {}), *clone_args(args, {}))
    assert torch.isfinite(out[0]).all() and torch.isfinite(grads[0]).all()
    assert_matches(SPEC, small_tiles(args, {}), args, {}, "masked_tiles")


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_no_gradient_buffers_are_made_in_evaluation(mode, monkeypatch):
    """needs_input_grad stays True under no_grad: an evaluation made a (rows × vocab) gradient
    buffer (and the fused op two extra matrix products and a weight-sized buffer)."""
    from rtxops.runtime.ops.triton import cross_entropy as ce
    from rtxops.runtime.ops.triton import linear_cross_entropy as lce

    given = []
    real = ce.loss_rows

    def recording(x2, target, grad, *args):
        given.append(grad)
        return real(x2, target, grad, *args)

    monkeypatch.setattr(ce, "loss_rows", recording)
    monkeypatch.setattr(lce, "loss_rows", recording)
    x, t = logits(4, 64, torch.float32), targets(4, 64)
    w = torch.randn(64, 8, requires_grad=True)
    h = torch.randn(4, 8, requires_grad=True)
    fn = build_for("cross_entropy", (x, t), {})
    with mode():
        torch.testing.assert_close(fn(x, t), F.cross_entropy(x, t))
        torch.testing.assert_close(lce.linear_cross_entropy(h, w, t), F.cross_entropy(h @ w.t(), t))
    assert len(given) >= 2 and all(g is None for g in given)
    fn(x, t).backward()   # with grad on, the buffer is made as before
    assert given[-1] is not None
