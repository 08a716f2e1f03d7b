"""The C++ dispatch core (``_native/dispatch_core.cpp``): the routing of plain calls at function
sites and RMSNorm classes, the same routes and records as the Python path, which takes
everything else."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading

import cloudpickle
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rtxops.runtime import dispatcher, patching
from rtxops.runtime.registry import load_builtin
from rtxops.runtime.spec import Variant

from .helpers import LlamaMLP, TinyRMSNorm, bucket_id, plan_for


def _counts(d) -> dict[tuple[str, str], int]:
    """Recorded calls per (site, variant)."""
    out: dict[tuple[str, str], int] = {}
    for s in d.slots:
        if d.readings.calls[s.id]:
            out[(s.site, s.variant)] = out.get((s.site, s.variant), 0) + d.readings.calls[s.id]
    return out


def _calls(x, q, k, v, layer):
    """One of each kind of call the core takes: positional, keyword, scalar, parameters."""
    return [F.silu(x), F.softmax(x, dim=-1), F.softmax(x, -1),
            F.scaled_dot_product_attention(q, k, v, is_causal=True),
            F.scaled_dot_product_attention(q, k, v, is_causal=False),
            F.layer_norm(x, (x.shape[-1],), eps=1e-5), layer(x), F.gelu(x, approximate="tanh")]


def _run(monkeypatch, core: bool, rounds: int = 5):
    if not core:
        monkeypatch.setattr(dispatcher, "_Core", None)
    torch.manual_seed(0)
    x = torch.randn(4, 16, requires_grad=True)
    q, k, v = (torch.randn(2, 2, 8, 4) for _ in range(3))
    layer = nn.Linear(16, 16)
    d = patching.enable()
    try:
        outs = [_calls(x, q, k, v, layer) for _ in range(rounds)]
        sizes = {s.name: s.core.size for s in d.sites if s.core is not None}
    finally:
        patching.disable()
    return outs, _counts(d), sizes


def test_the_dispatch_core_is_built():
    """``make install`` builds it: without it every test here would test the Python path twice."""
    assert dispatcher._Core is not None


def test_the_core_routes_and_records_each_call_as_the_python_path_does(monkeypatch):
    """Every call counted once under the same (site, variant) with the core as without it,
    the outputs the same; the core holds a route for each way of calling."""
    with_core, counted, sizes = _run(monkeypatch, core=True)
    without, counted_python, no_sizes = _run(monkeypatch, core=False)
    assert counted == counted_python
    assert counted[("F.silu", "reference")] == 5 and counted[("F.linear", "reference")] == 5
    assert counted[("F.gelu", "reference")] == 5
    for a, b in zip(with_core, without):
        for got, want in zip(a, b):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert no_sizes == {}
    # softmax: dim as keyword and as position; attention: is_causal True and False
    assert sizes["F.softmax"] == 2 and sizes["F.scaled_dot_product_attention"] == 2
    assert sizes["F.silu"] == sizes["F.linear"] == sizes["F.gelu"] == sizes["F.layer_norm"] == 1


def test_string_arguments_are_told_apart_by_value():
    """``approximate="tanh"`` made at run time (another str object) finds the route of the
    literal's; ``"none"`` has its own."""
    x = torch.randn(4, 16)
    made = "".join(["ta", "nh"])
    d = patching.enable()
    try:
        got = [F.gelu(x, approximate="tanh"), F.gelu(x, approximate=made), F.gelu(x, approximate="none")]
        assert d.site_named("F.gelu").core.size == 2
    finally:
        patching.disable()
    for out, approximate in zip(got, ("tanh", "tanh", "none")):
        torch.testing.assert_close(out, F.gelu(x, approximate=approximate), rtol=0, atol=0)


def test_a_plan_swap_clears_the_core_and_the_calls_take_the_new_route():
    x = torch.randn(4, 16)
    d = patching.enable()
    try:
        for _ in range(3):
            F.silu(x)
        site = d.site_named("F.silu")
        assert site.core.size == 1
        version = site.core.version
        d.install_plan(plan_for(2, ("silu", bucket_id("silu", x), "tanh")))
        d.apply_pending(at_once=True)
        assert site.core.size == 0 and site.core.version > version
        for _ in range(4):
            torch.testing.assert_close(F.silu(x), torch.nn.functional.silu.__wrapped__(x))
        assert site.core.size == 1
    finally:
        patching.disable()
    counted = _counts(d)
    assert counted[("F.silu", "reference")] == 3
    assert counted[("F.silu", "tanh")] == 4


def test_a_route_looked_up_before_a_clear_is_not_kept():
    """A route the Python path found while another thread cleared the routes (a plan swap)
    would answer with the old plan's variant for good: the core refuses it."""
    x = torch.randn(4, 16)
    d = patching.enable()
    try:
        F.silu(x)
        core = d.site_named("F.silu").core
        stale = core.version
        core.clear()
        assert not core.insert(stale, torch.sigmoid, 0, None, x)
        assert core.insert(core.version, torch.sigmoid, 0, None, x)
    finally:
        patching.disable()


