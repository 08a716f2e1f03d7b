"""The compiled fast path of :func:`.otlp.convert` for OTLP protobuf: request bytes → Arrow columns
in C (``_otlp_columns``, built from ``_native/otlp_columns.c``), with the resources decoded here.

:func:`convert` returns None whenever the C decoder declines a request (anything unusual or
malformed); the caller then runs the reference decoder, which owns every error message. Set
``RTXOPS_OTLP_NATIVE=0`` to always use the reference (benchmarks compare the two).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from google.protobuf.message import DecodeError
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from . import schema as S

try:
    from . import _otlp_columns
except ImportError:                     # no compiler at install time: the reference decoder only
    _otlp_columns = None


def available() -> bool:
    return _otlp_columns is not None and os.environ.get("RTXOPS_OTLP_NATIVE", "1") != "0"


def count_rows(body: bytes) -> tuple[int, int]:
    """(spans, events) of an OTLP protobuf request, counted without decoding it (a malformed
    part ends the count: the decoders refuse it)."""
    return _otlp_columns.count_rows(body)


def convert(body: bytes, received_ns: int) -> Any:
    """A :class:`.otlp.Batch` from OTLP protobuf ``body``, or None: use the reference decoder."""
    from . import otlp as O

    out = _otlp_columns.decode(body, _typed_spec(), CACHE_KEYS)
    if out is None:
        return None
    seen: dict[int, list] = {}
    resource_ids, copies = [], []
    for i, (raw, schema_url) in enumerate(out["resources"]):
        try:
            resource = Resource.FromString(raw)
        except (DecodeError, RecursionError):
            return None
        if len(resource.attributes) > O.MAX_ATTRIBUTES:
            return None
        try:
            rid, copy = O._resource(resource, schema_url, i, received_ns, seen)
        except O.TelemetryInputError:
            return None
        resource_ids.append(rid)
        copies.append(copy)
    n = out["spans"]
    scopes = out["scopes"]
    scope_of_span = pa.array(np.frombuffer(out["scope_of_span"], np.int32))

    def per_scope(values: list, type_: pa.DataType) -> pa.Array:
        return pa.array(values, type_).take(scope_of_span)

    fixed = [_array(t, n, c) for t, c in zip(_FIXED_TYPES, out["fixed"])]
    trace_id, span_id, parent, name, kind, start, end, code, message = fixed
    columns = [trace_id, span_id, parent, name, kind, start, end, pc.subtract(end, start), code, message,
               per_scope([resource_ids[r] for r, _ in scopes], pa.int64()),
               per_scope([s for _, s in scopes], pa.string())]
    for k, key in enumerate(O.SPAN_RESOURCE_COPIES):
        type_ = O.SPANS_SCHEMA.field(O.RESOURCE_ATTRIBUTE_COLUMNS[key]).type
        columns.append(per_scope([copies[r][k] for r, _ in scopes], type_))
    for c, (key, column) in zip(out["typed"], O.SPAN_ATTRIBUTE_COLUMNS.items()):
        columns.append(_array(O.SPANS_SCHEMA.field(column).type, n, c))
    columns.append(_array(pa.string(), n, out["attributes"]))
    spans = pa.table(columns, schema=O.SPANS_SCHEMA)
    m = out["events_count"]
    events = pa.table([_array(f.type, m, c) for f, c in zip(O.EVENTS_SCHEMA, out["events"])],
                      schema=O.EVENTS_SCHEMA)
    hints = out["hints"]
    counts = None if hints is None else tuple(_array(pa.int64(), n, c) for c in hints)
    return O.Batch(O._resource_table(seen.values()), spans, events, n, received_ns, counts)


CACHE_KEYS = (S.CACHE_HITS, S.CACHE_MISSES)
_FIXED_TYPES = (pa.string(), pa.string(), pa.string(), pa.string(), pa.int32(), pa.int64(), pa.int64(),
                pa.int32(), pa.string())
_spec: tuple | None = None


def _typed_spec() -> tuple:
    global _spec
    if _spec is None:
        from . import otlp as O
        from . import schema as S

        types = {S.TYPED_SPAN_ATTRIBUTES[k] for k in O.SPAN_ATTRIBUTE_COLUMNS}
        assert types <= {"BIGINT", "VARCHAR"}, types     # what the C decoder fills
        _spec = tuple((k, S.TYPED_SPAN_ATTRIBUTES[k] == "BIGINT") for k in O.SPAN_ATTRIBUTE_COLUMNS)
    return _spec


def _array(type_: pa.DataType, n: int, parts: tuple) -> pa.Array:
    validity, *data, nulls = parts
    buffers = [None if validity is None else pa.py_buffer(validity)] + [pa.py_buffer(d) for d in data]
    return pa.Array.from_buffers(type_, n, buffers, null_count=nulls)
