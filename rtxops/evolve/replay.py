"""Replay simulator: run search strategies against a recorded exhaustive sweep (as Kernel Tuner's
simulation mode does) and count the trials each needs to come within 5 % of the best arm.

A sweep file is JSON: ``{"op": ..., "bucket": ..., "arms": [{"variant": ..., "config": {...},
"values": [ns, ...]}, ...]}`` (``rtxops tune --sweep-out`` writes one; ``op`` and ``bucket`` are
optional). A trial of an arm draws one of its recorded values. With several sweeps,
:func:`replay_many` also replays Thompson sampling with priors from the OTHER sweeps of the same op
on other buckets (leave-one-out: a sweep's own values never inform its prior).
"""
from __future__ import annotations

import json
import math
import os
import random
import stat
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .candidates import Arm
from .priors import priors_from_rows
from .search import STRATEGIES, make_strategy

WITHIN = 0.05
WITH_PRIORS = "thompson+priors"
MAX_SWEEP_BYTES = 256 << 20   # a sweep of 10 000 arms × 1000 values is ~200 MB of JSON
MAX_REPS = 10_000             # values one trial takes the median of (the tuner's reps)


class SweepError(ValueError):
    """The sweep file is unreadable or not of the expected form."""


@dataclass
class Sweep:
    """One recorded sweep: arm label → values, the label's arm, and where it was recorded."""

    arms: dict[str, list[float]]
    op: str | None = None
    bucket: str | None = None
    keys: dict[str, Arm] = field(default_factory=dict)
    reps: int | None = None   # the repetitions of one trial when it was recorded

    def rows(self) -> list[dict]:
        """Tuning-table-like rows (one per arm: its median) for :func:`priors_from_rows`."""
        return [{"bucket": self.bucket, "variant": self.keys[label].variant,
                 "config": self.keys[label].config_json, "median_ns": statistics.median(v)}
                for label, v in self.arms.items()]


def load_sweep(path: str | Path) -> dict[str, list[float]]:
    """Arm label → recorded values."""
    return load_sweep_file(path).arms


def load_sweep_file(path: str | Path) -> Sweep:
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):   # /dev/zero would never end
                raise SweepError(f"sweep {path} is not a regular file")
            raw = f.read(MAX_SWEEP_BYTES + 1)
        if len(raw) > MAX_SWEEP_BYTES:
            raise SweepError(f"sweep {path} is over {MAX_SWEEP_BYTES >> 20} MB")
        data = json.loads(raw)
    except SweepError:
        raise
    except (OSError, ValueError, RecursionError) as e:   # RecursionError: arrays nested too deep
        raise SweepError(f"cannot read sweep {path}: {type(e).__name__}: {e}") from None
    return load_sweep_data(data, path)


def load_sweep_data(data: Any, source: Any = "sweep") -> Sweep:
    """A :class:`Sweep` from parsed sweep JSON (``source`` names it in errors)."""
    sweep = Sweep({})
    try:
        for i, a in enumerate(data["arms"]):
            if not isinstance(a["values"], list):
                raise SweepError(f"arms[{i}].values must be a list of numbers")
            values = [float(v) for v in a["values"]]
            if not values or not all(math.isfinite(v) and v > 0 for v in values):
                raise SweepError(f"arms[{i}] needs positive, finite values")
            config = a.get("config", {})
            label = f'{a["variant"]} {json.dumps(config, sort_keys=True)}'
            if label in sweep.arms:
                raise SweepError(f"arms[{i}] repeats the arm {label}")
            sweep.arms[label] = values
            sweep.keys[label] = Arm.of(a["variant"], config)
        sweep.op, sweep.bucket = data.get("op"), data.get("bucket")
        reps = data.get("reps")
        if reps is not None and (isinstance(reps, bool) or not isinstance(reps, int)
                                 or not 1 <= reps <= MAX_REPS):
            raise SweepError(f"sweep {source}: reps must be a whole number from 1 to {MAX_REPS}")
        sweep.reps = reps
    except SweepError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
        raise SweepError(f"cannot read sweep {source}: {type(e).__name__}: {e}") from None
    if not sweep.arms:
        raise SweepError(f"sweep {source} has no arms")
    return sweep


