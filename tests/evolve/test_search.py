from __future__ import annotations

import json
import math
import random

import pytest

from rtxops.evolve import replay, search

ARMS = [f"arm{i}" for i in range(12)]


def truth(arm: str) -> float:
    """A synthetic sweep with its optimum at arm7."""
    return 100.0 + 10 * abs(int(arm[3:]) - 7)


def run(strategy: search.Strategy, noise: float, seed: int) -> int:
    rng = random.Random(seed)
    used = 0
    while arms := strategy.ask():
        for arm in arms:
            strategy.tell(arm, truth(arm) * (1 + rng.gauss(0, noise)))
            used += 1
    return used


@pytest.mark.parametrize("name", list(search.STRATEGIES))
def test_each_strategy_respects_its_budget(name):
    for budget in (1, 5, 30):
        s = search.make_strategy(name, ARMS, budget, seed=1)
        assert run(s, 0.02, 1) <= budget


@pytest.mark.parametrize("name", list(search.STRATEGIES))
def test_each_strategy_finds_the_known_optimum(name):
    s = search.make_strategy(name, ARMS, budget=40, seed=3)
    run(s, 0.01, 3)
    assert s.best() == "arm7"


def test_unknown_strategy_and_bad_budget_are_clear_errors():
    with pytest.raises(ValueError, match="unknown strategy"):
        search.make_strategy("annealing", ARMS, 3)
    with pytest.raises(ValueError, match="budget"):
        search.make_strategy("random", ARMS, 0)


def test_successive_halving_remeasures_survivors():
    s = search.SuccessiveHalving(ARMS, budget=100, batch=100)
    run(s, 0.0, 0)
    assert len(s.values["arm7"]) > 1 and len(s.values["arm0"]) == 1


def test_successive_halving_on_a_budget_below_its_arms_still_halves():
    """Budget 11 for 17 arms: it measured the first 10 in order, once each, and never halved (a
    CUDA bucket's 17 candidates at the default budget: 6 of its Triton configs never ran)."""
    arms = [f"arm{i:02d}" for i in range(17)]
    tried = set()
    for seed in range(8):
        s = search.SuccessiveHalving(arms, budget=11, seed=seed)
        asked = []
        while batch := s.ask():
            asked += batch
            for arm in batch:
                s.tell(arm, 100.0 + int(arm[3:]))
        assert len(asked) <= 11 and len(set(asked)) < len(asked)   # survivors measured again
        tried |= set(asked)
    assert tried - set(arms[:10])                                  # not only the first ten


@pytest.mark.parametrize("name,budget", [("successive_halving", 1), ("successive_halving", 4),
                                         ("thompson", 1), ("thompson", 5), ("random", 1)])
def test_a_small_budget_tries_other_arms_with_other_seeds(name, budget):
    """Thompson without priors took the untried arms in the callers' (sorted) order, and
    successive halving always kept the first arm: a budget of one measured the same arm on
    every run whatever the seed, and the others never."""
    tried = set()
    for seed in range(40):
        s = search.make_strategy(name, ARMS, budget, seed=seed)
        tried |= set(a for _ in range(budget) for a in s.ask() or [])
    assert len(tried) > len(ARMS) // 2


def test_replay_counts_trials_to_within_five_percent(tmp_path):
    sweep = {"arms": [{"variant": a, "config": {}, "values": [truth(a) * f for f in (0.99, 1.0, 1.01)]}
                      for a in ARMS]}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(sweep))
    loaded = replay.load_sweep(path)
    report = replay.replay(loaded, budget=24, seeds=5)
    assert report["arms"] == 12
    for name, r in report["strategies"].items():
        assert r["reached"] == 1.0, name
        assert 1 <= r["median_trials"] <= 24
    # exhaustive walks the arms in order: the optimum (arm7) is the 8th trial
    assert report["strategies"]["exhaustive"]["median_trials"] == 8


