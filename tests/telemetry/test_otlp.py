"""OTLP → Arrow conversion: fidelity of every column, OTLP/JSON, and precise input errors."""
from __future__ import annotations

import base64
import json
import os

import orjson
import pytest
from google.protobuf import json_format
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue, KeyValueList
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from rtxops.telemetry import _wire, otlp, synthetic
from rtxops.telemetry import schema as S
from rtxops.telemetry.otlp import JSON, PROTOBUF, TelemetryInputError

from .otlp_helpers import RESOURCE, kvs, request, span

KERNEL = {S.STEP_NUMBER: 12, S.PLAN_VERSION: 3, S.OP: "rms_norm", S.VARIANT: "triton",
          S.FAMILY: "triton", S.CONFIG: '{"block":128}', S.BUCKET: "float32/cuda/hidden=64,rows=512",
          S.SITE: "F.rms_norm", S.PHASE: "fwd", S.COUNT: 4, S.TOTAL_NS: 4000, S.MIN_NS: 900,
          S.MAX_NS: 1200, S.HIST: [0, 0, 3, 1], S.CACHE_HITS: 3, S.CACHE_MISSES: 1,
          S.SAMPLED: True, "custom.ratio": 0.25}


def rows(batch: otlp.Batch) -> list[dict]:
    return batch.spans.to_pylist()


def convert(req, content_type: str = PROTOBUF) -> otlp.Batch:
    return otlp.convert(req.SerializeToString(), content_type, 123)


def test_kernel_span_columns_and_json_attributes():
    step = span("rtx.step", {S.STEP_NUMBER: 12, S.RSS: 5 << 30})
    kernel = span("rtx.kernel", KERNEL, parent=step.span_id, trace_id=step.trace_id)
    batch = convert(request([step, kernel]))
    assert batch.span_count == 2 and batch.received_ns == 123
    s, k = rows(batch)
    assert k["trace_id"] == kernel.trace_id.hex() and k["span_id"] == kernel.span_id.hex()
    assert k["parent_span_id"] == step.span_id.hex() and s["parent_span_id"] is None
    assert (k["start_ns"], k["end_ns"], k["duration_ns"]) == (
        kernel.start_time_unix_nano, kernel.end_time_unix_nano, 1000)
    assert k["name"] == "rtx.kernel" and k["kind"] == Span.SPAN_KIND_INTERNAL and k["status_code"] == 1
    for attr, column in otlp.SPAN_ATTRIBUTE_COLUMNS.items():
        assert k[column] == KERNEL[attr], column
    assert json.loads(k["attributes"]) == {
        S.FAMILY: "triton", S.HIST: [0, 0, 3, 1], S.CACHE_HITS: 3, S.CACHE_MISSES: 1,
        S.SAMPLED: True, "custom.ratio": 0.25}
    assert s["step"] == 12 and s["op"] is None and json.loads(s["attributes"]) == {S.RSS: 5 << 30}
    assert (k["job_id"], k["rank"]) == ("job-a", 1) and k["scope_name"] == "test"


def test_resource_row_and_stable_id():
    a = convert(request([span()]))
    b = convert(request([span()], resource=dict(reversed(list(RESOURCE.items())))))
    other = convert(request([span()], resource={**RESOURCE, "rtx.rank": 2}))
    (res,) = a.resources.to_pylist()
    assert res["resource_id"] == rows(a)[0]["resource_id"] == b.resources.to_pylist()[0]["resource_id"]
    assert other.resources.to_pylist()[0]["resource_id"] != res["resource_id"]
    assert {k: res[k] for k in ("service_name", "host_name", "job_id", "rank", "process_pid")} == {
        "service_name": "trainer", "host_name": "h1", "job_id": "job-a", "rank": 1, "process_pid": 77}
    assert json.loads(res["attributes"]) == {"hw.gpu.model": "H200"}


