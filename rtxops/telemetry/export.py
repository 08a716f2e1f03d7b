"""Export stored spans for other tools: Chrome trace (Perfetto, chrome://tracing), OTLP/JSON (any
OpenTelemetry tool), Parquet (pandas, DuckDB, Spark). Rows come from ``store_export.iter_export_rows``.

The JSON documents are made piece by piece (:class:`JsonExport`): a long job's millions of spans
are written out in bounded memory, never held as one document."""
from __future__ import annotations

import json
from typing import Any, Iterable, Iterator

from . import schema as S

# store column -> attribute name, for the typed columns rebuilt into OTLP attributes
_TYPED_COLUMNS = {
    "step": S.STEP_NUMBER, "plan_version": S.PLAN_VERSION, "op": S.OP, "variant": S.VARIANT,
    "config": S.CONFIG, "bucket": S.BUCKET, "site": S.SITE, "phase": S.PHASE, "count": S.COUNT,
    "total_ns": S.TOTAL_NS, "min_ns": S.MIN_NS, "max_ns": S.MAX_NS,
}
_LANES = {S.STEP: 0, S.SWAP: 0, S.COMPILE: 1, S.CALL: 3, S.TRIAL: 4}
_OTHER_LANE = 5
_LANE_NAMES = {0: "steps", 1: "compile", 3: "sampled calls", 4: "trials", _OTHER_LANE: "other spans"}
_FIRST_KERNEL_LANE = 10   # then one lane per kernel
_FIRST_EXTRA_LANE = 1 << 20   # lanes for spans that overlap others of their kind in part


class _Lanes:
    """Which lane a span of a kind goes on, so that slices on a lane nest or follow each other:
    Perfetto drops a slice that overlaps another on its lane in part (an OTLP client's concurrent
    requests, say). Spans come oldest first."""

    def __init__(self) -> None:
        self._open: dict[tuple, list[int]] = {}      # (pid, lane) -> ends of the slices open on it
        self._extra: dict[tuple, list[int]] = {}     # (pid, base lane) -> its extra lanes
        self._next = _FIRST_EXTRA_LANE

    def place(self, pid: int, base: int, start: int, end: int) -> tuple[int, bool]:
        """The lane for a span of ``base``'s kind in process ``pid``; True when it is a new lane."""
        extra = self._extra.setdefault((pid, base), [])
        for lane in (base, *extra):
            stack = self._open.setdefault((pid, lane), [])
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or stack[-1] >= end:
                stack.append(end)
                return lane, False
        lane, self._next = self._next, self._next + 1
        extra.append(lane)
        self._open[(pid, lane)] = [end]
        return lane, True


def span_attributes(row: dict) -> dict[str, Any]:
    """A stored span's attributes: typed columns and the JSON column, merged."""
    attrs = json.loads(row.get("attributes") or "{}")
    for column, name in _TYPED_COLUMNS.items():
        if row.get(column) is not None:
            attrs[name] = row[column]
    return attrs


