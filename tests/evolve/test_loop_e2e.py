"""The online evolve loop end to end: a real daemon (in this process, so the test reads its store),
real training jobs, real telemetry, the loop gating, exploring, promoting, canarying and rolling
back. Two jobs run at once, each with one hot ``gelu`` bucket:

* job ``fast``: starts on ``slow3x`` (the reference, three times); ``toggle`` (as fast as the
  reference) must be promoted, then made slow by the test right when it is promoted: the canary
  must roll it back and mark it regressed.
* job ``slow``: starts on the reference; ``slow3x`` must never be promoted, and ``toggle`` (the
  same speed as the reference) must not be promoted either (no gain beyond the noise).
In both, ``wrong`` (10 % off) and ``nan`` must be rejected by the gate with the reason stored.
"""
from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from rtxops.daemon.home import Home
from rtxops.daemon.jobs import JobSpec
from rtxops.daemon.server import Daemon
from rtxops.runtime import registry as registry_module
from rtxops.runtime.plan import Plan, PlanEntry
from rtxops.telemetry import store_evolve

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = "tests.evolve.plugins_speed"

JOB = textwrap.dedent("""
    import sys, time, torch
    import torch.nn.functional as F
    rows = int(sys.argv[1])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    w = torch.nn.Parameter(torch.ones(256))
    opt = torch.optim.SGD([w], lr=1e-6)
    x = torch.randn(rows, 256)
    for step in range(200000):
        h = x * w
        for _ in range(8):
            h = F.gelu(h) + x
        loss = h.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.008)
""")


def gelu_bucket(rows: int) -> str:
    spec = registry_module.default_registry().op("gelu")
    return spec.to_bucket(spec.bucket(torch.empty(rows, 256))).id


