"""A step's rtx.kernel spans written straight to OTLP bytes (``_aggregate.kernel_spans``) once
the exporter takes bytes: the same spans, byte for byte, as the ReadableSpans they replace."""
from __future__ import annotations

import random
import time
from array import array

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

from rtxops.runtime import patching
from rtxops.runtime.plan import Plan
from rtxops.runtime.readings import CallStats, Slot
from rtxops.telemetry import encode as E
from rtxops.telemetry import schema as S
from rtxops.telemetry.exporters import STEPS_PER_ENCODE, StepProcessor
from rtxops.telemetry.job import start_job_telemetry
from rtxops.telemetry.recorder import StepRecord
from rtxops.telemetry.spans import CallSampling, SpanBuilder, _kernel_spans_native

from ..runtime.helpers import TinyNet, train_losses
from .test_encoded_export import _EncodingExporter, _span_count
from .test_spans import RESOURCE

pytestmark = pytest.mark.skipif(_kernel_spans_native is None, reason="built without a compiler")

SLOTS = [Slot(i, ("linear", "gelu", "rms_norm")[i % 3], "eager", "{}" if i % 2 else "",
              f"float32/cpu/rows={2 ** i}", f"F.site{i}", "eager") for i in range(5)]


def _records() -> list[StepRecord]:
    rnd = random.Random(3)
    out = []
    for step in range(1, 7):
        t0 = 10_000 * step
        calls = array("q")
        for i in range(40):
            # short, long and past the histogram's last bin (2^39 ns and more)
            dur = rnd.choice([rnd.randrange(1, 900), rnd.randrange(10 ** 6, 10 ** 9), 1 << 41])
            calls.extend([rnd.choice([0, 1, 3, 4]) if step % 2 else rnd.randrange(5), t0 + i, dur])
        out.append(StepRecord(
            step, t0, t0 + 10 ** 10, plan_version=step // 3, rss_bytes=7, calls=calls,
            backward=[(1, t0, 700), (4, t0 + 5, 1 << 20)] if step % 2 == 0 else [],
            builds=[(2, t0, 30, False), (3, t0, 30, True), (2, t0 + 1, 30, False)] if step == 1 else [],
            memory={1: (-(1 << 40), 4096), 2: (512, 1 << 33)} if step in (1, 2) else {}))
    return out


def _build(as_bytes: bool, records: list[StepRecord], id_generator=None, offset=None):
    random.seed(11)   # the SDK's span and trace ids: the same in both ways
    provider = TracerProvider(resource=Resource.create(RESOURCE), id_generator=id_generator)
    processor = StepProcessor()
    processor.accepts_encoded = as_bytes
    provider.add_span_processor(processor)
    totals = CallStats()
    for slot in SLOTS:
        totals.register_slot(slot)
    builder = SpanBuilder(provider.get_tracer("rtxops"), SLOTS, sampling=CallSampling(1, 2),
                          totals=totals, encoded_to=processor)
    builder._epoch_offset = 1_700_000_000 * 10 ** 9 if offset is None else offset
    made = sum(builder.build(rec, {S.DROPPED_STEPS: 0}) for rec in records)
    spans = processor.drain()
    pieces = [(e.resource, e.scope, e.span_fields) for e in processor.drain_encoded()]
    return made, spans, pieces, builder, totals


def _spans_of(body: bytes) -> list[bytes]:
    request = ExportTraceServiceRequest.FromString(body)
    assert len(request.resource_spans) == 1 and len(request.resource_spans[0].scope_spans) == 1
    return sorted(s.SerializeToString() for s in request.resource_spans[0].scope_spans[0].spans)


def test_kernel_spans_written_as_bytes_are_the_bytes_of_the_spans_they_replace():
    made_a, spans_a, pieces_a, builder_a, totals_a = _build(False, _records())
    made_b, spans_b, pieces_b, builder_b, totals_b = _build(True, _records())
    assert not pieces_a and pieces_b
    assert {s.name for s in spans_b} == {S.STEP, S.CALL, S.COMPILE}   # the kernel spans are bytes
    assert made_a == made_b == len(spans_a) == len(spans_b) + sum(e[2].count(b"rtx.kernel")
                                                                  for e in pieces_b)
    merged = E.merge([E.encode(spans_b)], pieces_b)
    assert len(merged) == len(E.encode(spans_a))
    assert _spans_of(merged) == _spans_of(E.encode(spans_a))
    # what the step left for later, and the run's totals, alike too
    assert builder_a._memory_carried == builder_b._memory_carried
    assert (totals_a.calls, totals_a.total_ns, totals_a.build_misses) == (
        totals_b.calls, totals_b.total_ns, totals_b.build_misses)
    assert sum(totals_b.build_misses) == 2


class _WideIds(RandomIdGenerator):
    def generate_span_id(self) -> int:
        return 1 << 64