def test_calls_it_cannot_describe_go_to_the_python_path():
    """A tensor subclass, a scalar of another type, a thread running unrouted: the Python path
    answers, as it does without the core."""
    class Marked(torch.Tensor):
        pass

    x = torch.randn(4, 16)
    d = patching.enable()
    try:
        core = d.site_named("F.softmax").core
        F.softmax(x.as_subclass(Marked), dim=-1)
        F.softmax(x, dim=-1, dtype=torch.float64)
        assert core.size == 0
        with dispatcher.unrouted_on_this_thread():
            F.softmax(x, dim=-1)
        assert core.size == 0
        F.softmax(x, dim=-1)
        assert core.size == 1
        seen = []
        with dispatcher.unrouted_on_this_thread():   # a hit too goes back while it runs unrouted
            before = dict(_counts(d))
            seen.append(F.softmax(x, dim=-1))
            assert _counts(d) == before
    finally:
        patching.disable()


def test_autocast_calls_take_the_python_path_with_their_scope():
    x = torch.randn(4, 16)
    d = patching.enable()
    try:
        F.silu(x)
        core = d.site_named("F.silu").core
        assert core.size == 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.silu(x)
        assert core.size == 1
        assert any(getattr(k, "scope", None) for k in d.site_named("F.silu").routes)
    finally:
        patching.disable()


