"""Stored spans read out for export (``rtxops telemetry export``), in bounded memory.

A store's DuckDB connection has a small memory limit (``RTXOPS_STORE_MEMORY``, 96 MB): sorting a
whole store at once ran out of it past ~1 M spans (every export of a job longer than ~20 minutes
failed). So the spans are read in slices of start time, each sorted on its own and all in one
transaction (one snapshot of the store, however long the reader takes); a slice's span events
are read with it. Works on a :class:`~.store.Store` and a :class:`~.store.ReadOnlyStore`.
"""
from __future__ import annotations

import math
import os
from typing import Any, Iterator

EXPORT_FETCH_ROWS = 10_000   # rows held at once while exporting
EXPORT_SLICE_ROWS = 100_000  # rows sorted at once: their sort fits the store's memory limit

_MATCHING = "($job IS NULL OR s.job_id = $job)"
# a slice [$lo, $hi): $hi NULL is no end; $lo NULL is the spans without a start time
_IN_SLICE = ("(($lo IS NULL AND s.start_ns IS NULL) OR "
             "(s.start_ns >= $lo AND ($hi IS NULL OR s.start_ns < $hi)))")
_ROWS = f"""
    SELECT s.*, r.attributes AS resource_attributes, r.service_name AS resource_service_name,
           r.host_name AS resource_host_name, r.job_id AS resource_job_id, r.rank AS resource_rank,
           r.process_pid AS resource_process_pid, r.schema_url AS resource_schema_url
    FROM spans s LEFT JOIN resources r USING (resource_id)
    WHERE {_MATCHING} AND {_IN_SLICE}
    ORDER BY {{order}}"""
_EVENTS = f"""
    SELECT e.trace_id, e.span_id, e.time_ns, e.name, e.attributes FROM span_events e
    SEMI JOIN (SELECT s.trace_id, s.span_id FROM spans s WHERE {_MATCHING} AND {_IN_SLICE}) m
        ON e.trace_id = m.trace_id AND e.span_id = m.span_id
    ORDER BY e.time_ns"""
# an unnamed scope is exported as "rtxops" (export.otlp_json_chunks): it sorts under that name
_ORDER = {"time": "s.start_ns",
          "resource": "s.resource_id, coalesce(s.scope_name, 'rtxops'), s.start_ns"}


def iter_export_rows(q, job_id: str | None = None, order: str = "time",
                     events: bool = False) -> Iterator[dict]:
    """Spans (with their resource's attributes) for export, a few thousand at a time: oldest
    first (``order="time"``), or per slice of start time grouped by resource and scope, oldest
    first in each (``"resource"``: a resource recurs once per slice); with ``events``, each
    with ``span_events``, its events by time (None without)."""
    with q.reader() as cur, _snapshot(cur):
        for lo, hi in _slices(cur, job_id):
            params = {"job": job_id, "lo": lo, "hi": hi}
            by_span: dict[tuple, list] = {}
            if events:
                for trace_id, span_id, time_ns, name, attributes in cur.execute(_EVENTS, params).fetchall():
                    by_span.setdefault((trace_id, span_id), []).append(
                        {"time_ns": time_ns, "name": name, "attributes": attributes})
            result = cur.execute(_ROWS.format(order=_ORDER[order]), params)
            names = [d[0] for d in result.description]
            while rows := result.fetchmany(EXPORT_FETCH_ROWS):
                for values in rows:
                    row = dict(zip(names, values))
                    if events:
                        row["span_events"] = by_span.get((row["trace_id"], row["span_id"]))
                    yield row


def export_parquet(q, path: str | os.PathLike[str], job_id: str | None = None) -> int:
    """Write the spans (and resource attributes) to a Parquet file, oldest first, a batch of
    rows at a time; returns the row count."""
    import pyarrow.parquet as pq

    rows = 0
    writer = None
    with q.reader() as cur, _snapshot(cur):
        try:
            for lo, hi in _slices(cur, job_id) or [(None, None)]:   # an empty file has the schema
                reader = cur.sql(_ROWS.format(order=_ORDER["time"]),
                                 params={"job": job_id, "lo": lo, "hi": hi}
                                 ).to_arrow_reader(EXPORT_FETCH_ROWS)
                if writer is None:
                    writer = pq.ParquetWriter(str(path), reader.schema)
                for batch in reader:
                    writer.write_batch(batch)
                    rows += batch.num_rows
        finally:
            if writer is not None:
                writer.close()
    return rows


class _snapshot:
    """A read transaction around the slices' queries: they see one state of the store."""

    def __init__(self, cur) -> None:
        self.cur = cur

    def __enter__(self) -> None:
        self.cur.execute("BEGIN TRANSACTION")

    def __exit__(self, *exc: Any) -> None:
        self.cur.execute("ROLLBACK")   # nothing was written


def _slices(cur, job_id: str | None) -> list[tuple[int | None, int | None]]:
    """Start-time ranges ``[lo, hi)`` covering the matching spans, about
    :data:`EXPORT_SLICE_ROWS` each (cut at approximate quantiles), oldest first, the last one
    open (``hi`` None); then ``(None, None)`` for spans without a start time if any."""
    n, lo, hi, unset = cur.execute(
        f"SELECT count(*), min(start_ns), max(start_ns), count(*) - count(start_ns) "
        f"FROM spans s WHERE {_MATCHING}", {"job": job_id}).fetchall()[0]
    out: list[tuple[int | None, int | None]] = []
    if lo is not None:
        pieces = math.ceil((n - unset) / EXPORT_SLICE_ROWS)
        cuts: list[int] = []
        if pieces > 1:
            at = ", ".join(f"{i / pieces:.6f}" for i in range(1, pieces))
            (cuts,) = cur.execute(
                f"SELECT approx_quantile(start_ns, [{at}]) FROM spans s WHERE {_MATCHING}",
                {"job": job_id}).fetchall()[0]
        bounds = sorted({lo, *(int(c) for c in cuts if lo < c <= hi)})
        out = list(zip(bounds, [*bounds[1:], None]))
    if unset:
        out.append((None, None))
    return out
