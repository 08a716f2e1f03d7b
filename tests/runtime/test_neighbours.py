"""rtxops next to other code in the same process: lazily imported modules stay lazy, and patches
another library installs while rtxops is on stay in place after ``disable()``."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types

import torch
import torch.nn.functional as F
from rtxops.runtime import patching


class _Failing(importlib.abc.Loader):
    """An optional dependency whose body fails (a missing shared library, say)."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError("optional_backend needs libfoo.so")


def test_a_lazily_imported_module_stays_unloaded_and_fails_no_call():
    patching.enable()
    F.softmax(torch.randn(4, 8), -1)
    loader = importlib.util.LazyLoader(_Failing())
    spec = importlib.util.spec_from_loader("rtxops_test_lazy_backend", loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    loader.exec_module(module)
    try:
        y = F.softmax(torch.randn(3, 5), -1)  # a route miss: the scan for rope functions runs
        assert y.shape == (3, 5)
    finally:
        del sys.modules[spec.name]


def test_patches_made_by_others_while_on_survive_disable():
    modeling = types.ModuleType("rtxops_test_modeling")
    exec(
        "import torch\n"
        "from torch import nn\n"
        "def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):\n"
        "    return q * cos, k * cos\n"
        "class MyRMSNorm(nn.Module):\n"
        "    def __init__(self, d):\n"
        "        super().__init__(); self.weight = nn.Parameter(torch.ones(d)); self.eps = 1e-6\n"
        "    def forward(self, x):\n"
        "        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)\n",
        modeling.__dict__)
    sys.modules[modeling.__name__] = modeling
    torch_gelu = F.gelu

    def fast_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return "fast rope"

    def fast_norm(self, x):
        return "fast norm"

    def my_gelu(x, approximate="none"):
        return "my gelu"

    try:
        patching.enable()
        modeling.apply_rotary_pos_emb, modeling.MyRMSNorm.forward, F.gelu = fast_rope, fast_norm, my_gelu
        patching.disable()
        x = torch.randn(2, 4)
        assert modeling.apply_rotary_pos_emb(x, x, x, x) == "fast rope"
        assert modeling.MyRMSNorm(4)(x) == "fast norm"
        assert F.gelu(x) == "my gelu"
    finally:
        F.gelu = torch_gelu
        del sys.modules[modeling.__name__]


def test_what_rtxops_installed_is_taken_down():
    before = F.gelu
    patching.enable()
    assert F.gelu is not before
    patching.disable()
    assert F.gelu is before


def test_a_wrapper_held_past_disable_is_torchs_function_again():
    """``self.act = F.gelu`` taken while rtxops was on: after disable() it computes torch's gelu
    and records nothing, whatever the plan had routed it to."""
    from rtxops.runtime.plan import Plan

    d = patching.enable(plan=Plan(version=1, defaults={"gelu": "algebraic"}))
    held = F.gelu
    x = torch.randn(64)
    held(x)
    patching.disable()
    calls = sum(d.readings.calls)
    assert torch.equal(held(x), F.gelu(x))
    assert sum(d.readings.calls) == calls


def test_a_variant_answers_a_transposed_input_in_the_layout_torch_gives():
    """A job may .view() an output as torch laid it out (softmax over a transposed input answers
    contiguous); the eager softmax, whose math would keep the input's layout, does too (a
    variant that did not would fail its first-call check: test_dispatcher)."""
    from rtxops.runtime.plan import Plan

    def softmax_rows():
        return F.softmax(torch.randn(16, 300).t(), -1).view(-1)

    d = patching.enable(plan=Plan(version=1, defaults={"softmax": "eager"}))
    for _ in range(2):
        assert softmax_rows().shape == (4800,)
    assert not d.disabled
    assert any(s.variant == "eager" and d.readings.calls[s.id] for s in d.readings.slots)


def test_a_module_without_a_namespace_does_not_stop_the_scan():
    """cffi's ``Lib`` objects sit in sys.modules as modules without a ``__dict__`` (cryptography
    puts one there): the rope functions of modules loaded after one are still found."""
    import cryptography.hazmat.bindings._rust  # noqa: F401 - registers _openssl.lib

    lib = sys.modules["_openssl.lib"]
    assert type(lib).__name__ == "Lib" and isinstance(lib, types.ModuleType)
    patching.enable()
    F.softmax(torch.randn(2, 3), -1)
    modeling = types.ModuleType("rtxops_test_rope_after")
    exec("def apply_rotary_pos_emb(q, k, cos, sin):\n    return q * cos, k * cos\n", modeling.__dict__)
    original = modeling.apply_rotary_pos_emb
    sys.modules["rtxops_test_lib"] = lib  # newly seen by the next scan, before the modeling module
    sys.modules[modeling.__name__] = modeling
    try:
        F.softmax(torch.randn(5, 7), -1)  # a route miss: the scan runs
        assert modeling.apply_rotary_pos_emb is not original
    finally:
        del sys.modules["rtxops_test_lib"], sys.modules[modeling.__name__]
