"""SDK spans → OTLP ``ExportTraceServiceRequest`` bytes, byte for byte what the OTLP exporters'
own encoder (``encode_spans(...).SerializeToString()``) writes, at a fraction of its cost.

That encoder builds a protobuf object per attribute; a job's kernel spans repeat the same slot
attributes every step, so here each (key, value) pair is encoded once and its bytes reused.
:func:`encode` returns None for spans it does not handle (links, map values, foreign types): the
caller then uses the SDK's encoder. The compiled encoder (``_otlp_encode``, built from
``_native/otlp_encode.c``) writes the same bytes again, ~5x faster; where it declines (None),
the Python encoder here decides. ``RTXOPS_OTLP_NATIVE=0`` turns it off, as for the decoder.
"""
from __future__ import annotations

import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util import BoundedList
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode

_pack_d = struct.Struct("<d").pack
_pack_q = struct.Struct("<Q").pack
_pack_i = struct.Struct("<I").pack
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200       # SpanFlags
_KIND = {0: 1, 1: 2, 2: 3, 3: 4, 4: 5}          # SDK SpanKind value → OTLP Span.SpanKind


try:
    from . import _otlp_encode
except ImportError:  # built without a compiler: the Python encoder alone
    _otlp_encode = None
else:  # these exact types it reads field by field, anything else through its properties
    try:
        _otlp_encode.configure(ReadableSpan, SpanContext, Status, BoundedAttributes, BoundedList,
                               sorted(SpanKind, key=lambda k: k.value),
                               sorted(StatusCode, key=lambda c: c.value))
    except Exception:  # an SDK whose types it does not know: the Python encoder alone
        _otlp_encode = None


class Unsupported(Exception):
    """A span this encoder does not mirror exactly."""


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = 1 << 14
_VARINTS = [_varint(n) for n in range(_SMALL)]  # lengths, counts, small values: looked up
_TAGS = [bytes((t,)) for t in range(256)]


def varint(n: int) -> bytes:
    return _VARINTS[n] if 0 <= n < _SMALL else _varint(n)


def _len(tag: int, payload: bytes) -> bytes:
    n = len(payload)
    return _TAGS[tag] + (_VARINTS[n] if n < _SMALL else _varint(n)) + payload


def _string(tag: int, text: str) -> bytes:
    return _len(tag, text.encode()) if text else b""


def any_value(v: Any) -> bytes:
    """AnyValue bytes (the oneof is written even when its value is the default)."""
    if v is None:
        return b""
    cls = v.__class__
    if cls is bool:
        return b"\x10\x01" if v else b"\x10\x00"
    if cls is str:
        return _len(0x0A, v.encode())
    if cls is int:
        if not -(1 << 63) <= v < 1 << 63:  # the SDK's encoder refuses it too: never wrap it
            raise Unsupported(f"integer attribute {v} is outside int64")
        return b"\x18" + varint(v)
    if cls is float:
        return b"\x21" + _pack_d(v)
    if cls is bytes:
        return _len(0x3A, v)
    if cls in (tuple, list):
        return _len(0x2A, b"".join(_len(0x0A, any_value(x)) for x in v))
    # subclasses (a TorchVersion is a str), in the order of the SDK encoder's isinstance checks;
    # their values as the base type holds them (str(v) would call an overridden __str__: a
    # `class Color(str, Enum)` member is "red" to the SDK, "Color.RED" to str())
    if isinstance(v, str):
        return any_value(str.__str__(v))
    if isinstance(v, int):
        return any_value(int.__index__(v))
    if isinstance(v, float):
        return any_value(float.__float__(v))
    if isinstance(v, bytes):
        return any_value(bytes(memoryview(v)))
    if isinstance(v, Sequence) and not isinstance(v, Mapping):
        return any_value(tuple(v))
    raise Unsupported(f"attribute value of type {cls.__name__}")


# Values whose equal ones encode alike. Not floats: 0.0 == -0.0 (and they hash alike), so a
# cached 0.0 would be written for -0.0; tuples only of these types.
_CACHED = {str, int, bool, bytes, tuple}
_CACHED_ITEMS = {str, int, bool, bytes}
_kv_cache: dict[tuple, bytes] = {}
_KV_CACHE_LIMIT = 1 << 14


def key_value(tag: int, key: str, value: Any) -> bytes:
    """One repeated KeyValue field (tag + length + KeyValue) of a message."""
    cls = value.__class__
    hashable = cls in _CACHED
    if hashable:
        # (1,), (True,) and (1.0,) are equal tuples: their element types belong to the key
        types = tuple(map(type, value)) if cls is tuple else None
        hashable = types is None or _CACHED_ITEMS.issuperset(types)
        cache_key = (tag, key, cls, value, types)
    if hashable:
        got = _kv_cache.get(cache_key)
        if got is not None:
            return got
    out = _len(tag, _string(0x0A, key) + _len(0x12, any_value(value)))
    if hashable:
        if len(_kv_cache) >= _KV_CACHE_LIMIT:
            _kv_cache.clear()
        _kv_cache[cache_key] = out
    return out