_CHUNK_ITEMS = 2000  # JSON items joined into one piece of the document
_CHUNK_CHARS = 1 << 20   # or fewer, where they are long (spans with many events)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def chrome_trace_chunks(rows: Iterable[dict], origin: int | None = None) -> Iterator[str]:
    """Chrome trace-event JSON, in pieces: one process per (job, rank), lanes for steps, compiles,
    calls and trials, and one lane per kernel (op, variant, phase, bucket, site, config): a step's kernel spans
    overlap one another (each spans its first call to its last), and slices on one lane must nest. Times in microseconds, as the format wants, from ``origin``
    (default: the first row's start, for rows oldest first; ``otherData.origin_unix_ns``): Unix
    times in µs are ~1.8e15, where a double keeps only 0.25 µs, and back-to-back steps would
    overlap (Perfetto drops overlapping slices)."""
    yield '{"traceEvents":['
    processes: dict[tuple, int] = {}
    kernel_lanes: dict[tuple, int] = {}   # (pid, kernel) -> tid
    lanes = _Lanes()
    chars = 0
    items: list[str] = []
    first = True
    for row in rows:
        if origin is None and row["start_ns"]:   # a span sent without a start time is not one
            origin = row["start_ns"]
        # a job's rank is a process; spans of no job (any OTLP client), their resource's: all
        # in one process, two services' steps overlapped on one lane (Perfetto drops those)
        proc = ((row["job_id"], row.get("rank") or 0) if row.get("job_id")
                else (None, row.get("resource_id")))
        pid = processes.get(proc)
        if pid is None:
            pid = processes[proc] = len(processes) + 1
            name = (f"job {proc[0]} rank {proc[1]}" if proc[0] is not None else
                    f"{row.get('resource_service_name') or 'unknown service'} "
                    f"pid {row.get('resource_process_pid') or '?'}")
            items.append(_dumps({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                                 "args": {"name": name}}))
        attrs = span_attributes(row)
        label = row["name"]
        if attrs.get(S.OP):
            label = f"{attrs[S.OP]}/{attrs.get(S.VARIANT, '?')} {attrs.get(S.PHASE, '')}".strip()
        elif row["name"] == S.STEP:
            label = f"step {attrs.get(S.STEP_NUMBER)}"
        tid = _LANES.get(row["name"], _OTHER_LANE)
        if row["name"] != S.KERNEL:
            base, start = tid, row["start_ns"] or 0
            tid, new = lanes.place(pid, base, start, max(row["end_ns"] or 0, start))
            if new:
                items.append(_dumps({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                                     "args": {"name": f"{_LANE_NAMES[base]} (overlapping)"}}))
        else:
            # one lane per kernel span's own key: the slot (site, variant, config, bucket) and
            # phase; two sites of one op, variant and bucket overlap in part like two ops
            config = _hashable(attrs.get(S.CONFIG))
            lane = (pid, label, _hashable(attrs.get(S.BUCKET)), _hashable(attrs.get(S.SITE)),
                    None if config in (None, "{}") else config)
            tid = kernel_lanes.get(lane)
            if tid is None:
                tid = kernel_lanes[lane] = _FIRST_KERNEL_LANE + len(kernel_lanes)
                name = " ".join(str(x) for x in (f"kernel {label}", *lane[2:]) if x)
                items.append(_dumps({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                                     "args": {"name": name}}))
        items.append(_dumps({
            "ph": "X", "name": label, "cat": row["name"], "pid": pid,
            "tid": tid,
            # a row without times (written by hand, or by an old version): at the origin
            "ts": ((row["start_ns"] if row["start_ns"] is not None else origin or 0) - (origin or 0)) / 1000,
            "dur": max(0, (row["end_ns"] or 0) - (row["start_ns"] or 0)) / 1000
                   if row["start_ns"] is not None and row["end_ns"] is not None else 0,
            "args": attrs,
        }))
        chars += len(items[-1])
        if len(items) >= _CHUNK_ITEMS or chars >= _CHUNK_CHARS:
            yield ("" if first else ",") + ",".join(items)
            first, items, chars = False, [], 0
    for pid in processes.values():
        for tid, name in _LANE_NAMES.items():
            items.append(_dumps({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                                 "args": {"name": name}}))
    if items:
        yield ("" if first else ",") + ",".join(items)
    yield '],"displayTimeUnit":"ns","otherData":' + _dumps({"origin_unix_ns": origin or 0}) + "}"


