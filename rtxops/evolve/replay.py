"""Replay simulator: run search strategies against a recorded exhaustive sweep (as Kernel Tuner's
simulation mode does) and count the trials each needs to come within 5 % of the best arm.

A sweep file is JSON: ``{"arms": [{"variant": ..., "config": {...}, "values": [ns, ...]}, ...]}``
(``rtxops tune --sweep-out`` writes one). A trial of an arm draws one of its recorded values.
"""
from __future__ import annotations

import json
import random
import statistics
from pathlib import Path
from typing import Sequence

from .search import STRATEGIES, make_strategy

WITHIN = 0.05


class SweepError(ValueError):
    """The sweep file is unreadable or not of the expected form."""


def load_sweep(path: str | Path) -> dict[str, list[float]]:
    """Arm label → recorded values."""
    try:
        data = json.loads(Path(path).read_text())
        arms = {}
        for i, a in enumerate(data["arms"]):
            values = [float(v) for v in a["values"]]
            if not values or any(v <= 0 for v in values):
                raise SweepError(f"arms[{i}] needs positive values")
            arms[f'{a["variant"]} {json.dumps(a.get("config", {}), sort_keys=True)}'] = values
    except SweepError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SweepError(f"cannot read sweep {path}: {type(e).__name__}: {e}") from None
    if not arms:
        raise SweepError(f"sweep {path} has no arms")
    return arms


def trials_to_within(sweep: dict[str, list[float]], strategy: str, budget: int, seed: int,
                     within: float = WITHIN) -> int | None:
    """Trials until the strategy's current best arm is truly within ``within`` of the best
    median, or None when the budget ran out first."""
    truth = {a: statistics.median(v) for a, v in sweep.items()}
    target = min(truth.values()) * (1 + within)
    rng = random.Random(seed)
    s = make_strategy(strategy, list(sweep), budget, seed=seed, batch=1)
    used = 0
    while arms := s.ask():
        for arm in arms:
            s.tell(arm, rng.choice(sweep[arm]))
            used += 1
            best = s.best()
            if best is not None and truth[best] <= target:
                return used
    return None


def replay(sweep: dict[str, list[float]], strategies: Sequence[str] | None = None,
           budget: int | None = None, seeds: int = 20) -> dict:
    """Per strategy: median and worst trials to within 5 % of the best, and how often it got
    there inside the budget (default budget: 2 × the number of arms)."""
    budget = budget or 2 * len(sweep)
    out = {"arms": len(sweep), "budget": budget, "seeds": seeds, "within": WITHIN, "strategies": {}}
    for name in strategies or list(STRATEGIES):
        runs = [trials_to_within(sweep, name, budget, seed) for seed in range(seeds)]
        reached = [r for r in runs if r is not None]
        out["strategies"][name] = {
            "reached": len(reached) / seeds,
            "median_trials": statistics.median(reached) if reached else None,
            "worst_trials": max(reached) if reached else None,
        }
    return out
