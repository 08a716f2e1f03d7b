"""Search strategies over candidate arms (variant × config), one interface, all on a trial budget.

A *trial* is one measurement of one arm (online: the arm's mean time over an explore window;
offline: one benchmark of it). Lower values are better. Callers loop::

    while arms := strategy.ask():
        for arm in arms:
            strategy.tell(arm, measure(arm))
    best = strategy.best()
"""
from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections import defaultdict
from typing import Hashable, Sequence

Arm = Hashable


class Strategy(ABC):
    """Proposes arms to measure until its budget of trials is spent."""

    name: str = ""

    def __init__(self, arms: Sequence[Arm], budget: int, seed: int = 0, batch: int = 4) -> None:
        if budget < 1:
            raise ValueError("the trial budget must be at least 1")
        self.arms = list(dict.fromkeys(arms))
        self.budget = budget
        self.batch = max(1, batch)
        self.rng = random.Random(seed)
        self.values: dict[Arm, list[float]] = defaultdict(list)
        self.asked = 0

    @property
    def remaining(self) -> int:
        return self.budget - self.asked

    def ask(self) -> list[Arm]:
        """The next arms to measure (empty when done); each counts against the budget."""
        if self.remaining <= 0 or not self.arms:
            return []
        arms = self._propose()[: min(self.batch, self.remaining)]
        self.asked += len(arms)
        return arms

    def tell(self, arm: Arm, value: float) -> None:
        self.values[arm].append(float(value))

    def best(self) -> Arm | None:
        """The arm with the lowest median of what was told so far."""
        measured = {a: _median(v) for a, v in self.values.items() if v}
        return min(measured, key=measured.get) if measured else None

    @abstractmethod
    def _propose(self) -> list[Arm]:
        ...


class Exhaustive(Strategy):
    """Every arm once, in order."""

    name = "exhaustive"

    def _propose(self) -> list[Arm]:
        return [a for a in self.arms if a not in self.values][: self.batch] or []


class RandomSearch(Strategy):
    """Arms in a random order, each once."""

    name = "random"

    def __init__(self, arms, budget, seed=0, batch=4) -> None:
        super().__init__(arms, budget, seed, batch)
        self.order = list(self.arms)
        self.rng.shuffle(self.order)

    def _propose(self) -> list[Arm]:
        return [a for a in self.order if a not in self.values][: self.batch]


class SuccessiveHalving(Strategy):
    """Measure every surviving arm, keep the better half, measure again, … until one is left.
    Later rounds re-measure the survivors, so noise in one trial does not decide alone."""

    name = "successive_halving"

    def __init__(self, arms, budget, seed=0, batch=4) -> None:
        super().__init__(arms, budget, seed, batch)
        self.survivors = list(self.arms)
        self.round_todo = list(self.survivors)
        self.round = 0

    def _propose(self) -> list[Arm]:
        if not self.round_todo:
            if len(self.survivors) <= 1:
                return []
            ranked = sorted(self.survivors, key=lambda a: _median(self.values[a]))
            self.survivors = ranked[: max(1, math.ceil(len(ranked) / 2))]
            if len(self.survivors) == 1:
                return []
            self.round += 1
            self.round_todo = list(self.survivors)
        out, self.round_todo = self.round_todo[: self.batch], self.round_todo[self.batch:]
        return out

    def best(self) -> Arm | None:
        alive = [a for a in self.survivors if self.values.get(a)]
        if alive:
            return min(alive, key=lambda a: _median(self.values[a]))
        return super().best()


class ThompsonSampling(Strategy):
    """A bandit: each arm's log value has a normal posterior; every trial goes to the arm whose
    posterior draw is lowest. Arms never measured are tried first. Uses telemetry as reward."""

    name = "thompson"

    def __init__(self, arms, budget, seed=0, batch=1, prior_sd: float = 0.5) -> None:
        super().__init__(arms, budget, seed, batch)
        self.prior_sd = prior_sd

    def _propose(self) -> list[Arm]:
        untried = [a for a in self.arms if not self.values.get(a)]
        if untried:
            return untried[: self.batch]
        out = []
        for _ in range(self.batch):
            draws = {a: self._draw(a) for a in self.arms}
            out.append(min(draws, key=draws.get))
        return out

    def _draw(self, arm: Arm) -> float:
        logs = [math.log(max(v, 1e-12)) for v in self.values[arm]]
        mean = sum(logs) / len(logs)
        spread = (sum((x - mean) ** 2 for x in logs) / (len(logs) - 1)) ** 0.5 if len(logs) > 1 \
            else self.prior_sd
        return self.rng.gauss(mean, max(spread, 0.01) / math.sqrt(len(logs)))

    def best(self) -> Arm | None:
        # the most-measured arms are the ones the bandit believes in; break ties by median
        measured = {a: v for a, v in self.values.items() if v}
        if not measured:
            return None
        return min(measured, key=lambda a: _median(measured[a]))


STRATEGIES: dict[str, type[Strategy]] = {
    s.name: s for s in (Exhaustive, RandomSearch, SuccessiveHalving, ThompsonSampling)
}


def make_strategy(name: str, arms: Sequence[Arm], budget: int, seed: int = 0,
                  batch: int | None = None) -> Strategy:
    """The strategy called ``name`` (exhaustive, random, successive_halving, thompson)."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r} (known: {', '.join(STRATEGIES)})") from None
    return cls(arms, budget, seed) if batch is None else cls(arms, budget, seed, batch)


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
