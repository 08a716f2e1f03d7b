"""Dispatch rules: plan routing, swaps at step boundaries, broken variants, explore shares."""
from __future__ import annotations

import math
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

from rtxops.runtime import patching
from rtxops.runtime.dispatcher import background_compile
from rtxops.runtime.errors import PlanError
from rtxops.runtime.plan import ExploreArm, Plan
from rtxops.runtime.registry import load_builtin
from rtxops.runtime.spec import Variant

from .._bounded import joined
from .helpers import TinyNet, bucket_id, plan_for, train_losses

GELU_BUCKET = bucket_id("gelu", torch.randn(16, 64))
LN_BUCKET = bucket_id("layer_norm", torch.randn(16, 64), [64], torch.ones(64), torch.ones(64))


def _calls(dispatcher, op: str) -> dict[str, int]:
    stats = dispatcher.readings
    out: dict[str, int] = {}
    for s in stats.slots:
        if s.op == op and stats.calls[s.id]:
            out[s.variant] = out.get(s.variant, 0) + stats.calls[s.id]
    return out


def _registry_with(*variants: Variant):
    registry = load_builtin()
    for v in variants:
        registry.add_variant(v)
    return registry


def _raises(*args, **kwargs):
    raise RuntimeError("kernel exploded")


def _nan(input, approximate="none"):
    return torch.full_like(input, math.nan)


BROKEN = [
    Variant("gelu", "raises", "eager", lambda c, b: _raises),
    Variant("gelu", "nan", "eager", lambda c, b: _nan),
    Variant("gelu", "raises_later", "eager", lambda c, b: _ExplodesOnSecondCall()),
    Variant("gelu", "unbuildable", "eager", lambda c, b: _raises()),
]


class _ExplodesOnSecondCall:
    def __init__(self):
        self.n = 0

    def __call__(self, input, approximate="none"):
        self.n += 1
        if self.n > 1:
            raise RuntimeError("second call exploded")
        return torch.ops.aten.gelu(input)


@pytest.mark.parametrize("broken", [v.name for v in BROKEN])
def test_broken_variant_is_disabled_and_training_matches_reference(broken):
    torch.manual_seed(0)
    expected = train_losses(TinyNet(dim=32), steps=4)
    d = patching.enable(registry=_registry_with(*BROKEN))
    d.install_plan(plan_for(1, ("gelu", GELU_BUCKET, broken)))
    d.apply_pending()
    torch.manual_seed(0)
    got = train_losses(TinyNet(dim=32), steps=4)
    assert got == expected
    (key, reason), = d.disabled.items()
    assert key[:2] == ("gelu", broken) and key[3] == GELU_BUCKET
    assert "exploded" in reason or "NaN" in reason or "build failed" in reason
    assert _calls(d, "gelu").get("reference", 0) >= 3


def test_a_call_that_is_wrong_itself_does_not_disable_the_variant_it_first_met():
    """A bad batch (a target out of range) makes the variant and torch both raise on the
    route's first call: torch's error reaches the job, and the variant stays in use."""
    d = patching.enable(plan=Plan.from_dict({"version": 1,
                                             "defaults": {"cross_entropy": "logsoftmax_nll"}}))
    x = torch.randn(4, 8)
    with pytest.raises((IndexError, RuntimeError)) as raised:
        F.cross_entropy(x, torch.tensor([1, 2, 3, 99]))
    assert "out of bounds" in str(raised.value)
    want = torch.nn.functional.cross_entropy.__wrapped__(x, torch.tensor([1, 2, 3, 4]))
    torch.testing.assert_close(F.cross_entropy(x, torch.tensor([1, 2, 3, 4])), want)
    assert not d.disabled
    assert _calls(d, "cross_entropy").get("logsoftmax_nll") == 1


