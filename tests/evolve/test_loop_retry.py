"""A tick that fails after it counted a round's measurements (a store write timing out) is
retried by the next tick: the round's steps must enter the statistics once, not twice (twice
halves the interval's width and promotes on noise)."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from rtxops.evolve import loop as L
from rtxops.evolve.candidates import Arm
from rtxops.evolve.search import make_strategy

from .loop_harness import loop_over_rows


def test_a_retried_round_is_counted_once(monkeypatch, caplog):
    inc, cand = Arm.of("reference"), Arm.of("fastish")
    rng = np.random.default_rng(5)
    rows = []
    for s in range(10, 18):
        rows.append({"step": s, "variant": inc.variant, "config": "{}", "calls": 1, "total_ns": 1e5})
        rows.append({"step": s, "variant": cand.variant, "config": "{}", "calls": 1,
                     "total_ns": 1e5 * float(np.exp(rng.normal(-0.04, 0.06)))})
    fails = [1]

    def save_trial(store, row):
        if fails[0]:
            fails[0] -= 1
            raise TimeoutError("store writer busy")

    loop = loop_over_rows(monkeypatch, rows, last=30, save_trial=save_trial)
    bt = L.BucketTuning("gelu", "b", inc, strategy=make_strategy("exhaustive", [cand], budget=1),
                        round_arms=[cand], plan_version=5)
    bt.strategy.ask()
    loop.jobs["job"] = L.JobEvolution(active=bt)
    with caplog.at_level(logging.ERROR):
        loop.tick()  # counts the round, then the trial write fails
        loop.tick()  # retries the round
    assert len(bt.pairs[cand]) == 8 and len(bt.strategy.values[cand]) == 1
    assert bt.windows == [[10, 30]]


def test_a_trial_write_failing_mid_round_still_tells_every_arm_once(monkeypatch, caplog):
    """The first arm's trial write fails: the retry writes the rest, and the second arm is told
    (successive halving would otherwise rank an arm with no value, every tick)."""
    inc, a, b = Arm.of("reference"), Arm.of("fast_a"), Arm.of("fast_b")
    rng = np.random.default_rng(5)
    rows = [{"step": s, "variant": arm.variant, "config": "{}", "calls": 1,
             "total_ns": 1e5 * (0.8 if arm != inc else 1.0) * float(np.exp(rng.normal(0, .02)))}
            for s in range(10, 31) for arm in (inc, a, b)]
    fails, written = [1], []

    def save_trial(store, row):
        if fails[0]:
            fails[0] -= 1
            raise TimeoutError("store writer busy")
        written.append(row["variant"])

    loop = loop_over_rows(monkeypatch, rows, last=30, save_trial=save_trial)
    bt = L.BucketTuning("gelu", "b", inc, strategy=make_strategy("successive_halving", [a, b],
                                                                 budget=12, batch=3), plan_version=5)
    bt.round_arms = bt.strategy.ask()
    loop.jobs["job"] = L.JobEvolution(active=bt)
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            loop.tick()
    assert {str(k): len(v) for k, v in bt.strategy.values.items()} == {"fast_a": 1, "fast_b": 1}
    assert sorted(written) == ["fast_a", "fast_b"]  # each trial written once
    assert bt.phase != "exploring" or loop.jobs["job"].active is not bt


class _FailingOnce:
    def __init__(self):
        self.published, self.fail = [], 1

    def current(self, job):
        return self.published[-1] if self.published else None

    def promote(self, plan, job, decision, evidence):
        if self.fail:
            self.fail -= 1
            raise TimeoutError("ledger write timed out")
        self.published.append(plan)
        return plan


def test_a_round_whose_publish_failed_is_published_again_with_the_same_arms(monkeypatch, caplog):
    """Not a refusal (the ledger, the disk): the retry publishes the arms already asked for;
    asking again would spend the budget on arms never measured."""
    inc = Arm.of("reference")
    arms = [Arm.of(f"v{i}") for i in range(4)]
    rows = [{"step": s, "variant": x.variant, "config": "{}", "calls": 1, "total_ns": 1e5}
            for s in range(10, 31) for x in [inc] + arms]
    loop = loop_over_rows(monkeypatch, rows, last=30)
    loop.board = _FailingOnce()
    bt = L.BucketTuning("gelu", "b", inc, strategy=make_strategy("exhaustive", arms, budget=4, batch=2),
                        plan_version=5)
    bt.round_arms = bt.strategy.ask()  # round 1: v0, v1, over at step 30
    loop.jobs["job"] = L.JobEvolution(active=bt)
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            loop.tick()
    assert bt.strategy.asked == 4
    assert {str(k): len(v) for k, v in bt.strategy.values.items()} == {f"v{i}": 1 for i in range(4)}


def test_a_gate_that_cannot_run_is_tried_a_few_times_then_the_bucket_is_rejected(monkeypatch):
    """An error of the gate other than a worker's (a worker that would not start, a bug) left the
    bucket unrecorded: the next tick opened and gated it again, every tick, for good."""
    from rtxops.telemetry import store_evolve as se

    decisions: list = []
    loop = loop_over_rows(monkeypatch, [], last=100, decisions=decisions)
    runs = []

    def screen(*args, **kwargs):
        runs.append(1)
        raise AttributeError("the gate fell over")

    monkeypatch.setattr(L, "screen", screen)
    monkeypatch.setattr(L, "candidates", lambda registry, op, bucket, deterministic=False: [Arm.of("eager")])
    monkeypatch.setattr(se, "region_swap_step", lambda q, job: None)
    monkeypatch.setattr(se, "hotspots", lambda q, job, since: [
        {"op": "gelu", "bucket": "float32/cpu/tanh=0,hidden=64,rows=8", "variant": "reference",
         "config": "{}", "share": 0.5}])
    loop.registry.op = lambda op: None
    loop._regressed = lambda *a: False
    logging.disable(logging.CRITICAL)
    try:
        for _ in range(8):
            loop.tick()
    finally:
        logging.disable(logging.NOTSET)
    assert len(runs) == L.GATE_ERRORS_KEPT
    assert [d["kind"] for d in decisions] == ["no_candidates"]
    assert "the gate could not run (3 times): AttributeError: the gate fell over" in decisions[0]["reason"]


def test_a_promotion_whose_record_failed_is_recorded_by_the_next_tick(monkeypatch, caplog):
    """The plan was published and the bucket moved to its canary, then the promote record's
    write failed: the table showed a canary_pass with no promote before it, and a daemon
    restarted during the canary (it finds the canary by that record) left the winner unwatched."""
    from .loop_harness import tick_one_arm

    inc, cand = Arm.of("reference"), Arm.of("fast")
    rng = np.random.default_rng(3)
    rows = [{"step": s, "variant": arm.variant, "config": "{}", "calls": 2,
             "total_ns": 2e5 * (0.7 if arm == cand else 1.0) * float(np.exp(rng.normal(0, .02)))}
            for s in range(10, 121) for arm in (inc, cand)]
    decisions: list[dict] = []
    loop = loop_over_rows(monkeypatch, rows, last=120, decisions=decisions)
    fails = [1]

    def save_decision(store, row):
        if row["kind"] == "promote" and fails[0]:
            fails[0] -= 1
            raise TimeoutError("store writer busy")
        decisions.append(row)

    monkeypatch.setattr(L.store_evolve, "save_decision", save_decision)
    with caplog.at_level(logging.ERROR):
        bt = tick_one_arm(loop, "gelu", inc, cand)   # promotes; its record fails
        assert bt.phase == "canary" and decisions == []
        loop.tick()                                   # the record, then the canary's verdict
    assert [d["kind"] for d in decisions] == ["promote", "canary_pass"], decisions
    assert decisions[0]["plan_version"] == bt.plan_version


def test_a_trial_whose_tuning_update_failed_is_not_written_twice(monkeypatch, caplog):
    """The trial's row was saved, then the tuning database's update failed: the retry wrote the
    measurement again under a new id (two rows, two ids in the signed evidence)."""
    inc, cand = Arm.of("reference"), Arm.of("fastish")
    rows = [{"step": s, "variant": arm.variant, "config": "{}", "calls": 1, "total_ns": 1e5}
            for s in range(10, 31) for arm in (inc, cand)]
    saved: list[str] = []
    loop = loop_over_rows(monkeypatch, rows, last=30,
                          save_trial=lambda store, row: saved.append(row["trial_id"]))
    fails = [1]

    def upsert(store, key, values):
        if fails[0]:
            fails[0] -= 1
            raise TimeoutError("store writer busy")

    monkeypatch.setattr(L.store_evolve, "upsert_tuning", upsert)
    bt = L.BucketTuning("gelu", "b", inc, strategy=make_strategy("exhaustive", [cand], budget=1),
                        round_arms=[cand], plan_version=5)
    bt.strategy.ask()
    loop.jobs["job"] = L.JobEvolution(active=bt)
    with caplog.at_level(logging.ERROR):
        loop.tick()   # the row saved, the tuning update failed
        loop.tick()   # the rest of that trial
    assert len(saved) == 1 and bt.trial_ids == saved and fails == [0]


@pytest.mark.parametrize("config", ["{not json", "1", "null", '"x"', "[]"])
def test_a_hot_spot_whose_config_is_not_a_json_object_is_passed_over(monkeypatch, caplog, config):
    """Any OTLP client writes rtx.config: one that was not a JSON object, on the hottest bucket,
    failed every tick for good, and the job's other buckets were never tuned."""
    from rtxops.telemetry import store_evolve as se

    loop = loop_over_rows(monkeypatch, [], last=100)
    opened = []
    monkeypatch.setattr(L, "screen", lambda *a, **k: opened.append(a) or ([Arm.of("eager")], {}))
    monkeypatch.setattr(L, "candidates", lambda registry, op, bucket, deterministic=False: [Arm.of("eager")])
    monkeypatch.setattr(se, "region_swap_step", lambda q, job: None)
    monkeypatch.setattr(se, "hotspots", lambda q, job, since: [
        {"op": "gelu", "bucket": "float32/cpu/tanh=0,hidden=64,rows=8", "variant": "reference",
         "config": config, "share": 0.5},
        {"op": "gelu", "bucket": "float32/cpu/tanh=0,hidden=64,rows=16", "variant": "reference",
         "config": "{}", "share": 0.3}])
    loop.registry.op = lambda op: None
    loop._regressed = lambda *a: False
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            loop.tick()
    assert not [r for r in caplog.records if "failed" in r.getMessage()]
    state = loop.jobs["job"]
    tuned = [state.active] if state.active else list(state.done.values())
    assert [bt.bucket for bt in tuned] == ["float32/cpu/tanh=0,hidden=64,rows=16"]
