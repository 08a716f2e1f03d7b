"""The optimizer-step region: the job's torch.optim optimizer switched to torch's fused kernel at a
step boundary, timed against the default, kept only when faster; optimizers torch cannot fuse
and jobs with two optimizers are left alone."""
from __future__ import annotations

import textwrap
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from rtxops.runtime import patching
from rtxops.runtime.optimizer_region import (DEFAULT, FUSED, TRIAL, UNSUPPORTED, WAIT,
                                             FusedOptimizer, step_clock, unsupported_reason)
from tests.daemon.live import PY, Daemons, cli


def make(opt_cls=torch.optim.AdamW, sparse=False, **opt_kw):
    torch.manual_seed(0)
    emb = nn.Embedding(50, 16, sparse=sparse)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 50))
    opt = opt_cls([*emb.parameters(), *net.parameters()], lr=1e-2, **opt_kw)
    return emb, net, opt


def train(emb, net, opt, steps, more=lambda: False, opts=None):
    """``steps`` steps, then on while ``more()`` (at most 60 s); the losses."""
    g = torch.Generator().manual_seed(1)
    losses = []
    deadline = time.monotonic() + 60
    while len(losses) < steps or (more() and time.monotonic() < deadline):
        x, y = torch.randint(0, 50, (8, 4), generator=g), torch.randint(0, 50, (32,), generator=g)
        loss = F.cross_entropy(net(emb(x)).view(-1, 50), y)
        for o in opts or [opt]:
            o.zero_grad()
        loss.backward()
        for o in opts or [opt]:
            o.step()
        losses.append(loss.item())
    return losses


def run_region(opt_cls=torch.optim.AdamW, steps=6, settle=True, slow_when=None, **kw):
    """Train under the runtime with a FusedOptimizer; ``slow_when(fused)`` says when a step
    should take 150 ms longer (to force the decision, whatever the host's load)."""
    emb, net, opt = make(opt_cls, **kw)
    if slow_when is not None:
        opt.register_step_pre_hook(
            lambda o, a, k: time.sleep(0.15) if slow_when(bool(o.param_groups[0]["fused"])) else None)
    reports = []
    d = patching.enable()
    region = d.optimizer_region = FusedOptimizer(lambda s, o: reports.append((s, o)),
                                                 trial_steps=5, warmup_steps=1)
    groups: list[dict] = []
    try:
        losses = train(emb, net, opt, steps,
                       more=lambda: settle and region.state not in (FUSED, DEFAULT, UNSUPPORTED))
    finally:
        groups = [{k: g.get(k) for k in ("fused", "foreach")} for g in opt.param_groups]
        patching.disable()
    return region, reports, losses, opt, groups


def test_the_optimizer_switches_to_fused_and_trains_the_same():
    region, reports, losses, opt, groups = run_region()
    assert region.state in (FUSED, DEFAULT), region.reason  # kept or reverted on measured times
    assert reports[0][1] == "fused" and reports[0][0] > 1 + 5  # after warm-up and a baseline
    fused = region.state == FUSED
    assert all(g["fused"] is (True if fused else None) for g in groups)
    # disable() puts the script's settings back
    assert all(g["fused"] is None and g["foreach"] is None for g in opt.param_groups)
    if not fused:
        assert [o for _, o in reports] == ["fused", "default"]
    emb, net, plain_opt = make()
    plain = train(emb, net, plain_opt, len(losses))
    torch.testing.assert_close(losses, plain, rtol=1e-5, atol=1e-6)  # the same training


def test_a_faster_fused_optimizer_is_kept():
    region, reports, _, opt, groups = run_region(slow_when=lambda fused: not fused)
    assert region.state == FUSED and [o for _, o in reports] == ["fused"]
    assert all(g["fused"] is True and g["foreach"] is False for g in groups)
    # disable() puts the script's settings back
    assert all(g["fused"] is None and g["foreach"] is None for g in opt.param_groups)
    assert all(s["step"].dtype == torch.float32 for s in opt.state.values())


def test_a_slower_fused_optimizer_is_reverted_to_the_scripts_settings():
    region, reports, losses, opt, groups = run_region(torch.optim.Adam, slow_when=lambda fused: fused,
                                                      foreach=True)
    assert region.state == DEFAULT and [o for _, o in reports] == ["fused", "default"]
    assert all(g["fused"] is None and g["foreach"] is True for g in groups)
    emb, net, plain_opt = make(torch.optim.Adam, foreach=True)
    torch.testing.assert_close(losses, train(emb, net, plain_opt, len(losses)), rtol=1e-5, atol=1e-6)


def test_the_trial_waits_until_the_model_region_has_settled():
    emb, net, opt = make()
    settled = []
    d = patching.enable()
    region = d.optimizer_region = FusedOptimizer(lambda s, o: None, trial_steps=3, warmup_steps=1,
                                                 ready=lambda: bool(settled))
    try:
        train(emb, net, opt, 10)
        assert region.state == WAIT and not any(g["fused"] for g in opt.param_groups)
        settled.append(True)
        train(emb, net, opt, 2 + 3)
        assert region.state == TRIAL and all(g["fused"] for g in opt.param_groups)
    finally:
        patching.disable()


