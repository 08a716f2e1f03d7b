"""Informative priors for the bandit, transferred across problem sizes: what the same op measured
on OTHER buckets (same device and versions) says about each arm, relative to the best arm there.

A prior is ``arm → (mean, sd)`` of the arm's log time minus the best arm's log time. An arm
measured elsewhere gets the mean of its relative log times over those buckets (sd: ``transfer_sd``
widened by their spread); an arm never measured but whose variant was (other configs) gets the
variant's mean with the wider ``family_sd``; an arm of a variant never measured gets nothing (the
bandit gives it a weak default).
"""
from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

TRANSFER_SD = 0.2
FAMILY_SD = 0.4

Prior = dict[Any, tuple[float, float]]


def priors_from_rows(rows: Iterable[dict], arms: Sequence[Any], *, transfer_sd: float = TRANSFER_SD,
                     family_sd: float = FAMILY_SD) -> Prior:
    """Priors for ``arms`` (objects with ``variant`` and ``config_json``, e.g.
    :class:`~rtxops.evolve.candidates.Arm`) from result rows (``bucket``, ``variant``, ``config``
    as canonical JSON or a dict, ``median_ns``). Rows without a positive median are skipped; the
    caller picks which buckets the rows may come from (never the one being tuned)."""
    by_bucket: dict[str, dict[tuple[str, str], float]] = defaultdict(dict)
    for r in rows:
        m = r.get("median_ns")
        if m is None or not (m > 0) or math.isinf(m):
            continue
        key = (r["variant"], canonical(r.get("config") or {}))
        by_bucket[r["bucket"]][key] = math.log(m)
    exact: dict[tuple[str, str], list[float]] = defaultdict(list)
    family: dict[str, list[float]] = defaultdict(list)
    for logs in by_bucket.values():
        best = min(logs.values())
        for (variant, config), x in logs.items():
            exact[(variant, config)].append(x - best)
            family[variant].append(x - best)
    out: Prior = {}
    for arm in arms:
        rels = exact.get((arm.variant, canonical(arm.config_json)))
        if rels:
            out[arm] = (statistics.fmean(rels), _widen(transfer_sd, rels))
        elif family.get(arm.variant):
            rels = family[arm.variant]
            out[arm] = (statistics.fmean(rels), _widen(family_sd, rels))
    return out


def tuning_priors(store, registry, op: str, bucket: str, arms: Sequence[Any]) -> Prior:
    """Priors for tuning ``op`` on ``bucket`` from the tuning database: the op's current offline
    results (same device model, torch and triton versions, kernel source) on every other bucket."""
    from rtxops.runtime.bucket import Bucket
    from rtxops.telemetry import store_evolve

    from .environment import environment

    env = environment(Bucket.parse(op, bucket).device)
    hashes: dict[str, str | None] = {}

    def current(row: dict) -> bool:
        v = row["variant"]
        if v not in hashes:
            try:
                hashes[v] = registry.variant(op, v).source_hash
            except Exception:  # a variant no longer registered: its rows say nothing now
                hashes[v] = None
        # offline results only: an online figure times the forward calls alone, and one bucket
        # mixing both would rank arms by what was measured rather than by speed
        return (row["bucket"] != bucket and row.get("status") == "ok" and hashes[v] is not None
                and row.get("source") == "offline"
                and row.get("source_hash") == hashes[v]
                and all(row.get(k) == env[k] for k in ("device", "torch_version", "triton_version")))

    rows = [r for r in store_evolve.tuning_rows(store, op=op, limit=100_000) if current(r)]
    return priors_from_rows(rows, arms)


def canonical(config: str | dict) -> str:
    """A config as canonical JSON (the form :class:`~rtxops.evolve.candidates.Arm` keeps)."""
    if isinstance(config, str):
        config = json.loads(config or "{}")
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def _widen(base: float, rels: list[float]) -> float:
    spread = statistics.stdev(rels) if len(rels) > 1 else 0.0
    return math.hypot(base, spread)