class _SiluExplodingLater:
    """A silu variant right in its first two calls (the checked call runs it twice) and its
    next, and raising from then on."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input, inplace=False):
        self.calls += 1
        if self.calls > 3:
            raise RuntimeError("silu kernel exploded")
        return torch.sigmoid(input) * input


def test_a_variant_raising_from_the_core_is_put_aside_and_torch_answers():
    """The route's on_error runs as in the Python path: the variant disabled, torch's answer
    returned, the routes made again without it."""
    registry = load_builtin()
    exploding = _SiluExplodingLater()
    registry.add_variant(Variant("silu", "explodes_later", "eager", lambda config, bucket: exploding))
    x = torch.randn(4, 16)
    d = patching.enable(registry=registry)
    try:
        d.install_plan(plan_for(2, ("silu", bucket_id("silu", x), "explodes_later")))
        d.apply_pending(at_once=True)
        for _ in range(2):   # the first call (checked), then one that puts its route in the core
            F.silu(x)
        assert d.site_named("F.silu").core.size == 1
        torch.testing.assert_close(F.silu(x), torch.nn.functional.silu.__wrapped__(x))
        assert d.site_named("F.silu").core.size == 0   # disabled: the routes start over
        F.silu(x)
    finally:
        patching.disable()
    (key, reason), = d.disabled.items()
    assert key[:2] == ("silu", "explodes_later") and "exploded" in reason
    assert exploding.calls == 4
    assert _counts(d)[("F.silu", "reference")] == 2


def test_an_error_in_the_route_propagates_as_torchs():
    d = patching.enable()
    try:
        x = torch.randn(4, 16)
        F.linear(x, torch.randn(8, 16))
        assert d.site_named("F.linear").core.size == 1
        with pytest.raises(RuntimeError):
            F.linear(torch.randn(4, 15), torch.randn(8, 16))
        with pytest.raises(RuntimeError):   # the same description again: now from the core
            F.linear(torch.randn(4, 15), torch.randn(8, 16))
    finally:
        patching.disable()


def test_a_pickled_core_is_left_behind():
    """A wrapper shipped by value (see ``dispatcher._Live``) takes no routes with it."""
    d = patching.enable()
    try:
        F.silu(torch.randn(3))
        copy = pickle.loads(cloudpickle.dumps(d.site_named("F.silu").core))
    finally:
        patching.disable()
    assert isinstance(copy, dispatcher._CoreLeftBehind)
    with pytest.raises(RuntimeError):
        copy.call(torch.randn(3))


def test_threads_routing_at_once_each_get_every_call_recorded():
    xs = [torch.randn(4, 8 * (i + 1)) for i in range(4)]
    d = patching.enable()
    try:
        def work(x):
            for _ in range(200):
                F.silu(x)

        threads = [threading.Thread(target=work, args=(x,)) for x in xs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        patching.disable()
    assert _counts(d)[("F.silu", "reference")] == 800


NORM_SITE = f"module:{TinyRMSNorm.__module__}.{TinyRMSNorm.__qualname__}"


def _norm_plan(variant: str):
    x, w = torch.randn(4, 16), torch.ones(16)
    return plan_for(2, ("rms_norm", bucket_id("rms_norm", x, (16,), w, 1e-6), variant))


def _run_norms(monkeypatch, core: bool, variant: str | None = None):
    """Two instances (their eps apart), each called in train and in eval mode, with autograd
    and without: the outputs, the counts, the routes the core holds."""
    if not core:
        monkeypatch.setattr(dispatcher, "_Core", None)
    torch.manual_seed(0)
    x = torch.randn(4, 16, requires_grad=True)
    d = patching.enable()
    try:
        if variant is not None:
            d.install_plan(_norm_plan(variant))
            d.apply_pending(at_once=True)
        norms = [TinyRMSNorm(16), TinyRMSNorm(16, eps=1e-5)]
        outs = []
        for _ in range(4):
            for norm in norms:
                outs.append(norm(x))
                with torch.no_grad():
                    outs.append(norm(x))
                norm.eval()
                outs.append(norm(x))
                norm.train()
        core = d.site_named(NORM_SITE).core
        size = None if core is None else core.size
    finally:
        patching.disable()
    return outs, _counts(d), size


@pytest.mark.parametrize("variant", [None, "fused"])
def test_an_rms_norm_class_is_routed_by_the_core_as_by_the_python_path(monkeypatch, variant):
    """The class's own forward (the default plan) or a variant in its place: every call counted
    once under the same variant with the core as without it, the outputs the same; the core
    holds a route per instance and mode (each instance's settings are checked apart)."""
    with_core, counted, size = _run_norms(monkeypatch, True, variant)
    without, counted_python, no_size = _run_norms(monkeypatch, False, variant)
    assert counted == counted_python
    assert counted[(NORM_SITE, variant or "reference")] == 2 * 4 * 3
    for got, want in zip(with_core, without):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert no_size is None and size == 2 * 3


class _SubRMSNorm(TinyRMSNorm):
    """Inherits the wrapped forward: its calls are checked apart from the class's own."""


class _ClassEpsRMSNorm(TinyRMSNorm):
    variance_epsilon = 1e-6   # (the instances drop theirs: the class holds it)


class _Marked(torch.Tensor):
    pass


def _changing_state():
    """A weight cast in place, a subclass inheriting the forward: each a new description, found
    by the Python path; the core holds one route for each."""
    x, norm = torch.randn(4, 16), TinyRMSNorm(16)
    return [(norm, x), (_SubRMSNorm(16), x), (norm.double(), x.double())], 3


def _undescribed():
    """A weight that is no parameter, an eps the instance does not hold (its class does), a
    tensor subclass: the core holds nothing."""
    x, plain_weight, class_eps = torch.randn(4, 16), TinyRMSNorm(16), _ClassEpsRMSNorm(16)
    weight = plain_weight.weight.detach().clone()
    del plain_weight.weight
    plain_weight.weight = weight
    del class_eps.variance_epsilon
    return [(plain_weight, x), (class_eps, x), (TinyRMSNorm(16), x.as_subclass(_Marked))], 0


def _run_module_calls(monkeypatch, core: bool, calls) -> tuple[list, dict]:
    if not core:
        monkeypatch.setattr(dispatcher, "_Core", None)
    torch.manual_seed(0)
    d = patching.enable()
    try:
        made, held = calls()
        outs = []
        for module, input in made:
            for _ in range(3):
                out = module(input)
                torch.testing.assert_close(out, TinyRMSNorm.forward.__wrapped__(module, input),
                                           rtol=0, atol=0)
                outs.append(out)
        if core:
            assert d.site_named(NORM_SITE).core.size == held
    finally:
        patching.disable()
    return outs, _counts(d)


@pytest.mark.parametrize("calls", [_changing_state, _undescribed])
def test_module_calls_are_counted_and_answered_as_by_the_python_path(monkeypatch, calls):
    with_core, counted = _run_module_calls(monkeypatch, True, calls)
    without, counted_python = _run_module_calls(monkeypatch, False, calls)
    assert counted == counted_python and counted[(NORM_SITE, "reference")] > 0
    for got, want in zip(with_core, without):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_autocast_module_calls_take_the_python_path():
    d = patching.enable()
    try:
        norm, x = TinyRMSNorm(16), torch.randn(4, 16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            norm(x)
            norm(x)
        assert d.site_named(NORM_SITE).core.size == 0
        assert any(isinstance(k, tuple) and k[1][1] is not None
                   for k in d.site_named(NORM_SITE).routes)
    finally:
        patching.disable()


def test_a_gated_mlp_class_is_routed_in_python():
    """Its key reads its layers, which the core does not describe."""
    d = patching.enable()
    try:
        LlamaMLP()(torch.randn(2, 8))
        site = next(s for s in d.sites if getattr(s, "cls", None) is LlamaMLP)
        assert site.core is None
    finally:
        patching.disable()


def test_the_core_can_be_switched_off():
    """``RTXOPS_DISPATCH_CORE=0``: every call routed in Python."""
    code = ("import torch, torch.nn.functional as F\n"
            "from rtxops.runtime import dispatcher, patching\n"
            "d = patching.enable(); F.silu(torch.randn(3))\n"
            "print(dispatcher._Core is None, d.site_named('F.silu').core is None)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "RTXOPS_DISPATCH_CORE": "0"})
    assert out.stdout.split() == ["True", "True"]