def test_value_types_nested_and_odd_values():
    attrs = [KeyValue(key="s", value=AnyValue(string_value="é✓")),
             KeyValue(key="b", value=AnyValue(bool_value=False)),
             KeyValue(key="d", value=AnyValue(double_value=-1.5)),
             KeyValue(key="neg", value=AnyValue(int_value=-(1 << 62))),
             KeyValue(key="raw", value=AnyValue(bytes_value=b"\x00\xff")),
             KeyValue(key="empty", value=AnyValue()),
             KeyValue(key="mixed", value=synthetic.any_value([1, "two", 3.0])),
             KeyValue(key="kv", value=AnyValue(kvlist_value=KeyValueList(values=kvs({"x": [1, 2]})))),
             KeyValue(key="dup", value=AnyValue(int_value=1)),
             KeyValue(key="dup", value=AnyValue(int_value=2))]
    s = span()
    s.attributes.extend(attrs)
    (row,) = rows(convert(request([s])))
    assert json.loads(row["attributes"]) == {
        "s": "é✓", "b": False, "d": -1.5, "neg": -(1 << 62),
        "raw": base64.b64encode(b"\x00\xff").decode(), "empty": None, "mixed": [1, "two", 3.0],
        "kv": {"x": [1, 2]}, "dup": 2}


def test_column_decoding_falls_back_when_values_differ_across_spans():
    spans = [span(attrs={"v": 1, S.STEP_NUMBER: 1}), span(attrs={"v": "one", S.STEP_NUMBER: "x"}),
             span(attrs={"v": [1, 2], S.STEP_NUMBER: 3})]
    got = rows(convert(request(spans)))
    assert [json.loads(r["attributes"])["v"] for r in got] == [1, "one", [1, 2]]
    assert [r["step"] for r in got] == [1, None, 3]                  # a string is no BIGINT...
    assert json.loads(got[1]["attributes"])[S.STEP_NUMBER] == "x"   # ...so it stays in the JSON


def test_spans_with_different_key_orders_and_counts_keep_their_own_values():
    spans = [span(attrs={"a": i, "b": f"x{i}"} if i % 3 else {"b": f"x{i}", "a": i, "c": i})
             for i in range(30)]
    got = rows(convert(request(spans)))
    for i, r in enumerate(got):
        want = {"a": i, "b": f"x{i}"} if i % 3 else {"b": f"x{i}", "a": i, "c": i}
        assert json.loads(r["attributes"]) == want


def test_non_canonical_encodings_decode_like_protobuf():
    plain = AnyValue(int_value=1).SerializeToString()
    long_varint = b"\x18\x81\x80\x00"                      # 1, in three bytes
    twice = b"\x18\x05" + plain                          # a repeated field: the last wins
    unknown_only = b"\xc0\x3e\x01"                       # field 1000: nothing we know
    raws = [plain, long_varint, twice, unknown_only, plain]
    assert _wire.decode_column(raws) is None
    assert _wire.decode_values(raws) == [1, 1, 1, None, 1]
    arrays = [synthetic.any_value([1, 2]).SerializeToString(),
              b"\x2a\x08\x0a\x02\x18\x05\x0a\x02\x18\x07"]          # [5, 7]
    assert _wire.decode_column(arrays) == [(1, 2), (5, 7)]
    compensated = b"\x2a\x08\x0a\x04\x18\x05\x18\x06\x0a\x00"        # [6, None] per protobuf
    assert _wire.decode_column([arrays[0], compensated]) is None
    assert _wire.decode_values([compensated]) == [(6, None)]


def test_events_go_to_their_table():
    event = Span.Event(time_unix_nano=5, name=S.ERROR_EVENT, attributes=kvs({S.REASON: "boom"}))
    s = span("rtx.step", {S.STEP_NUMBER: 1}, events=[event])
    batch = convert(request([span(), s, span()]))
    assert batch.events.to_pylist() == [{"trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                         "time_ns": 5, "name": S.ERROR_EVENT,
                                         "attributes": orjson.dumps({S.REASON: "boom"}).decode()}]


def test_synthetic_exporter_shaped_request_round_trips():
    req = synthetic.otlp_request(500, seed=3)
    got = rows(convert(req))
    spans = req.resource_spans[0].scope_spans[0].spans
    assert len(got) == len(spans) == 500
    for s, r in zip(spans, got):
        attrs = {kv.key: _wire.any_value(kv.value) for kv in s.attributes}
        assert r["span_id"] == s.span_id.hex() and r["name"] == s.name
        assert r["step"] == attrs[S.STEP_NUMBER] and r["count"] == attrs.get(S.COUNT)
        assert r["op"] == attrs.get(S.OP) and r["total_ns"] == attrs.get(S.TOTAL_NS)
        rest = {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.items()
                if k not in S.TYPED_SPAN_ATTRIBUTES}
        assert json.loads(r["attributes"]) == rest