def trials_to_within(sweep: dict[str, list[float]], strategy: str, budget: int, seed: int,
                     within: float = WITHIN, prior: dict | None = None,
                     trial_reps: int | None = None, shuffle: bool = False) -> int | None:
    """Trials until the strategy's current best arm is truly within ``within`` of the best
    median, or None when the budget ran out first. ``prior``: arm label → (mean, sd). A trial
    tells one recorded value, or with ``trial_reps`` the median of that many values drawn with
    replacement (a benchmark of R repetitions, as the offline tuner runs). ``shuffle``: the
    strategy gets the arms in an order of its seed's own, not the sweep's (whose first arm, the
    reference, is often near the best on CPU: strategies that start in order would look good)."""
    truth = {a: statistics.median(v) for a, v in sweep.items()}
    target = min(truth.values()) * (1 + within)
    rng = random.Random(seed)
    labels = list(sweep)
    if shuffle:
        random.Random(f"order {seed}").shuffle(labels)
    s = make_strategy(strategy, labels, budget, seed=seed, batch=1, prior=prior)
    used = 0
    while arms := s.ask():
        for arm in arms:
            s.tell(arm, _trial(rng, sweep[arm], trial_reps))
            used += 1
            best = s.best()
            if best is not None and truth[best] <= target:
                return used
    return None


def replay(sweep: dict[str, list[float]], strategies: Sequence[str] | None = None,
           budget: int | None = None, seeds: int = 20, prior: dict | None = None,
           trial_reps: int | None = None, shuffle: bool = False) -> dict:
    """Per strategy: median and worst trials to within 5 % of the best, and how often it got
    there inside the budget (default budget: 2 × the number of arms). With ``prior`` (arm label →
    (mean, sd)), Thompson sampling is also replayed with it, as ``thompson+priors``."""
    budget = budget or 2 * len(sweep)
    out = {"arms": len(sweep), "budget": budget, "seeds": seeds, "within": WITHIN,
           "trial_reps": trial_reps or 1, "shuffled": shuffle, "strategies": {}}
    runs_of = {name: (name, None) for name in strategies or list(STRATEGIES)}
    if prior:
        runs_of[WITH_PRIORS] = ("thompson", prior)
    for label, (name, p) in runs_of.items():
        runs = [trials_to_within(sweep, name, budget, seed, prior=p, trial_reps=trial_reps,
                                 shuffle=shuffle) for seed in range(seeds)]
        reached = [r for r in runs if r is not None]
        out["strategies"][label] = {
            "reached": len(reached) / seeds,
            "median_trials": statistics.median(reached) if reached else None,
            "worst_trials": max(reached) if reached else None,
        }
    return out


def loo_prior(sweeps: Sequence[Sweep], i: int) -> dict[str, tuple[float, float]]:
    """Priors (arm label → (mean, sd)) for ``sweeps[i]`` from the other sweeps of its op on other
    buckets; never from its own values."""
    target = sweeps[i]
    rows = [r for j, s in enumerate(sweeps)
            if j != i and s.op is not None and s.op == target.op and s.bucket != target.bucket
            for r in s.rows()]
    by_arm = priors_from_rows(rows, list(target.keys.values()))
    return {label: by_arm[arm] for label, arm in target.keys.items() if arm in by_arm}


def replay_many(sweeps: Sequence[Sweep], strategies: Sequence[str] | None = None,
                budget: int | None = None, seeds: int = 20,
                trial_reps: int | None = None, shuffle: bool = False) -> list[dict]:
    """:func:`replay` of each sweep, Thompson with leave-one-out priors included where the sweep
    has an op and another bucket of it was recorded. Each result adds ``prior_arms`` (how many arms
    had a prior) and ``prior_best`` (the arm the prior ranked first)."""
    out = []
    for i, s in enumerate(sweeps):
        prior = loo_prior(sweeps, i)
        r = replay(s.arms, strategies, budget, seeds, prior=prior or None, trial_reps=trial_reps,
                   shuffle=shuffle)
        r.update(op=s.op, bucket=s.bucket, prior_arms=len(prior),
                 prior_best=min(prior, key=lambda a: prior[a][0]) if prior else None)
        out.append(r)
    return out


def _trial(rng: random.Random, values: list[float], reps: int | None) -> float:
    if not reps or reps <= 1:
        return rng.choice(values)
    return statistics.median(rng.choices(values, k=reps))
