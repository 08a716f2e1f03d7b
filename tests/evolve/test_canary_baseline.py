"""The canary judges the swap it follows: its step-time baseline is the window just before the
promotion, and a slower step alone (anything in the step may have changed) rolls back without
marking the kernel regressed in the tuning database, where it would be kept from every job."""
from __future__ import annotations

import numpy as np

from rtxops.evolve import loop as L
from rtxops.evolve.candidates import Arm
from rtxops.telemetry import store_evolve as se

from .loop_harness import loop_over_rows

INC, WIN = Arm.of("reference"), Arm.of("fast")


def test_the_canary_baseline_is_the_window_before_the_promotion(monkeypatch):
    rng = np.random.default_rng(0)
    rows = []
    for step in range(10, 31):
        rows.append({"step": step, "variant": INC.variant, "config": "{}", "calls": 9,
                     "total_ns": 9e6 * float(np.exp(rng.normal(0, 0.02)))})
        rows.append({"step": step, "variant": WIN.variant, "config": "{}", "calls": 1,
                     "total_ns": 0.6e6 * float(np.exp(rng.normal(0, 0.02)))})
    decisions: list[dict] = []
    loop = loop_over_rows(monkeypatch, rows, last=30, decisions=decisions)
    # the job's steps took 100 ms before the rounds began (the baseline then), 130 ms since
    monkeypatch.setattr(se, "step_durations", lambda q, job, since, until=None: [
        {"step": s, "duration_ns": 130e6 if s >= 10 else 100e6} for s in range(since, (until or 30) + 1)])
    bt = L.BucketTuning("gelu", "b", INC, step_before=[100e6] * 20)
    from rtxops.evolve.search import make_strategy
    bt.strategy = make_strategy("exhaustive", [WIN], budget=1)
    bt.strategy.ask()
    bt.round_arms, bt.plan_version = [WIN], 5
    loop.jobs["job"] = L.JobEvolution(active=bt)
    loop.tick()
    assert decisions[-1]["kind"] == "promote", decisions[-1]["reason"]
    assert bt.phase == "canary" and min(bt.step_before) == 130e6


def canary_of(monkeypatch, live_ms: float, steps_ms: float) -> tuple[list[dict], list[dict]]:
    """One tick of a canary (steps 10-29 after the swap) of a winner measured 0.8 ms a call
    against the incumbent's 1 ms, running ``live_ms`` a call live, the job's steps taking
    ``steps_ms`` against 100 ms before; its decisions and tuning-DB records."""
    rows = [{"step": s, "variant": WIN.variant, "config": "{}", "calls": 8,
             "total_ns": 8 * live_ms * 1e6} for s in range(10, 30)]
    decisions: list[dict] = []
    marked: list[dict] = []
    loop = loop_over_rows(monkeypatch, rows, last=29, decisions=decisions)
    monkeypatch.setattr(se, "step_durations", lambda *a, **k: [
        {"duration_ns": steps_ms * 1e6 + i * 1e5} for i in range(20)])
    loop.tuning.record = lambda *a, **k: marked.append(k)
    bt = L.BucketTuning("gelu", "b", INC, phase="canary", winner=WIN, plan_version=7,
                        step_before=[100e6 + i * 1e5 for i in range(20)])
    bt.rounds = [({s: 1.0e6 + s for s in range(-400, -380)},
                  {WIN: {s: 0.8e6 + s for s in range(-400, -380)}})]
    loop.jobs["job"] = L.JobEvolution(active=bt)
    loop.tick()
    return decisions, marked


def test_a_slower_step_with_a_faster_kernel_rolls_back_without_marking_it_regressed(monkeypatch):
    decisions, marked = canary_of(monkeypatch, live_ms=0.8, steps_ms=130)
    assert decisions[-1]["kind"] == "rollback" and "step time" in decisions[-1]["reason"]
    assert not [m for m in marked if m.get("status") == "regressed"]


def test_a_kernel_slower_live_is_marked_regressed(monkeypatch):
    decisions, marked = canary_of(monkeypatch, live_ms=2.0, steps_ms=100)
    assert decisions[-1]["kind"] == "rollback" and "kernel time" in decisions[-1]["reason"]
    assert [m["status"] for m in marked] == ["regressed"]


def test_a_job_that_ends_during_its_canary_leaves_the_promotion_an_outcome(monkeypatch):
    """The loop forgot an ended job's buckets: a promotion whose canary the job's end cut short
    had no outcome at all, and its plan kept a winner nothing had checked."""
    decisions: list[dict] = []
    loop = loop_over_rows(monkeypatch, [], last=14, decisions=decisions)
    bt = L.BucketTuning("gelu", "b", INC, phase="canary", winner=WIN, plan_version=7,
                        canary_from=10)
    loop.jobs["job"] = L.JobEvolution(active=bt)
    loop.running_jobs = lambda: []
    loop.tick()
    assert "job" not in loop.jobs
    d = decisions[-1]
    assert d["kind"] == "canary_incomplete" and d["plan_version"] == 7
    assert "the job ended 5 steps into its 20-step window" in d["reason"]