def test_a_class_rewritten_as_an_op_is_checked_even_with_first_call_checks_off():
    """RTXOPS_VERIFY_FIRST_CALL=0 skips the numeric check of routed ops, not the check that a
    class found by its layers' names (w1/w2/w3) really is a gated MLP."""
    from torch import nn

    class FeedForward(nn.Module):      # three layers named as a gated MLP's, no gate
        def __init__(self, h=16):
            super().__init__()
            self.w1, self.w2, self.w3 = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)

        def forward(self, x):
            return self.w3(F.relu(self.w2(F.relu(self.w1(x)))))

    torch.manual_seed(0)
    m, x = FeedForward(), torch.randn(4, 16)
    want = m(x)
    patching.enable(Plan.from_dict({"version": 1, "defaults": {"swiglu": "eager"}}),
                    verify_first_call=False)
    for _ in range(2):
        torch.testing.assert_close(m(x), want)


def test_a_norm_class_and_a_rope_function_found_by_name_are_checked_with_first_call_checks_off():
    """Only gated MLPs kept their check: a Gemma-style norm (``x * (1 + weight)``) and a rope of
    interleaved pairs were rewritten unchecked, every output wrong."""
    import types

    from torch import nn

    from .helpers import bucket_id, plan_for

    class GemmaRMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-6):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.zeros(dim))

        def forward(self, x):
            out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return out * (1.0 + self.weight)

    def rotate_every_two(x):
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)

    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rotate_every_two(q) * sin, k * cos + rotate_every_two(k) * sin

    module = types.ModuleType("interleaved_rope_model")
    apply_rotary_pos_emb.__module__ = module.__name__
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    sys.modules[module.__name__] = module
    try:
        torch.manual_seed(0)
        norm, x = GemmaRMSNorm(16), torch.randn(8, 16)
        q, k, angle = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16), torch.randn(2, 8, 16)
        cos, sin = angle.cos(), angle.sin()
        want_norm, want_rope = norm(x), apply_rotary_pos_emb(q, k, cos, sin)
        patching.enable(plan_for(1, ("rms_norm", bucket_id("rms_norm", x, (16,), norm.weight, 1e-6),
                                     "eager"),
                                 ("rope", bucket_id("rope", q, k, cos, sin), "halves")),
                        verify_first_call=False)
        assert module.apply_rotary_pos_emb is not apply_rotary_pos_emb   # routed
        for _ in range(2):
            torch.testing.assert_close(norm(x), want_norm)
            torch.testing.assert_close(module.apply_rotary_pos_emb(q, k, cos, sin), want_rope)
    finally:
        patching.disable()
        del sys.modules[module.__name__]


def test_a_variant_that_raises_on_a_norm_class_leaves_the_class_routed_for_the_next_plan():
    """The raise put the class back on its own forward for good: a later plan's working variant
    never ran on it."""
    from .helpers import TinyRMSNorm

    def refuses(*args, **kwargs):
        raise RuntimeError("a shape the kernel refuses")

    registry = load_builtin()
    registry.add_variant(Variant("rms_norm", "refuses", "eager", lambda config, bucket: refuses))
    norm, x = TinyRMSNorm(16), torch.randn(8, 16)
    want = norm(x)
    bucket = bucket_id("rms_norm", x, (16,), norm.weight, 1e-6)
    d = patching.enable(plan_for(1, ("rms_norm", bucket, "refuses")), registry=registry)
    try:
        torch.testing.assert_close(norm(x), want)
        assert ("rms_norm", "refuses", "{}", bucket, None) in d.disabled
        d.install_plan(plan_for(2, ("rms_norm", bucket, "eager")))
        d.on_step()
        for _ in range(3):
            torch.testing.assert_close(norm(x), want)
        calls = {s.variant: d.readings.calls[s.id] for s in d.readings.slots if s.op == "rms_norm"}
        assert calls.get("eager") == 3 and not calls.get("refuses")
    finally:
        patching.disable()


def test_a_training_step_with_two_optimizers_is_one_step():
    """A GAN steps two optimizers per iteration: one step each iteration, not two; an optimizer
    replaced mid-run (the old one kept alive) hands the count over to the new one."""
    from torch import nn

    d = patching.enable()
    g, critic = nn.Linear(8, 8), nn.Linear(8, 1)
    opt_g, opt_c = torch.optim.SGD(g.parameters(), 0.01), torch.optim.SGD(critic.parameters(), 0.01)
    for _ in range(10):
        critic(F.gelu(g(torch.randn(4, 8)))).mean().backward()
        opt_c.step()
        opt_g.step()
    assert d.step == 10
    kept, opt_c = opt_c, torch.optim.SGD(critic.parameters(), 0.001)
    for _ in range(5):
        critic(F.gelu(g(torch.randn(4, 8)))).mean().backward()
        opt_c.step()
    assert d.step == 14        # the new optimizer's second step on: it leads
    assert kept is not None


