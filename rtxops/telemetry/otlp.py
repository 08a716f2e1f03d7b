"""OTLP trace requests → Arrow tables for the store. Pure conversion: no I/O, no threads.

Two entry points do the work: :func:`decode_request` (OTLP protobuf or OTLP/JSON bytes → an
``ExportTraceServiceRequest``, validated) and :func:`to_arrow` (request → :class:`Batch`).
:func:`convert` chains them for the receiver; :func:`encode_readable_spans` lets an in-process
exporter take the same path as the HTTP one.

Speed: attribute values are read through a second, wire-compatible view of the request in which
all ``KeyValue``s of a scope merge into two flat lists (keys and raw ``AnyValue`` bytes), so the
per-attribute work is a dict lookup in a cache of decoded values instead of building a protobuf
wrapper object per attribute.
"""
from __future__ import annotations

import base64
import hashlib
import itertools
import json
import operator
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

from . import _columns, _wire
from . import schema as S

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
MAX_ATTRIBUTES = 1024      # per span, event or resource
MAX_EVENTS = 1024          # per span
# per request: an empty event is 2 bytes on the wire and a row of the store, so a small gzipped
# body could otherwise make tens of millions of rows (an SDK sends at most 512 spans × 128 events)
MAX_REQUEST_EVENTS = 1 << 18
MAX_JOB_ID = 1024   # characters, as the dashboard and the API take in a job id


class TelemetryError(Exception):
    """Base class of every error the telemetry package raises on purpose."""


class TelemetryInputError(TelemetryError, ValueError):
    """A request body is not a valid OTLP trace export; the message says what is wrong and where."""


# ---- the tables ------------------------------------------------------------------------------

_ARROW = {"BIGINT": pa.int64(), "INTEGER": pa.int32(), "VARCHAR": pa.string(),
          "DOUBLE": pa.float64(), "BOOLEAN": pa.bool_()}


def column_name(attribute: str) -> str:
    """Store column of a typed attribute: ``rtx.plan.version`` → ``plan_version``."""
    return attribute.removeprefix("rtx.").replace(".", "_")


SPAN_ATTRIBUTE_COLUMNS = {k: column_name(k) for k in S.TYPED_SPAN_ATTRIBUTES}
RESOURCE_ATTRIBUTE_COLUMNS = {k: column_name(k) for k in S.TYPED_RESOURCE_ATTRIBUTES}
SPAN_RESOURCE_COPIES = (S.JOB_ID, S.RANK)   # typed resource columns repeated on every span

RESOURCES_SCHEMA = pa.schema(
    [("resource_id", pa.int64())]
    + [(c, _ARROW[S.TYPED_RESOURCE_ATTRIBUTES[k]]) for k, c in RESOURCE_ATTRIBUTE_COLUMNS.items()]
    + [("attributes", pa.string()), ("schema_url", pa.string()), ("first_seen_ns", pa.int64())])

SPANS_SCHEMA = pa.schema(
    [("trace_id", pa.string()), ("span_id", pa.string()), ("parent_span_id", pa.string()),
     ("name", pa.string()), ("kind", pa.int32()), ("start_ns", pa.int64()), ("end_ns", pa.int64()),
     ("duration_ns", pa.int64()), ("status_code", pa.int32()), ("status_message", pa.string()),
     ("resource_id", pa.int64()), ("scope_name", pa.string())]
    + [(RESOURCE_ATTRIBUTE_COLUMNS[k], _ARROW[S.TYPED_RESOURCE_ATTRIBUTES[k]]) for k in SPAN_RESOURCE_COPIES]
    + [(c, _ARROW[S.TYPED_SPAN_ATTRIBUTES[k]]) for k, c in SPAN_ATTRIBUTE_COLUMNS.items()]
    + [("attributes", pa.string())])

EVENTS_SCHEMA = pa.schema(
    [("trace_id", pa.string()), ("span_id", pa.string()), ("time_ns", pa.int64()),
     ("name", pa.string()), ("attributes", pa.string())])


