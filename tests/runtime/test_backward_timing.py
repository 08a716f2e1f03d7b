"""Backward timing of sampled calls: hooks on the autograd nodes a call made, never a change to the
call's tensors, so in-place ops and functorch see what they would without rtxops."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

from rtxops.runtime import patching
from rtxops.runtime.dispatcher import EXPLORE_BACKWARD_EVERY
from rtxops.runtime.plan import ExploreArm
from rtxops.runtime.timing import BackwardTimer

from .helpers import bucket_id, plan_for, train_losses


class InPlaceNet(nn.Module):
    """Outputs of routed calls modified in place (ReLU(inplace=True), F.silu(inplace=True))."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 10)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.act(self.fc1(x))
        return self.fc2(F.silu(h * 1.0, inplace=True))


def _losses(routed: bool, steps: int = 6) -> list[float]:
    torch.manual_seed(0)
    model = InPlaceNet()
    if routed:
        patching.enable().backward_every = 1  # every step's calls have their backward timed
    try:
        return train_losses(model, steps=steps)
    finally:
        if routed:
            patching.disable()


def test_outputs_of_sampled_calls_can_be_modified_in_place():
    assert _losses(routed=True) == _losses(routed=False)


def test_per_sample_gradients_through_functorch_while_sampling():
    torch.manual_seed(0)
    w = torch.randn(4, 16)
    xs = torch.randn(5, 16)

    def loss(w, x):
        return F.gelu(F.linear(x, w)).sum()

    plain = vmap(grad(loss), in_dims=(None, 0))(w, xs)
    d = patching.enable()
    d.backward_every = 1
    try:
        for _ in range(2):
            routed = vmap(grad(loss), in_dims=(None, 0))(w, xs)
            d.on_step()
    finally:
        patching.disable()
    assert torch.equal(routed, plain)


class _Slow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, delay):
        ctx.delay = delay
        return x * 2

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.delay)
        return g * 2, None


class _Backwards:
    def __init__(self):
        self.seen = []

    def backward(self, slot, start_ns, duration_ns):
        self.seen.append((slot, duration_ns))


def test_the_time_covers_the_calls_backward_and_nothing_around_it():
    readings = _Backwards()
    x = torch.randn(3, requires_grad=True)
    before = _Slow.apply(x, 0.05)
    timer = BackwardTimer(7, readings)
    timer.before()
    out = _Slow.apply(_Slow.apply(before, 0.02), 0.02)  # the timed call: two nodes, 40 ms
    timer.after(out)
    _Slow.apply(out, 0.05).sum().backward()
    [(slot, duration_ns)] = readings.seen
    assert slot == 7
    assert 0.04 <= duration_ns / 1e9 < 0.09


def test_a_call_without_a_backward_of_its_own_is_not_timed():
    readings = _Backwards()
    x = torch.randn(3, requires_grad=True)
    timer = BackwardTimer(1, readings)
    timer.before()
    out = x  # returned as it came: no node of the call's
    timer.after(out)
    (out * 2).sum().backward()
    assert readings.seen == []


def test_a_route_not_called_for_many_steps_has_its_next_backward_timed_once():
    """Each boundary armed the route again on top of its armed self: one backward was recorded
    once per boundary it had waited, and after thousands the call hit Python's recursion limit."""
    d = patching.enable()
    d.backward_every = 1
    seen: list[int] = []
    record = d.readings.backward
    d.readings.backward = lambda slot, start, duration: (seen.append(slot), record(slot, start, duration))
    try:
        x = torch.randn(8, 16, requires_grad=True)
        F.gelu(x).sum().backward()
        d.on_step()
        for _ in range(3000):          # an eval shape, an epoch's last batch: seldom called
            d.on_step()
        seen.clear()
        F.gelu(x).sum().backward()
        assert len(seen) == 1
    finally:
        patching.disable()


def test_a_sampled_call_under_a_fake_tensor_mode_runs_untimed():
    """The timer's probe is a real tensor: under FakeTensorMode (a memory estimator tracing the
    model) the sampled call raised to the job."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    d = patching.enable()
    d.backward_every = 1
    try:
        x = torch.randn(8, 16, requires_grad=True)
        F.gelu(x).sum().backward()
        d.on_step()                    # the route is armed
        with FakeTensorMode() as mode:
            assert F.gelu(mode.from_tensor(x)).shape == (8, 16)
    finally:
        patching.disable()


def test_a_sampled_calls_forward_figure_leaves_the_timers_own_cost_out(monkeypatch):
    """The armed call's forward was timed around the backward timer's set-up too: a cost that
    weighed most on the explore arms with the fewest calls in a window."""
    real_before = BackwardTimer.before

    def slow_before(self):
        time.sleep(0.05)
        real_before(self)

    monkeypatch.setattr(BackwardTimer, "before", slow_before)
    d = patching.enable()
    d.backward_every = 1
    try:
        x = torch.randn(8, 16, requires_grad=True)
        F.gelu(x).sum().backward()
        d.on_step()                    # armed
        calls, total = sum(d.readings.calls), sum(d.readings.total_ns)
        F.gelu(x).sum().backward()
        assert sum(d.readings.calls) == calls + 1
        assert sum(d.readings.total_ns) - total < 0.05e9
    finally:
        patching.disable()


def test_exploring_arms_have_their_backward_timed_more_often_than_settled_routes():
    """The evolve loop weighs an exploring bucket's arms by their backward: every
    EXPLORE_BACKWARD_EVERY steps; a settled route's backward only feeds telemetry, and its
    sampling cost every step of the job: every ``backward_every`` steps."""
    x = torch.randn(16, 64, requires_grad=True)
    d = patching.enable()
    d.backward_every = 4 * EXPLORE_BACKWARD_EVERY
    d.install_plan(plan_for(1, ("gelu", bucket_id("gelu", x), "eager", {},
                                [ExploreArm("algebraic", {}, 0.5)])))
    d.apply_pending()
    timed: dict[str, int] = {}
    record = d.readings.backward

    def seen(slot, start, duration):
        op = d.slots[slot].op
        timed[op] = timed.get(op, 0) + 1
        record(slot, start, duration)

    d.readings.backward = seen
    try:
        steps = 8 * d.backward_every
        for _ in range(steps):
            # a settled route (silu on the default plan) and an exploring one (gelu), a few calls each
            (F.silu(x).sum() + sum(F.gelu(x).sum() for _ in range(4))).backward()
            d.on_step()
        # both arms of gelu once every EXPLORE_BACKWARD_EVERY steps, silu once in backward_every
        # (the last boundary arms calls that never come)
        assert timed["gelu"] == 2 * (steps // EXPLORE_BACKWARD_EVERY - 1)
        assert timed["silu"] == steps // d.backward_every - 1
    finally:
        patching.disable()