def until(predicate, timeout: float, what: str, daemon=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    seen = ""
    if daemon is not None:   # what the loop and the jobs were doing (a timeout says nothing else)
        loop = daemon.evolve.loop if daemon.evolve else None
        seen = (f"\nloop: {loop.status() if loop else None}\njobs: "
                f"{[(j.name, j.state.value, j.last_step, j.reason) for j in daemon.supervisor.jobs()]}"
                f"\ndecisions: {daemon.store.query('SELECT kind, op, reason FROM decisions')}")
    raise AssertionError(f"timed out after {timeout} s waiting for {what}{seen}")


@pytest.fixture
def evolving_daemon(tmp_path, monkeypatch):
    # the daemon (its loop, plan checks and gate workers) loads the same plugin as the jobs
    monkeypatch.setenv("RTXOPS_VARIANT_MODULES", PLUGIN)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setattr(registry_module, "_default", registry_module.load_builtin())
    for name, value in {"RTXOPS_EVOLVE": "1", "RTXOPS_EVOLVE_INTERVAL_S": "0.3",
                        "RTXOPS_EVOLVE_MIN_STEPS": "5", "RTXOPS_EVOLVE_WINDOW_STEPS": "20",
                        "RTXOPS_EVOLVE_EXPLORE_SHARE": "0.5", "RTXOPS_EVOLVE_MIN_SHARE": "0.005",
                        "RTXOPS_EVOLVE_VARIANTS": "slow3x,toggle,wrong,nan",
                        "RTXOPS_EVOLVE_STRATEGY": "successive_halving"}.items():
        monkeypatch.setenv(name, value)
    d = Daemon(Home(tmp_path / "home"), port=0, job_grace_s=5).start_in_thread()
    yield d
    d.shutdown()


def test_loop_promotes_the_faster_variant_rolls_back_a_regression_and_never_promotes_a_slower_one(
        evolving_daemon, tmp_path):
    d = evolving_daemon
    fast_bucket, slow_bucket = gelu_bucket(64), gelu_bucket(200)
    assert fast_bucket != slow_bucket
    d.board.publish(Plan(version=1, entries=(PlanEntry("gelu", fast_bucket, "slow3x"),)))
    slow_file = tmp_path / "make-toggle-slow"
    script = tmp_path / "train.py"
    script.write_text(JOB)
    env = {"RTXOPS_VARIANT_MODULES": PLUGIN, "PYTHONPATH": str(ROOT), "RTXOPS_PLAN_POLL_S": "0.2",
           "RTXOPS_EXPORT_INTERVAL_S": "0.5", "RTXOPS_TEST_SLOW_FILE": str(slow_file)}
    fast = d.supervisor.submit(JobSpec((sys.executable, str(script), "64"), name="fast", env=env))
    slow = d.supervisor.submit(JobSpec((sys.executable, str(script), "200"), name="slow",
                                       env={**env, "RTXOPS_TEST_SLOW_FILE": str(tmp_path / "never")}))
    publish = d.board.promote

    def promote_then_regress(plan, job_id=None, **kw):
        # the promoted kernel regresses right as its plan is published: made slow by the test
        # after it saw the plan, it could run its whole canary fast on a loaded machine
        if job_id == fast.id and (kw.get("decision") or {}).get("kind") == "promote":
            slow_file.write_text("slow")
        return publish(plan, job_id, **kw)

    d.board.promote = promote_then_regress
    try:
        def promoted_toggle():
            plan = d.board.current(fast.id)
            entry = plan.entry("gelu", fast_bucket) if plan else None
            return entry is not None and entry.variant == "toggle" and not entry.explore
        until(promoted_toggle, 150, "the loop to promote toggle in job fast", d)

        def decisions(job, kind):
            return [r for r in store_evolve.decisions(d.store, job) if r["kind"] == kind]
        rollback = until(lambda: decisions(fast.id, "rollback"), 120, "the canary to roll back", d)[0]
        reject = until(lambda: decisions(slow.id, "reject"), 150, "job slow's bucket decision")[0]
    finally:
        for job in (fast, slow):
            d.supervisor.cancel(job.id)

    # job fast: promoted with a gain well beyond the minimum, then rolled back in its first canary
    promote = decisions(fast.id, "promote")
    assert len(promote) == 1 and promote[0]["candidate_variant"] == "toggle"
    assert promote[0]["incumbent_variant"] == "slow3x"
    assert promote[0]["gain"] > 0.3 and promote[0]["ci_low"] > 0
    evidence = json.loads(promote[0]["evidence"])
    assert evidence["trial_ids"] and evidence["telemetry_digest"].startswith("sha256:")
    assert rollback["candidate_variant"] == "toggle" and "canary" in rollback["reason"]
    assert rollback["plan_version"] > promote[0]["plan_version"]
    # both are signed bundles in the ledger, linked from the decision
    ledger = {r["subject_digest"]: r for r in d.store.query("SELECT * FROM ledger")}
    for decision in (promote[0], rollback):
        entry = ledger[decision["bundle_digest"]]
        assert entry["scope"] == fast.id and entry["version"] == decision["plan_version"]
    assert not decisions(fast.id, "canary_pass")
    current = d.board.current(fast.id).entry("gelu", fast_bucket)
    assert current.variant == "slow3x" and not current.explore
    regressed = store_evolve.tuning_rows(d.store, {"op": "gelu", "bucket": fast_bucket,
                                                   "variant": "toggle"})
    assert regressed and regressed[0]["status"] == "regressed"

    # job slow: nothing promoted; the slower arm measured slower
    assert not decisions(slow.id, "promote")
    assert reject["bucket"] == slow_bucket and reject["incumbent_variant"] == "reference"
    trials = store_evolve.trials(d.store, slow.id)
    by_variant = {t["variant"]: t["median_ns"] for t in trials if t["median_ns"]}
    # three times the compute, not three times the time: a call's fixed costs (the wrappers, the
    # output's allocation) are the same in both and grow with the machine's load
    assert by_variant["slow3x"] > 1.3 * by_variant["toggle"]
    assert all(t["mode"] == "online" for t in trials)
    spans = d.store.query("SELECT count(*) AS n FROM spans WHERE name = 'rtx.trial'")[0]["n"]
    assert spans == len(store_evolve.trials(d.store))

    # the gate: wrong values and NaN rejected, with the reason, for both buckets
    gates = {(r["bucket"], r["variant"]): r for r in d.store.query("SELECT * FROM gate_results")}
    for bucket in (fast_bucket, slow_bucket):
        assert not gates[(bucket, "wrong")]["passed"]
        assert "exceeds" in gates[(bucket, "wrong")]["reason"]
        assert not gates[(bucket, "nan")]["passed"]
        assert "NaN" in gates[(bucket, "nan")]["reason"]
        assert gates[(bucket, "toggle")]["passed"]
    assert not any(t["variant"] in ("wrong", "nan") for t in store_evolve.trials(d.store))
