"""A bucket called once per step (a model's LM head, say) never runs the incumbent and an explore
arm in the same step: the loop must still decide on it, from the calls of each in the same
windows, and give its rounds enough steps for each arm to be measured."""
from __future__ import annotations

import numpy as np

from rtxops.evolve import loop as L
from rtxops.evolve import stats
from rtxops.evolve.candidates import Arm
from rtxops.evolve.config import LoopConfig
from rtxops.evolve.search import make_strategy

from .loop_harness import loop_over_rows


def _one_call_per_step(inc: Arm, cand: Arm, cand_ratio: float, seed: int) -> list[dict]:
    """Steps 10..200, one call each: the arm on every tenth step, the incumbent on the rest."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(10, 201):
        arm, base = (cand, 1e6 * cand_ratio) if s % 10 == 0 else (inc, 1e6)
        rows.append({"step": s, "variant": arm.variant, "config": "{}", "calls": 1,
                     "total_ns": base * float(np.exp(rng.normal(0, 0.03)))})
    return rows


def _decide(monkeypatch, cand_ratio: float) -> dict:
    inc, cand = Arm.of("reference"), Arm.of("fastish")
    decisions: list[dict] = []
    loop = loop_over_rows(monkeypatch, _one_call_per_step(inc, cand, cand_ratio, seed=3), last=200,
                          decisions=decisions)
    bt = L.BucketTuning("linear", "b", inc, strategy=make_strategy("exhaustive", [cand], budget=1),
                        round_arms=[cand], plan_version=5, calls_per_step=1.0)
    bt.strategy.ask()
    loop.jobs["job"] = L.JobEvolution(active=bt)
    loop.tick()
    assert bt.pairs[cand] == []  # no step ran both
    (decision,) = decisions
    return decision


def test_a_faster_arm_of_a_once_per_step_bucket_is_promoted_on_unpaired_calls(monkeypatch):
    decision = _decide(monkeypatch, 0.7)
    assert decision["kind"] == "promote", decision["reason"]
    assert 0.25 < decision["gain"] < 0.35


def test_a_slower_arm_of_a_once_per_step_bucket_is_not(monkeypatch):
    decision = _decide(monkeypatch, 1.3)
    assert decision["kind"] == "reject" and "below the minimum" in decision["reason"]


def test_a_round_lasts_long_enough_for_each_arm_to_be_measured():
    loop = object.__new__(L.EvolveLoop)
    loop.config = LoopConfig(window_steps=20, explore_share=0.1)
    many = L.BucketTuning("gelu", "b", Arm.of("reference"), calls_per_step=12.0)
    once = L.BucketTuning("linear", "b", Arm.of("reference"), calls_per_step=1.0)
    unknown = L.BucketTuning("linear", "b", Arm.of("reference"))
    assert loop._round_steps(many, 3) == 20
    # 1 call a step, 10 % shared by 3 arms: 150 steps give each arm MIN_SAMPLES calls
    assert loop._round_steps(once, 3) == min(int(np.ceil(stats.MIN_SAMPLES * 3 / 0.1)), 200)
    assert loop._round_steps(once, 30) == 200  # at most 10 windows
    assert loop._round_steps(unknown, 3) == 20
