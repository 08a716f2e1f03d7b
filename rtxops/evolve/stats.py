"""Decisions with confidence: is a candidate faster than the incumbent by more than the noise?

Online trials give paired samples (both arms ran in the same training steps); offline trials give
two independent sets of repetitions. Both are compared on log ratios, so a gain is a fraction of
the incumbent's time (0.05 = 5 % faster), with a bootstrap confidence interval and a p-value.
A candidate is promoted when its gain is at least the minimum (3 %), the 99 % interval's lower
end clears half of it, and the one-sided p-value is at most 1 %.

The evolve loop's per-step values are an arm's mean time per call in a step, and arms take
different numbers of calls (an explore arm 1 in 10). Those are compared by
:func:`compare_per_call`, on call-weighted means: a per-step statistic treats one call's time
like a mean of nine, and an arm identical to the incumbent whose few calls missed the rare slow
one looked several percent faster, and was promoted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence

import numpy as np

from .config import MIN_GAIN

CONFIDENCE = 0.99
RESAMPLES = 2000
MIN_SAMPLES = 5
# the sign-flip test's smallest p-value on n pairs is 2^-n: below this many pairs it can never
# reach 1 - CONFIDENCE, so fewer pairs are compared unpaired
MIN_PAIRED_SAMPLES = math.ceil(math.log2(1 / (1 - CONFIDENCE)))
MAX_SAMPLES = 2000


@dataclass(frozen=True)
class Comparison:
    """The outcome of comparing a candidate to the incumbent (lower values are better)."""

    gain: float | None  # fraction of the incumbent's value saved (negative: slower); None:
    #                     too few samples to say
    ci_low: float
    ci_high: float
    p_value: float  # one-sided: the chance of a gain this large with no real difference
    samples: int
    promote: bool
    reason: str

    def to_dict(self) -> dict:
        """The figures as JSON takes them: an unbounded interval (too few samples) as None."""
        return {"gain": finite(self.gain), "ci_low": finite(self.ci_low),
                "ci_high": finite(self.ci_high), "p_value": finite(self.p_value),
                "samples": self.samples, "promote": self.promote, "reason": self.reason}


def finite(value: float | None) -> float | None:
    """``value``, or None where it is not a finite number (JSON has no Infinity or NaN: a
    signed provenance with them fails strict parsers)."""
    return value if value is not None and math.isfinite(value) else None


class StepMean(float):
    """An arm's mean time per call in one step, carrying how many calls it is the mean of."""

    calls: int

    def __new__(cls, total_ns: float, calls: int) -> "StepMean":
        value = super().__new__(cls, total_ns / calls)
        value.calls = calls
        return value


def compare_per_call(incumbent: Sequence[float], candidate: Sequence[float], *,
                     min_gain: float = MIN_GAIN, confidence: float = CONFIDENCE,
                     min_samples: int = MIN_SAMPLES) -> Comparison:
    """Compare two arms' per-step means of calls (:class:`StepMean`; a plain value counts as one
    call) by their call-weighted means. The calls' variance is estimated from both arms together
    (relative to each arm's mean; as under "no difference" they share it: the arm with few calls
    may not have met the rare slow call the other shows), and the log ratio of the means gets a
    normal interval and a one-sided p-value from it."""
    a, b = _weighted(incumbent), _weighted(candidate)
    if len(a) and len(b):
        a, b = _without_gross_outliers(a, b)
    n = min(len(a), len(b))
    if n < min_samples:
        return _too_few(n, min_samples)
    (xa, ka), (xb, kb) = a.T, b.T
    ma, mb = (ka @ xa) / ka.sum(), (kb @ xb) / kb.sum()
    # a step's mean of k calls varies as 1/k of one call: k (x - m)^2 estimates one call's
    # variance; relative to each arm's mean (timing noise scales with the time), then pooled
    spread = ((ka @ ((xa - ma) / ma) ** 2 + kb @ ((xb - mb) / mb) ** 2)
              / max(1, len(a) + len(b) - 2))
    se = math.sqrt(spread / ka.sum() + spread / kb.sum())
    observed = math.log(mb / ma)
    alpha = 1.0 - confidence
    if se == 0:
        return _verdict(observed, observed, observed, 0.0 if observed < 0 else 1.0, n, min_gain,
                        confidence)
    z = NormalDist().inv_cdf(1 - alpha / 2)
    return _verdict(observed, observed - z * se, observed + z * se,
                    NormalDist().cdf(observed / se), n, min_gain, confidence)


