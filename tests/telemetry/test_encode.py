"""The job-side OTLP encoder writes exactly the bytes of the SDK exporters' encoder."""
from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

from rtxops.telemetry import encode as E


class Version(str):
    """Like torch's TorchVersion: a str subclass as an attribute value."""


def provider(resource: dict) -> tuple[TracerProvider, InMemorySpanExporter]:
    p = TracerProvider(resource=Resource.create(resource))
    memory = InMemorySpanExporter()
    p.add_span_processor(SimpleSpanProcessor(memory))
    return p, memory


ODD = {"s": "plain", "empty": "", "uni": "é 漢 😀", "ctl": "\x00\n", "t": True, "f": False, "zero": 0,
       "neg": -5, "min": -(1 << 63), "max": (1 << 63) - 1, "half": 0.5, "negz": -0.0, "big": 1e300,
       "ints": [1, -2, 0], "strs": ["a", ""], "bools": [True], "floats": [1.5], "none": [],
       "ver": Version("2.13.0")}


def spans_of_every_shape():
    p1, m1 = provider({"service.name": "a", "torch": Version("2.1")})
    p2, m2 = provider({"service.name": "b"})
    t1, t1b, t2 = p1.get_tracer("rtxops"), p1.get_tracer("other", "1.2", schema_url="https://x"), p2.get_tracer("x")
    with t1.start_as_current_span("rtx.step", attributes=ODD, start_time=10) as step:
        step.add_event("rtx.variant.disabled", {"rtx.reason": "boom", "n": 3}, timestamp=12)
        step.add_event("bare")
        for kind in SpanKind:
            s = t1.start_span("k", kind=kind, start_time=11)
            s.end(end_time=20)
        err = t1b.start_span("err")
        err.set_status(Status(StatusCode.ERROR, "bad ü"))
        err.end()
        ok = t2.start_span("ok")
        ok.set_status(Status(StatusCode.OK))
        ok.end()
    remote = SpanContext(0x1234, 0x99, is_remote=True, trace_flags=TraceFlags(1))
    child = t1.start_span("remote-child", context=trace.set_span_in_context(trace.NonRecordingSpan(remote)))
    child.end()
    spans = list(m1.get_finished_spans()) + list(m2.get_finished_spans())
    return spans[::2] + spans[1::2]          # resources interleaved


def test_bytes_equal_the_sdk_encoder():
    spans = spans_of_every_shape()
    assert E.encode(spans) == encode_spans(spans).SerializeToString()
    for span in spans:
        assert E.encode([span]) == encode_spans([span]).SerializeToString()
    assert E.encode([]) == encode_spans([]).SerializeToString()


def test_span_builder_spans():
    from .test_spans import _run  # real spans of a tiny training run

    spans = _run(steps=3)[2]
    assert len(spans) > 10 and E.encode(spans) == encode_spans(spans).SerializeToString()


@pytest.mark.parametrize("what", ["link", "map"])
def test_declines_links_and_maps(what):
    p, memory = provider({})
    tracer = p.get_tracer("t")
    if what == "link":
        tracer.start_span("l", links=[Link(SpanContext(1, 2, False))]).end()
    else:
        span = tracer.start_span("m")
        span._attributes._dict["kv"] = {"a": 1}               # the SDK itself refuses to set one
        span.end()
    assert E.encode(memory.get_finished_spans()) is None


def test_equal_tuples_of_other_types_are_encoded_as_their_own_types():
    p, memory = provider({})
    tracer = p.get_tracer("t")
    for value in ((1, 2), (True, False), (1.0, 2.0)):  # equal as tuples: (1, 2) == (1.0, 2.0)
        tracer.start_span("s", attributes={"a": value}).end()
    spans = memory.get_finished_spans()
    assert E.encode(spans) == encode_spans(spans).SerializeToString()


@pytest.mark.parametrize("value", [1 << 63, -(1 << 63) - 1, 1 << 64])
def test_declines_integers_outside_int64(value):
    p, memory = provider({})
    span = p.get_tracer("t").start_span("big")
    span._attributes._dict["n"] = value  # set past the SDK's checks: never sent wrapped
    span.end()
    assert E.encode(memory.get_finished_spans()) is None


def test_fast_exporter_posts_the_same_bytes(monkeypatch):
    from rtxops.telemetry.exporters import otlp_http_exporter

    exporter = otlp_http_exporter("http://127.0.0.1:9", "tok")
    sent = []

    class Result:
        success, error = True, None

    monkeypatch.setattr(exporter._client, "export", lambda body: sent.append(body) or Result())
    spans = spans_of_every_shape()
    assert exporter.export(spans).name == "SUCCESS"
    assert sent == [encode_spans(spans).SerializeToString()]