@pytest.mark.parametrize("odd", ["span ids past 64 bits", "times before 1970"])
def test_a_step_the_writer_declines_is_built_as_readable_spans(odd):
    """What OTLP cannot carry as the encoder writes it, the C writer declines, and nothing of the
    step is taken twice (the memory readings it carried show once, as in the other way)."""
    wide = _WideIds() if odd == "span ids past 64 bits" else None
    offset = -(1 << 62) if odd == "times before 1970" else None
    made, spans, pieces, builder, totals = _build(True, _records(), wide, offset)
    assert not pieces and made == len(spans)
    _, as_spans, _, _, _ = _build(False, _records(), wide, offset)
    kernels = [(dict(s.attributes), s.start_time, s.end_time) for s in spans if s.name == S.KERNEL]
    assert kernels and kernels == [(dict(s.attributes), s.start_time, s.end_time)
                                   for s in as_spans if s.name == S.KERNEL]
    assert sum(k[S.COUNT] for k, _, _ in kernels if k[S.PHASE] == "fwd") == sum(totals.calls)


def test_a_job_sends_its_kernel_spans_as_bytes_once_its_exporter_takes_bytes():
    """Real training: the first export's kernel spans are ReadableSpans (the exporter has not
    taken bytes yet), the later ones bytes; every call is in exactly one kernel span."""
    d = patching.enable(plan=Plan(version=1, defaults={"gelu": "eager"}))
    exporter = _EncodingExporter()
    telemetry = start_job_telemetry(d, exporter, resource=RESOURCE, export_interval_s=0.2)
    processor = telemetry.thread.processor
    try:
        train_losses(TinyNet(), steps=2)
        deadline = time.monotonic() + 30
        while not (processor.accepts_encoded and telemetry.thread.steps_built >= 2) and (
                time.monotonic() < deadline):
            time.sleep(0.01)
        assert processor.accepts_encoded
        written = []
        on_encoded = processor.on_encoded
        processor.on_encoded = lambda *a: (written.append(a[3]), on_encoded(*a))
        train_losses(TinyNet(), steps=4)
    finally:
        telemetry.close(d)
        patching.disable()
    spans = [s for body in exporter.bodies for rs in ExportTraceServiceRequest.FromString(body).resource_spans
             for ss in rs.scope_spans for s in ss.spans]
    assert len(spans) == telemetry.thread.spans_exported and telemetry.thread.spans_failed == 0

    def attrs(span):
        return {kv.key: kv.value for kv in span.attributes}

    kernels = [attrs(s) for s in spans if s.name == S.KERNEL]
    steps = sorted(attrs(s)[S.STEP_NUMBER].int_value for s in spans if s.name == S.STEP)
    assert steps == list(range(1, 7))
    stats = telemetry.recorder.totals
    for slot in stats.slots:
        mine = [k for k in kernels if k[S.PHASE].string_value == "fwd"
                and tuple(k[a].string_value for a in (S.OP, S.VARIANT, S.CONFIG, S.BUCKET, S.SITE))
                == (slot.op, slot.variant, slot.config, slot.bucket, slot.site)]
        assert sum(k[S.COUNT].int_value for k in mine) == stats.calls[slot.id]
        assert sum(k[S.TOTAL_NS].int_value for k in mine) == stats.total_ns[slot.id]
    assert sum(stats.calls) > 0
    assert {k[S.STEP_NUMBER].int_value for k in kernels} == set(range(1, 7))
    # the later steps' kernel spans were written as bytes
    assert sum(written) == sum(1 for k in kernels if k[S.STEP_NUMBER].int_value > 2) > 0


def test_an_exporter_whose_encoder_breaks_gets_the_bytes_already_written_and_spans_after():
    class Keeping(_EncodingExporter):
        def export(self, spans):
            self.spans = getattr(self, "spans", []) + list(spans)
            return super().export(spans)

    exporter = Keeping()
    d = patching.enable(plan=Plan(version=1, defaults={"gelu": "eager"}))
    telemetry = start_job_telemetry(d, exporter, resource=RESOURCE, export_interval_s=60)
    thread, processor = telemetry.thread, telemetry.thread.processor
    steps = 3 * STEPS_PER_ENCODE
    try:
        processor.accepts_encoded = True      # as after an export
        train_losses(TinyNet(), steps=steps)
        exporter.encodes = False              # its encoder breaks before the steps are built
        telemetry.close(d)
    finally:
        patching.disable()
    assert not processor.accepts_encoded and exporter.bodies and exporter.as_spans
    assert thread.spans_failed == 0
    as_bytes = [kv.value.int_value for body in exporter.bodies
                for rs in ExportTraceServiceRequest.FromString(body).resource_spans
                for ss in rs.scope_spans for s in ss.spans if s.name == S.KERNEL
                for kv in s.attributes if kv.key == S.STEP_NUMBER]
    as_spans = [s.attributes[S.STEP_NUMBER] for s in exporter.spans if s.name == S.KERNEL]
    # the first chunk's kernel spans were bytes already; every later step's are spans
    assert set(as_bytes) == set(range(1, STEPS_PER_ENCODE + 1))
    assert set(as_spans) == set(range(STEPS_PER_ENCODE + 1, steps + 1))
    assert sum(_span_count(b) for b in exporter.bodies) + exporter.as_spans == thread.spans_exported