# a step whose calls took more than this many typical calls' worth of extra time held something
# else (a kernel compiled inside its first call, a preempted thread): left out of both arms
GROSS_EXCESS_CALLS = 20


def _without_gross_outliers(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both arms' (mean, calls) steps less those with gross extra time. A step's excess is
    counted from its own arm's median (a faster arm is not an outlier of the other) and in
    time, not per call, against one bound for both arms, so one event is left out alike
    whichever arm's step it fell in."""
    bound = GROSS_EXCESS_CALLS * float(np.median(np.concatenate([a[:, 0], b[:, 0]])))
    keep = lambda v: v[(v[:, 0] - np.median(v[:, 0])) * v[:, 1] <= bound]  # noqa: E731
    return keep(a), keep(b)


def _weighted(values: Sequence[float]) -> np.ndarray:
    return np.asarray([(float(v), getattr(v, "calls", 1)) for v in values if _usable(v)],
                      dtype=float).reshape(-1, 2)


def compare_paired(incumbent: Sequence[float], candidate: Sequence[float], *,
                   min_gain: float = MIN_GAIN, confidence: float = CONFIDENCE,
                   resamples: int = RESAMPLES, seed: int = 0,
                   min_samples: int = MIN_SAMPLES) -> Comparison:
    """Compare per-step values of two arms measured in the same steps (pairs by position)."""
    if len(incumbent) != len(candidate):
        raise ValueError("paired samples must have the same length")
    ratios = _log_ratios(incumbent, candidate)
    if len(ratios) < min_samples:
        return _too_few(len(ratios), min_samples)
    rng = np.random.default_rng(seed)
    ratios = _bounded(ratios, rng)
    means = rng.choice(ratios, size=(resamples, len(ratios)), replace=True).mean(axis=1)
    observed = float(ratios.mean())
    # sign-flip permutation test: under "no difference" every paired log ratio is as likely
    # to be negative as positive
    flips = rng.choice((-1.0, 1.0), size=(resamples, len(ratios)))
    null = (flips * np.abs(ratios)).mean(axis=1)
    p_value = float((np.sum(null <= observed) + 1) / (resamples + 1))
    return _decide(observed, means, p_value, len(ratios), min_gain, confidence)


def compare_independent(incumbent: Sequence[float], candidate: Sequence[float], *,
                        min_gain: float = MIN_GAIN, confidence: float = CONFIDENCE,
                        resamples: int = RESAMPLES, seed: int = 0,
                        min_samples: int = MIN_SAMPLES) -> Comparison:
    """Compare repetitions of two arms measured separately (offline trials): bootstrap of the
    ratio of medians, Mann-Whitney U (normal approximation) for the p-value."""
    a = np.log(np.asarray([v for v in incumbent if _usable(v)], dtype=float))
    b = np.log(np.asarray([v for v in candidate if _usable(v)], dtype=float))
    n = min(len(a), len(b))
    if n < min_samples:
        return _too_few(n, min_samples)
    rng = np.random.default_rng(seed)
    a, b = _bounded(a, rng), _bounded(b, rng)
    diffs = (np.median(rng.choice(b, size=(resamples, len(b))), axis=1)
             - np.median(rng.choice(a, size=(resamples, len(a))), axis=1))
    observed = float(np.median(b) - np.median(a))
    return _decide(observed, diffs, _mann_whitney_less(b, a), n, min_gain, confidence)


def _bounded(values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """At most MAX_SAMPLES values (a random subset): resampling costs resamples × n."""
    return values if len(values) <= MAX_SAMPLES else rng.choice(values, MAX_SAMPLES, replace=False)


def _log_ratios(incumbent: Sequence[float], candidate: Sequence[float]) -> np.ndarray:
    pairs = [(i, c) for i, c in zip(incumbent, candidate) if _usable(i) and _usable(c)]
    return np.asarray([math.log(c / i) for i, c in pairs], dtype=float)


def _usable(v: float) -> bool:
    """A timing that can enter a ratio: positive and finite (NaN and inf are dropped)."""
    return v > 0 and math.isfinite(v)


def _decide(observed: float, resampled: np.ndarray, p_value: float, n: int, min_gain: float,
            confidence: float) -> Comparison:
    alpha = 1.0 - confidence
    lo, hi = np.quantile(resampled, [alpha / 2, 1 - alpha / 2])
    return _verdict(observed, float(lo), float(hi), p_value, n, min_gain, confidence)


def _verdict(observed: float, lo: float, hi: float, p_value: float, n: int, min_gain: float,
             confidence: float) -> Comparison:
    """The decision on a log ratio (candidate / incumbent) and its interval [lo, hi]."""
    alpha = 1.0 - confidence
    gain = 1.0 - math.exp(observed)
    ci_low, ci_high = 1.0 - math.exp(hi), 1.0 - math.exp(lo)
    # the interval must clear half the minimum gain, not just zero: over many windows a
    # zero-clearing rule alone lets noise through now and then, and every promotion is a swap
    if not all(map(math.isfinite, (gain, ci_low, ci_high, p_value))):
        promote, reason = False, "the samples give no finite gain"
    elif gain < min_gain:
        promote, reason = False, f"gain {gain:+.1%} is below the minimum {min_gain:.1%}"
    elif ci_low < min_gain / 2:
        promote, reason = False, (f"gain {gain:+.1%} is within the noise "
                                  f"({confidence:.0%} CI {ci_low:+.1%} … {ci_high:+.1%})")
    elif p_value > alpha:
        # the percentile bootstrap is narrow on few samples: the test must agree
        promote, reason = False, (f"gain {gain:+.1%} is not significant yet (p={p_value:.3g} > "
                                  f"{alpha:.2g}, n={n})")
    else:
        promote, reason = True, (f"gain {gain:+.1%} ({confidence:.0%} CI {ci_low:+.1%} … "
                                 f"{ci_high:+.1%}, p={p_value:.3g}, n={n})")
    return Comparison(gain, ci_low, ci_high, p_value, n, promote, reason)


def _too_few(n: int, need: int) -> Comparison:
    return Comparison(None, float("-inf"), float("inf"), 1.0, n, False,
                      f"{n} samples, {need} needed")


def _mann_whitney_less(b: np.ndarray, a: np.ndarray) -> float:
    """One-sided p-value that ``b`` tends to be smaller than ``a`` (normal approximation with a
    tie correction)."""
    both = np.concatenate([a, b])
    order = both.argsort(kind="mergesort")
    ranks = np.empty(len(both))
    ranks[order] = np.arange(1, len(both) + 1)
    _, inverse, counts = np.unique(both, return_inverse=True, return_counts=True)
    ranks = (np.bincount(inverse, weights=ranks) / counts)[inverse]  # average ranks over ties
    n1, n2 = len(b), len(a)
    u = ranks[len(a):].sum() - n1 * (n1 + 1) / 2
    n = n1 + n2
    var = n1 * n2 / 12 * ((n + 1) - (counts ** 3 - counts).sum() / (n * (n - 1)))
    if var <= 0:
        return 1.0
    z = (u - n1 * n2 / 2 + 0.5) / math.sqrt(var)
    return 0.5 * math.erfc(-z / math.sqrt(2))


def objective_value(time_ns: float, peak_bytes: float | None, objective: str,
                    base_time_ns: float, base_peak_bytes: float | None) -> float:
    """One number to minimise: time, memory, or both relative to the incumbent's figures.
    Memory falls back to time where it was not measured (CPU calls carry no per-call memory)."""
    if objective == "time" or not peak_bytes or not base_peak_bytes:
        return time_ns
    if objective == "memory":
        return peak_bytes
    if objective == "time+memory":
        return time_ns / base_time_ns + peak_bytes / base_peak_bytes
    raise ValueError(f"unknown objective {objective!r} (time, memory, time+memory)")
