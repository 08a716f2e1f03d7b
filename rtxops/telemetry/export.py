"""Export stored spans for other tools: Chrome trace (Perfetto, chrome://tracing), OTLP/JSON (any
OpenTelemetry tool), Parquet (pandas, DuckDB, Spark). Rows come from ``Store.export_rows``."""
from __future__ import annotations

import json
from typing import Any, Iterable

from . import schema as S

# store column -> attribute name, for the typed columns rebuilt into OTLP attributes
_TYPED_COLUMNS = {
    "step": S.STEP_NUMBER, "plan_version": S.PLAN_VERSION, "op": S.OP, "variant": S.VARIANT,
    "config": S.CONFIG, "bucket": S.BUCKET, "site": S.SITE, "phase": S.PHASE, "count": S.COUNT,
    "total_ns": S.TOTAL_NS, "min_ns": S.MIN_NS, "max_ns": S.MAX_NS,
}
_LANES = {S.STEP: 0, S.SWAP: 0, S.COMPILE: 1, S.KERNEL: 2, S.CALL: 3, S.TRIAL: 4}


def span_attributes(row: dict) -> dict[str, Any]:
    """A stored span's attributes: typed columns and the JSON column, merged."""
    attrs = json.loads(row.get("attributes") or "{}")
    for column, name in _TYPED_COLUMNS.items():
        if row.get(column) is not None:
            attrs[name] = row[column]
    return attrs


def chrome_trace(rows: Iterable[dict]) -> dict:
    """Chrome trace-event JSON: one process per (job, rank), lanes for steps, compiles, kernels,
    calls and trials. Times in microseconds, as the format wants, from the first span's start
    (``otherData.origin_unix_ns``): Unix times in µs are ~1.8e15, where a double keeps only
    0.25 µs, and back-to-back steps would overlap (Perfetto drops overlapping slices)."""
    rows = list(rows)
    origin = min((row["start_ns"] for row in rows), default=0)
    events: list[dict] = []
    processes: dict[tuple, int] = {}
    for row in rows:
        proc = (row.get("job_id") or "?", row.get("rank") or 0)
        pid = processes.get(proc)
        if pid is None:
            pid = processes[proc] = len(processes) + 1
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                           "args": {"name": f"job {proc[0]} rank {proc[1]}"}})
        attrs = span_attributes(row)
        label = row["name"]
        if attrs.get(S.OP):
            label = f"{attrs[S.OP]}/{attrs.get(S.VARIANT, '?')} {attrs.get(S.PHASE, '')}".strip()
        elif row["name"] == S.STEP:
            label = f"step {attrs.get(S.STEP_NUMBER)}"
        events.append({
            "ph": "X", "name": label, "cat": row["name"], "pid": pid,
            "tid": _LANES.get(row["name"], 5),
            "ts": (row["start_ns"] - origin) / 1000,
            "dur": max(0, row["end_ns"] - row["start_ns"]) / 1000,
            "args": attrs,
        })
    for (job, rank), pid in processes.items():
        for name, tid in (("steps", 0), ("compile", 1), ("kernels (per step)", 2),
                          ("sampled calls", 3), ("trials", 4)):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": name}})
    return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": {"origin_unix_ns": origin}}


def otlp_json(rows: Iterable[dict], events: Iterable[dict] = ()) -> dict:
    """An OTLP/JSON ``ExportTraceServiceRequest`` (hex ids, int64 as strings), grouped by resource
    and scope; the resource's typed attributes (service.name, host.name, job, rank, pid) are put
    back beside its others, and each span gets its ``events`` (rows of the span_events table)."""
    by_span: dict[tuple, list] = {}
    for e in events:
        by_span.setdefault((e["trace_id"], e["span_id"]), []).append(
            {"timeUnixNano": str(e["time_ns"]), "name": e["name"],
             "attributes": _kv(json.loads(e.get("attributes") or "{}"))})
    by_resource: dict[int, dict] = {}
    scopes: dict[tuple, dict] = {}
    for row in rows:
        group = by_resource.get(row["resource_id"])
        if group is None:
            group = by_resource[row["resource_id"]] = {
                "resource": {"attributes": _kv(resource_attributes(row))}, "scopeSpans": []}
            if row.get("resource_schema_url"):
                group["schemaUrl"] = row["resource_schema_url"]
        scope_key = (row["resource_id"], row.get("scope_name") or "rtxops")
        scope = scopes.get(scope_key)
        if scope is None:
            scope = scopes[scope_key] = {"scope": {"name": scope_key[1]}, "spans": []}
            group["scopeSpans"].append(scope)
        span = {
            "traceId": row["trace_id"], "spanId": row["span_id"], "name": row["name"],
            "kind": row["kind"] if row.get("kind") is not None else 1,
            "startTimeUnixNano": str(row["start_ns"]), "endTimeUnixNano": str(row["end_ns"]),
            "attributes": _kv(span_attributes(row)),
            "status": {"code": row.get("status_code") or 0,
                       **({"message": row["status_message"]} if row.get("status_message") else {})},
        }
        if row.get("parent_span_id"):
            span["parentSpanId"] = row["parent_span_id"]
        if (row["trace_id"], row["span_id"]) in by_span:
            span["events"] = by_span[(row["trace_id"], row["span_id"])]
        scope["spans"].append(span)
    return {"resourceSpans": list(by_resource.values())}


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
    return {"stringValue": "" if v is None else str(v)}
