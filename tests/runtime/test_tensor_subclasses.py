"""Tensor subclasses with ``__torch_function__`` take their calls as torch hands them over, under
the name the job called (``torch.nn.functional.X``, rtxops's wrapper while it is on: what torch's
own handlers compare with when they run), and no route checked on plain tensors runs for them."""
from __future__ import annotations

import torch
import torch.nn.functional as F

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


class FakeQuantWeight(torch.Tensor):
    """A weight whose F.linear rounds it to multiples of 0.25 (as weight-quantizing subclasses do)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            if func is F.linear:
                x, w, *rest = args
                return func(x, (w * 4).round() / 4, *rest, **(kwargs or {}))
            return func(*args, **(kwargs or {}))


def test_a_subclass_is_handed_the_function_by_the_name_it_was_called():
    """Under ``rtxops run`` the job's code (and torch's lazily imported modules) key their
    tables on ``F.X`` after rtxops has put its wrapper there."""
    patching.enable()
    HANDLED.clear()
    HANDLED[F.softmax] = lambda *a, **k: "softmax handler"
    HANDLED[F.layer_norm] = lambda *a, **k: "layer_norm handler"
    x = torch.randn(4, 8).as_subclass(Handled)
    assert F.softmax(x, -1) == "softmax handler"
    assert F.layer_norm(x, [8]) == "layer_norm handler"
    assert torch.equal(F.gelu(x).as_subclass(torch.Tensor), F.gelu(x.as_subclass(torch.Tensor)))


def test_torchs_causal_bias_is_applied_as_a_causal_mask():
    """``CausalBias`` takes SDPA only when handed ``torch.nn.functional.scaled_dot_product_attention``;
    else it is read as a plain tensor (wrong values, or a shape error)."""
    # imported here: it imports Triton, which tests/runtime/triton sets to interpret first
    from torch.nn.attention.bias import causal_lower_right
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    bias = causal_lower_right(4, 6)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias._materialize())
    patching.enable()
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert torch.allclose(got, want, atol=1e-6)


# as under ``rtxops run``: rtxops is on before the job imports torch's expanded weights and
# fx quantization, whose tables and patterns hold ``F.linear`` as it is then
_LAZY_IMPORTS_SCRIPT = """
import torch, torch.nn.functional as F
from torch import nn
from rtxops.runtime import patching
patching.enable()
from torch.nn.utils._per_sample_grad import call_for_per_sample_grads
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
x = torch.randn(4, 8)
call_for_per_sample_grads(model)(x).sum().backward()
per_sample = [p.grad_sample for p in model.parameters()]
for i in range(4):
    model.zero_grad()
    model(x[i:i + 1]).sum().backward()
    for p, g in zip(model.parameters(), per_sample):
        assert torch.allclose(p.grad, g[i], atol=1e-5), "per-sample gradient differs"
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx
class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(8, 16)), nn.Parameter(torch.randn(8))
    def forward(self, x):
        return F.linear(x, self.w, self.b)
m = Functional().eval()
prepared = prepare_fx(m, get_default_qconfig_mapping("x86"), example_inputs=(torch.randn(4, 16),))
prepared(torch.randn(32, 16))
q = convert_fx(prepared)
assert "quantized" in q.code, q.code
print("ok")
"""


def test_torchs_handlers_imported_after_rtxops_find_its_functions(tmp_path):
    import subprocess
    import sys
    script = tmp_path / "lazy.py"
    script.write_text(_LAZY_IMPORTS_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


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
