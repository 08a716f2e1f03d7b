"""Wire-compatible views of OTLP trace messages that let upb (C) do per-attribute work in bulk.

Protobuf merges repeated occurrences of a singular message field and accepts a singular scalar
encoding for a repeated field. Declaring OTLP's fields differently, but with the same numbers and
wire types, therefore makes one parse return flat lists instead of one wrapper object per
attribute, which is where pure-Python conversion spends its time:

* :data:`LightRequest`: span attributes stay raw bytes (the per-span view only counts them).
* :data:`MergedRequest`: every span of a scope merges into one message, so all attribute keys and
  raw ``AnyValue`` bytes of the scope come out as two lists (and its events' bytes as a third).
* :func:`decode_column`: raw ``AnyValue`` bytes of one attribute across many spans → Python
  values, by a single parse of their concatenation (they usually share one type).
"""
from __future__ import annotations

import base64
import itertools
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
ARRAY = 0x2A
_SCALAR_FIELDS = {0x0A: "s", 0x10: "b", 0x18: "i", 0x21: "d"}


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


def _value_classes() -> tuple[type[Message], type[Message]]:
    """``Scalars``: AnyValue with every field repeated (unpacked, so re-encoding is byte-exact);
    ``CountedArrays``: concatenated array AnyValues, each array's elements kept as raw bytes."""
    proto = descriptor_pb2.FileDescriptorProto(name="rtxops_wire_values.proto", package="rtxops.wire",
                                               syntax="proto3")
    scalars = proto.message_type.add(name="Scalars")
    for name, number, kind in (("s", 1, F.TYPE_STRING), ("b", 2, F.TYPE_BOOL),
                               ("i", 3, F.TYPE_INT64), ("d", 4, F.TYPE_DOUBLE),
                               ("other", 5, F.TYPE_BYTES), ("kv", 6, F.TYPE_BYTES),
                               ("raw", 7, F.TYPE_BYTES)):
        field = scalars.field.add(name=name, number=number, label=F.LABEL_REPEATED, type=kind)
        field.options.packed = False
    counted = proto.message_type.add(name="CountedArray")
    counted.field.add(name="values", number=1, label=F.LABEL_REPEATED, type=F.TYPE_BYTES)
    batch = proto.message_type.add(name="CountedArrays")
    batch.field.add(name="array_value", number=5, label=F.LABEL_REPEATED, type=F.TYPE_MESSAGE,
                    type_name=".rtxops.wire.CountedArray")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"rtxops.wire.{n}"))
                 for n in ("Scalars", "CountedArrays"))


LightRequest = _request_class(merged=False)
MergedRequest = _request_class(merged=True)
_Scalars, _CountedArrays = _value_classes()
_values_of = operator.attrgetter("values")
_all_fields = operator.attrgetter("s", "b", "i", "d", "other", "kv", "raw")


def decode_column(raws: list[bytes]) -> list | None:
    """Values of raw ``AnyValue`` bytes that all hold one scalar type, or all hold arrays of one
    scalar type (arrays come back as tuples), decoded by one parse of their concatenation.
    None when the column is anything else (mixed types, nulls, kvlists, unusual encodings):
    decode those one by one with :func:`decode_values`."""
    if not raws or b"" in raws:
        return None
    if raws[0][0] == ARRAY:
        return _cached_array_column(raws)
    return _scalar_column(raws)


_arrays: dict[bytes, tuple] = {}     # decoded arrays by raw bytes: histograms repeat a lot
_ARRAY_CACHE_LIMIT = 1 << 12
_CACHED_ARRAY_MAX_BYTES = 256        # histograms are small; a large array is decoded, not kept


def _cached_array_column(raws: list[bytes]) -> list | None:
    values = list(map(_arrays.get, raws))
    if None not in values:
        return values
    missing = [i for i, v in enumerate(values) if v is None]
    decoded = _array_column([raws[i] for i in missing])
    if decoded is None:
        return None
    if len(_arrays) + len(missing) > _ARRAY_CACHE_LIMIT:
        _arrays.clear()
    for i, value in zip(missing, decoded):
        values[i] = value
        if len(raws[i]) <= _CACHED_ARRAY_MAX_BYTES:  # at most 4096 small arrays are kept
            _arrays[raws[i]] = value
    return values


def _scalar_column(raws: list[bytes]) -> list | None:
    if b"" in raws:
        return None
    blob = b"".join(raws)
    try:
        parsed = _Scalars.FromString(blob)
    except DecodeError:
        return None
    name = _SCALAR_FIELDS.get(raws[0][0])
    if name is None:
        return None
    values = getattr(parsed, name)
    # With no empty value and nothing unknown, each raw holds at least one field, so n values in
    # all, all of one type, from n raws means exactly one field each, in order.
    if len(values) != len(raws) or sum(map(len, _all_fields(parsed))) != len(raws):
        return None
    parsed.DiscardUnknownFields()
    if parsed.ByteSize() != len(blob):
        return None
    if name == "d":
        return list(map(_json_double, values))
    return values[:]


def _array_column(raws: list[bytes]) -> list | None:
    blob = b"".join(raws)
    try:
        arrays = _CountedArrays.FromString(blob)
    except DecodeError:
        return None
    arrays.DiscardUnknownFields()
    if len(arrays.array_value) != len(raws) or arrays.ByteSize() != len(blob):
        return None
    elements = list(map(_values_of, arrays.array_value))
    flat = list(itertools.chain.from_iterable(elements))
    if not flat:
        return [()] * len(raws)
    values = _scalar_column(flat)
    if values is None:
        return None
    it = iter(values)
    return list(map(tuple, map(itertools.islice, itertools.repeat(it), map(len, elements))))


def decode_values(raws: Sequence[bytes]) -> list:
    """Python values of raw ``AnyValue`` bytes, one parse each. Raises DecodeError (corrupt, or a
    string that is not UTF-8) or ValueError (nested too deep)."""
    return [any_value(AnyValue.FromString(raw)) if raw else None for raw in raws]


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
        return Encoded(base64.b64encode(v.bytes_value).decode())
    if which == "double_value":
        return _json_double(v.double_value)
    return getattr(v, which)


class Encoded(str):
    """Text that stands for a value of another type (bytes as base64, a non-finite double as
    protobuf's JSON writes it): kept in the JSON of attributes, never in a typed string column."""

    __slots__ = ()


_NON_FINITE = {"nan": Encoded("NaN"), "inf": Encoded("Infinity"), "-inf": Encoded("-Infinity")}


def _json_double(d: float) -> float | str:
    """JSON has no NaN or infinities: they are kept as protobuf's JSON mapping writes them."""
    return d if d - d == 0.0 else _NON_FINITE[repr(d)]
