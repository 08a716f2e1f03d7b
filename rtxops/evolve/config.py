"""The evolve loop's knobs (no torch here: the daemon reads them at start)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

MIN_GAIN = 0.03
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass
class LoopConfig:
    """Knobs of the loop; ``RTXOPS_EVOLVE_<NAME>`` overrides each (e.g. RTXOPS_EVOLVE_WINDOW_STEPS)."""

    interval_s: float = 2.0          # how often the daemon ticks the loop
    min_steps: int = 10              # steps of telemetry before looking for hot spots
    hot_window_steps: int = 50       # the window hot spots are ranked over
    min_share: float = 0.01          # buckets below this share of step time are not worth tuning
    explore_share: float = 0.10      # at most this share of a bucket's calls runs candidates
    # a round whose arms add more than this share to the job's step time ends at once (an arm
    # that passed the gate can still be many times slower than the incumbent)
    explore_cost_cap: float = 0.05
    window_steps: int = 20           # steps per explore round and per canary window
    margin_steps: int = 5            # a plan takes effect this many steps after the last one seen
    strategy: str = "successive_halving"
    budget: int = 12                 # trials (arm × window) per bucket
    max_arms: int = 3                # arms explored at once
    min_gain: float = MIN_GAIN
    rollback_threshold: float = 0.10  # canary: the promoted kernel this much slower → roll back
    step_rollback_threshold: float = 0.25  # canary: step time this much slower → roll back
    drift_threshold: float = 0.25    # settled: live time this far from the decision → re-open
    objective: str = "time"
    deterministic: bool = False      # leave non-deterministic variants out
    variants: str = ""               # comma-separated allow-list of variant names ("": all)
    seed: int = 0
    gate_timeout_s: float = 600.0
    # gates (candidate kernels in a worker process that imports torch, perhaps compiling) running
    # at once over all jobs: they take CPU and memory from the jobs themselves, and a job tuning
    # a bucket another has just gated finds the verdicts stored
    gates: int = 1
    swap_timeout_s: float = 300.0    # a job that has not swapped to a published plan by then: failed
    # a job with nothing left worth tuning is scanned for hot spots again after twice the gap of
    # the scan before, from interval_s up to this (a converged job costs the store a query a
    # minute, not one a tick)
    idle_scan_max_s: float = 60.0

    @classmethod
    def from_env(cls, **overrides) -> LoopConfig:
        """Read ``RTXOPS_EVOLVE_*``; a malformed value raises ValueError naming the variable."""
        names = {f"RTXOPS_EVOLVE_{f.name.upper()}" for f in fields(cls)}
        for name in sorted(k for k in os.environ if k.startswith("RTXOPS_EVOLVE_") and k not in names):
            import difflib

            near = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
            raise ValueError(f"{name} is not a setting of the evolve loop"
                             + (f" (did you mean {near[0]}?)" if near else "")
                             + f"; the settings: {', '.join(sorted(names))}")
        values = {}
        for f in fields(cls):
            name = f"RTXOPS_EVOLVE_{f.name.upper()}"
            raw = os.environ.get(name)
            if raw is None:
                continue
            kind = type(f.default)
            if kind is bool:
                word = raw.strip().lower()
                if word not in _TRUE + _FALSE:
                    raise ValueError(f"{name}={raw!r}: give 1 or 0 (true/false, yes/no, on/off)")
                values[f.name] = word in _TRUE
                continue
            try:
                values[f.name] = kind(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None
            if kind is float and not math.isfinite(values[f.name]):
                raise ValueError(f"{name}={raw!r}: give a finite number")
        config = cls(**{**values, **overrides})
        config.check()
        return config

    def check(self) -> None:
        from .search import STRATEGIES  # no torch there

        if self.strategy not in STRATEGIES:
            raise ValueError(f"RTXOPS_EVOLVE_STRATEGY={self.strategy!r}: known strategies are "
                             f"{', '.join(STRATEGIES)}")
        if self.objective in ("memory", "time+memory"):
            # stats.objective_value can weigh memory, but the loop's per-step readings are times
            # only (per-call memory is measured on CUDA, and off by default): a decision said to
            # be on memory would be on time
            raise ValueError(f"RTXOPS_EVOLVE_OBJECTIVE={self.objective!r}: the loop decides on time "
                             "only so far")
        if self.objective != "time":
            raise ValueError(f"RTXOPS_EVOLVE_OBJECTIVE={self.objective!r}: time")
        for f in fields(self):   # nan passes every comparison below unless refused here
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"RTXOPS_EVOLVE_{f.name.upper()}={value!r}: give a finite number")
        for name in ("interval_s", "hot_window_steps", "window_steps", "budget", "max_arms", "gates",
                     "rollback_threshold", "step_rollback_threshold", "drift_threshold",
                     "gate_timeout_s", "swap_timeout_s", "explore_cost_cap", "idle_scan_max_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RTXOPS_EVOLVE_{name.upper()} must be > 0")
        for name in ("min_steps", "margin_steps", "min_gain"):
            if getattr(self, name) < 0:
                raise ValueError(f"RTXOPS_EVOLVE_{name.upper()} must be ≥ 0")
        if not 0 <= self.min_share < 1:
            raise ValueError("RTXOPS_EVOLVE_MIN_SHARE must be in [0, 1)")
        if not 0 < self.explore_share <= 0.5:
            raise ValueError("RTXOPS_EVOLVE_EXPLORE_SHARE must be in (0, 0.5]")

    def allowed_variants(self) -> set[str]:
        """The ``variants`` allow-list's names (empty: every variant may be tried)."""
        return {v.strip() for v in self.variants.split(",") if v.strip()}

    def check_variants(self, registry=None) -> None:
        """Refuse allow-listed names that no op's variant has: a misspelt name would leave the
        loop no candidate to try, saying nothing. Reads the registry (torch, and the plugins
        of ``RTXOPS_VARIANT_MODULES``) only when there is an allow-list."""
        wanted = self.allowed_variants()
        if not wanted:
            return
        from rtxops.runtime.errors import RegistryError

        try:
            if registry is None:
                from rtxops.runtime.registry import default_registry

                registry = default_registry()
            known = {v.name for op in registry.ops() for v in registry.variants(op.name)}
        except RegistryError as e:   # a plugin module that cannot be imported
            raise ValueError(str(e)) from None
        unknown = sorted(wanted - known)
        if unknown:
            raise ValueError(f"RTXOPS_EVOLVE_VARIANTS: no op has a variant named "
                             f"{', '.join(map(repr, unknown))} (the variants: {', '.join(sorted(known))})")
