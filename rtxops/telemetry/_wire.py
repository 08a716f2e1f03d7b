"""Wire-compatible views of OTLP trace messages that let upb (C) do per-attribute work in bulk.

Protobuf merges repeated occurrences of a singular message field and accepts a singular scalar
encoding for a repeated field. Declaring OTLP's fields differently, but with the same numbers and
wire types, therefore makes one parse return flat lists instead of one wrapper object per
attribute, which is where pure-Python conversion spends its time:

* :data:`LightRequest`: span attributes stay raw bytes (the per-span view only counts them).
* :data:`MergedRequest`: every span of a scope merges into one message, so all attribute keys and
  raw ``AnyValue`` bytes of the scope come out as two lists (and its events' bytes as a third).
* :func:`decode_any_values`: raw ``AnyValue`` bytes → Python values, scalars of one type decoded
  by a single parse of their concatenation, int arrays by a merged parse per batch.
"""
from __future__ import annotations

import base64
import operator
from typing import Any, Sequence

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

F = descriptor_pb2.FieldDescriptorProto
MAX_DEPTH = 32

# first byte of a raw AnyValue = its oneof field's tag
STRING, BOOL, INT, DOUBLE, ARRAY = 0x0A, 0x10, 0x18, 0x21, 0x2A
_SCALAR_FIELDS = {STRING: "s", BOOL: "b", INT: "i", DOUBLE: "d"}


def _copy(module: Any) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(proto)
    return proto


def _request_class(merged: bool) -> type[Message]:
    pool = descriptor_pool.DescriptorPool()
    pool.Add(_copy(common_pb2))
    pool.Add(_copy(resource_pb2))
    proto = _copy(trace_pb2)
    package = "." + proto.package
    messages = {m.name: m for m in proto.message_type}
    span_fields = {f.name: f for f in messages["Span"].field}
    if merged:
        spans = proto.message_type.add(name="MergedSpans")
        attrs = spans.nested_type.add(name="Attributes")
        attrs.field.add(name="key", number=1, label=F.LABEL_REPEATED, type=F.TYPE_STRING)
        attrs.field.add(name="value", number=2, label=F.LABEL_REPEATED, type=F.TYPE_BYTES)
        spans.field.add(name="attributes", number=span_fields["attributes"].number,
                        label=F.LABEL_OPTIONAL, type=F.TYPE_MESSAGE,
                        type_name=f"{package}.MergedSpans.Attributes")
        spans.field.add(name="events", number=span_fields["events"].number,
                        label=F.LABEL_REPEATED, type=F.TYPE_BYTES)
        for field in messages["ScopeSpans"].field:
            if field.name == "spans":
                field.label = F.LABEL_OPTIONAL
                field.type_name = f"{package}.MergedSpans"
    else:
        span_fields["attributes"].type = F.TYPE_BYTES
        span_fields["attributes"].ClearField("type_name")
    pool.Add(proto)
    pool.Add(_copy(trace_service_pb2))
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName(trace_service_pb2.ExportTraceServiceRequest.DESCRIPTOR.full_name))


def _value_classes() -> tuple[type[Message], type[Message], type[Message]]:
    """Scalars (AnyValue fields 1-4 as repeated), and two views of a batch of array values."""
    proto = descriptor_pb2.FileDescriptorProto(name="rtxops_wire_values.proto", package="rtxops.wire",
                                               syntax="proto3")
    scalars = proto.message_type.add(name="Scalars")
    for name, number, kind in (("s", 1, F.TYPE_STRING), ("b", 2, F.TYPE_BOOL),
                               ("i", 3, F.TYPE_INT64), ("d", 4, F.TYPE_DOUBLE),
                               ("other", 5, F.TYPE_BYTES), ("kv", 6, F.TYPE_BYTES),
                               ("raw", 7, F.TYPE_BYTES)):
        scalars.field.add(name=name, number=number, label=F.LABEL_REPEATED, type=kind)
    merged = proto.message_type.add(name="MergedArray")        # ArrayValue, elements merged
    merged.field.add(name="values", number=1, label=F.LABEL_OPTIONAL, type=F.TYPE_MESSAGE,
                     type_name=".rtxops.wire.Scalars")
    counted = proto.message_type.add(name="CountedArray")      # ArrayValue, elements as bytes
    counted.field.add(name="values", number=1, label=F.LABEL_REPEATED, type=F.TYPE_BYTES)
    for name, element in (("MergedArrays", "MergedArray"), ("CountedArrays", "CountedArray")):
        batch = proto.message_type.add(name=name)               # concatenated array AnyValues
        batch.field.add(name="array_value", number=5, label=F.LABEL_REPEATED,
                        type=F.TYPE_MESSAGE, type_name=f".rtxops.wire.{element}")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    get = lambda n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"rtxops.wire.{n}"))  # noqa: E731
    return get("Scalars"), get("MergedArrays"), get("CountedArrays")


