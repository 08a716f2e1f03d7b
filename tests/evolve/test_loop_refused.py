"""A bucket whose plan the job never takes: silence counts as a refusal only once the job is
past the plan's effective step, and then the incumbent's entry goes back on the board (later
plans are derived from it, so they would carry the failed bucket's explore arms)."""
from __future__ import annotations

from rtxops.evolve import loop as L
from rtxops.evolve.candidates import Arm
from rtxops.evolve.search import make_strategy
from rtxops.telemetry import store_evolve as se

from .loop_harness import loop_over_rows


class _Board:
    def __init__(self):
        self.published, self.reports = [], []

    def current(self, job):
        return self.published[-1] if self.published else None

    def promote(self, plan, job, decision, evidence):
        self.published.append(plan)
        return plan


def test_a_plan_never_taken_fails_the_bucket_and_puts_the_incumbent_back(monkeypatch):
    decisions = []
    loop = loop_over_rows(monkeypatch, [], last=30, decisions=decisions)
    loop.board = _Board()
    monkeypatch.setattr(se, "swap_step", lambda q, job, v: None)  # the job never swaps
    inc, cand = Arm.of("reference"), Arm.of("fastish")
    bt = L.BucketTuning("gelu", "b", inc, strategy=make_strategy("exhaustive", [cand], budget=2))
    loop._next_round("job", bt, 30)
    assert loop.board.current("job").entry("gelu", "b").explore  # exploring
    loop.jobs["job"] = L.JobEvolution(active=bt)
    bt.published_ns -= int(400e9)  # past the swap timeout

    loop.tick()  # ...but the job has not reached the plan's effective step: minute-long steps?
    assert bt.phase == "exploring" and not decisions

    monkeypatch.setattr(se, "last_step", lambda q, job: bt.effective_step + 10)
    loop.tick()
    assert bt.phase == "failed" and decisions[-1]["kind"] == "refused"
    entry = loop.board.current("job").entry("gelu", "b")
    assert (entry.variant, entry.explore) == ("reference", ())


def test_a_canary_without_the_winner_running_waits_then_rolls_back(monkeypatch):
    """Only the fallback ran in the canary window (the job disabled the winner): no pass on
    zero live samples; after the longest window the incumbent goes back."""
    import numpy as np

    inc, win = Arm.of("reference"), Arm.of("fastish")
    rng = np.random.default_rng(0)
    rows = [{"step": s, "variant": inc.variant, "config": "{}", "calls": 4,
             "total_ns": 4e5 * float(np.exp(rng.normal(0, .02)))} for s in range(10, 400)]
    decisions = []
    loop = loop_over_rows(monkeypatch, rows, last=30, decisions=decisions)
    loop.board = _Board()
    bt = L.BucketTuning("gelu", "b", inc, phase="canary", winner=win, plan_version=7)
    bt.rounds = [({s: 1e5 for s in range(0, 9)}, {win: {s: 0.8e5 for s in range(0, 9)}})]
    bt.decision_ns = 0.8e5
    loop.jobs["job"] = L.JobEvolution(active=bt)
    loop.tick()
    assert bt.phase == "canary" and not decisions  # one window: wait for more
    monkeypatch.setattr(se, "last_step", lambda q, job: 399)
    loop.tick()
    assert decisions[-1]["kind"] == "rollback", decisions[-1]
    assert "nothing shows it works live" in decisions[-1]["reason"]
    assert loop.board.current("job").entry("gelu", "b").variant == "reference"