class MyAdam(torch.optim.Adam):
    pass


@pytest.mark.parametrize("opt_cls, kw, why", [
    (MyAdam, {}, "MyAdam has no fused implementation"),
    (torch.optim.SGD, {"sparse": True}, "sparse gradients"),
    (torch.optim.AdamW, {"fused": True}, "already runs fused"),
    (torch.optim.RMSprop, {}, "RMSprop has no fused implementation"),
])
def test_optimizers_torch_cannot_fuse_are_left_alone(opt_cls, kw, why):
    region, reports, losses, opt, _ = run_region(opt_cls, steps=8, settle=False, **kw)
    assert region.state == UNSUPPORTED and why in region.reason
    assert reports == [] and len(losses) == 8
    assert [g.get("fused") for g in opt.param_groups] == [kw.get("fused")] * len(opt.param_groups)


def test_a_differentiable_optimizer_is_not_fused():
    assert "differentiable" in unsupported_reason(torch.optim.Adam([nn.Parameter(torch.ones(3))],
                                                                   differentiable=True))


def test_a_refusing_constructor_is_the_reason():
    w = nn.Parameter(torch.randn(4, dtype=torch.complex64))  # fused kernels take no complex
    opt = torch.optim.Adam([w])
    assert "torch refuses fused=True" in unsupported_reason(opt)


def test_every_optimizer_step_is_recorded_under_its_variant():
    emb, net, opt = make()
    d = patching.enable()
    switched = []
    region = d.optimizer_region = FusedOptimizer(lambda s, o: switched.append(s), trial_steps=5,
                                                 warmup_steps=1, clock=step_clock(d))
    try:
        losses = train(emb, net, opt, 6, more=lambda: region.state not in (FUSED, DEFAULT, UNSUPPORTED))
    finally:
        patching.disable()
    stats = d.readings
    slots = {(s.variant, s.site): s.id for s in d.slots if s.op == "region"}
    site = "optimizer:torch.optim.adamw.AdamW"
    assert set(slots) <= {(FUSED, site), (DEFAULT, site)} and (FUSED, site) in slots
    calls = {v: stats.calls[i] for (v, _), i in slots.items()}
    assert sum(calls.values()) == len(losses)
    # the fused steps are those from the switch on (and back, when the default won)
    fused_steps = (switched[1] if len(switched) > 1 else len(losses)) - switched[0]
    assert calls[FUSED] == fused_steps
    assert all(stats.total_ns[i] > 0 for i in slots.values())
    # the hook is gone with the runtime: steps after disable() are not recorded
    train(emb, net, opt, 2)
    assert sum(stats.calls[i] for i in slots.values()) == len(losses)


def test_a_failing_clock_never_fails_the_jobs_step():
    emb, net, opt = make()
    d = patching.enable()

    def broken(optimizer, variant):
        raise RuntimeError("no clock today")

    region = d.optimizer_region = FusedOptimizer(lambda s, o: None, trial_steps=3, warmup_steps=1,
                                                 clock=broken)
    later = register_optimizer_step_pre_hook(lambda o, a, k: None)  # torch iterates over both
    try:
        losses = train(emb, net, opt, 5)
        assert region._pre_hook is None  # gone at the first step boundary
    finally:
        later.remove()
        patching.disable()
    assert len(losses) == 5


def test_a_job_stepping_two_optimizers_is_left_alone():
    emb, net, opt = make()
    other = torch.optim.SGD(emb.parameters(), lr=0.1)
    d = patching.enable()
    region = d.optimizer_region = FusedOptimizer(lambda s, o: None, trial_steps=3, warmup_steps=1)
    try:
        train(emb, net, opt, 6, opts=[opt, other])
    finally:
        patching.disable()
    assert region.state == UNSUPPORTED and "more than one optimizer" in region.reason
    assert not any(g["fused"] for o in (opt, other) for g in o.param_groups)


JOB = """
import torch
from torch import nn
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
x, y = torch.randn(16, 32), torch.randint(0, 8, (16,))
for _ in range(80):
    loss = nn.functional.cross_entropy(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
from rtxops.runtime import patching
region = patching.active().optimizer_region
print("REGION", region.state, opt.param_groups[0]["fused"])
"""


@pytest.fixture
def daemons(tmp_path):
    ds = Daemons(tmp_path)
    yield ds
    assert not ds.cleanup(), "processes outlived the test"


