"""Tensor subclasses with ``__torch_function__`` take their calls as torch hands them over: the
function they are handed is torch's own, and no route checked on plain tensors runs for them."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

from rtxops.runtime import patching
from rtxops.runtime.plan import Plan

HANDLED = {}


class Handled(torch.Tensor):
    """Looks its calls up by function, as 'Extending torch' shows."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in HANDLED:
            return HANDLED[func](*args, **(kwargs or {}))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


HANDLED[F.softmax] = lambda *a, **k: "softmax handler"
HANDLED[F.layer_norm] = lambda *a, **k: "layer_norm handler"


class FakeQuantWeight(torch.Tensor):
    """A weight whose F.linear rounds it to multiples of 0.25 (as weight-quantizing subclasses do)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            if func is torch._C._nn.linear:
                x, w, *rest = args
                return func(x, (w * 4).round() / 4, *rest, **(kwargs or {}))
            return func(*args, **(kwargs or {}))


def test_a_subclass_is_handed_torchs_own_functions():
    x = torch.randn(4, 8).as_subclass(Handled)
    patching.enable()
    assert F.softmax(x, -1) == "softmax handler"
    assert F.layer_norm(x, [8]) == "layer_norm handler"


def test_per_sample_gradients_of_torchs_expanded_weights():
    def per_sample(model, x):
        for p in model.parameters():
            p.grad_sample = None
        call_for_per_sample_grads(model)(x).sum().backward()
        return [p.grad_sample for p in model.parameters()]

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    x = torch.randn(4, 8)
    plain = per_sample(model, x)
    patching.enable()
    routed = per_sample(model, x)
    assert all(torch.equal(a, b) for a, b in zip(routed, plain))


def test_a_subclass_never_takes_a_route_checked_on_plain_tensors():
    w, x = torch.randn(8, 16), torch.randn(4, 16)
    quantized = w.clone().as_subclass(FakeQuantWeight)
    want = F.linear(x, quantized).as_subclass(torch.Tensor)
    d = patching.enable(plan=Plan(version=1, defaults={"linear": "matmul"}))
    F.linear(x, w)  # the route of this shape, checked on plain tensors
    got = F.linear(x, quantized).as_subclass(torch.Tensor)
    assert torch.equal(got, want)
    assert sum(d.readings.calls) == 1  # the subclass's call ran as written, not routed


def test_calls_under_a_default_device_are_still_routed():
    """``torch.set_default_device`` installs a torch function mode for good: not a subclass."""
    torch.set_default_device("cpu")
    try:
        d = patching.enable()
        F.softmax(torch.randn(4, 8), -1)
        F.layer_norm(torch.randn(4, 8), [8])
        assert sum(d.readings.calls) == 2
    finally:
        torch.set_default_device(None)