def _contiguous_gelu(input, approximate="none"):
    return torch.ops.aten.gelu(input.contiguous())


def test_a_strided_input_is_checked_on_its_own_first_call():
    """A route checked on a contiguous input is not trusted with a view of another layout of
    the same shape: that call is checked too, and a variant answering in another layout than
    torch's is disabled (torch's answer is returned)."""
    d = patching.enable(registry=_registry_with(
        Variant("gelu", "contiguous", "eager", lambda c, b: _contiguous_gelu)))
    d.install_plan(plan_for(1, ("gelu", GELU_BUCKET, "contiguous")))
    d.apply_pending()
    F.gelu(torch.randn(16, 64))
    assert not d.disabled and _calls(d, "gelu") == {"contiguous": 1}
    x = torch.randn(64, 16).t()
    got = F.gelu(x)
    assert got.stride() == torch.ops.aten.gelu(x).stride() == x.stride()
    (key, reason), = d.disabled.items()
    assert key[1] == "contiguous" and "stride" in reason


def test_plan_routes_bucket_to_variant_and_other_buckets_to_reference():
    d = patching.enable()
    d.install_plan(plan_for(1, ("gelu", GELU_BUCKET, "algebraic")))
    d.apply_pending()
    x, other = torch.randn(16, 64), torch.randn(3, 5)
    for _ in range(4):
        F.gelu(x)
        F.gelu(other)
    assert _calls(d, "gelu") == {"algebraic": 4, "reference": 4}


def test_swap_waits_for_the_optimizer_step_boundary():
    d = patching.enable()
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 32)
    model(x).sum().backward()
    d.install_plan(plan_for(1, ("gelu", GELU_BUCKET, "eager")))
    model(x).sum().backward()  # still mid-step: old plan
    assert d.plan.version == 0 and _calls(d, "gelu") == {"reference": 2}
    opt.step()
    assert d.plan.version == 1 and d.step == 1
    model(x).sum().backward()
    assert _calls(d, "gelu") == {"reference": 2, "eager": 1}
    assert d.readings.swaps == [(1, 0, 1, d.plan.digest)]


def test_effective_step_delays_the_swap():
    d = patching.enable()
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    plan = plan_for(1, ("gelu", GELU_BUCKET, "eager"))
    d.install_plan(Plan(plan.version, plan.entries, effective_step=3))
    for step in range(1, 5):
        model(torch.randn(16, 32)).sum().backward()
        opt.step()
        assert d.plan.version == (1 if step >= 3 else 0)


@pytest.mark.parametrize("bad,message", [
    (plan_for(0), "not newer"),
    (plan_for(2, ("gelu", GELU_BUCKET, "no_such_variant")), "unknown variant"),
    (plan_for(2, ("conv", GELU_BUCKET, "eager")), "unknown op"),
])
def test_rejected_plan_keeps_the_running_plan(bad, message):
    d = patching.enable()
    good = plan_for(1, ("gelu", GELU_BUCKET, "eager"))
    d.install_plan(good)
    d.apply_pending()
    with pytest.raises(PlanError) as e:
        d.install_plan(bad)
    assert message in str(e.value)
    assert d.plan is good and d.pending is None
    assert d.plan_rejections and message in d.plan_rejections[-1]
    F.gelu(torch.randn(16, 64))
    assert _calls(d, "gelu") == {"eager": 1}


def test_explore_weights_route_that_share_of_calls():
    d = patching.enable()
    entry_plan = plan_for(1, ("gelu", GELU_BUCKET, "eager", {}, [ExploreArm("algebraic", {}, 0.1)]))
    d.install_plan(entry_plan)
    d.apply_pending()
    x = torch.randn(16, 64)
    for _ in range(1000):
        F.gelu(x)
    assert _calls(d, "gelu") == {"eager": 900, "algebraic": 100}


