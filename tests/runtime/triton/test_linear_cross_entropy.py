"""Fused linear + cross-entropy against F.linear then F.cross_entropy."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rtxops.runtime.registry import default_registry

from .compare import assert_matches

CE = default_registry().op("cross_entropy")


def reference(x, weight, target, bias=None, **kwargs):
    logits = F.linear(x, weight, bias)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), **kwargs)


def inputs(rows, hidden, vocab, dtype, bias, ignored=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (rows,), generator=g)
    t[list(ignored)] = -100
    b = (0.1 * torch.randn(vocab, generator=g)).to(dtype).requires_grad_() if bias else None
    return x, w, t, b


CASES = [
    # name, rows, hidden, vocab, bias, ignored, kwargs, config
    ("mean_chunks_of_3", 8, 40, 200, False, (1, 6), {}, {"chunk_rows": 3, "block_v": 64}),
    ("sum_bias_smoothing", 7, 24, 150, True, (0,), {"reduction": "sum", "label_smoothing": 0.1},
     {"chunk_rows": 4, "block_v": 32}),
    ("one_row_default_config", 1, 33, 97, False, (), {}, {}),
    ("weight_dtype_accum", 6, 16, 64, True, (), {}, {"chunk_rows": 2, "grad_accum": "weight"}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name,rows,hidden,vocab,bias,ignored,kwargs,config", CASES,
                         ids=[c[0] for c in CASES])
def test_matches_linear_then_cross_entropy(name, rows, hidden, vocab, bias, ignored, kwargs,
                                           config, dtype):
    from rtxops.runtime.ops.triton.linear_cross_entropy import linear_cross_entropy

    x, w, t, b = inputs(rows, hidden, vocab, dtype, bias, ignored)

    def fused(x, w, b=None):
        return linear_cross_entropy(x, w, t, b, config=config, **kwargs)

    def ref(x, w, b=None):
        return reference(x, w, t, b, **kwargs)

    args = (x, w) + ((b,) if bias else ())
    assert_matches(CE, fused, args, {}, name, reference=ref, dtype=dtype)


def test_three_dim_input_all_ignored_and_reduction_none_refused():
    from rtxops.runtime.ops.triton.linear_cross_entropy import linear_cross_entropy

    x, w, t, _ = inputs(6, 16, 50, torch.float32, False, ignored=range(6))
    x3 = x.detach().view(2, 3, 16).requires_grad_()
    loss = linear_cross_entropy(x3, w, t.view(2, 3), reduction="sum")
    loss.backward()
    assert loss.item() == 0 and not x3.grad.any() and not w.grad.any()
    with pytest.raises(ValueError, match="'mean' or 'sum'"):
        linear_cross_entropy(x, w, t, reduction="none")


def test_a_retained_graph_and_a_gradient_penalty_get_the_references_gradients():
    """Its gradients are made in forward and scaled in place: a second backward raised, and a
    gradient penalty (create_graph) got constants, losing its second-order terms."""
    from rtxops.runtime.ops.triton.linear_cross_entropy import linear_cross_entropy

    x, w, t, b = inputs(6, 16, 40, torch.float32, bias=True)

    def penalty(fn):
        xi, wi, bi = (v.detach().clone().requires_grad_() for v in (x, w, b))
        loss = fn(xi, wi, t, bi)
        gx, = torch.autograd.grad(loss, xi, create_graph=True, retain_graph=True)
        again, = torch.autograd.grad(loss, xi, retain_graph=True)
        torch.testing.assert_close(gx.detach(), again)
        return torch.autograd.grad((gx ** 2).sum(), (xi, wi, bi))

    got = penalty(lambda *a: linear_cross_entropy(*a, config={"chunk_rows": 4, "block_v": 16}))
    for g, want in zip(got, penalty(reference)):
        torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-4)


def test_a_strided_or_out_of_range_target():
    """The fused op read a strided target as contiguous, and read logits past the vocab for a
    target out of range (-1 padding with ignore_index left at -100) where torch raises."""
    from rtxops.runtime.ops.triton.linear_cross_entropy import linear_cross_entropy

    x, w, _, _ = inputs(6, 16, 50, torch.float32, False)
    labels = torch.randint(0, 50, (6, 3), generator=torch.Generator().manual_seed(2))
    strided = labels[:, 1]
    torch.testing.assert_close(linear_cross_entropy(x, w, strided, config={"chunk_rows": 4}),
                               reference(x, w, strided.contiguous()))
    for bad in (torch.tensor([1, 2, 50, 3, 4, 5]), torch.tensor([1, -1, 2, 3, 4, 5])):
        with pytest.raises(RuntimeError, match="linear_cross_entropy: a target is out of bounds"):
            linear_cross_entropy(x, w, bad)
