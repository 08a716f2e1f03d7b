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
        """``arm`` measured ``value``; NaN, zero or less (a failed measurement) counts as inf,
        which ranks last and never makes an arm the best."""
        value = float(value)
        self.values[arm].append(value if value > 0 and not math.isnan(value) else math.inf)

    def retire(self, arm: Arm) -> None:
        """Propose ``arm`` no more (exploring it costs the job too much, or the job disabled
        it); what it measured stays told."""
        self.arms = [a for a in self.arms if a != arm]

    def best(self) -> Arm | None:
        """The arm with the lowest median of what was told so far (None: nothing measured)."""
        measured = {a: m for a, v in self.values.items() if v and math.isfinite(m := _median(v))}
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

    def retire(self, arm: Arm) -> None:
        super().retire(arm)
        self.order = [a for a in self.order if a != arm]


class SuccessiveHalving(Strategy):
    """Measure every surviving arm, keep the better half, measure again, … until one is left.
    Later rounds re-measure the survivors, so noise in one trial does not decide alone."""

    name = "successive_halving"

    def __init__(self, arms, budget, seed=0, batch=4) -> None:
        super().__init__(arms, budget, seed, batch)
        self.survivors = list(self.arms)
        if budget < len(self.arms):
            # as Hyperband does: a random few with room for a round that halves them, not the
            # first ones in order, once each, never halved; a budget too small for any halving
            # tries as many (callers hand the arms over sorted: the first is no one's favourite,
            # and keeping it made a budget of one the same arm on every run)
            k = max((n for n in range(3, budget + 1) if n + math.ceil(n / 2) <= budget),
                    default=budget)
            chosen = set(self.rng.sample(range(len(self.arms)), k))
            self.survivors = [a for i, a in enumerate(self.arms) if i in chosen]
        self.round_todo = list(self.survivors)
        self.round = 0

    def _propose(self) -> list[Arm]:
        if not self.round_todo:
            if len(self.survivors) <= 1:
                return []
            # an arm never told (its round cut short) ranks last
            ranked = sorted(self.survivors,
                            key=lambda a: _median(self.values[a]) if self.values[a] else math.inf)
            self.survivors = ranked[: max(1, math.ceil(len(ranked) / 2))]
            if len(self.survivors) == 1:
                return []
            self.round += 1
            self.round_todo = list(self.survivors)
        out, self.round_todo = self.round_todo[: self.batch], self.round_todo[self.batch:]
        return out

    def retire(self, arm: Arm) -> None:
        super().retire(arm)
        self.survivors = [a for a in self.survivors if a != arm]
        self.round_todo = [a for a in self.round_todo if a != arm]

    def best(self) -> Arm | None:
        alive = [a for a in self.survivors
                 if self.values.get(a) and math.isfinite(_median(self.values[a]))]
        if alive:
            return min(alive, key=lambda a: _median(self.values[a]))
        return super().best()


