"""A tick that fails after it counted a round's measurements (a store write timing out) is
retried by the next tick: the round's steps must enter the statistics once, not twice (twice
halves the interval's width and promotes on noise)."""
from __future__ import annotations

import logging

import numpy as np

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
