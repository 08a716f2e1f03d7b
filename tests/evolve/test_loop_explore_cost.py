"""Exploring costs the job at most a share of its step time (RTXOPS_EVOLVE_EXPLORE_COST_CAP, 5 %):
an arm that passed the gate but is many times slower than the incumbent, on a hot bucket, added
to every step for a whole round (up to 200 steps for a seldom-called bucket)."""
from __future__ import annotations

from rtxops.evolve.candidates import Arm
from rtxops.telemetry import store_evolve as se

from .loop_harness import loop_over_rows, tick_one_arm

INC, ARM = Arm.of("reference"), Arm.of("slow")


def rows_for(arm_ms: float, last: int, ranks: int = 1) -> list[dict]:
    """Steps of 10 calls a rank (9 incumbent at 1 ms, 1 arm) from step 10 (the round's first),
    summed over ``ranks`` as the store sums them."""
    rows = []
    for step in range(10, last + 1):
        rows.append({"step": step, "variant": INC.variant, "config": "{}", "calls": 9 * ranks,
                     "total_ns": 9e6 * ranks})
        rows.append({"step": step, "variant": ARM.variant, "config": "{}", "calls": ranks,
                     "total_ns": arm_ms * 1e6 * ranks})
    return rows


def tick_at(monkeypatch, arm_ms: float, last: int, ranks: int = 1) -> list[dict]:
    decisions: list[dict] = []
    loop = loop_over_rows(monkeypatch, rows_for(arm_ms, last, ranks), last=last, decisions=decisions)
    monkeypatch.setattr(se, "step_durations", lambda q, job, since, until=None: [
        {"step": s, "duration_ns": 100e6, "ranks": ranks} for s in range(since, (until or last) + 1)])
    tick_one_arm(loop, "gelu", INC, ARM)
    return decisions


def test_a_round_whose_arm_costs_more_than_the_cap_ends_at_once(monkeypatch):
    # 40 ms for the arm's call against 1 ms: +39 ms on a 100 ms step, 39 %
    decisions = tick_at(monkeypatch, arm_ms=40.0, last=16)
    assert decisions and decisions[-1]["kind"] == "reject", decisions


def test_a_round_within_the_cap_runs_its_window(monkeypatch):
    # 4 ms against 1 ms: +3 ms on a 100 ms step, 3 %
    assert tick_at(monkeypatch, arm_ms=4.0, last=16) == []


def test_the_cost_is_per_rank_on_a_job_of_many_ranks(monkeypatch):
    """The arms' calls are summed over the ranks and a step's time is one rank's: an arm adding
    3 % to each of 8 ranks' steps was said to add 24 %, and its round was cut short."""
    assert tick_at(monkeypatch, arm_ms=4.0, last=16, ranks=8) == []
    decisions = tick_at(monkeypatch, arm_ms=40.0, last=16, ranks=8)
    assert decisions and decisions[-1]["kind"] == "reject", decisions


def test_an_arm_over_the_cap_is_not_explored_again_whatever_the_strategy(monkeypatch):
    """A round over the cap ended, but the arm stayed a candidate: Thompson sampling asked for
    it again every round until its budget was spent, the job paying the cap each time."""
    from rtxops.evolve import loop as L
    from rtxops.evolve.search import make_strategy

    for name in ("thompson", "successive_halving", "random", "exhaustive"):
        decisions: list[dict] = []
        loop = loop_over_rows(monkeypatch, rows_for(40.0, 16), last=16, decisions=decisions)
        monkeypatch.setattr(se, "step_durations", lambda q, job, since, until=None: [
            {"step": s, "duration_ns": 100e6} for s in range(since, (until or 16) + 1)])
        bt = L.BucketTuning("gelu", "b", INC, strategy=make_strategy(name, [ARM], budget=12),
                            round_arms=[ARM], plan_version=5)
        bt.strategy.ask()
        loop.jobs["job"] = L.JobEvolution(active=bt)
        loop.tick()
        assert bt.phase != "exploring" and bt.strategy.asked == 1, (name, bt.phase)
        assert decisions and decisions[-1]["kind"] == "reject", (name, decisions)


def test_an_arms_first_step_with_its_compile_is_not_its_exploring_cost(monkeypatch):
    """A compiled arm's first call holds its compile (seconds): counted as exploring's cost it
    pushed the fastest arm over the cap, and the arm was retired for good."""
    rows = rows_for(0.5, 16)             # half the incumbent's time a call...
    first = next(r for r in rows if r["variant"] == ARM.variant)
    first["total_ns"] = 2e9              # ...but 2 s in the step it compiled in
    decisions: list[dict] = []
    loop = loop_over_rows(monkeypatch, rows, last=16, decisions=decisions)
    monkeypatch.setattr(se, "step_durations", lambda q, job, since, until=None: [
        {"step": s, "duration_ns": 100e6} for s in range(since, (until or 16) + 1)])
    bt = tick_one_arm(loop, "gelu", INC, ARM)
    assert decisions == [] and ARM in bt.strategy.arms