def test_variant_with_config_space_gets_its_config():
    d = patching.enable()
    d.install_plan(plan_for(1, ("layer_norm", LN_BUCKET, "chunked", {"chunk_rows": 256})))
    d.apply_pending()
    x = torch.randn(16, 64, requires_grad=True)
    y = F.layer_norm(x, [64], torch.ones(64), torch.ones(64))
    y.sum().backward()
    slot, = [s for s in d.readings.slots if s.variant == "chunked"]
    assert slot.config == '{"chunk_rows":256}' and d.readings.calls[slot.id] == 1
    assert d.readings.build_misses[slot.id] == 1


def test_variants_built_with_torch_compile_wait_until_a_background_compile_is_over():
    """dynamo compiles one frame at a time: a variant compiled on the job's thread during a
    background compile would stall the job until that one is done."""
    d = patching.enable()
    try:
        x = torch.randn(4, 8)
        d.install_plan(plan_for(1, ("silu", bucket_id("silu", x), "compiled")))
        d.apply_pending()
        entered, release = threading.Event(), threading.Event()

        def background():
            with background_compile():
                entered.set()
                release.wait(60)

        ran = lambda: {s.variant: d.readings.calls[s.id] for s in d.slots
                       if s.op == "silu" and d.readings.calls[s.id]}
        F.silu(x)  # routed before the compile begins
        assert ran() == {"compiled": 1}
        thread = threading.Thread(target=background)
        thread.start()
        try:
            assert entered.wait(60)
            d.on_step()  # the compile began: routes are made again, without torch.compile
            F.silu(x)
            d.on_step()  # the compile goes on: the route stays
            F.silu(x)
        finally:
            release.set()
            joined(thread)
        assert ran() == {"compiled": 1, "reference": 2}
        d.on_step()  # the first boundary after the compile routes again
        torch.testing.assert_close(F.silu(x), x * torch.sigmoid(x))
        assert ran() == {"compiled": 2, "reference": 2}
    finally:
        patching.disable()


def test_a_route_that_can_never_be_checked_leaves_its_first_call_check():
    """Under torch.func.vmap the values cannot be compared: every call ran the reference twice
    and the route once, for good (per-sample gradients took twice as long)."""
    from torch.func import vmap

    from rtxops.runtime import patching
    from rtxops.runtime.dispatcher import UNCHECKED_CALLS_KEPT
    from rtxops.runtime.plan import Plan

    d = patching.enable(Plan(version=1, defaults={"layer_norm": "native"}))
    try:
        site = d.site_named("F.layer_norm")
        ran, reference = [], site.run_reference
        site.run_reference = lambda *a: ran.append(1) or reference(*a)
        w, b = torch.ones(16), torch.zeros(16)
        calls = 3 * UNCHECKED_CALLS_KEPT
        batched = vmap(lambda x: F.layer_norm(x, [16], w, b))
        x = torch.randn(4, 16)
        for _ in range(calls):
            torch.testing.assert_close(batched(x), F.layer_norm.__wrapped__(x, [16], w, b))
        assert len(ran) <= 2 * UNCHECKED_CALLS_KEPT, len(ran)
        assert not d.disabled
    finally:
        patching.disable()


def test_a_scalar_annealed_every_step_keeps_the_route_table_bounded():
    """A call key holds the scalar arguments: label smoothing annealed every step made a new
    key (and a route kept forever) at every call."""
    from rtxops.runtime.dispatcher import ROUTES_PER_SITE

    d = patching.enable()
    try:
        x, target = torch.randn(8, 10), torch.randint(0, 10, (8,))
        site = next(s for s in d.sites if s.name == "F.cross_entropy")
        steps = 3 * ROUTES_PER_SITE
        for i in range(steps):
            smoothing = 0.1 * (1 - i / steps)
            got = F.cross_entropy(x, target, label_smoothing=smoothing)
            if i % 500 == 0:
                want = F.cross_entropy.__wrapped__(x, target, label_smoothing=smoothing)
                torch.testing.assert_close(got, want)
        assert ROUTES_PER_SITE // 2 < len(site.routes) <= ROUTES_PER_SITE   # the newer half kept
        assert _calls(d, "cross_entropy") == {"reference": steps}
    finally:
        patching.disable()
