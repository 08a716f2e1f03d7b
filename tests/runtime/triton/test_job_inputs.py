"""Triton variants on inputs a job may pass that the op's cases do not hold: weights that are
views, empty batches."""
from __future__ import annotations

import pytest
import torch

from rtxops.runtime.registry import default_registry

from .compare import build_for


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("weight", ["expanded", "strided"])
def test_a_weight_that_is_a_view_is_read_as_its_values(op, weight):
    """The kernels read the weight as W + cols: an expanded weight (stride 0) or a sliced one
    gave wrong values (max difference 1e16, or NaN), with no error."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=g)
    w = (torch.randn(1, generator=g).expand(8) if weight == "expanded"
         else torch.randn(16, generator=g)[::2])
    rest = (torch.randn(8, generator=g),) if op == "layer_norm" else ()
    fn = build_for(op, (x, (8,), w.contiguous(), *rest), {})  # a route checked on a dense weight
    spec = default_registry().op(op)

    def forward_and_grad(f):
        xi = x.clone().requires_grad_()
        out = f(xi, (8,), w, *rest)
        (out * torch.arange(8.0)).sum().backward()
        return out.detach(), xi.grad

    for got, want in zip(forward_and_grad(fn), forward_and_grad(spec.reference)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "softmax"])
def test_an_empty_batch_has_empty_gradients(op):
    """Backward of zero rows divided by zero (ZeroDivisionError) where torch gives empty
    gradients."""
    x = torch.randn(0, 3, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    args = {"layer_norm": (x, (8,), w), "rms_norm": (x, (8,), w), "softmax": (x, -1)}[op]
    fn = build_for(op, (torch.randn(2, 3, 8),) + args[1:], {})
    out = fn(*args)
    assert out.shape == x.shape
    out.sum().backward()
    assert x.grad.shape == x.shape
    if op != "softmax":
        assert torch.equal(w.grad, torch.zeros(8))


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
def test_an_elementwise_output_keeps_the_inputs_layout(layout):
    """gelu on a channels-last input after another strided call: the kernel answered contiguous
    (it reads flat), torch keeps the input's layout, and the job's .view() of it failed."""
    base = torch.randn(2, 8, 4, 4)
    x = (base.to(memory_format=torch.channels_last) if layout == "channels_last"
         else base.transpose(1, 3))
    fn = build_for("gelu", (base.transpose(2, 3),), {})
    got, want = fn(x), torch.nn.functional.gelu(x)
    torch.testing.assert_close(got, want)
    assert got.stride() == want.stride()
