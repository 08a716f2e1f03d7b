"""A bucket called once per step (a model's LM head, say) never runs the incumbent and an explore
arm in the same step: the loop must still decide on it, from the calls of each in the same
windows, and keep a round open until each arm has been measured."""
from __future__ import annotations

import numpy as np

from rtxops.evolve import loop as L
from rtxops.evolve import stats
from rtxops.evolve.candidates import Arm
from rtxops.evolve.search import make_strategy
from rtxops.runtime.dispatcher import _explore_schedule
from rtxops.telemetry import store_evolve as se

from .loop_harness import loop_over_rows, tick_one_arm

INC = Arm.of("reference")


def _one_call_per_step(first: int, last: int, speed: dict[Arm, float], seed: int) -> list[dict]:
    """One call a step, routed as the dispatcher routes it: the arms share 10 % of the calls."""
    arms = [a for a in speed if a != INC]
    schedule = _explore_schedule([INC, *arms], [0.0] + [0.1 / len(arms)] * len(arms))
    rng = np.random.default_rng(seed)
    return [{"step": s, "variant": arm.variant, "config": "{}", "calls": 1,
             "total_ns": 1e6 * speed[arm] * float(np.exp(rng.normal(0, 0.03)))}
            for i, s in enumerate(range(first, last + 1))
            for arm in [schedule[(i + 1) % len(schedule)]]]


def _tuning(arms: list[Arm], batch: int) -> L.BucketTuning:
    bt = L.BucketTuning("linear", "b", INC, strategy=make_strategy("exhaustive", arms,
                                                                   budget=len(arms), batch=batch),
                        plan_version=5)
    bt.round_arms = bt.strategy.ask()
    return bt


def test_a_round_waits_for_its_arms_then_a_faster_arm_is_promoted_on_unpaired_calls(monkeypatch):
    fast, slow, same = Arm.of("fast"), Arm.of("slow"), Arm.of("same")
    rows = _one_call_per_step(10, 400, {INC: 1.0, fast: 0.7, slow: 1.3, same: 1.0}, seed=3)
    decisions: list[dict] = []
    loop = loop_over_rows(monkeypatch, rows, last=60, decisions=decisions)
    bt = _tuning([fast, slow, same], batch=3)
    loop.jobs["job"] = L.JobEvolution(active=bt)
    loop.tick()  # 50 steps: about 1.7 calls per arm, not enough to compare anything
    assert bt.phase == "exploring" and not bt.windows and not decisions
    monkeypatch.setattr(se, "last_step", lambda q, job: 400)
    loop.tick()
    assert all(len(v) >= stats.MIN_SAMPLES for v in bt.rounds[0][1].values())
    assert not any(bt.pairs.values())  # no step ran both
    (decision,) = decisions
    assert decision["kind"] == "promote" and decision["candidate_variant"] == "fast", decision
    assert 0.25 < decision["gain"] < 0.35


def test_a_slower_arm_of_a_once_per_step_bucket_is_not_promoted(monkeypatch):
    slow = Arm.of("slow")
    rows = _one_call_per_step(10, 400, {INC: 1.0, slow: 1.3}, seed=4)
    decisions: list[dict] = []
    loop = loop_over_rows(monkeypatch, rows, last=400, decisions=decisions)
    loop.jobs["job"] = L.JobEvolution(active=_tuning([slow], batch=1))
    loop.tick()
    (decision,) = decisions
    assert decision["kind"] == "reject" and "below the minimum" in decision["reason"]


def test_an_arm_is_compared_with_the_incumbent_of_its_own_rounds(monkeypatch):
    """The job got faster between two rounds: the second round's arm, as fast as the incumbent
    next to it, must not look faster for the slower incumbent of the first round."""
    early, late = Arm.of("early"), Arm.of("late")
    rows = (_one_call_per_step(10, 300, {INC: 1.3, early: 1.3}, seed=5)
            + _one_call_per_step(311, 600, {INC: 1.0, late: 1.0}, seed=6))
    decisions: list[dict] = []
    loop = loop_over_rows(monkeypatch, rows, last=300, decisions=decisions)
    bt = _tuning([early, late], batch=1)
    loop.jobs["job"] = L.JobEvolution(active=bt)
    loop.tick()  # the first round ends at 300; the second is published
    assert bt.round_arms == [late]
    monkeypatch.setattr(se, "swap_step", lambda q, job, v: 310)
    monkeypatch.setattr(se, "last_step", lambda q, job: 600)
    loop.tick()
    (decision,) = decisions
    assert decision["kind"] == "reject" and abs(decision["gain"]) < 0.03, decision


def test_a_faster_arm_with_too_few_pairs_for_the_paired_test_is_compared_unpaired(monkeypatch):
    """Six steps shared with the incumbent: the sign-flip test cannot go below 2^-6 > 0.01, so a
    clearly faster arm must be judged on the unpaired evidence of the same rounds."""
    inc, cand = Arm.of("reference"), Arm.of("fastish")
    rng = np.random.default_rng(1)
    rows = [{"step": s, "variant": inc.variant, "config": "{}", "calls": 1,
             "total_ns": 1e5 * float(np.exp(rng.normal(0, .02)))} for s in range(10, 31)]
    rows += [{"step": s, "variant": cand.variant, "config": "{}", "calls": 1,
              "total_ns": 0.8e5 * float(np.exp(rng.normal(0, .02)))} for s in (10, 12, 14, 16, 18, 20)]
    decisions = []
    bt = tick_one_arm(loop_over_rows(monkeypatch, rows, last=30, decisions=decisions), "gelu", inc, cand)
    assert len(bt.pairs[cand]) == 6 < stats.MIN_PAIRED_SAMPLES
    assert decisions[-1]["kind"] == "promote", decisions[-1]["reason"]
