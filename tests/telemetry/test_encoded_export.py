"""Spans encoded as they are built and sent as one merged request per export."""
from __future__ import annotations

import gc
import random
import time

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult

from rtxops.runtime import patching
from rtxops.runtime.plan import Plan
from rtxops.telemetry import encode as E
from rtxops.telemetry.exporters import (
    MAX_SPANS_PER_EXPORT,
    STEPS_PER_ENCODE,
    DeferredExporter,
    ExportThread,
    StepProcessor,
)
from rtxops.telemetry.job import start_job_telemetry

from ..runtime.helpers import TinyNet, train_losses
from .test_encode import capturing_otlp_exporter, spans_of_every_shape
from .test_spans import RESOURCE, _record


def _span_count(body: bytes) -> int:
    request = ExportTraceServiceRequest.FromString(body)
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


@pytest.mark.parametrize("native_on", ["1", "0"])
def test_merged_requests_are_the_bytes_of_one_request_of_all_their_spans(native_on, monkeypatch):
    monkeypatch.setenv("RTXOPS_OTLP_NATIVE", native_on)
    spans = spans_of_every_shape()          # two resources, three scopes, interleaved
    rnd = random.Random(0)
    for _ in range(20):
        cuts = sorted(rnd.sample(range(1, len(spans)), rnd.randint(1, 4)))
        chunks = [spans[a:b] for a, b in zip([0, *cuts], [*cuts, len(spans)])]
        merged = E.merge([E.encode(c) for c in chunks])
        assert merged == E.encode(spans) == encode_spans(spans).SerializeToString()


def test_a_request_merge_cannot_take_apart_is_kept_whole():
    spans = spans_of_every_shape()
    odd = E.encode(spans[3:]) + b"\x10\x01"   # an unknown top-level field: valid, but not ours
    merged = E.merge([E.encode(spans[:3]), odd])
    assert _span_count(merged) == len(spans)
    assert merged.startswith(E.merge([E.encode(spans[:3])]))


class _EncodingExporter:
    """Takes its spans encoded (as the OTLP and DuckDB exporters do) and keeps each request."""

    def __init__(self, failures: int = 0, encodes: bool = True):
        self.bodies: list[bytes] = []
        self.as_spans = 0
        self.failures = failures
        self.encodes = encodes
        self.encode_calls = 0

    def encode_request(self, spans):
        self.encode_calls += 1
        if not self.encodes:
            raise ValueError("this exporter's encoder broke")
        return E.encode(spans)

    def export_encoded(self, body, spans):
        assert _span_count(body) == spans
        if self.failures:
            self.failures -= 1
            return SpanExportResult.FAILURE
        self.bodies.append(body)
        return SpanExportResult.SUCCESS

    def export(self, spans):
        self.as_spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


def _thread(exporter, spans_per_step: int, **kwargs) -> ExportThread:
    processor = StepProcessor()
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("test")

    def build(rec, counters):
        for _ in range(spans_per_step):
            tracer.start_span("rtx.kernel").end()
        return spans_per_step

    return ExportThread(build, processor, exporter, **kwargs)


def test_an_interval_of_steps_goes_out_as_one_request_however_often_the_thread_looked():
    exporter = _EncodingExporter()
    thread = _thread(exporter, 10, interval_s=60, poll_s=0.01)
    for step in range(5):
        thread.submit(_record(step))
        time.sleep(0.05)                      # a look (and an encoding) per step
    thread.close()
    assert len(exporter.bodies) == 1 and _span_count(exporter.bodies[0]) == 50
    request = ExportTraceServiceRequest.FromString(exporter.bodies[0])
    assert len(request.resource_spans) == 1 and len(request.resource_spans[0].scope_spans) == 1
    assert thread.spans_exported == 50 and exporter.as_spans == 0


def test_an_interval_over_one_requests_spans_goes_out_in_parts_when_encoded_too():
    exporter = _EncodingExporter()
    thread = _thread(exporter, 2 * MAX_SPANS_PER_EXPORT + 100, interval_s=60, poll_s=60)
    thread.submit(_record(1))
    thread.close()
    assert [_span_count(b) for b in exporter.bodies] == [MAX_SPANS_PER_EXPORT] * 2 + [100]
    assert thread.spans_exported == 2 * MAX_SPANS_PER_EXPORT + 100


def test_an_encoded_part_refused_once_goes_again_with_the_next_export():
    exporter = _EncodingExporter(failures=1)
    thread = _thread(exporter, 10, interval_s=0.05, poll_s=0.01)
    for step in range(3):
        thread.submit(_record(step))
        time.sleep(0.2)
    thread.close()
    assert sum(_span_count(b) for b in exporter.bodies) == 30 == thread.spans_exported
    assert thread.spans_failed == 0


