"""The per-minute kernel rollup (``kernel_minutes``) of a group of span rows, aggregated with Arrow.

Same rows as the SQL rollup it replaces (``GROUP BY hash(job, op, bucket, variant, config,
phase), minute`` with a ``histogram`` of per-span mean ns), at a fraction of its cost: DuckDB
only hashes the keys of the few aggregated rows. The receiver aggregates each batch in its
decoding thread (:func:`for_batch`); the store's writer only merges them (:func:`merge`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from . import narrow

KEYS = ("job_id", "op", "bucket", "variant", "config", "phase")
GROUP = [*KEYS, "minute"]
MINUTE_NS = 60 * 10**9
HIST_BINS_PER_OCTAVE = 16

# counts outside 0..2^53 are left out of the sums, as valid_figures leaves out typed ones
CACHE_COUNTS_SQL = """
WITH counts AS (
    SELECT TRY_CAST(attributes->>'rtx.cache.hits' AS BIGINT) AS hits,
           TRY_CAST(attributes->>'rtx.cache.misses' AS BIGINT) AS misses
    FROM _rtx_rows WHERE name = 'rtx.kernel'
)
SELECT CASE WHEN hits BETWEEN 0 AND 9007199254740992 THEN hits END AS cache_hits,
       CASE WHEN misses BETWEEN 0 AND 9007199254740992 THEN misses END AS cache_misses
FROM counts"""     # rows in the order of rollup.kernels()

# _rtx_rows (from :func:`tables`) → kernel_minutes rows
INSERT_SQL = f"""
INSERT INTO kernel_minutes BY NAME
SELECT hash({', '.join(KEYS)}) AS key_id, * FROM _rtx_rows
"""
BIN_SPAN = 1 << 12   # bins lie in 0 .. 16 * 63 (a mean of 1 ns to 2^63 ns)


FIGURE_MAX = 2**53  # ns (104 days) or calls in one span: past it a span's figures are not real
FIGURES = ("count", "total_ns", "min_ns", "max_ns")


def valid_figures(batch: Any) -> Any:
    """``batch`` with each span's figures outside 0..2^53 (its count, kernel times, and cache
    counts) taken out of the typed columns the rollup sums: past that the sums overflow (DuckDB
    and Arrow wrap or fail) and lose precision. A figure taken out is kept in the span's
    attributes, as it was sent; the span is stored like any other."""
    from .otlp import SPAN_ATTRIBUTE_COLUMNS

    spans = batch.spans
    if spans.num_rows == 0:
        return batch
    counts = batch.cache_counts
    columns = [spans[name] for name in FIGURES if name in spans.column_names]
    if all(_within_range(c) for c in (*columns, *(counts or ()))):
        return batch   # (one call a column, where the masks below take five)
    out_of_range = {name: _out_of_range(spans[name]) for name in FIGURES if name in spans.column_names}
    bad_counts = [_out_of_range(c) for c in counts] if counts is not None else []
    if bad_counts:   # their attributes hold them already
        counts = tuple(pc.if_else(pa.array(m), pa.scalar(None, pa.int64()), c)
                       for c, m in zip(counts, bad_counts))
    attribute_of = {column: key for key, column in SPAN_ATTRIBUTE_COLUMNS.items()}
    attributes = spans["attributes"].to_pylist()
    for name, mask in out_of_range.items():
        if not mask.any():
            continue
        values = spans[name].to_pylist()
        for i in np.flatnonzero(mask):
            kept = orjson.loads(attributes[i]) if attributes[i] else {}
            kept[attribute_of[name]] = values[i]
            attributes[i] = orjson.dumps(kept).decode()
        column = pc.if_else(pa.array(mask), pa.scalar(None, spans.schema.field(name).type), spans[name])
        spans = spans.set_column(spans.schema.get_field_index(name), name, column)
    spans = spans.set_column(spans.schema.get_field_index("attributes"), "attributes",
                             pa.array(attributes, pa.string()))
    # a rollup made before is of the figures taken out: made again from these
    return dataclasses.replace(batch, spans=spans, cache_counts=counts, rollup=None)


def _within_range(column: pa.ChunkedArray | pa.Array) -> bool:
    """Whether every value of ``column`` lies in 0..2^53 (nulls do)."""
    low_high = pc.min_max(column)
    low, high = low_high["min"].as_py(), low_high["max"].as_py()
    return low is None or (low >= 0 and high <= FIGURE_MAX)


def _out_of_range(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Where ``column`` holds a value outside 0..2^53 (nulls are not)."""
    outside = pc.or_(pc.less(column, 0), pc.greater(column, FIGURE_MAX))
    return np.asarray(pc.fill_null(outside, False), dtype=bool)