@dataclass(frozen=True)
class Batch:
    """One request's rows, ready for the store: ``attributes`` columns hold JSON objects."""

    resources: pa.Table
    spans: pa.Table
    events: pa.Table
    span_count: int
    received_ns: int = 0
    # rtx.cache.hits / rtx.cache.misses of every span as int64 columns (null: absent), when the
    # decoder saw them as integers; spares the store's rollup a JSON parse per span
    cache_counts: tuple[pa.Array, pa.Array] | None = None
    rollup: pa.Table | None = None                      # this batch's kernel_minutes rows
    narrow: tuple[pa.Table, pa.Table] | None = None     # its span_rows and span_keys (narrow.py)
    # a hash of the request body: a client's retry of a request already committed (its answer
    # was lost or late) is acknowledged and not stored again (see Store)
    digest: bytes | None = None

    @classmethod
    def empty(cls, received_ns: int = 0) -> Batch:
        return cls(RESOURCES_SCHEMA.empty_table(), SPANS_SCHEMA.empty_table(),
                   EVENTS_SCHEMA.empty_table(), 0, received_ns)


# ---- decoding --------------------------------------------------------------------------------

def media_type(content_type: str | None) -> str:
    """``application/json; charset=utf-8`` → ``application/json``."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def decode_request(body: bytes, content_type: str) -> ExportTraceServiceRequest:
    """Parse and validate an OTLP/HTTP trace export body (protobuf or OTLP/JSON)."""
    kind = media_type(content_type)
    if kind == PROTOBUF:
        request = _parse_protobuf(ExportTraceServiceRequest, body)
    elif kind == JSON:
        request = _parse_json(body)
    else:
        raise TelemetryInputError(f"unsupported content type {content_type!r}: "
                                  f"send {PROTOBUF} or {JSON}")
    _validate(request)
    return request


def convert(body: bytes, content_type: str, received_ns: int) -> Batch:
    """:func:`decode_request` then :func:`to_arrow`; the protobuf path skips building the full
    request (attribute values are checked while they are converted)."""
    if media_type(content_type) == PROTOBUF:
        if _columns.available():
            _check_events(_columns.count_rows(body)[1])   # before either decoder allocates them
            batch = _columns.convert(body, received_ns)
            if batch is not None:
                return _check_job_ids(batch)
        return _check_job_ids(to_arrow(_parse_protobuf(_wire.LightRequest, body), received_ns,
                                       wire=body))
    return _check_job_ids(to_arrow(decode_request(body, content_type), received_ns))


_DOTS = pa.array([".", ".."])


def _check_job_ids(batch: Batch) -> Batch:
    """Refuse job ids no page or API route could open: longer than :data:`MAX_JOB_ID`
    characters, or ``.`` and ``..`` (a browser reads them as the path's own dot segments)."""
    for table in (batch.resources, batch.spans):
        if table.num_rows and "job_id" in table.column_names:
            ids = table["job_id"]
            longest = pc.max(pc.utf8_length(ids)).as_py()
            if longest is not None and longest > MAX_JOB_ID:
                raise TelemetryInputError(f"a {S.JOB_ID} of {longest} characters; the limit is "
                                          f"{MAX_JOB_ID}")
            dots = longest is not None and longest <= 2 and pc.any(pc.is_in(ids, _DOTS)).as_py()
            if dots:
                raise TelemetryInputError(f"{S.JOB_ID} '.' or '..' names no job (a path segment)")
    return batch


def _check_events(events: int) -> None:
    if events > MAX_REQUEST_EVENTS:
        raise TelemetryInputError(f"the request holds {events} span events; the limit is "
                                  f"{MAX_REQUEST_EVENTS} a request")


def _parse_protobuf(cls: type[Message], body: bytes) -> Message:
    try:
        return cls.FromString(body)
    except DecodeError as e:
        raise TelemetryInputError(f"body is not a valid OTLP protobuf ExportTraceServiceRequest "
                                  f"(truncated, corrupt, or a string that is not UTF-8): {e}") from None
    except RecursionError:
        raise TelemetryInputError("protobuf nesting is too deep") from None


_ID_FIELDS = ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id")


def _parse_json(body: bytes) -> ExportTraceServiceRequest:
    try:
        data = json.loads(body)
    except UnicodeDecodeError as e:
        raise TelemetryInputError(f"JSON body is not valid UTF-8: {e}") from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise TelemetryInputError(f"body is not valid JSON: {e}") from None
    except ValueError as e:   # an integer of more digits than Python converts (4300)
        raise TelemetryInputError(f"JSON body holds a number that cannot be read: {e}") from None
    if not isinstance(data, dict):
        raise TelemetryInputError("JSON body must be an object with a 'resourceSpans' array")
    for where, span in _json_spans(data):
        _hex_ids_to_base64(span, where)
        for j, link in enumerate(_json_list(span, "links", where)):
            _hex_ids_to_base64(link, f"{where}.links[{j}]")
    try:
        return json_format.ParseDict(data, ExportTraceServiceRequest(), ignore_unknown_fields=True)
    except json_format.ParseError as e:
        raise TelemetryInputError(f"JSON body is not an OTLP ExportTraceServiceRequest: {e}") from None
    except RecursionError:
        raise TelemetryInputError("JSON nesting is too deep") from None


def _json_list(obj: dict, camel: str, where: str) -> list:
    snake = "".join("_" + c.lower() if c.isupper() else c for c in camel)
    value = obj.get(camel, obj.get(snake, []))
    if value is None:
        return []
    if not isinstance(value, list):
        raise TelemetryInputError(f"{where}.{camel} must be an array")
    return value


def _json_spans(data: dict) -> Iterable[tuple[str, dict]]:
    for i, rs in enumerate(_json_list(data, "resourceSpans", "request")):
        where = f"resourceSpans[{i}]"
        if not isinstance(rs, dict):
            raise TelemetryInputError(f"{where} must be an object")
        for j, ss in enumerate(_json_list(rs, "scopeSpans", where)):
            if not isinstance(ss, dict):
                raise TelemetryInputError(f"{where}.scopeSpans[{j}] must be an object")
            for k, span in enumerate(_json_list(ss, "spans", f"{where}.scopeSpans[{j}]")):
                if not isinstance(span, dict):
                    raise TelemetryInputError(f"{where}.scopeSpans[{j}].spans[{k}] must be an object")
                yield f"{where}.scopeSpans[{j}].spans[{k}]", span


def _hex_ids_to_base64(obj: dict, where: str) -> None:
    """OTLP/JSON carries ids as hex strings; protobuf's JSON mapping expects base64."""
    if not isinstance(obj, dict):
        raise TelemetryInputError(f"{where} must be an object")
    for key in _ID_FIELDS:
        value = obj.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise TelemetryInputError(f"{where}.{key} must be a hex string")
        try:
            obj[key] = base64.b64encode(bytes.fromhex(value)).decode()
        except ValueError:
            raise TelemetryInputError(f"{where}.{key} is not hex: {value[:40]!r}") from None


def _validate(request: ExportTraceServiceRequest) -> None:
    """Checks the per-span loop of :func:`to_arrow` would otherwise have to repeat."""
    for i, rs in enumerate(request.resource_spans):
        if len(rs.resource.attributes) > MAX_ATTRIBUTES:
            raise TelemetryInputError(f"resource_spans[{i}].resource has {len(rs.resource.attributes)} "
                                      f"attributes; the limit is {MAX_ATTRIBUTES}")


# ---- conversion ------------------------------------------------------------------------------

def to_arrow(request: ExportTraceServiceRequest, received_ns: int, *, wire: bytes | None = None) -> Batch:
    """Rows for the store from a decoded request. ``wire``: the protobuf bytes ``request`` was
    parsed from, when at hand (saves serializing it again)."""
    if wire is None:
        wire = request.SerializeToString()
    view = _parse_protobuf(_wire.MergedRequest, wire)
    if len(view.resource_spans) != len(request.resource_spans):
        raise TelemetryInputError("request and its wire form disagree")
    out = _Columns()
    resources: dict[int, list] = {}
    for i, (rs, rs_view) in enumerate(zip(request.resource_spans, view.resource_spans)):
        # an unset resource is an empty one ("no resource info is known", the proto says)
        resource_id, copies = _resource(rs.resource, rs.schema_url, i, received_ns, resources)
        if len(rs_view.scope_spans) != len(rs.scope_spans):
            raise TelemetryInputError("request and its wire form disagree")
        for j, (ss, ss_view) in enumerate(zip(rs.scope_spans, rs_view.scope_spans)):
            if ss.spans:
                out.add_scope(ss, ss_view.spans, f"resource_spans[{i}].scope_spans[{j}]",
                              resource_id, copies)
    return Batch(_resource_table(resources.values()), out.spans_table(), out.events_table(),
                 out.count, received_ns)


def encode_readable_spans(spans: Sequence[Any]) -> ExportTraceServiceRequest:
    """OTLP request from OpenTelemetry SDK ``ReadableSpan``s (the OTLP exporters' own encoder)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return encode_spans(spans)


def response(rejected: int = 0, message: str = "") -> ExportTraceServiceResponse:
    """An ExportTraceServiceResponse; ``rejected`` > 0 makes it a partial success."""
    resp = ExportTraceServiceResponse()
    if rejected or message:
        resp.partial_success.rejected_spans = rejected
        resp.partial_success.error_message = message
    return resp


def _resource(resource: Any, schema_url: str, i: int, received_ns: int,
              seen: dict[int, list]) -> tuple[int, tuple]:
    attrs = _attributes_dict(resource.attributes, f"resource_spans[{i}].resource")
    # the schema URL is part of what a resource is (two of the same attributes under two
    # schemas are two rows); without one, the id is the attributes' alone, as it always was
    identity = attrs if not schema_url else [attrs, schema_url]
    digest = hashlib.blake2b(orjson.dumps(identity, option=orjson.OPT_SORT_KEYS), digest_size=8).digest()
    resource_id = int.from_bytes(digest, "big", signed=True)
    typed = {c: _typed_scalar(attrs, k, S.TYPED_RESOURCE_ATTRIBUTES[k])
             for k, c in RESOURCE_ATTRIBUTE_COLUMNS.items()}
    rest = {k: v for k, v in attrs.items() if k not in RESOURCE_ATTRIBUTE_COLUMNS or
            typed[RESOURCE_ATTRIBUTE_COLUMNS[k]] is None}
    if resource_id not in seen:
        seen[resource_id] = [resource_id, *typed.values(), orjson.dumps(rest).decode(),
                             schema_url or None, received_ns]
    return resource_id, tuple(typed[RESOURCE_ATTRIBUTE_COLUMNS[k]] for k in SPAN_RESOURCE_COPIES)


def _resource_table(rows: Iterable[list]) -> pa.Table:
    columns = list(zip(*rows)) or [[] for _ in RESOURCES_SCHEMA]
    return pa.table([pa.array(c, f.type) for c, f in zip(columns, RESOURCES_SCHEMA)],
                    schema=RESOURCES_SCHEMA)


def _typed_scalar(attrs: dict, key: str, sql_type: str) -> Any:
    value = attrs.get(key)
    return value if _fits(value, sql_type) else None


def _fits(value: Any, sql_type: str) -> bool:
    if sql_type == "VARCHAR":
        return type(value) is str
    if sql_type in ("BIGINT", "INTEGER"):
        bits = 63 if sql_type == "BIGINT" else 31
        return type(value) is int and -(1 << bits) <= value < (1 << bits)
    if sql_type == "DOUBLE":
        return type(value) in (int, float)
    if sql_type == "BOOLEAN":
        return type(value) is bool
    return False


_SPAN_FIELDS = operator.attrgetter("trace_id", "span_id", "parent_span_id", "name", "kind",
                                   "start_time_unix_nano", "end_time_unix_nano", "status.code",
                                   "status.message", "attributes", "events")


class _Layout:
    """Where the typed and the other attributes sit in spans whose keys come in one order."""

    __slots__ = ("typed", "rest_keys", "rest_positions", "positions")

    def __init__(self, keys: tuple[str, ...]) -> None:
        last = {k: i for i, k in enumerate(keys)}          # a repeated key: the last one wins
        self.typed = [(c, last[k]) for c, k in enumerate(SPAN_ATTRIBUTE_COLUMNS) if k in last]
        self.rest_keys = tuple(k for k in last if k not in SPAN_ATTRIBUTE_COLUMNS)
        self.rest_positions = [last[k] for k in self.rest_keys]
        self.positions = sorted(last.values())


_layouts: dict[tuple[str, ...], _Layout] = {}
_LAYOUT_CACHE_LIMIT = 4096
_LAYOUT_CACHED_KEY_CHARS = 4096   # a layout of longer keys is made each time, not kept


def _layout(keys: tuple[str, ...]) -> _Layout:
    layout = _layouts.get(keys)
    if layout is None:
        layout = _Layout(keys)
        if sum(map(len, keys)) > _LAYOUT_CACHED_KEY_CHARS:
            return layout   # (a request's 60 MB key stayed in the cache for good)
        if len(_layouts) >= _LAYOUT_CACHE_LIMIT:
            _layouts.clear()
        _layouts[keys] = layout
    return layout


@dataclass
class _Run:
    """Consecutive spans whose attribute keys come in the same order."""

    first_span: int
    pos: int            # index of its first attribute in the scope's flat lists
    width: int          # attributes per span
    spans: int
    keys: tuple[str, ...]
    offset: int = 0     # where its spans start in the columns decoded for its layout


def _runs(keys: list[str], counts: list[int]) -> list[_Run]:
    runs: list[_Run] = []
    pos = span = 0
    for width, group in itertools.groupby(counts):
        n = sum(1 for _ in group)
        end = pos + width * n
        head = keys[pos:pos + width]
        if n == 1 or keys[pos:end] == head * n:
            runs.append(_Run(span, pos, width, n, tuple(head)))
        else:                                   # same count, different keys: split span by span
            for k in range(n):
                p = pos + k * width
                row = tuple(keys[p:p + width])
                if runs and runs[-1].keys == row and runs[-1].pos + runs[-1].width * runs[-1].spans == p:
                    runs[-1].spans += 1
                else:
                    runs.append(_Run(span + k, p, width, 1, row))
        pos, span = end, span + n
    return runs


class _Columns:
    """Column lists of the spans and events tables, filled one scope at a time."""

    def __init__(self) -> None:
        self.count = 0
        self.fixed: list[list] = [[] for _ in range(9)]
        self.resource_id: list[int] = []
        self.scope: list[str | None] = []
        self.copies: list[list] = [[] for _ in SPAN_RESOURCE_COPIES]
        self.typed: list[list] = [[] for _ in SPAN_ATTRIBUTE_COLUMNS]
        self.rest: list[bytes | None] = []
        self.events: list[list] = [[] for _ in EVENTS_SCHEMA]

    def add_scope(self, scope_spans: Any, merged: Any, where: str, resource_id: int,
                  copies: tuple) -> None:
        spans = scope_spans.spans
        n = len(spans)
        rows = list(zip(*map(_SPAN_FIELDS, spans)))
        for column, values in zip(self.fixed, rows):
            column.extend(values)
        counts = list(map(len, rows[9]))
        _check_ids(rows[0], rows[1], rows[2], where)
        self.resource_id.extend(itertools.repeat(resource_id, n))
        self.scope.extend(itertools.repeat(scope_spans.scope.name or None, n))
        for column, value in zip(self.copies, copies):
            column.extend(itertools.repeat(value, n))
        self._attributes(merged.attributes, spans, counts, where)
        if merged.events:
            for idx, events in enumerate(rows[10]):
                if events:
                    self._events(spans[idx], f"{where}.spans[{idx}]")
        self.count += n

    def _attributes(self, merged: Any, spans: Any, counts: list[int], where: str) -> None:
        keys, raws = merged.key[:], merged.value[:]
        total = sum(counts)
        if len(keys) != total or len(raws) != total:
            # a KeyValue with an empty key or no value (proto3 leaves either out of the wire):
            # the scope's flat lists no longer pair up, so they are read from the messages (a
            # missing value is null)
            try:
                pairs = [kv if isinstance(kv, KeyValue) else KeyValue.FromString(kv)  # raw: LightRequest
                         for span in spans for kv in span.attributes]
            except DecodeError as e:
                raise TelemetryInputError(f"{where}: a span attribute is not a valid KeyValue: {e}") from None
            keys = [kv.key for kv in pairs]
            raws = [kv.value.SerializeToString() for kv in pairs]
        if max(counts, default=0) > MAX_ATTRIBUTES:
            k = next(i for i, c in enumerate(counts) if c > MAX_ATTRIBUTES)
            raise TelemetryInputError(f"{where}.spans[{k}] has {counts[k]} attributes; "
                                      f"the limit is {MAX_ATTRIBUTES}")
        runs = _runs(keys, counts)
        by_layout: dict[tuple[str, ...], list[_Run]] = {}
        for run in runs:
            by_layout.setdefault(run.keys, []).append(run)
        columns: dict[tuple[str, ...], dict[int, list]] = {}
        for layout_keys, layout_runs in by_layout.items():
            offset = 0
            for run in layout_runs:
                run.offset, offset = offset, offset + run.spans
            columns[layout_keys] = {
                j: _decode_column(raws, layout_runs, j, where)
                for j in _layout(layout_keys).positions}
        typed, rest, dumps = self.typed, self.rest, orjson.dumps
        for run in runs:
            layout = _layout(run.keys)
            decoded = columns[run.keys]
            lo, hi = run.offset, run.offset + run.spans
            filled = set()
            for c, j in layout.typed:
                typed[c].extend(decoded[j][lo:hi])
                filled.add(c)
            for c, column in enumerate(typed):
                if c not in filled:
                    column.extend(itertools.repeat(None, run.spans))
            if layout.rest_keys:
                rows = zip(*[decoded[j][lo:hi] for j in layout.rest_positions])
                rest.extend(map(dumps, map(dict, map(zip, itertools.repeat(layout.rest_keys), rows))))
            else:
                rest.extend(itertools.repeat(None, run.spans))

    def _events(self, span: Any, where: str) -> None:
        if len(span.events) > MAX_EVENTS:
            raise TelemetryInputError(f"{where} has {len(span.events)} events; the limit is {MAX_EVENTS}")
        trace_id, span_id, time_ns, name, attrs = self.events
        if span.events:
            _check_events(len(time_ns) + len(span.events))
        tid, sid = span.trace_id.hex(), span.span_id.hex()
        for e, event in enumerate(span.events):
            trace_id.append(tid)
            span_id.append(sid)
            time_ns.append(event.time_unix_nano)
            name.append(event.name)
            d = _attributes_dict(event.attributes, f"{where}.events[{e}]")
            attrs.append(orjson.dumps(d).decode() if d else None)

    def spans_table(self) -> pa.Table:
        trace_id, span_id, parent, name, kind, start, end, code, message = self.fixed
        start_a = _int64(start, "start_time_unix_nano")
        end_a = _int64(end, "end_time_unix_nano")
        parent_a = pa.array(map(bytes.hex, parent), pa.string(), size=len(parent))
        columns = [pa.array(map(bytes.hex, trace_id), pa.string(), size=len(trace_id)),
                   pa.array(map(bytes.hex, span_id), pa.string(), size=len(span_id)),
                   _empty_to_null(parent_a), pa.array(name, pa.string()),
                   pa.array(kind, pa.int32()), start_a, end_a, pc.subtract(end_a, start_a),
                   pa.array(code, pa.int32()), _empty_to_null(pa.array(message, pa.string())),
                   pa.array(self.resource_id, pa.int64()), pa.array(self.scope, pa.string())]
        columns += [pa.array(c, SPANS_SCHEMA.field(RESOURCE_ATTRIBUTE_COLUMNS[k]).type)
                    for c, k in zip(self.copies, SPAN_RESOURCE_COPIES)]
        for key, values in zip(SPAN_ATTRIBUTE_COLUMNS, self.typed):
            columns.append(_typed_column(values, key, self.rest))
        columns.append(pa.array(self.rest, pa.string()))
        return pa.table(columns, schema=SPANS_SCHEMA)

    def events_table(self) -> pa.Table:
        return pa.table([_int64(c, "event time") if f.name == "time_ns" else pa.array(c, f.type)
                         for c, f in zip(self.events, EVENTS_SCHEMA)], schema=EVENTS_SCHEMA)


def _check_ids(trace_ids: Sequence[bytes], span_ids: Sequence[bytes], parents: Sequence[bytes],
               where: str) -> None:
    for ids, sizes, label in ((trace_ids, {16}, "trace_id"), (span_ids, {8}, "span_id"),
                              (parents, {0, 8}, "parent_span_id")):
        if not set(map(len, ids)) <= sizes:
            k = next(i for i, x in enumerate(ids) if len(x) not in sizes)
            need = " or ".join(str(n) for n in sorted(sizes))
            raise TelemetryInputError(f"{where}.spans[{k}].{label} has {len(ids[k])} bytes; "
                                      f"OTLP needs {need}")


def _empty_to_null(array: pa.Array) -> pa.Array:
    return pc.if_else(pc.equal(array, ""), pa.scalar(None, pa.string()), array)


def _int64(values: list[int], label: str) -> pa.Array:
    try:
        return pa.array(values, pa.int64())
    except (OverflowError, pa.ArrowInvalid):
        raise TelemetryInputError(f"a span's {label} is past the year 2262 (over 2^63 ns)") from None


def _typed_column(values: list, key: str, rest: list[bytes | None]) -> pa.Array:
    """Arrow column of a typed attribute; values of another type go back to the JSON column."""
    sql_type = S.TYPED_SPAN_ATTRIBUTES[key]
    arrow_type = _ARROW[sql_type]
    try:
        if sql_type == "VARCHAR" and any(type(v) is _wire.Encoded for v in values):
            raise pa.ArrowTypeError("bytes or a non-finite double among the strings")
        array = pa.array(values)
        if array.type == arrow_type or array.type == pa.null():
            return array.cast(arrow_type)
        if sql_type == "INTEGER" and array.type == pa.int64():
            return array.cast(arrow_type)
    except (pa.ArrowException, OverflowError):
        pass
    for i, value in enumerate(values):
        if value is not None and not _fits(value, sql_type):
            d = orjson.loads(rest[i]) if rest[i] else {}
            d[key] = value
            rest[i] = orjson.dumps(d)
            values[i] = None
    return pa.array(values, arrow_type)


# ---- attribute values ------------------------------------------------------------------------

_VALUE_ERRORS = (DecodeError, UnicodeDecodeError, ValueError, RecursionError)


def _decode_column(raws: list[bytes], runs: list[_Run], j: int, where: str) -> list:
    """Values of the ``j``-th attribute of every span in ``runs`` (which share one key order)."""
    column: list[bytes] = []
    for run in runs:
        column += raws[run.pos + j: run.pos + run.width * run.spans: run.width]
    values = _wire.decode_column(column)
    if values is not None:
        return values
    try:
        return _wire.decode_values(column)
    except _VALUE_ERRORS as e:
        error = e
    for run in runs:                                    # find the value, for the message
        for k in range(run.spans):
            raw = raws[run.pos + k * run.width + j]
            try:
                _wire.decode_values([raw])
            except _VALUE_ERRORS as e:
                raise TelemetryInputError(f"{where}.spans[{run.first_span + k}] attribute "
                                          f"{run.keys[j]!r}: {_reason(e)}") from None
    raise TelemetryInputError(f"{where}: attribute {runs[0].keys[j]!r}: {_reason(error)}")


def _reason(e: Exception) -> str:
    if isinstance(e, UnicodeDecodeError):
        return "string value is not valid UTF-8"
    if isinstance(e, DecodeError):
        return f"value is not a valid AnyValue (corrupt, or a string that is not UTF-8): {e}"
    if isinstance(e, RecursionError):
        return "value is nested too deeply"
    return str(e)


def _attributes_dict(attributes: Sequence[Any], where: str) -> dict:
    if len(attributes) > MAX_ATTRIBUTES:
        raise TelemetryInputError(f"{where} has {len(attributes)} attributes; the limit is {MAX_ATTRIBUTES}")
    try:
        return {kv.key: _wire.any_value(kv.value) for kv in attributes}
    except ValueError as e:
        raise TelemetryInputError(f"{where}: {e}") from None