def otlp_json_chunks(rows: Iterable[dict]) -> Iterator[str]:
    """An OTLP/JSON ``ExportTraceServiceRequest`` (hex ids, int64 as strings), in pieces. ``rows``
    come grouped by resource and scope (``iter_export_rows(order="resource", events=True)``: a
    group per slice of time, and OTLP lets a resource or scope recur); the resource's typed attributes
    (service.name, host.name, job, rank, pid) are put back beside its others, and each span gets
    its events (a row's ``span_events``)."""
    yield '{"resourceSpans":['
    none = object()  # before the first row (a row's resource id may be None)
    resource, scope = none, None
    parts: list[str] = []
    chars = 0
    for row in rows:
        key = (row["resource_id"], row.get("scope_name") or "rtxops")
        if key[0] != resource:  # (the first row's too: nothing equals ``none``)
            if resource is not none:
                parts.append("]}]},")                   # its spans, scope, scopes, resource
            group = {"resource": {"attributes": _kv(resource_attributes(row))}}
            if row.get("resource_schema_url"):
                group["schemaUrl"] = row["resource_schema_url"]
            parts.append(_dumps(group)[:-1] + ',"scopeSpans":[')
            resource, scope = key[0], None
        if key != scope:   # (a scope may recur in a resource, as a resource may in the request)
            if scope is not None:
                parts.append("]},")
            parts.append('{"scope":' + _dumps({"name": key[1]}) + ',"spans":[')
            scope = key
        else:
            parts.append(",")
        span = {
            "traceId": row["trace_id"], "spanId": row["span_id"], "name": row["name"],
            "kind": row["kind"] if row.get("kind") is not None else 1,
            "startTimeUnixNano": str(row["start_ns"] or 0),
            "endTimeUnixNano": str(row["end_ns"] or row["start_ns"] or 0),
            "attributes": _kv(span_attributes(row)),
            "status": {"code": row.get("status_code") or 0,
                       **({"message": row["status_message"]} if row.get("status_message") else {})},
        }
        if row.get("parent_span_id"):
            span["parentSpanId"] = row["parent_span_id"]
        if row.get("span_events"):
            span["events"] = [{"timeUnixNano": str(e["time_ns"]), "name": e["name"],
                               "attributes": _kv(json.loads(e["attributes"] or "{}"))}
                              for e in row["span_events"]]
        parts.append(_dumps(span))
        chars += len(parts[-1])
        if len(parts) >= _CHUNK_ITEMS or chars >= _CHUNK_CHARS:
            yield "".join(parts)
            parts, chars = [], 0
    if resource is not none:
        parts.append("]}]}")
    yield "".join(parts) + "]}"


def chrome_trace(rows: Iterable[dict]) -> dict:
    """:func:`chrome_trace_chunks` of ``rows`` as one document (small exports, tests)."""
    rows = list(rows)
    origin = min((row["start_ns"] for row in rows), default=0)
    return json.loads("".join(chrome_trace_chunks(rows, origin)))


class JsonExport:
    """The stored spans of one job (or all) as a Chrome trace or OTLP/JSON document: iterate it
    for the document's pieces (str), read from the store as they are written; ``spans`` counts
    the spans written so far."""

    FORMATS = ("chrome-trace", "otlp-json")

    def __init__(self, q, format: str, job_id: str | None = None) -> None:
        if format not in self.FORMATS:
            raise ValueError(f"unknown JSON export format {format!r} ({', '.join(self.FORMATS)})")
        self.q, self.format, self.job_id = q, format, job_id
        self.spans = 0

    def _counted(self, rows: Iterable[dict]) -> Iterator[dict]:
        for row in rows:
            self.spans += 1
            yield row

    def __iter__(self) -> Iterator[str]:
        from . import store_export

        if self.format == "chrome-trace":  # oldest first: the first row is the origin
            return chrome_trace_chunks(self._counted(store_export.iter_export_rows(self.q, self.job_id)))
        rows = self._counted(store_export.iter_export_rows(self.q, self.job_id, order="resource",
                                                           events=True))
        return otlp_json_chunks(rows)


_TYPED_RESOURCE_COLUMNS = {"resource_service_name": S.SERVICE_NAME, "resource_host_name": S.HOST_NAME,
                           "resource_job_id": S.JOB_ID, "resource_rank": S.RANK,
                           "resource_process_pid": S.PROCESS_PID}


def resource_attributes(row: dict) -> dict:
    """A span's resource attributes: its typed columns and the JSON column, merged."""
    attrs = json.loads(row.get("resource_attributes") or "{}")
    for column, name in _TYPED_RESOURCE_COLUMNS.items():
        if row.get(column) is not None:
            attrs[name] = row[column]
    return attrs


def _kv(attrs: dict) -> list[dict]:
    return [{"key": k, "value": _any_value(v)} for k, v in attrs.items()]


def _any_value(v: Any) -> dict:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [_any_value(x) for x in v]}}
    if isinstance(v, dict):
        return {"kvlistValue": {"values": _kv(v)}}
    if v is None:   # an unset AnyValue (it came without a value)
        return {}
    return {"stringValue": str(v)}


def _hashable(value: Any) -> Any:
    """An attribute as a lane key: another OTLP client may send a list or map where rtxops
    sends a string (kept in the attributes, as sent)."""
    return _dumps(value) if isinstance(value, (list, dict)) else value
