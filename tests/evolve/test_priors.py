"""Informative priors for the Thompson bandit: a right prior finds the optimum in far fewer trials,
a misleading one is overridden by measurements within the budget, the budget holds, and priors for
a sweep never come from that sweep (leave-one-out), in the replay and in the offline tuner."""
from __future__ import annotations

import math
import random
import statistics

import pytest

from rtxops.evolve import replay, search
from rtxops.evolve.candidates import Arm
from rtxops.evolve.priors import priors_from_rows

ARMS = [f"arm{i}" for i in range(12)]
BEST = "arm7"


def truth(arm: str) -> float:
    """Optimum at arm7; every other arm at least 10 % slower."""
    return 100.0 + 10 * abs(int(arm[3:]) - 7)


def relative(arm: str) -> float:
    return math.log(truth(arm) / truth(BEST))


def trials_to_best(strategy: search.Strategy, noise: float, seed: int) -> int | None:
    rng = random.Random(seed)
    used = 0
    while arms := strategy.ask():
        for arm in arms:
            strategy.tell(arm, truth(arm) * (1 + rng.gauss(0, noise)))
            used += 1
            if strategy.best() == BEST:
                return used
    return None


def median_trials(prior: dict | None, budget: int = 24, seeds: int = 30) -> float:
    runs = [trials_to_best(search.ThompsonSampling(ARMS, budget, seed=s, prior=prior), 0.02, s)
            for s in range(seeds)]
    assert all(r is not None for r in runs), runs  # found within the budget on every seed
    return statistics.median(runs)


def test_a_correct_prior_finds_the_optimum_in_far_fewer_trials():
    right = {a: (relative(a), 0.2) for a in ARMS}
    with_prior, without = median_trials(right), median_trials(None)
    assert with_prior <= 3 and without >= 6 and with_prior * 2 <= without


def test_a_misleading_prior_is_overridden_within_the_budget():
    # the prior ranks the arms backwards: the optimum looks like the worst arm
    wrong = {a: (0.5 - relative(a), 0.2) for a in ARMS}
    runs = [trials_to_best(search.ThompsonSampling(ARMS, 24, seed=s, prior=wrong), 0.02, s)
            for s in range(30)]
    found = [r for r in runs if r is not None]
    assert len(found) >= 0.8 * len(runs) and statistics.median(found) <= 18, runs


def test_priors_are_relative_so_the_buckets_scale_changes_nothing():
    # learned where arms take ~100 ns, used where they take ~100 µs: the same picks, seed for seed
    right = {a: (relative(a), 0.2) for a in ARMS}

    def picks(scale: float) -> list[str]:
        s, rng, out = search.ThompsonSampling(ARMS, 12, seed=5, prior=right), random.Random(5), []
        while arms := s.ask():
            for arm in arms:
                out.append(arm)
                s.tell(arm, scale * truth(arm) * (1 + rng.gauss(0, 0.02)))
        return out

    assert picks(1.0) == picks(1000.0)


@pytest.mark.parametrize("budget", [1, 3, 10, 30])
def test_the_budget_holds_with_a_prior(budget):
    prior = {a: (relative(a), 0.2) for a in ARMS[:6]}  # half the arms without one: weak default
    for batch in (1, 4):
        s = search.ThompsonSampling(ARMS, budget, seed=1, batch=batch, prior=prior)
        used = 0
        while arms := s.ask():
            used += len(arms)
            for a in arms:
                s.tell(a, truth(a))
        assert used == budget


def test_make_strategy_passes_priors_only_to_strategies_that_use_them():
    prior = {a: (relative(a), 0.2) for a in ARMS}
    assert search.make_strategy("thompson", ARMS, 5, prior=prior).prior is not None
    assert search.make_strategy("thompson", ARMS, 5).prior is None
    s = search.make_strategy("successive_halving", ARMS, 5, prior=prior)
    assert not hasattr(s, "prior")


def test_priors_from_rows_are_relative_to_each_buckets_best_with_a_family_fallback():
    rows = [{"bucket": "b1", "variant": "v", "config": '{"k":1}', "median_ns": 100.0},
            {"bucket": "b1", "variant": "v", "config": {"k": 2}, "median_ns": 200.0},
            {"bucket": "b1", "variant": "w", "config": "{}", "median_ns": 400.0},
            {"bucket": "b2", "variant": "v", "config": '{"k": 1}', "median_ns": 30.0},
            {"bucket": "b2", "variant": "w", "config": "{}", "median_ns": 10.0},
            {"bucket": "b2", "variant": "x", "config": "{}", "median_ns": None}]
    arms = [Arm.of("v", {"k": 1}), Arm.of("v", {"k": 2}), Arm.of("v", {"k": 3}), Arm.of("w"),
            Arm.of("x"), Arm.of("y")]
    p = priors_from_rows(rows, arms)
    assert p[Arm.of("v", {"k": 1})][0] == pytest.approx((0 + math.log(3)) / 2)
    assert p[Arm.of("v", {"k": 2})][0] == pytest.approx(math.log(2))
    assert p[Arm.of("w")][0] == pytest.approx((math.log(4) + 0) / 2)
    # two buckets that disagree widen the prior beyond the one-bucket one
    assert p[Arm.of("v", {"k": 1})][1] > p[Arm.of("v", {"k": 2})][1]
    # never measured, but its variant was: the family's mean, a wider sd
    fam = p[Arm.of("v", {"k": 3})]
    assert fam[0] == pytest.approx(statistics.fmean([0, math.log(2), math.log(3)]))
    assert fam[1] > p[Arm.of("v", {"k": 2})][1]
    assert Arm.of("x") not in p and Arm.of("y") not in p  # nothing usable measured