class ThompsonSampling(Strategy):
    """A bandit: each arm's log value has a normal posterior; every trial goes to the arm whose
    posterior draw is lowest. Uses telemetry as reward.

    Without ``prior``, arms never measured are tried first. With ``prior`` (arm → (mean, sd) of its
    log value *relative to the best arm*, e.g. from other buckets: :mod:`rtxops.evolve.priors`),
    no arm is forced: an unmeasured arm draws from its prior mapped onto this bucket (scale and
    slope fitted on the measured arms, :meth:`_fit`); a measured one draws from the normal-normal
    posterior, so measurements override a wrong prior. Arms missing from
    ``prior`` get a weak one (the median prior mean, sd ``prior_sd``). With a prior, picks are
    top-two (see :meth:`_top_two`)."""

    name = "thompson"
    uses_prior = True
    slope_shrink = 0.2  # pulls the prior→bucket slope towards 1 like one agreeing pair 0.45 apart

    def __init__(self, arms, budget, seed=0, batch=1, prior_sd: float = 0.5,
                 prior: dict[Arm, tuple[float, float]] | None = None,
                 obs_sd: float = 0.1, top_two: float = 0.5) -> None:
        super().__init__(arms, budget, seed, batch)
        self.prior_sd, self.obs_sd, self.top_two = prior_sd, obs_sd, top_two
        self.prior: dict[Arm, tuple[float, float]] | None = None
        if prior:
            given = {a: (float(m), max(float(sd), 1e-3)) for a, (m, sd) in prior.items()}
            weak = (_median([m for m, _ in given.values()]), prior_sd)
            self.prior = {a: given.get(a, weak) for a in self.arms}
        else:   # untried arms go first, in an order of the seed's (a budget under the arms
            # took the same first few, in the callers' sorted order, on every run)
            self._first = self.rng.sample(self.arms, len(self.arms))

    def retire(self, arm: Arm) -> None:
        super().retire(arm)
        if self.prior is None:
            self._first = [a for a in self._first if a != arm]

    def _propose(self) -> list[Arm]:
        if self.prior is None:
            untried = [a for a in self._first if not self.values.get(a)]
            if untried:
                return untried[: self.batch]
        # distinct arms per batch: a batch runs at once (one explore round), so a repeated arm
        # would count the same steps as evidence twice
        out: list[Arm] = []
        for _ in range(20 * self.batch):
            if len(out) >= min(self.batch, len(self.arms)):
                break
            if self.prior is not None:
                arm = self._top_two()
            else:
                draws = {a: self._draw(a) for a in self.arms}
                arm = min(draws, key=draws.get)
            if arm not in out:
                out.append(arm)
        return out

    def _top_two(self) -> Arm:
        """Top-two Thompson sampling (Russo 2016), for finding the best arm: the leader of one
        posterior draw with probability ``top_two``, else the first other arm to lead a fresh
        draw. Without it a relative prior can trap the bandit: re-measuring only the prior's
        favourite moves the bucket's scale, never the ranking."""
        fit, noise = self._fit(), self._noise()
        # an arm told only failures (inf) ranks last, as in _draw: its posterior is its prior,
        # which would keep picking a favourite that fails every trial
        live = [a for a in self.arms
                if not self.values.get(a) or any(math.isfinite(x) for x in _logs(self.values[a]))]
        post = {a: self.posterior(a, fit, noise) for a in (live or self.arms)}

        def lead() -> tuple[Arm, dict]:
            draws = {a: self.rng.gauss(m, sd) for a, (m, sd) in post.items()}
            return min(draws, key=draws.get), draws

        leader, draws = lead()
        if len(post) == 1 or self.rng.random() < self.top_two:
            return leader
        for _ in range(50):
            other, draws = lead()
            if other != leader:
                return other
        return sorted(draws, key=draws.get)[1]

    def _draw(self, arm: Arm) -> float:
        # a round that measured nothing is told as inf: no evidence either way, so left out
        logs = [x for x in _logs(self.values[arm]) if math.isfinite(x)]
        if not logs:  # never measured: first; only failures: last
            return -math.inf if not self.values[arm] else math.inf
        mean = sum(logs) / len(logs)
        spread = _sd(logs) if len(logs) > 1 else self.prior_sd
        return self.rng.gauss(mean, max(spread, 0.01) / math.sqrt(len(logs)))

    def posterior(self, arm: Arm, fit: tuple[float, float, float] | None = None,
                  noise: float | None = None) -> tuple[float, float]:
        """Mean and sd of ``arm``'s log value: its prior mapped onto this bucket (see
        :meth:`_fit`), updated with what was told (normal-normal); the mapped prior itself for
        an arm never measured."""
        scale, slope, misfit = self._fit() if fit is None else fit
        m0, s0 = self.prior[arm]
        m0, s0 = scale + slope * m0, max(s0, misfit)
        logs = [x for x in _logs(self.values.get(arm, [])) if math.isfinite(x)]
        if not logs:
            return m0, s0
        noise = self._noise() if noise is None else noise
        precision = 1 / s0 ** 2 + len(logs) / noise ** 2
        mean = (m0 / s0 ** 2 + sum(logs) / noise ** 2) / precision
        return mean, precision ** -0.5

    def _fit(self) -> tuple[float, float, float]:
        """How priors map onto this bucket: measured log mean ≈ scale + slope × prior mean, fitted
        over the measured arms (slope shrunk towards 1, :attr:`slope_shrink`), and the RMS misfit.
        One arm fixes only the scale; more reveal a prior that ranks this bucket wrongly (a slope
        far from 1, or a large misfit), so arms the prior wrote off get explored."""
        pts = []
        for a, v in self.values.items():
            logs = [x for x in _logs(v) if math.isfinite(x)]
            if logs and a in self.prior:
                pts.append((self.prior[a][0], sum(logs) / len(logs)))
        if not pts:
            return 0.0, 1.0, 0.0
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        sxy = sum((x - mx) * (y - my) for x, y in pts)
        slope = (sxy + self.slope_shrink) / (sxx + self.slope_shrink)
        scale = my - slope * mx
        resid = [y - scale - slope * x for x, y in pts]
        misfit = (sum(r * r for r in resid) / (len(pts) - 2)) ** 0.5 if len(pts) > 2 else 0.0
        return scale, slope, misfit

    def _noise(self) -> float:
        """One trial's log-value noise: pooled over arms measured more than once, else ``obs_sd``."""
        ss = dof = 0.0
        for v in self.values.values():
            logs = [x for x in _logs(v) if math.isfinite(x)]
            if len(logs) > 1:
                ss += _sd(logs) ** 2 * (len(logs) - 1)
                dof += len(logs) - 1
        return max((ss / dof) ** 0.5, 0.01) if dof >= 3 else self.obs_sd

    def best(self) -> Arm | None:
        """The lowest median among the most-measured arms (at least half as many trials as the
        most-measured one): one lucky trial of a barely-tried arm does not win."""
        measured = {a: v for a, v in self.values.items() if v and math.isfinite(_median(v))}
        if not measured:
            return None
        most = max(len(v) for v in measured.values())
        trusted = {a: v for a, v in measured.items() if 2 * len(v) >= most}
        return min(trusted, key=lambda a: _median(trusted[a]))


STRATEGIES: dict[str, type[Strategy]] = {
    s.name: s for s in (Exhaustive, RandomSearch, SuccessiveHalving, ThompsonSampling)
}


def make_strategy(name: str, arms: Sequence[Arm], budget: int, seed: int = 0,
                  batch: int | None = None,
                  prior: dict[Arm, tuple[float, float]] | None = None) -> Strategy:
    """The strategy called ``name`` (exhaustive, random, successive_halving, thompson).
    ``prior`` (arm → (relative log mean, sd)) goes to strategies that use one (thompson); the
    others ignore it."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r} (known: {', '.join(STRATEGIES)})") from None
    kw = {"prior": prior} if prior and getattr(cls, "uses_prior", False) else {}
    return cls(arms, budget, seed, **kw) if batch is None else cls(arms, budget, seed, batch, **kw)


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _logs(values: list[float]) -> list[float]:
    return [math.log(max(v, 1e-12)) for v in values]


def _sd(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5
