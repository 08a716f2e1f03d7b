"""The compiled OTLP protobuf decoder against the reference one: same tables whenever it answers,
and it declines (None → the reference decides, with its error messages) on anything else."""
from __future__ import annotations

import json
import math
import os
import random

import pytest
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    KeyValue,
    KeyValueList,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from rtxops.telemetry import _columns, otlp, synthetic
from rtxops.telemetry import schema as S
from rtxops.telemetry.otlp import PROTOBUF, TelemetryInputError

from .otlp_helpers import RESOURCE, kvs, request, span

pytestmark = pytest.mark.skipif(_columns._otlp_columns is None, reason="C decoder not built")


def reference(body: bytes) -> otlp.Batch:
    return otlp.to_arrow(otlp._parse_protobuf(otlp._wire.LightRequest, body), 7, wire=body)


def check(body: bytes) -> otlp.Batch | None:
    """Native result (or None), after proving it equals the reference's."""
    native = _columns.convert(body, 7)
    try:
        ref = reference(body)
    except Exception:                   # the reference refuses: the native path must have declined
        assert native is None
        return None
    if native is not None:
        for name in ("spans", "resources", "events"):
            got, want = getattr(native, name), getattr(ref, name)
            assert got.schema == want.schema, name
            assert got.to_pylist() == want.to_pylist(), name
        assert native.span_count == ref.span_count
    return native


def test_exporter_shaped_requests_take_the_fast_path():
    for seed in range(4):
        body = synthetic.otlp_request(300, seed=seed, job_id=f"j{seed}", rank=seed).SerializeToString()
        assert check(body) is not None


def test_convert_uses_it_and_the_switch_turns_it_off(monkeypatch):
    body = synthetic.otlp_request(50).SerializeToString()
    fast = otlp.convert(body, PROTOBUF, 7)
    monkeypatch.setenv("RTXOPS_OTLP_NATIVE", "0")
    assert not _columns.available()
    assert otlp.convert(body, PROTOBUF, 7).spans.equals(fast.spans)


ODD_STRINGS = ["", "plain", 'quote " and \\ back', "\x00\x01\x1f\x7f", "tab\tnl\ncr\r\b\f", "é ü 漢 😀",
               "\u2028\u2029", "</script>"]
ODD_NUMBERS = [0, -1, 1 << 62, -(1 << 63), (1 << 63) - 1]
ODD_DOUBLES = [0.0, -0.0, 0.1, 1e-05, 1e16, 1.5e300, 5e-324, math.inf, -math.inf, math.nan, 123.456]


def test_every_value_type_and_odd_values():
    attrs = {f"s{i}": v for i, v in enumerate(ODD_STRINGS)}
    attrs |= {f"i{i}": v for i, v in enumerate(ODD_NUMBERS)}
    attrs |= {f"d{i}": v for i, v in enumerate(ODD_DOUBLES)}
    attrs |= {"t": True, "f": False, "bytes": b"\x00\xff\x10", "b1": b"x", "b2": b"xy", "b0": b"",
              "arr": [1, 2, 3], "mixed": ["a", 1, 2.5, True, [1, [2]]], "empty_arr": [],
              S.OP: "rms_norm", S.STEP_NUMBER: -5, S.CONFIG: "é\x00"}
    s = span(attrs=attrs)
    s.attributes.add(key="kv", value=AnyValue(kvlist_value=KeyValueList(values=kvs({"x": 1, "y": [b"z"]}))))
    s.attributes.add(key="none", value=AnyValue())
    s.attributes.add(key=S.PHASE, value=AnyValue())               # a typed key without a value
    s.attributes.add(key="arr_none", value=AnyValue(array_value=ArrayValue(values=[AnyValue()])))
    for key, value in attrs.items():
        s2 = span(attrs={key: value, S.COUNT: 3})
        assert check(request([s2]).SerializeToString()) is not None, key
    assert check(request([s, span(), span(attrs={})]).SerializeToString()) is not None