def kernels(spans: pa.Table) -> pa.Table:
    """The kernel spans' columns the rollup reads."""
    mask = pc.equal(spans["name"], "rtx.kernel")
    return spans.select([*KEYS, "start_ns", "count", "total_ns", "min_ns", "max_ns"]).filter(mask)


def tables(kernel: pa.Table, hits: pa.Array, misses: pa.Array,
           key_index: np.ndarray | None = None) -> pa.Table:
    """The kernel_minutes rows (less key_id) of ``kernel``: totals per key and minute, and the
    histogram of the spans' mean ns as a map of bin → spans. ``key_index``: for each row, a
    number that is the same for rows whose :data:`KEYS` are the same (the narrow layout's key
    rows, which :func:`.store.prepared` has at hand), so that only integers need grouping."""
    minute = pc.divide(kernel["start_ns"], MINUTE_NS)           # truncates, as DuckDB's //
    t = pa.table({**{k: kernel[k] for k in KEYS}, "minute": minute})
    if key_index is None:
        group, first = narrow.distinct_rows(t, GROUP)
    else:
        group, first = narrow.distinct_rows(pa.table({"k": key_index, "minute": minute}), ["k", "minute"])
    sums = pa.table({"g": group, "count": kernel["count"], "total_ns": kernel["total_ns"],
                     "min_ns": kernel["min_ns"], "max_ns": kernel["max_ns"],
                     "start_ns": kernel["start_ns"], "cache_hits": hits, "cache_misses": misses})
    totals = _grouped(sums, [
        ([], "count_all"), ("count", "sum"), ("total_ns", "sum"), ("min_ns", "min"),
        ("max_ns", "max"), ("start_ns", "min"), ("start_ns", "max"), ("cache_hits", "sum"),
        ("cache_misses", "sum")])
    totals = totals.take(pa.array(np.argsort(np.asarray(totals["g"]), kind="stable")))
    # bin of the span's mean ns, as floor(log2(greatest(total_ns / count, 1)) * 16) in SQL
    valid = np.asarray(pc.fill_null(pc.and_(pc.greater(kernel["count"], 0),
                                            pc.is_valid(kernel["total_ns"])), False))
    mean = pc.divide(pc.cast(kernel["total_ns"].filter(valid), pa.float64(), safe=False),
                     pc.cast(kernel["count"].filter(valid), pa.float64(), safe=False))
    bin_ = np.asarray(pc.cast(pc.floor(pc.multiply(pc.log2(pc.max_element_wise(mean, 1.0)),
                                                   float(HIST_BINS_PER_OCTAVE))), pa.int64()))
    hist = _histograms(group[valid], bin_, np.ones(len(bin_), np.int64), len(first))
    names = {"count_all": "samples", "count_sum": "calls", "total_ns_sum": "total_ns",
             "min_ns_min": "min_ns", "max_ns_max": "max_ns", "start_ns_min": "first_ns",
             "start_ns_max": "last_ns", "cache_hits_sum": "cache_hits",
             "cache_misses_sum": "cache_misses"}
    out = t.take(pa.array(first))
    for old, new in names.items():
        out = out.append_column(new, totals[old])
    out = out.append_column("mean_hist", hist)
    # keys that differ in what KEYS leave out (site, rank, ...) share a kernel_minutes row
    return out if key_index is None else _combine(out)


_INT64 = (-2**63, 2**63 - 1)