def _sweep(op: str, bucket: str, medians: dict[str, float]) -> replay.Sweep:
    return replay.load_sweep_data({"op": op, "bucket": bucket, "arms": [
        {"variant": v, "config": {}, "values": [m * f for f in (0.98, 1.0, 1.02)]}
        for v, m in medians.items()]})


def test_leave_one_out_priors_never_use_the_target_sweep():
    fast_a = {"a": 100.0, "b": 300.0, "c": 900.0}
    sweeps = [_sweep("op1", "small", fast_a),
              _sweep("op1", "large", {"a": 900.0, "b": 300.0, "c": 100.0}),  # the reverse
              _sweep("op1", "small", fast_a),  # same bucket again: not "another bucket"
              _sweep("op2", "large", fast_a)]  # another op: never a source
    p = replay.loo_prior(sweeps, 1)
    # only the op1 "small" sweeps inform op1 "large": their ranking, not its own
    assert min(p, key=lambda a: p[a][0]) == "a {}"
    assert p["a {}"][0] == pytest.approx(0.0) and p["c {}"][0] == pytest.approx(math.log(9))
    # changing the target's own values changes nothing in its prior
    changed = list(sweeps)
    changed[1] = _sweep("op1", "large", {"a": 1.0, "b": 2.0, "c": 3.0})
    assert replay.loo_prior(changed, 1) == p
    assert replay.loo_prior(sweeps, 3) == {}  # op2 has no other sweep
    results = replay.replay_many(sweeps, seeds=3)
    assert [r["prior_arms"] for r in results] == [3, 3, 3, 0]
    assert replay.WITH_PRIORS in results[0]["strategies"]
    assert replay.WITH_PRIORS not in results[3]["strategies"]


def test_replay_with_a_transferable_prior_needs_fewer_trials():
    arms = {f"v{i}": 100.0 * (1 + 0.3 * abs(i - 6)) for i in range(10)}
    sweeps = [_sweep("op", "b1", arms), _sweep("op", "b2", {k: 7 * v for k, v in arms.items()})]
    for r in replay.replay_many(sweeps, seeds=20, trial_reps=3):
        s = r["strategies"]
        assert s[replay.WITH_PRIORS]["reached"] == 1.0
        assert s[replay.WITH_PRIORS]["median_trials"] <= 2
        assert s["thompson"]["median_trials"] >= 5


def test_offline_priors_come_from_other_buckets_of_the_same_versions(tmp_path):
    from rtxops.evolve.priors import tuning_priors
    from rtxops.evolve.tuning import TuningDB
    from rtxops.runtime.registry import Registry, load_builtin
    from rtxops.telemetry.store import Store

    registry = load_builtin(Registry())
    store = Store(tmp_path / "rtxops.duckdb")
    try:
        db = TuningDB(store, registry)
        small, large = "float32/cpu/tanh=0,hidden=64,rows=16", "float32/cpu/tanh=0,hidden=256,rows=64"
        eager, algebraic = Arm.of("eager"), Arm.of("algebraic")
        db.record("gelu", small, eager, source="offline", trials=1, median_ns=100.0)
        db.record("gelu", small, algebraic, source="offline", trials=1, median_ns=400.0)
        db.record("gelu", large, eager, source="offline", trials=1, median_ns=900.0)
        db.record("gelu", large, algebraic, source="offline", trials=1, median_ns=100.0)
        p = tuning_priors(store, registry, "gelu", large, [eager, algebraic])
        assert p[eager][0] == pytest.approx(0.0) and p[algebraic][0] == pytest.approx(math.log(4))
        assert tuning_priors(store, registry, "softmax", large, [eager]) == {}
        # an online figure (forward calls only) of a third arm says nothing about it
        tanh = Arm.of("chunked")
        db.record("gelu", small, tanh, source="online", trials=20, median_ns=50.0)
        assert tanh not in tuning_priors(store, registry, "gelu", large, [eager, tanh])
    finally:
        store.close()