LightRequest = _request_class(merged=False)
MergedRequest = _request_class(merged=True)
_Scalars, _MergedArrays, _CountedArrays = _value_classes()
_values_of = operator.attrgetter("values")


def decode_any_values(raws: Sequence[bytes]) -> list:
    """Python values of raw ``AnyValue`` bytes, in order. Arrays become tuples, kvlists dicts,
    bytes base64 text, an empty AnyValue None. Raises DecodeError / UnicodeDecodeError /
    ValueError for a value that is not a valid AnyValue."""
    out: list = [None] * len(raws)
    scalar_idx: list[int] = []
    array_idx: list[int] = []
    slow_idx: list[int] = []
    for i, raw in enumerate(raws):
        tag = raw[0] if raw else None
        if tag in _SCALAR_FIELDS:
            scalar_idx.append(i)
        elif tag == ARRAY:
            array_idx.append(i)
        elif raw:
            slow_idx.append(i)
    slow_idx += _scalars([raws[i] for i in scalar_idx], scalar_idx, out)
    slow_idx += _int_arrays([raws[i] for i in array_idx], array_idx, out)
    for i in slow_idx:
        out[i] = any_value(AnyValue.FromString(raws[i]))
    return out


def _scalars(raws: list[bytes], where: list[int], out: list) -> list[int]:
    """Fills ``out`` from one parse of the concatenated scalars; returns the indices it could not."""
    if not raws:
        return []
    try:
        parsed = _Scalars.FromString(b"".join(raws))
    except DecodeError:
        return where
    columns = {tag: iter(getattr(parsed, name)) for tag, name in _SCALAR_FIELDS.items()}
    expected = {tag: 0 for tag in _SCALAR_FIELDS}
    for raw in raws:
        expected[raw[0]] += 1
    if parsed.other or parsed.kv or parsed.raw or any(
            len(getattr(parsed, name)) != expected[tag] for tag, name in _SCALAR_FIELDS.items()):
        return where                                    # a value with more than one field
    for i, raw in zip(where, raws):
        out[i] = next(columns[raw[0]])
    return []


def _int_arrays(raws: list[bytes], where: list[int], out: list) -> list[int]:
    """Arrays whose elements are all ints, via a counted and a merged parse of the batch."""
    if not raws:
        return []
    blob = b"".join(raws)
    try:
        counted = _CountedArrays.FromString(blob).array_value
        merged = _MergedArrays.FromString(blob).array_value
    except DecodeError:
        return where
    if len(counted) != len(raws) or len(merged) != len(raws):
        return where
    slow = []
    for i, n, m in zip(where, map(len, map(_values_of, counted)), map(_values_of, merged)):
        ints = m.i
        if len(ints) == n and not (m.s or m.b or m.d or m.other or m.kv or m.raw):
            out[i] = tuple(ints)
        else:
            slow.append(i)
    return slow


def any_value(v: AnyValue, depth: int = 0) -> Any:
    """Python value of a parsed ``AnyValue`` (JSON-ready)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"value is nested more than {MAX_DEPTH} levels deep")
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return tuple(any_value(x, depth + 1) for x in v.array_value.values)
    if which == "kvlist_value":
        return {kv.key: any_value(kv.value, depth + 1) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return base64.b64encode(v.bytes_value).decode()
    return getattr(v, which)