def _attributes(tag: int, attributes: Any) -> bytes:
    if not attributes:
        return b""
    return b"".join([key_value(tag, k, v) for k, v in attributes.items()])


_names: dict[str, bytes] = {}
_KIND_FIELDS = {sdk: b"\x30" + varint(otlp) for sdk, otlp in _KIND.items()}
_FLAGS_LOCAL = b"\x85\x01" + _pack_i(_HAS_IS_REMOTE)
_FLAGS_REMOTE_PARENT = b"\x85\x01" + _pack_i(_HAS_IS_REMOTE | _IS_REMOTE)


def _span(span: Any) -> bytes:
    if span.links:
        raise Unsupported("links")
    ctx = span.get_span_context()
    parent = span.parent
    parts = [b"\x0a\x10", ctx.trace_id.to_bytes(16, "big"), b"\x12\x08", ctx.span_id.to_bytes(8, "big")]
    if ctx.trace_state:
        parts.append(_string(0x1A, ",".join(f"{k}={v}" for k, v in ctx.trace_state.items())))
    if parent is not None:
        parts += (b"\x22\x08", parent.span_id.to_bytes(8, "big"))
    name = span.name
    name_field = _names.get(name)
    if name_field is None:
        if len(_names) >= _KV_CACHE_LIMIT:
            _names.clear()
        name_field = _names[name] = _string(0x2A, name)
    parts += (name_field, _KIND_FIELDS[span.kind.value])
    if span.start_time:
        parts += (b"\x39", _pack_q(span.start_time))
    if span.end_time:
        parts += (b"\x41", _pack_q(span.end_time))
    attributes = span.attributes
    if attributes:
        parts += [key_value(0x4A, k, v) for k, v in attributes.items()]
    if span.dropped_attributes:
        parts.append(b"\x50" + varint(span.dropped_attributes))
    for event in span.events:
        e = b""
        if event.timestamp:
            e += b"\x09" + _pack_q(event.timestamp)
        e += _string(0x12, event.name) + _attributes(0x1A, event.attributes)
        if event.dropped_attributes:
            e += b"\x20" + varint(event.dropped_attributes)
        parts.append(_len(0x5A, e))
    if span.dropped_events:
        parts.append(b"\x60" + varint(span.dropped_events))
    if span.dropped_links:
        parts.append(b"\x70" + varint(span.dropped_links))
    status = span.status
    if status is not None:
        if status.status_code.value or status.description:
            s = _string(0x12, status.description or "")
            if status.status_code.value:
                s += b"\x18" + varint(status.status_code.value)
            parts.append(_len(0x7A, s))
        else:
            parts.append(b"\x7a\x00")
    parts.append(_FLAGS_REMOTE_PARENT if parent is not None and parent.is_remote else _FLAGS_LOCAL)
    return _len(0x12, b"".join(parts))


def _scope(scope: Any) -> bytes:
    if scope is None:
        return b""
    return _string(0x0A, scope.name) + _string(0x12, scope.version or "") + _attributes(
        0x1A, scope.attributes)


# A local INTERNAL span's closing fields: its unset status and its flags (parent not remote).
SPAN_TAIL = b"\x7a\x00" + _FLAGS_LOCAL


def span_head(name: str) -> bytes:
    """An INTERNAL span's name and kind fields, as :func:`encode` writes them."""
    return _string(0x2A, name) + _KIND_FIELDS[0]


def key_field(key: str) -> bytes:
    """A KeyValue's key field."""
    return _string(0x0A, key)


def encode(spans: Sequence[Any]) -> bytes | None:
    """Request bytes for SDK ``ReadableSpan``s, or None (use the SDK's encoder)."""
    if not isinstance(spans, (list, tuple)):  # read twice where the compiled encoder declines
        spans = list(spans)
    if _otlp_encode is not None and os.environ.get("RTXOPS_OTLP_NATIVE", "1") != "0":
        body = _otlp_encode.encode(spans)
        if body is not None:
            return body
    return encode_python(spans)