def _grouped(table: pa.Table, aggregates: list) -> pa.Table:
    """``table.group_by("g").aggregate(aggregates)`` with its int64 sums saturating at the int64
    bounds: Arrow's wrap around silently (1100 spans of 2^53 ns summed to a negative total, and
    the store's compaction, which sums in SQL, failed on every run after). Sums that cannot reach
    the bounds, as any real job's, skip the check."""
    risky = []
    for column, how in aggregates:
        if how == "sum" and table.num_rows:
            lo, hi = pc.min_max(table[column]).values()
            bound = max(abs(lo.as_py() or 0), abs(hi.as_py() or 0))
            if bound * table.num_rows > 2**62:
                risky.append(column)
    shadow = table
    for column in risky:
        shadow = shadow.append_column(f"{column}__f",
                                      pc.cast(table[column], pa.float64(), safe=False))
    out = shadow.group_by("g", use_threads=False).aggregate(
        aggregates + [(f"{c}__f", "sum") for c in risky])
    for column in risky:
        exact, approx = out[f"{column}_sum"], out[f"{column}__f_sum"]
        saturated = pc.if_else(pc.greater(approx, 9.2e18), _INT64[1],
                               pc.if_else(pc.less(approx, -9.2e18), _INT64[0], exact))
        out = out.set_column(out.schema.get_field_index(f"{column}_sum"), f"{column}_sum",
                             pc.cast(saturated, pa.int64()))
    return out.drop_columns([f"{c}__f_sum" for c in risky])


def _histograms(group: np.ndarray, bins: np.ndarray, counts: np.ndarray, groups: int) -> pa.Array:
    """``groups`` maps bin → summed count from (group, bin, count) triples; null where a group
    has none (as the SQL rollup's LEFT JOIN)."""
    code = group.astype(np.int64) * BIN_SPAN + bins
    encoded = pc.dictionary_encode(pa.array(code, pa.int64()))     # hashing, then a small sort
    values = np.asarray(encoded.dictionary)
    summed = np.bincount(np.asarray(encoded.indices), weights=counts, minlength=len(values))
    order = np.argsort(values)
    unique, summed = values[order], summed[order].astype(np.int64)
    owner = unique // BIN_SPAN
    offsets = np.searchsorted(owner, np.arange(groups + 1)).astype(np.int32)
    empty = offsets[1:] == offsets[:-1]
    return pa.MapArray.from_arrays(
        pa.array(offsets), pa.array((unique % BIN_SPAN).astype(np.int32)), pa.array(summed),
        type=pa.map_(pa.int32(), pa.int64()), mask=pa.array(empty) if empty.any() else None)


def for_batch(batch: Any, key_index: np.ndarray | None = None) -> Any:
    """``batch`` with its rollup table attached, when its cache counts came typed (else the
    writer computes them: it alone can read the JSON column through DuckDB). ``key_index``:
    see :func:`tables` (one number per span)."""
    if batch.cache_counts is None or batch.rollup is not None:
        return batch
    mask = pc.equal(batch.spans["name"], "rtx.kernel")
    kernel = kernels(batch.spans)
    hits, misses = (c.filter(mask) for c in batch.cache_counts)
    index = None if key_index is None else key_index[np.asarray(mask)]
    return dataclasses.replace(batch, rollup=tables(kernel, hits, misses, index))


_SUMS = {"samples": "sum", "calls": "sum", "total_ns": "sum", "min_ns": "min", "max_ns": "max",
         "first_ns": "min", "last_ns": "max", "cache_hits": "sum", "cache_misses": "sum"}


def merge(parts: list[pa.Table]) -> pa.Table:
    """One rollup table from several batches' (the same rows as aggregating them at once)."""
    return parts[0] if len(parts) == 1 else _combine(pa.concat_tables(parts))


def _combine(rows: pa.Table) -> pa.Table:
    """``rows`` with those of the same key and minute made one."""
    group, first = narrow.distinct_rows(rows, GROUP)
    sums = rows.select(list(_SUMS)).append_column("g", pa.array(group))
    totals = _grouped(sums, list(_SUMS.items()))
    totals = totals.take(pa.array(np.argsort(np.asarray(totals["g"]), kind="stable")))
    maps = rows["mean_hist"].combine_chunks()
    offsets = np.asarray(maps.offsets)               # null maps are empty (see _histograms)
    lo, hi = int(offsets[0]), int(offsets[-1])
    hist = _histograms(np.repeat(group, np.diff(offsets)), np.asarray(maps.keys)[lo:hi],
                       np.asarray(maps.items)[lo:hi], len(first))
    out = rows.select(GROUP).take(pa.array(first))
    for column, how in _SUMS.items():
        out = out.append_column(column, totals[f"{column}_{how}"])
    return out.append_column("mean_hist", hist)
