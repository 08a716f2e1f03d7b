"""Stored spans read out for export (``rtxops telemetry export``), in bounded memory.

A store's DuckDB connection has a small memory limit (``RTXOPS_STORE_MEMORY``, 96 MB): sorting a
whole store at once ran out of it past ~1 M spans (every export of a job longer than ~20 minutes
failed). So the spans are read in slices of start time, each sorted on its own and all in one
transaction (one snapshot of the store, however long the reader takes); a slice's span events
are read with it. Works on a :class:`~.store.Store` and a :class:`~.store.ReadOnlyStore`.
"""
from __future__ import annotations

import os
from typing import Any, Iterator

EXPORT_FETCH_ROWS = 10_000   # rows held at once while exporting
# what one slice's sort holds: it must fit the store's memory limit (96 MB by default), with the
# spans' (and their resources') attributes, which any OTLP client may make kilobytes long
EXPORT_SLICE_ROWS = 100_000
EXPORT_SLICE_SHARE = 6       # a slice's bytes: at most the memory limit over this
_ROW_BYTES = 256             # a row's columns besides its attributes, about
_BINS = 1024                 # a slicing histogram's bins

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
        for lo, hi in _slices(cur, job_id, events):
            params = {"job": job_id, "lo": lo, "hi": hi}
            by_span: dict[tuple, list] = {}
            if events:   # (a slice's events are within its budget too)
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
                try:
                    if writer is None:
                        writer = pq.ParquetWriter(str(path), reader.schema)
                    for batch in reader:
                        writer.write_batch(batch)
                        rows += batch.num_rows
                finally:   # an open reader fails the snapshot's ROLLBACK, hiding the real error
                    reader.close()
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
        try:
            self.cur.execute("ROLLBACK")   # nothing was written
        except Exception:
            if exc[0] is None:
                raise
            # leaving on an error already (a full disk, Ctrl-C): that one is what to report


def _slices(cur, job_id: str | None, events: bool = False) -> list[tuple[int | None, int | None]]:
    """Start-time ranges ``[lo, hi)`` covering the matching spans, each of at most
    :data:`EXPORT_SLICE_ROWS` rows and a sixth of the connection's memory limit in bytes (with
    ``events``, their span events' too) where spans starting at different times allow it,
    oldest first, the last one open (``hi`` None); then ``(None, None)`` for spans without a
    start time if any."""
    budget = _memory_limit_bytes(cur) // EXPORT_SLICE_SHARE
    lo, hi, unset = cur.execute(
        f"SELECT min(start_ns), max(start_ns), count(*) - count(start_ns) "
        f"FROM spans s WHERE {_MATCHING}", {"job": job_id}).fetchall()[0]
    out: list[tuple[int | None, int | None]] = []
    if lo is not None:
        starts = _slice_starts(cur, job_id, lo, hi, budget, events)
        out = list(zip(starts, [*starts[1:], None]))
    if unset:
        out.append((None, None))
    return out


_HISTOGRAM = f"""
    SELECT (s.start_ns - $a) // $width AS bin, count(*),
           sum(coalesce(length(s.attributes), 0) + coalesce(length(r.attributes), 0) + {_ROW_BYTES})
    FROM spans s LEFT JOIN resources r USING (resource_id)
    WHERE {_MATCHING} AND s.start_ns >= $a AND s.start_ns <= $b
    GROUP BY bin ORDER BY bin"""
# span events by their own time, in the bins of their spans' start (near enough: an event
# falls in its span, which starts no later), any job's: a slice is cut smaller, never larger.
# Held in Python as dicts, an event takes some times its bytes in the store
_EVENT_HISTOGRAM = f"""
    SELECT (time_ns - $a) // $width AS bin,
           sum(coalesce(length(attributes), 0) + coalesce(length(name), 0) + {_ROW_BYTES}) * 4
    FROM span_events WHERE time_ns >= $a AND time_ns <= $b GROUP BY bin"""


def _slice_starts(cur, job_id: str | None, a: int, b: int, budget: int,
                  events: bool = False) -> list[int]:
    """Where slices of ``[a, b]`` start (the first at ``a``): the bins of a histogram of start
    times taken in order while they fit the budgets; a bin over budget is cut up the same way."""
    width = -(-(b - a + 1) // _BINS)
    params = {"job": job_id, "a": a, "b": b, "width": width}
    event_bytes = dict(cur.execute(_EVENT_HISTOGRAM, {"a": a, "b": b, "width": width}).fetchall()
                       ) if events else {}
    starts, rows, size = [a], 0, 0
    for k, n, nbytes in cur.execute(_HISTOGRAM, params).fetchall():
        nbytes += event_bytes.get(k, 0)
        start = a + k * width
        if rows and (rows + n > EXPORT_SLICE_ROWS or size + nbytes > budget):
            starts.append(start)
            rows = size = 0
        if (n > EXPORT_SLICE_ROWS or nbytes > budget) and width > 1:
            if starts[-1] != start:
                starts.append(start)
            starts += _slice_starts(cur, job_id, start, min(start + width - 1, b), budget, events)[1:]
            rows, size = EXPORT_SLICE_ROWS, budget   # the next bin starts a slice
        else:
            rows, size = rows + n, size + nbytes
    return starts


_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def _memory_limit_bytes(cur) -> int:
    """The connection's DuckDB memory limit (shown as ``91.5 MiB``)."""
    shown = cur.execute("SELECT current_setting('memory_limit')").fetchone()[0]
    number, _, unit = str(shown).partition(" ")
    try:
        return int(float(number) * _UNITS[unit])
    except (ValueError, KeyError):
        return 96 << 20   # (a form this DuckDB does not show: the store's default)
