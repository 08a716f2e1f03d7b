"""The per-minute kernel rollup (``kernel_minutes``) of a group of span rows, aggregated with Arrow.

Same rows as the SQL rollup it replaces (``GROUP BY hash(job, op, bucket, variant, config,
phase), minute`` with a ``histogram`` of per-span mean ns), at a fraction of its cost: DuckDB
only hashes the keys and builds the maps of the few aggregated rows. The receiver aggregates each
batch in its decoding thread (:func:`for_batch`); the store's writer only merges them (:func:`merge`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

KEYS = ("job_id", "op", "bucket", "variant", "config", "phase")
MINUTE_NS = 60 * 10**9
HIST_BINS_PER_OCTAVE = 16

CACHE_COUNTS_SQL = """
SELECT TRY_CAST(attributes->>'rtx.cache.hits' AS BIGINT) AS cache_hits,
       TRY_CAST(attributes->>'rtx.cache.misses' AS BIGINT) AS cache_misses
FROM _rtx_spans WHERE name = 'rtx.kernel'"""     # rows in the order of rollup.kernels()

# _rtx_totals and _rtx_bins (from :func:`tables`) → kernel_minutes rows
INSERT_SQL = f"""
INSERT INTO kernel_minutes BY NAME
WITH hist AS (
    SELECT hash({', '.join(KEYS)}) AS key_id, minute,
           map_from_entries(list((bin, n) ORDER BY bin)) AS mean_hist
    FROM _rtx_bins GROUP BY 1, 2
)
SELECT hash({', '.join('t.' + k for k in KEYS)}) AS key_id, t.*, hist.mean_hist
FROM _rtx_totals t LEFT JOIN hist
  ON hist.key_id = hash({', '.join('t.' + k for k in KEYS)}) AND hist.minute = t.minute
"""


FIGURE_MAX = 2**53  # ns (104 days) or calls in one span: past it a span's figures are not real
FIGURES = ("count", "total_ns", "min_ns", "max_ns")


def check_figures(spans: pa.Table) -> None:
    """TelemetryInputError unless every span's count and kernel times lie in 0..2^53 (the rollup
    sums them: figures past that would overflow its sums and lose precision in its means)."""
    from .otlp import TelemetryInputError

    for name in FIGURES:
        if name not in spans.column_names or spans.num_rows == 0:
            continue
        low, high = (v.as_py() for v in pc.min_max(spans[name]).values())
        if low is not None and (low < 0 or high > FIGURE_MAX):
            bad = low if low < 0 else high
            raise TelemetryInputError(f"a span's {name} of {bad} is out of range (0 to 2^53)")


def kernels(spans: pa.Table) -> pa.Table:
    """The kernel spans' columns the rollup reads."""
    mask = pc.equal(spans["name"], "rtx.kernel")
    return spans.select([*KEYS, "start_ns", "count", "total_ns", "min_ns", "max_ns"]).filter(mask)


def tables(kernel: pa.Table, hits: pa.Array, misses: pa.Array) -> tuple[pa.Table, pa.Table]:
    """(totals per key and minute, histogram bin counts per key, minute and bin)."""
    minute = pc.divide(kernel["start_ns"], MINUTE_NS)           # truncates, as DuckDB's //
    t = pa.table({**{k: kernel[k] for k in KEYS}, "minute": minute, "count": kernel["count"],
                  "total_ns": kernel["total_ns"], "min_ns": kernel["min_ns"],
                  "max_ns": kernel["max_ns"], "start_ns": kernel["start_ns"],
                  "cache_hits": hits, "cache_misses": misses})
    group = [*KEYS, "minute"]
    totals = t.group_by(group, use_threads=False).aggregate([
        ([], "count_all"), ("count", "sum"), ("total_ns", "sum"), ("min_ns", "min"),
        ("max_ns", "max"), ("start_ns", "min"), ("start_ns", "max"), ("cache_hits", "sum"),
        ("cache_misses", "sum")])
    totals = totals.rename_columns({
        "count_all": "samples", "count_sum": "calls", "total_ns_sum": "total_ns",
        "min_ns_min": "min_ns", "max_ns_max": "max_ns", "start_ns_min": "first_ns",
        "start_ns_max": "last_ns", "cache_hits_sum": "cache_hits",
        "cache_misses_sum": "cache_misses"})
    # bin of the span's mean ns, as floor(log2(greatest(total_ns / count, 1)) * 16) in SQL
    valid = pc.and_(pc.greater(t["count"], 0), pc.is_valid(t["total_ns"]))
    binned = t.filter(valid)
    mean = pc.divide(pc.cast(binned["total_ns"], pa.float64(), safe=False),
                     pc.cast(binned["count"], pa.float64(), safe=False))
    bin_ = pc.cast(pc.floor(pc.multiply(pc.log2(pc.max_element_wise(mean, 1.0)),
                                        float(HIST_BINS_PER_OCTAVE))), pa.int32())
    bins = pa.table({**{k: binned[k] for k in group}, "bin": bin_}).group_by(
        [*group, "bin"], use_threads=False).aggregate([([], "count_all")]).rename_columns(
        {"count_all": "n"})
    return totals, bins


def for_batch(batch: Any) -> Any:
    """``batch`` with its rollup tables attached, when its cache counts came typed (else the
    writer computes them: it alone can read the JSON column through DuckDB)."""
    if batch.cache_counts is None or batch.rollup is not None:
        return batch
    mask = pc.equal(batch.spans["name"], "rtx.kernel")
    kernel = kernels(batch.spans)
    hits, misses = (c.filter(mask) for c in batch.cache_counts)
    return dataclasses.replace(batch, rollup=tables(kernel, hits, misses))


_SUMS = {"samples": "sum", "calls": "sum", "total_ns": "sum", "min_ns": "min", "max_ns": "max",
         "first_ns": "min", "last_ns": "max", "cache_hits": "sum", "cache_misses": "sum"}


def merge(parts: list[tuple[pa.Table, pa.Table]]) -> tuple[pa.Table, pa.Table]:
    """One (totals, bins) pair from several batches' (the same rows as aggregating them at once)."""
    if len(parts) == 1:
        return parts[0]
    group = [*KEYS, "minute"]
    totals = pa.concat_tables([t for t, _ in parts]).group_by(group, use_threads=False).aggregate(
        list(_SUMS.items()))
    totals = totals.rename_columns({f"{c}_{f}": c for c, f in _SUMS.items()})
    bins = pa.concat_tables([b for _, b in parts]).group_by([*group, "bin"], use_threads=False).aggregate(
        [("n", "sum")]).rename_columns({"n_sum": "n"})
    return totals, bins