def test_readable_spans_take_the_same_path():
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create(RESOURCE))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("rtxops")
    with tracer.start_as_current_span(S.STEP, attributes={S.STEP_NUMBER: 4}):
        with tracer.start_as_current_span(S.KERNEL, attributes={S.OP: "gelu", S.HIST: [1, 2]}):
            pass
    batch = otlp.to_arrow(otlp.encode_readable_spans(memory.get_finished_spans()), 9)
    kernel, step = rows(batch)
    assert kernel["op"] == "gelu" and json.loads(kernel["attributes"]) == {S.HIST: [1, 2]}
    assert kernel["parent_span_id"] == step["span_id"] and step["step"] == 4
    assert batch.resources.to_pylist()[0]["job_id"] == "job-a"


# ---- OTLP/JSON ---------------------------------------------------------------------------------

def otlp_json(req) -> dict:
    """The OTLP/JSON encoding of ``req``: protobuf's JSON mapping with hex ids."""
    data = json_format.MessageToDict(req)
    for rs in data["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for s in ss["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in s:
                        s[key] = base64.b64decode(s[key]).hex()
    return data


def test_json_matches_protobuf():
    step = span("rtx.step", {S.STEP_NUMBER: 12})
    req = request([step, span(attrs=KERNEL, parent=step.span_id, trace_id=step.trace_id)])
    data = otlp_json(req)
    data["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["kind"] = 1      # enums as ints too
    assert isinstance(data["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["startTimeUnixNano"], str)
    from_json = otlp.convert(json.dumps(data).encode(), "application/json; charset=utf-8", 123)
    assert rows(from_json) == rows(convert(req))
    assert from_json.resources.to_pylist() == convert(req).resources.to_pylist()


# ---- errors ------------------------------------------------------------------------------------

def reject(body: bytes, content_type: str = PROTOBUF) -> str:
    with pytest.raises(TelemetryInputError) as e:
        otlp.convert(body, content_type, 0)
    return str(e.value)


def test_truncated_and_corrupt_protobuf():
    body = synthetic.otlp_request(50).SerializeToString()
    assert "not a valid OTLP protobuf" in reject(body[:-7])
    assert "not a valid OTLP protobuf" in reject(b"\xff" * 64)


def test_invalid_utf8_anywhere():
    def with_bad(where: str) -> bytes:
        marker = "MARKER-é"
        s = span(marker if where == "name" else "rtx.kernel",
                 {marker if where == "key" else "k": marker if where == "value" else "v",
                  "ok": 1})
        body = request([s]).SerializeToString()
        assert body.count(marker.encode()) == 1
        return body.replace(marker.encode(), b"MARKER-\xff\xfe")

    assert "not UTF-8" in reject(with_bad("name"))
    assert "not UTF-8" in reject(with_bad("key"))
    message = reject(with_bad("value"))
    assert "attribute 'k'" in message and "UTF-8" in message and "spans[0]" in message
    assert "not valid UTF-8" in reject(b'{"resourceSpans": ["\xff"]}', JSON)


def test_bad_ids_and_limits_and_a_missing_resource():
    short = span(trace_id=os.urandom(15))
    assert "trace_id has 15 bytes" in reject(request([short]).SerializeToString())
    no_span_id = span(span_id=b"")
    assert "span_id has 0 bytes" in reject(request([span(), no_span_id]).SerializeToString())
    assert "spans[1].span_id" in reject(request([span(), no_span_id]).SerializeToString())
    req = request([span()])
    req.resource_spans[0].ClearField("resource")   # unset: an empty resource (the proto says so)
    assert rows(otlp.convert(req.SerializeToString(), otlp.PROTOBUF, 0))[0]["job_id"] is None
    many = span(attrs={f"a{i}": i for i in range(otlp.MAX_ATTRIBUTES + 1)})
    assert "the limit is 1024" in reject(request([many]).SerializeToString())
    big_resource = {f"r{i}": i for i in range(otlp.MAX_ATTRIBUTES + 1)}
    assert "the limit is 1024" in reject(request([span()], big_resource).SerializeToString())
    late = span(start=(1 << 63) + 5)
    assert "2^63" in reject(request([late]).SerializeToString())


def test_bad_json():
    assert "not valid JSON" in reject(b"{nope", JSON)
    assert "must be an object" in reject(b"[1, 2]", JSON)
    good = otlp_json(request([span()]))
    good["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"] = "zz" * 16
    assert "traceId is not hex" in reject(json.dumps(good).encode(), JSON)
    good = otlp_json(request([span()]))
    good["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["startTimeUnixNano"] = "soon"
    assert "not an OTLP ExportTraceServiceRequest" in reject(json.dumps(good).encode(), JSON)
    good = otlp_json(request([span()]))
    good["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["kind"] = "SPAN_KIND_FROM_THE_FUTURE"
    good["resourceSpans"][0]["futureField"] = {"x": 1}
    assert rows(otlp.convert(json.dumps(good).encode(), JSON, 0))[0]["kind"] == 0   # spec: ignore
    deep = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    assert "JSON" in reject(deep, JSON)


def test_unknown_content_type():
    assert "unsupported content type" in reject(b"", "text/plain")


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_request_of_too_many_span_events_is_refused_on_either_decoding_path(native, monkeypatch):
    """Events are a row each: 2 bytes on the wire apiece, so a small body made millions."""
    monkeypatch.setenv("RTXOPS_OTLP_NATIVE", native)
    one = span(events=[Span.Event()] * 1024)
    body = request([one] * (otlp.MAX_REQUEST_EVENTS // 1024 + 1)).SerializeToString()
    with pytest.raises(TelemetryInputError, match="the limit is 262144 a request"):
        otlp.convert(body, PROTOBUF, 0)
    body = request([one] * (otlp.MAX_REQUEST_EVENTS // 1024)).SerializeToString()
    assert otlp.convert(body, PROTOBUF, 0).events.num_rows == otlp.MAX_REQUEST_EVENTS


def test_a_huge_attribute_key_is_not_kept_after_its_request(monkeypatch):
    """The attribute-layout cache kept every layout, whatever its keys' size: requests with a
    large key (gzipped, 1000:1) pinned that much memory each, 4096 of them."""
    monkeypatch.setenv("RTXOPS_OTLP_NATIVE", "0")
    key = "k" * (1 << 20)
    batch = otlp.convert(request([span(attrs={key: 1, "rtx.op": "x"})]).SerializeToString(), PROTOBUF, 0)
    assert key in batch.spans["attributes"][0].as_py()
    assert not any(key in keys for keys in otlp._layouts)
    small = otlp.convert(request([span(attrs={"small": 1})]).SerializeToString(), PROTOBUF, 0)
    assert small.spans["attributes"][0].as_py() == '{"small":1}'
    assert ("small",) in otlp._layouts   # small ones are still kept


def test_bytes_and_non_finite_doubles_stay_out_of_typed_string_columns():
    """A bytes ``rtx.op`` was stored as its base64 text in the typed ``op`` column, a NaN
    ``rtx.phase`` as "NaN": values of another type go to the attributes' JSON, as an int
    ``rtx.variant`` does."""
    attrs = [KeyValue(key="rtx.op", value=AnyValue(bytes_value=b"mm")),
             KeyValue(key="rtx.phase", value=AnyValue(double_value=float("nan"))),
             KeyValue(key="rtx.variant", value=AnyValue(int_value=3)),
             KeyValue(key="rtx.bucket", value=AnyValue(string_value="b"))]
    req = request([span(attrs={})])
    req.resource_spans[0].scope_spans[0].spans[0].attributes.extend(attrs)
    for batch in (otlp.convert(req.SerializeToString(), PROTOBUF, 0),
                  otlp.convert(json.dumps(otlp_json(req)).encode(), JSON, 0)):
        row = batch.spans.to_pylist()[0]
        assert (row["op"], row["phase"], row["variant"], row["bucket"]) == (None, None, None, "b")
        assert orjson.loads(row["attributes"]) == {"rtx.op": "bW0=", "rtx.phase": "NaN", "rtx.variant": 3}