def test_structure_resources_scopes_events_status():
    event = Span.Event(time_unix_nano=5, name=S.ERROR_EVENT, attributes=kvs({S.REASON: "boom", "n": 2}))
    bare_event = Span.Event(time_unix_nano=6, name="")
    with_events = span("rtx.step", {S.STEP_NUMBER: 1}, events=[event, bare_event])
    with_events.status.CopyFrom(Status(code=Status.STATUS_CODE_ERROR, message="bad ü"))
    child = span(parent=with_events.span_id, trace_id=with_events.trace_id)
    req = request([span(), with_events, child])
    rs2 = req.resource_spans.add()
    rs2.resource.attributes.extend(kvs({**RESOURCE, "rtx.rank": 3, "rtx.job.id": 7}))  # job id not a str
    rs2.schema_url = "https://opentelemetry.io/schemas/1.21.0"
    rs2.scope_spans.add()                                           # a scope without spans
    ss = rs2.scope_spans.add()                                      # and one without a name
    ss.spans.append(span(name=""))
    ss.scope.attributes.extend(kvs({"scope.attr": 1}))
    rs3 = req.resource_spans.add()                                  # a resource without scopes
    rs3.resource.attributes.extend(kvs({"service.name": "other"}))
    native = check(req.SerializeToString())
    assert native is not None and native.events.num_rows == 2 and native.resources.num_rows == 3


def test_declines_what_it_does_not_mirror():
    dup = span(attrs={"a": 1})
    dup.attributes.add(key="a", value=AnyValue(int_value=2))
    linked = span()
    linked.links.add(trace_id=os.urandom(16), span_id=os.urandom(8))
    wrong_typed = span(attrs={S.OP: 5, S.COUNT: "four", S.STEP_NUMBER: 1.5})
    deep = AnyValue(int_value=1)
    for _ in range(40):
        deep = AnyValue(array_value=ArrayValue(values=[deep]))
    nested = span()
    nested.attributes.add(key="deep", value=deep)
    many = span(attrs={f"a{i}": i for i in range(100)})
    for s in (dup, linked, wrong_typed, many):
        assert _columns.convert(request([s]).SerializeToString(), 7) is None
        check(request([s]).SerializeToString())
    assert _columns.convert(request([nested]).SerializeToString(), 7) is None
    with pytest.raises(TelemetryInputError):
        reference(request([nested]).SerializeToString())


def test_malformed_bodies_are_declined():
    marker = "MARKER-é"
    for where in ("name", "key", "value", "event", "scope", "status"):
        s = span(marker if where == "name" else "rtx.kernel",
                 {marker if where == "key" else "k": marker if where == "value" else "v"},
                 events=[Span.Event(time_unix_nano=1, name=marker if where == "event" else "e")])
        if where == "status":
            s.status.message = marker
        req = request([s])
        if where == "scope":
            req.resource_spans[0].scope_spans[0].scope.name = marker
        body = req.SerializeToString()
        assert body.count(marker.encode()) == 1, where
        bad = body.replace(marker.encode(), b"MARKER-\xff\xfe")
        assert _columns.convert(bad, 7) is None, where
        with pytest.raises(TelemetryInputError):
            reference(bad)
    late = request([span(start=(1 << 63) + 5)]).SerializeToString()
    short = request([span(trace_id=os.urandom(15))]).SerializeToString()
    no_resource = request([span()])
    no_resource.resource_spans[0].ClearField("resource")
    for body in (late, short, no_resource.SerializeToString(), b"\xff" * 64):
        assert _columns.convert(body, 7) is None


def test_truncations_and_random_corruption_agree_with_the_reference():
    s = span(attrs={**{k: v for k, v in zip("abcdef", ODD_STRINGS)}, "h": [1, 2], "d": 0.5, S.OP: "x"},
             events=[Span.Event(time_unix_nano=3, name="e", attributes=kvs({"q": 1}))])
    body = request([s, span()]).SerializeToString()
    for cut in range(len(body)):
        check(body[:cut])
    rnd = random.Random(3)
    answered = 0
    for _ in range(1500):
        mutated = bytearray(body)
        for _ in range(rnd.choice((1, 1, 2, 3))):
            mutated[rnd.randrange(len(mutated))] = rnd.randrange(256)
        answered += check(bytes(mutated)) is not None
    assert answered > 100                     # many corruptions still parse (strings, numbers)


def test_key_value_shapes():
    no_value = span()
    no_value.attributes.append(KeyValue(key="k"))
    assert _columns.convert(request([no_value]).SerializeToString(), 7) is None
    check(request([no_value]).SerializeToString())


@pytest.mark.parametrize("native", [True, False])
def test_non_finite_doubles_are_kept_as_json_strings(native, monkeypatch):
    monkeypatch.setenv("RTXOPS_OTLP_NATIVE", "1" if native else "0")
    body = request([span(attrs={"nan": math.nan, "inf": math.inf, "ninf": -math.inf, "ok": 1.5,
                                "arr": [1.0, math.nan]})]).SerializeToString()
    batch = otlp.convert(body, PROTOBUF, 7)
    assert json.loads(batch.spans["attributes"][0].as_py()) == {
        "nan": "NaN", "inf": "Infinity", "ninf": "-Infinity", "ok": 1.5, "arr": [1.0, "NaN"]}