def test_rtxops_run_fuse_optimizer_reports_the_swap_in_telemetry(tmp_path, daemons):
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    r = cli("run", "--direct", "--fuse-optimizer", "--no-summary", "--json", "summary.json", "--",
            PY, "job.py", mark=daemons.mark, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    state, fused = r.stdout.split("REGION", 1)[1].split()
    # switching back restores the job's own setting (None for a default AdamW)
    assert state in (FUSED, DEFAULT) and (fused == "True") == (state == FUSED)
    from rtxops.telemetry.store import ReadOnlyStore

    store = ReadOnlyStore(tmp_path / ".rtxops" / "rtxops.duckdb")
    digests = [s["plan_digest"] for s in store.query("SELECT plan_digest FROM swaps ORDER BY at_ns")]
    want = ["region:optimizer:fused"] + (["region:optimizer:default"] if state == DEFAULT else [])
    assert digests == want
    # every optimizer.step() of the job is a call of the optimizer's region slot
    rows = store.query("""SELECT variant, sum(count) AS calls, sum(total_ns) AS ns FROM kernel_spans
                          WHERE op = 'region' AND site = 'optimizer:torch.optim.adamw.AdamW'
                          GROUP BY variant""")
    calls = {r["variant"]: r["calls"] for r in rows}
    assert sum(calls.values()) == 80 and calls.get(FUSED, 0) > 0 and all(r["ns"] > 0 for r in rows)
    numel = 32 * 64 + 64 + 64 * 8 + 8
    buckets = store.query("SELECT DISTINCT bucket FROM kernel_spans WHERE op = 'region'")
    assert buckets == [{"bucket": f"float32/cpu/numel={numel}"}]


def test_a_checkpoint_taken_while_fused_keeps_the_jobs_own_settings():
    """A checkpoint saved during the trial (or after fused was kept) loads into a plain
    optimizer as the job set it up, not fused."""
    net = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(net.parameters())
    region = FusedOptimizer(lambda s, o: None, trial_steps=2, warmup_steps=0)
    for step in range(1, 6):
        net(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        region.on_step(step, opt)
    assert region.state == TRIAL and opt.param_groups[0]["fused"] is True
    saved = opt.state_dict()
    assert saved["param_groups"][0]["fused"] is None and saved["param_groups"][0]["foreach"] is None
    fresh = torch.optim.AdamW(net.parameters())
    fresh.load_state_dict(saved)
    assert not fresh.param_groups[0]["fused"]
    region.close()
    assert opt.state_dict()["param_groups"][0]["fused"] is None and not opt.param_groups[0]["fused"]


@pytest.mark.parametrize("settle", [False, True], ids=["in the trial", "once kept"])
def test_loading_a_checkpoint_keeps_the_fused_optimizer(settle):
    """A checkpoint's param groups hold the job's own settings: loading one (a resume, a
    rollback) put the optimizer back on the default path while the region timed its steps as
    fused, and reported it fused."""
    net = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(net.parameters())
    region = FusedOptimizer(lambda s, o: None, trial_steps=2, warmup_steps=0)
    step = 0

    def steps(n):
        nonlocal step
        for _ in range(n):
            step += 1
            net(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            region.on_step(step, opt)

    steps(5)
    assert region.state == TRIAL
    if settle:
        region._before = [10**12] * len(region._before)   # fused: faster than any real step
        steps(5)
        assert region.state == FUSED
    opt.load_state_dict(opt.state_dict())
    assert not opt.param_groups[0]["fused"]
    steps(1)
    assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["foreach"] is False
    assert all(s["step"].dtype == torch.float32 for s in opt.state.values())
    region.close()
    assert not opt.param_groups[0]["fused"]


def test_a_param_group_added_during_the_trial_is_fused_saved_and_restored_with_the_others():
    """add_param_group (unfreezing layers) after the flip: the new group was fused but left out
    of the checkpoint rewrite and of the revert; one torch cannot fuse (a complex parameter)
    would have made the job's own step raise."""
    net, head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(net.parameters())
    reports = []
    region = FusedOptimizer(lambda s, o: reports.append(o), trial_steps=2, warmup_steps=0)
    step = 0

    def steps(n):
        nonlocal step
        for _ in range(n):
            step += 1
            (net(torch.randn(2, 8)).sum() + head(torch.randn(2, 8)).sum()).backward()
            opt.step()
            opt.zero_grad()
            region.on_step(step, opt)

    steps(4)
    assert region.state == TRIAL
    opt.add_param_group({"params": head.parameters(), "foreach": True})
    steps(1)
    assert [(g["fused"], g["foreach"]) for g in opt.param_groups] == [(True, False)] * 2
    assert [(g["fused"], g["foreach"]) for g in opt.state_dict()["param_groups"]] == \
        [(None, None), (None, True)]
    region._restore()
    assert [(g["fused"], g["foreach"]) for g in opt.param_groups] == [(None, None), (None, True)]

    opt = torch.optim.AdamW(net.parameters())
    region = FusedOptimizer(lambda s, o: reports.append(o), trial_steps=2, warmup_steps=0)
    reports.clear()
    steps(4)
    assert region.state == TRIAL
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))]})
    steps(2)   # the job's steps go on, on the default path
    assert region.state == UNSUPPORTED and "an added param group" in region.reason
    assert reports == ["fused", "default"] and not any(g.get("fused") for g in opt.param_groups)