@pytest.mark.parametrize("text", ["not json", '{"arms": []}', '{"arms": [{"variant": "a", "values": []}]}',
                                  '{"arms": [{"values": [1]}]}',
                                  '{"arms": [{"variant": "a", "values": [1, NaN]}]}',
                                  '{"arms": [{"variant": "a", "values": [1, Infinity]}]}',
                                  '{"arms": [{"variant": "a", "values": "123"}]}',
                                  '{"arms": [{"variant": "a", "values": [1]}, {"variant": "a", "values": [2]}]}',
                                  '{"arms": [{"variant": "a", "values": [1%s]}]}' % ("0" * 400),
                                  "[" * 100_000 + "]" * 100_000])
def test_replay_rejects_malformed_sweeps(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(replay.SweepError):
        replay.load_sweep(path)


@pytest.mark.parametrize("name", list(search.STRATEGIES))
def test_every_batch_holds_distinct_arms(name):
    for seed in range(5):
        s = search.make_strategy(name, ARMS, budget=40, seed=seed, batch=3)
        rng = random.Random(seed)
        while arms := s.ask():
            assert len(arms) == len(set(arms)), arms
            for arm in arms:
                s.tell(arm, truth(arm) * (1 + rng.gauss(0, 0.05)))


def test_a_shuffled_replay_does_not_hand_the_strategy_the_best_arm_first():
    """The sweep's first arm is the best here: in file order exhaustive search finds it at once,
    every time; shuffled, each seed meets it somewhere else, about halfway on average."""
    sweep = {"best": [100.0]} | {f"arm{i}": [200.0 + i] for i in range(9)}
    in_order = [replay.trials_to_within(sweep, "exhaustive", 10, seed) for seed in range(40)]
    shuffled = [replay.trials_to_within(sweep, "exhaustive", 10, seed, shuffle=True)
                for seed in range(40)]
    assert set(in_order) == {1}
    assert len(set(shuffled)) > 5 and 3 <= sum(shuffled) / len(shuffled) <= 8
    assert replay.replay(sweep, ["exhaustive"], seeds=5, shuffle=True)["shuffled"] is True


def test_thompson_is_not_locked_onto_an_arm_whose_round_measured_nothing():
    """An arm measured once, then told inf (a round without its samples): no NaN draw that wins
    every batch; the best arm is still found."""
    truth = {"a_sparse": 95.0, "b": 100.0, "c": 80.0, "d": 120.0}
    told = []

    def measure(arm):
        if arm == "a_sparse":
            told.append(95.0 if not told else float("inf"))
            return told[-1]
        return truth[arm]

    s = search.make_strategy("thompson", list(truth), budget=20, seed=0, batch=3)
    while arms := s.ask():
        for a in arms:
            s.tell(a, measure(a))
    assert s.best() == "c"
    assert len(s.values["c"]) >= 3


@pytest.mark.parametrize("name", list(search.STRATEGIES))
def test_a_failed_measurement_never_makes_an_arm_the_best(name):
    """NaN, zero or a negative time (a broken benchmark) ranks last in every strategy."""
    for bad in (float("nan"), 0.0, -5.0):
        s = search.make_strategy(name, ["broken", "slow", "fast"], budget=12, seed=0, batch=1)
        while arms := s.ask():
            for arm in arms:
                s.tell(arm, {"broken": bad, "slow": 200.0, "fast": 100.0}[arm])
        assert s.best() == "fast", (bad, dict(s.values))
    only = search.make_strategy(name, ["broken"], budget=2, seed=0)
    for arm in only.ask():
        only.tell(arm, float("nan"))
    assert only.best() is None


@pytest.mark.parametrize("batch", [1, 4])
def test_thompson_with_priors_asks_no_more_of_an_arm_whose_trials_all_failed(batch):
    """An arm told only failures (inf) kept its prior as posterior: the prior's favourite was
    asked again and again (11 of 20 trials), each a worker run failing once more."""
    arms = ["crashes", "b", "c", "d"]
    value = {"crashes": math.inf, "b": 100.0, "c": 120.0, "d": 140.0}
    prior = {"crashes": (0.0, 0.2), "b": (0.1, 0.2), "c": (0.3, 0.2), "d": (0.5, 0.2)}
    s = search.make_strategy("thompson", arms, 20, seed=0, batch=batch, prior=prior)
    asked = []
    while batch_arms := s.ask():
        for arm in batch_arms:
            asked.append(arm)
            s.tell(arm, value[arm])
    assert asked.count("crashes") == 1 and len(asked) == 20 and s.best() == "b"