def encode_python(spans: Sequence[Any]) -> bytes | None:
    """:func:`encode` without the compiled encoder."""
    # grouped as the SDK does (by equal resource, then scope), but looked up by identity first:
    # hashing a Resource serializes its attributes to JSON
    groups: list[tuple[Any, dict[Any, list[bytes]]]] = []
    by_id: dict[int, dict[Any, list[bytes]]] = {}
    try:
        for span in spans:
            resource = span.resource
            scopes = by_id.get(id(resource))
            if scopes is None:
                scopes = next((g for r, g in groups if r == resource), None)
                if scopes is None:
                    scopes = {}
                    groups.append((resource, scopes))
                by_id[id(resource)] = scopes
            scopes.setdefault(span.instrumentation_scope or None, []).append(_span(span))
        out = []
        for resource, scopes in groups:
            body = _len(0x0A, _attributes(0x0A, resource.attributes))
            for scope, encoded in scopes.items():
                ss = _len(0x0A, _scope(scope)) + b"".join(encoded)
                if scope is not None and scope.schema_url:
                    ss += _string(0x1A, scope.schema_url)
                body += _len(0x12, ss)
            body += _string(0x1A, resource.schema_url or "")
            out.append(_len(0x0A, body))
    except (Unsupported, KeyError, AttributeError, OverflowError, TypeError, ValueError,
            IndexError, RecursionError, struct.error):
        # ValueError covers strings that are not UTF-8 encodable: the SDK's encoder decides
        return None
    return b"".join(out)


def merge(bodies: Sequence[bytes], pieces: Sequence[tuple[Any, Any, bytes]] = ()) -> bytes:
    """One request holding the spans of ``bodies`` (requests :func:`encode` wrote, in order)
    and of ``pieces`` ((resource, scope, Span fields) of spans already encoded: ``0x12``,
    length, Span, as :func:`encode` writes them), grouped by resource, then scope, as
    :func:`encode` groups them: the bytes :func:`encode` writes for all their spans at once,
    but for their order. A body it cannot take apart is appended as it is (two requests' bytes
    concatenated are one valid request holding both)."""
    if len(bodies) == 1 and not pieces:
        return bodies[0]
    resources: dict[tuple[bytes, bytes], dict[tuple[bytes, bytes], list[bytes]]] = {}
    whole: list[bytes] = []
    fields: dict[int, tuple[bytes, bytes]] = {}   # by id(): the pieces' objects live meanwhile
    for resource, scope, spans in pieces:
        key = fields.get(id(resource))
        if key is None:
            key = fields[id(resource)] = (_len(0x0A, _attributes(0x0A, resource.attributes)),
                                          _string(0x1A, resource.schema_url or ""))
        scope_key = fields.get(id(scope))
        if scope_key is None:
            scope_key = fields[id(scope)] = (_len(0x0A, _scope(scope)), _string(
                0x1A, scope.schema_url if scope is not None and scope.schema_url else ""))
        resources.setdefault(key, {}).setdefault(scope_key, []).append(spans)
    for body in bodies:
        try:
            parsed = [_resource_spans(raw) for _, raw in _fields(body, 0, len(body), {0x0A})]
        except ValueError:
            whole.append(body)
            continue
        for resource, schema, scopes in parsed:
            group = resources.setdefault((resource, schema), {})
            for scope, scope_schema, spans in scopes:
                group.setdefault((scope, scope_schema), []).extend(spans)
    out = []
    for (resource, schema), scopes in resources.items():
        inner = b"".join(_len(0x12, scope + b"".join(spans) + scope_schema)
                         for (scope, scope_schema), spans in scopes.items())
        out.append(_len(0x0A, resource + inner + schema))
    return b"".join(out + whole)


def _resource_spans(raw: bytes) -> tuple[bytes, bytes, list[tuple[bytes, bytes, list[bytes]]]]:
    """A ResourceSpans field as (resource field, schema_url field, [(scope field, schema_url
    field, span fields)]), each the field's bytes as written, tag included."""
    _, start, end = _field_header(raw, 0)
    resource, schema, scopes = b"", b"", []
    for t, field in _fields(raw, start, end, {0x0A, 0x12, 0x1A}):
        if t == 0x12:
            _, s, e = _field_header(field, 0)
            scope, scope_schema, spans = b"", b"", []
            for t2, f2 in _fields(field, s, e, {0x0A, 0x12, 0x1A}):
                if t2 == 0x12:
                    spans.append(f2)
                elif t2 == 0x0A:
                    scope = f2
                else:
                    scope_schema = f2
            scopes.append((scope, scope_schema, spans))
        elif t == 0x0A:
            resource = field
        else:
            schema = field
    return resource, schema, scopes


def _fields(buf: bytes, pos: int, end: int, tags: set[int]):
    """The length-delimited fields in ``buf[pos:end]`` as (tag, the field's bytes); ValueError
    for any other field or a broken length."""
    while pos < end:
        tag, _, stop = _field_header(buf, pos)
        if tag not in tags or stop > end:
            raise ValueError(f"unexpected field {tag:#x} at {pos}")
        yield tag, buf[pos:stop]
        pos = stop


def _field_header(buf: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, start of the payload, end of the field) of the field at ``pos`` (a one-byte tag)."""
    tag = buf[pos]
    n, shift, pos = 0, 0, pos + 1
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated length")
        b = buf[pos]
        n |= (b & 0x7F) << shift
        pos += 1
        if b < 0x80:
            return tag, pos, pos + n
        shift += 7