def test_spans_an_exporter_fails_to_encode_go_out_as_spans():
    """Its encoder raised once: it gets spans from then on (not a warning every look)."""
    exporter = _EncodingExporter(encodes=False)
    thread = _thread(exporter, 10, interval_s=60, poll_s=0.01)
    for step in range(3):
        thread.submit(_record(step))
        time.sleep(0.05)
    thread.close()
    assert exporter.as_spans == 30 == thread.spans_exported and not exporter.bodies
    assert exporter.encode_calls == 1


def _job_spans_alive(provider) -> int:
    return sum(1 for o in gc.get_objects()
               if issubclass(type(o), ReadableSpan) and o.resource is provider.resource)


def test_a_jobs_spans_do_not_outlive_the_export_that_built_them():
    """Held until the export (10 s), they outlived the collector's young generations and set off
    full collections of the job's heap, the GIL held for 100+ ms."""
    d = patching.enable(plan=Plan(version=1, defaults={"gelu": "eager"}))
    exporter = _EncodingExporter()
    telemetry = start_job_telemetry(d, exporter, resource=RESOURCE, export_interval_s=0.3)
    try:
        train_losses(TinyNet(), steps=4)
        deadline = time.monotonic() + 30
        while (telemetry.thread.steps_built < 4 or not exporter.bodies) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert telemetry.thread.steps_built >= 4 and exporter.bodies
        deadline = time.monotonic() + 5
        while _job_spans_alive(telemetry.provider) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _job_spans_alive(telemetry.provider) == 0
    finally:
        telemetry.close(d)
        patching.disable()
    assert sum(_span_count(b) for b in exporter.bodies) == telemetry.thread.spans_exported > 4


def test_steps_are_built_only_when_their_export_is_due():
    """A look that finds no export due builds nothing: the spans of an interval are made in one
    burst before its request, not a few at every look on caches the job's compute has filled."""
    exporter = _EncodingExporter()
    thread = _thread(exporter, 10, interval_s=60, poll_s=0.01)
    for step in range(5):
        thread.submit(_record(step))
    time.sleep(0.3)                               # some 30 looks
    assert thread.steps_built == 0
    thread.close()
    assert thread.steps_built == 5 and [_span_count(b) for b in exporter.bodies] == [50]


def test_half_a_queue_waiting_is_built_before_its_export_is_due():
    exporter = _EncodingExporter()
    thread = _thread(exporter, 10, max_queue=8, interval_s=60, poll_s=60)
    for step in range(5):          # the fifth finds half the queue waiting and wakes the thread
        thread.submit(_record(step))
    deadline = time.monotonic() + 10
    while thread.steps_built < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert thread.steps_built == 5 and not exporter.bodies and thread.steps_dropped == 0
    thread.close()
    assert [_span_count(b) for b in exporter.bodies] == [50]


def test_a_burst_of_steps_is_encoded_a_few_steps_at_a_time():
    """Building an interval's steps at once must not hold all their SDK spans at once."""
    processor = StepProcessor()
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("test")
    waiting: list[int] = []

    def build(rec, counters):
        waiting.append(len(processor._spans))     # spans made and not yet encoded
        for _ in range(10):
            tracer.start_span("rtx.kernel").end()
        return 10

    exporter = _EncodingExporter()
    thread = ExportThread(build, processor, exporter, interval_s=60, poll_s=60)
    for step in range(5 * STEPS_PER_ENCODE):
        thread.submit(_record(step))
    thread.close()
    assert len(waiting) == 5 * STEPS_PER_ENCODE
    assert max(waiting) == 10 * (STEPS_PER_ENCODE - 1)
    assert [_span_count(b) for b in exporter.bodies] == [50 * STEPS_PER_ENCODE]


def test_the_otlp_exporter_behind_a_deferred_one_posts_one_merged_request(monkeypatch):
    exporter, sent = capturing_otlp_exporter(monkeypatch)
    thread = _thread(DeferredExporter(lambda: exporter), 10, interval_s=60, poll_s=0.01)
    for step in range(3):
        thread.submit(_record(step))
        time.sleep(0.05)
    thread.close()
    assert len(sent) == 1 and _span_count(sent[0]) == 30 == thread.spans_exported


def test_a_deferred_exporter_whose_exporter_takes_only_spans_gets_spans():
    exporter = _EncodingExporter()
    exporter.encode_request = None            # an exporter without the encoded path
    thread = _thread(DeferredExporter(lambda: exporter), 10, interval_s=60, poll_s=0.01)
    for step in range(3):
        thread.submit(_record(step))
    thread.close()
    assert exporter.as_spans == 30 == thread.spans_exported
