"""Span content from a real (tiny) training run: counts and durations equal what was recorded."""
from __future__ import annotations

import time
import types

import pytest
import torch
import torch.nn.functional as F
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torch import nn

from rtxops.runtime import patching
from rtxops.runtime.plan import ExploreArm, Plan
from rtxops.telemetry import schema as S
from rtxops.telemetry.job import start_job_telemetry
from rtxops.telemetry.spans import CallSampling

from .._bounded import joined, read_all, reaped
from ..runtime.helpers import TinyNet, bucket_id, plan_for, train_losses

RESOURCE = {S.SERVICE_NAME: "test", S.JOB_ID: "job-1", S.RANK: 0}


def _run(steps: int, capacity: int = 1 << 16, backward_every: int = 2, sampling=None):
    d = patching.enable(plan=Plan(version=1, defaults={"gelu": "eager"}))
    d.backward_every = backward_every
    exporter = InMemorySpanExporter()
    telemetry = start_job_telemetry(d, exporter, capacity=capacity, resource=RESOURCE,
                                    sampling=sampling or CallSampling(2, 10))
    train_losses(TinyNet(), steps=steps)
    telemetry.close(d)
    # the run's totals are added up from the step records off the hot path
    stats = telemetry.recorder.totals
    return d, stats, exporter.get_finished_spans(), telemetry


def _by_name(spans, name):
    return [s for s in spans if s.name == name]


def test_step_and_kernel_spans_match_the_recorded_calls():
    d, stats, spans, _ = _run(steps=4)
    steps = _by_name(spans, S.STEP)
    assert [s.attributes[S.STEP_NUMBER] for s in steps] == [1, 2, 3, 4]
    kernels = [k for k in _by_name(spans, S.KERNEL) if k.attributes[S.PHASE] == "fwd"]
    # every kernel span hangs under the step span of its step
    step_ids = {s.context.span_id: s.attributes[S.STEP_NUMBER] for s in steps}
    assert all(step_ids[k.parent.span_id] == k.attributes[S.STEP_NUMBER] for k in kernels)
    for slot in stats.slots:
        mine = [k for k in kernels if (k.attributes[S.OP], k.attributes[S.VARIANT], k.attributes[S.BUCKET],
                                       k.attributes[S.SITE]) == (slot.op, slot.variant, slot.bucket, slot.site)]
        assert sum(k.attributes[S.COUNT] for k in mine) == stats.calls[slot.id]
        assert sum(k.attributes[S.TOTAL_NS] for k in mine) == stats.total_ns[slot.id]
        for k in mine:
            a = k.attributes
            assert a[S.MIN_NS] <= a[S.TOTAL_NS] / a[S.COUNT] <= a[S.MAX_NS]
            assert sum(a[S.HIST]) == a[S.COUNT]
            assert a[S.CACHE_HITS] + a[S.CACHE_MISSES] == a[S.COUNT]
            assert k.start_time <= k.end_time
    assert sum(stats.calls) > 0
    ops = {k.attributes[S.OP] for k in kernels}
    assert {"linear", "layer_norm", "gelu", "cross_entropy"} <= ops
    gelu = [k for k in kernels if k.attributes[S.OP] == "gelu"]
    assert {k.attributes[S.VARIANT] for k in gelu} == {"eager"}
    misses = {k.attributes[S.STEP_NUMBER]: k.attributes[S.CACHE_MISSES] for k in gelu}
    assert misses == {1: 1, 2: 0, 3: 0, 4: 0}  # built once, reused after


def test_backward_is_timed_on_sampled_steps():
    _, _, spans, _ = _run(steps=4, backward_every=2)
    bwd = [k for k in _by_name(spans, S.KERNEL) if k.attributes[S.PHASE] == "bwd"]
    assert bwd and all(k.attributes[S.SAMPLED] for k in bwd)
    # armed at the end of steps 2 and 4: the next forward's calls (steps 3 and 5) carry them
    assert {k.attributes[S.STEP_NUMBER] for k in bwd} <= {3, -1}
    assert all(k.attributes[S.TOTAL_NS] > 0 for k in bwd)
    assert {k.attributes[S.OP] for k in bwd} >= {"linear", "gelu"}


class LlamaRMSNorm(nn.Module):
    """An RMSNorm module routed by its class (a module site)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(dim)), 1e-6

    def forward(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.mark.parametrize("op, other", [("gelu", "algebraic"), ("rms_norm", "fused")])
def test_each_arm_of_an_exploring_bucket_has_its_backward_timed(op, other):
    """The evolve loop weighs a winner's backward while its bucket explores: each arm's backward
    is sampled then (the explore route's arms were skipped: no backward of either was timed)."""
    x = torch.randn(16, 64)
    norm = LlamaRMSNorm(64)
    call, bucket = ((lambda t: F.gelu(t), bucket_id("gelu", x)) if op == "gelu" else
                    (norm, bucket_id("rms_norm", x, (64,), norm.weight, norm.variance_epsilon)))
    explore = [ExploreArm(other, {}, 0.5)]
    d = patching.enable(plan=plan_for(1, (op, bucket, "eager", {}, explore)))
    d.backward_every = 1
    exporter = InMemorySpanExporter()
    telemetry = start_job_telemetry(d, exporter, resource=RESOURCE)
    for _ in range(12):
        call(x.clone().requires_grad_(True)).sum().backward()
        d.on_step()
    telemetry.close(d)
    bwd = [k.attributes for k in _by_name(exporter.get_finished_spans(), S.KERNEL)
           if k.attributes[S.PHASE] == "bwd" and k.attributes[S.OP] == op]
    calls = {v: sum(a[S.COUNT] for a in bwd if a[S.VARIANT] == v) for v in ("eager", other)}
    assert min(calls.values()) >= 3, calls
    assert all(a[S.TOTAL_NS] > 0 for a in bwd)


def test_sampled_call_spans_respect_their_budget():
    _, stats, spans, _ = _run(steps=6, sampling=CallSampling(1, 3))
    calls = _by_name(spans, S.CALL)
    used_slots = [s for s in stats.slots if stats.calls[s.id]]
    windows = 2  # steps 1-2 in window 0, 3-5 in window 1, 6 in window 2
    assert len(calls) <= len(used_slots) * (windows + 1)
    per_window = {}
    for c in calls:
        k = (c.attributes[S.STEP_NUMBER] // 3, c.attributes[S.OP], c.attributes[S.VARIANT],
             c.attributes[S.BUCKET], c.attributes[S.SITE])
        per_window[k] = per_window.get(k, 0) + 1
    assert per_window and max(per_window.values()) == 1


def test_a_step_with_more_calls_than_the_buffer_hands_them_over_early():
    """TinyNet makes 5 routed calls a step; a buffer of 3 was full at each step's fourth call and
    the rest were dropped (a job without an optimizer dropped all but its first 65536 calls and
    sent nothing until exit). A full buffer is handed over as it is, as step -1: every call is
    counted, none dropped."""
    capacity = 3
    _, stats, spans, _ = _run(steps=3, capacity=capacity, backward_every=0)
    steps = [s for s in _by_name(spans, S.STEP) if s.attributes[S.STEP_NUMBER] > 0]
    kernels = [k for k in _by_name(spans, S.KERNEL) if k.attributes[S.PHASE] == "fwd"]
    assert len(steps) == 3 and all(s.attributes[S.DROPPED_RECORDS] == 0 for s in steps)
    early = sum(k.attributes[S.COUNT] for k in kernels if k.attributes[S.STEP_NUMBER] == -1)
    at_steps = sum(k.attributes[S.COUNT] for k in kernels if k.attributes[S.STEP_NUMBER] > 0)
    assert early + at_steps == 5 * 3 and early >= 3 * 3
    assert sum(stats.calls) == 5 * 3


def test_calls_past_a_full_buffer_that_cannot_be_handed_over_are_counted_as_dropped():
    from rtxops.runtime.readings import Slot
    from rtxops.telemetry.recorder import Recorder

    handed = []

    def on_step(rec):
        if rec.step == -1:
            raise RuntimeError("the consumer is gone")
        handed.append(rec)

    recorder = Recorder(on_step, capacity=2)
    recorder.register_slot(Slot(0, "gelu", "eager", "{}", "b0", "F.gelu", "eager"))
    for i in range(5):
        recorder.record(0, i, 10)
    recorder.step(1, 100, 1, 0)
    # each hand-over failed: what it took is counted as dropped on the next step; every call is
    # in the step's record or counted
    assert len(handed[0].calls) // 3 + handed[0].dropped_records == 5


def test_a_job_that_has_not_stepped_hands_its_calls_over_every_interval():
    """A job without an optimizer (an inference loop) sent nothing until its 65536-call buffer
    filled or it exited: its dashboard stayed empty for as long."""
    from rtxops.runtime.readings import Slot
    from rtxops.telemetry.recorder import Recorder

    handed = []
    recorder = Recorder(handed.append, capacity=1000, flush_every_s=0.05)
    recorder.register_slot(Slot(0, "gelu", "eager", "{}", "b0", "F.gelu", "eager"))
    recorder.record(0, time.perf_counter_ns(), 10)
    recorder.record(0, time.perf_counter_ns(), 10)
    assert handed == []
    time.sleep(0.06)
    recorder.record(0, time.perf_counter_ns(), 10)   # the interval passed: the two before go
    assert [(r.step, len(r.calls) // 3) for r in handed] == [(-1, 2)]
    time.sleep(0.06)
    recorder.step(1, time.perf_counter_ns(), 1, 0)     # a job that steps: its steps hand over
    assert [(r.step, len(r.calls) // 3) for r in handed[1:]] == [(1, 1)]
    time.sleep(0.06)
    recorder.record(0, time.perf_counter_ns(), 10)
    assert len(handed) == 2        # however long its steps last


def test_an_inference_loop_under_rtxops_exports_while_it_runs():
    d = patching.enable(plan=Plan(version=1, defaults={"gelu": "eager"}))
    exporter = InMemorySpanExporter()
    telemetry = start_job_telemetry(d, exporter, resource=RESOURCE, export_interval_s=0.2)
    try:
        net = TinyNet()
        deadline = time.monotonic() + 30
        with torch.no_grad():
            while not _by_name(exporter.get_finished_spans(), S.KERNEL) and time.monotonic() < deadline:
                net(torch.randn(4, 32))
                time.sleep(0.01)
        kernels = _by_name(exporter.get_finished_spans(), S.KERNEL)
        assert kernels and all(k.attributes[S.STEP_NUMBER] == -1 for k in kernels)
    finally:
        telemetry.close(d)
        patching.disable()


def test_resource_and_plan_attributes():
    d, _, spans, _ = _run(steps=1)
    step, = _by_name(spans, S.STEP)
    assert step.resource.attributes[S.JOB_ID] == "job-1"
    assert step.attributes[S.PLAN_VERSION] == d.plan.version
    assert step.attributes[S.RSS] > 0


def test_spans_made_without_the_tracer_equal_the_tracers():
    """The builder's direct ReadableSpans carry what tracer-made spans carry (ids aside)."""
    import random
    from array import array

    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    from rtxops.runtime.readings import Slot
    from rtxops.telemetry.exporters import StepProcessor
    from rtxops.telemetry.recorder import StepRecord
    from rtxops.telemetry.spans import SpanBuilder

    slots = [Slot(i, "gelu", "eager", "{}", f"b{i}", "F.gelu", "eager") for i in range(3)]
    rnd = random.Random(1)
    calls = array("q", [v for i in range(30) for v in (i % 3, 1000 * i, rnd.randrange(100, 9000))])
    rec = StepRecord(4, 0, 50_000, 2, 123, calls, backward=[(1, 10, 500)],
                     builds=[(2, 5, 300, False)], errors=[(0, "boom", 70)], swaps=[(4, 1, 2, "d", 80)],
                     memory={0: (10, 20)})
    made = {}
    for direct in (True, False):
        provider = TracerProvider(resource=Resource.create(RESOURCE))
        processor = StepProcessor()
        provider.add_span_processor(processor)
        builder = SpanBuilder(provider.get_tracer("rtxops"), slots, lambda rec: {S.RSS: 5},
                              CallSampling(2, 10))
        assert builder._direct
        builder._direct = direct
        builder._epoch_offset = 0
        builder.build(rec, {S.DROPPED_STEPS: 0})
        made[direct] = processor.drain()

    def view(spans):
        by_id = {s.context.span_id: s.name for s in spans}
        return [(s.name, by_id.get(s.parent.span_id) if s.parent else None, dict(s.attributes),
                 s.start_time, s.end_time, s.kind, s.status.status_code, s.resource,
                 s.instrumentation_scope, [(e.name, dict(e.attributes), e.timestamp) for e in s.events],
                 s.dropped_attributes, s.context.trace_flags,
                 s.parent.trace_id == s.context.trace_id if s.parent else True,
                 type(s.context), s.context.is_remote, s.context.trace_state, s.context.is_valid,
                 sorted(vars(s))) for s in spans]

    a, b = view(made[True]), view(made[False])
    for x, y in zip(a, b):
        for i, (u, v) in enumerate(zip(x, y)):
            assert u == v, (i, u, v)
    assert a == b and len(a) > 5


def test_a_slot_that_appears_after_its_window_filled_still_gets_its_call_spans():
    """Once every slot had its calls sampled in a window, steps skip the search until the next
    window, unless a slot was added since."""
    from array import array

    from opentelemetry.sdk.trace import TracerProvider

    from rtxops.runtime.readings import Slot
    from rtxops.telemetry.exporters import StepProcessor
    from rtxops.telemetry.recorder import StepRecord
    from rtxops.telemetry.spans import SpanBuilder

    provider = TracerProvider()
    processor = StepProcessor()
    provider.add_span_processor(processor)
    slots = [Slot(i, "gelu", "eager", "{}", f"b{i}", "F.gelu", "eager") for i in range(2)]
    builder = SpanBuilder(provider.get_tracer("rtxops"), slots, sampling=CallSampling(1, 10))

    def calls_sampled(step: int, slot_ids) -> list:
        calls = array("q", [v for i, s in enumerate(slot_ids) for v in (s, 100 * i, 50)])
        builder.build(StepRecord(step, 0, 1000, 1, 0, calls))
        return sorted(dict(s.attributes)[S.BUCKET] for s in processor.drain() if s.name == S.CALL)

    assert calls_sampled(0, [0, 1, 0]) == ["b0", "b1"]
    assert calls_sampled(1, [0, 1]) == []          # the window is full
    slots.append(Slot(2, "gelu", "eager", "{}", "b2", "F.gelu", "eager"))
    assert calls_sampled(2, [0, 1, 2]) == ["b2"]   # a new slot in the same window
    assert calls_sampled(3, [0, 1, 2]) == []
    assert calls_sampled(10, [1, 2]) == ["b1", "b2"]   # the next window


def test_all_ways_of_aggregating_a_step_agree():
    """Few calls are added up in a plain loop, many with numpy, any number in C where it was
    built: the figures must not depend on it."""
    import numpy as np

    from rtxops.telemetry import spans
    from rtxops.telemetry.spans import _aggregate_loop, _aggregate_numpy

    rng = np.random.default_rng(0)
    n = 500
    calls = np.stack([rng.integers(0, 7, n), rng.integers(0, 10**9, n),
                      np.concatenate([[0, 1, 2, 3, 2**40], rng.integers(0, 10**7, n - 5)])], axis=1)
    loop, vectorized = _aggregate_loop(calls.tolist()), _aggregate_numpy(calls)
    assert loop == vectorized
    assert list(loop) == sorted(loop)   # slot order, as the spans go out
    if spans._aggregate_native is not None:
        native = spans._aggregate_native
        assert native(calls.astype(np.int64), spans.HIST_BINS) == loop
        few = calls[:20].astype(np.int64)
        assert native(few, spans.HIST_BINS) == _aggregate_loop(few.tolist())
        assert native(np.zeros((0, 3), dtype=np.int64), spans.HIST_BINS) == {}
        # what it does not take goes back to Python: a slot id past its table, a sum past int64
        assert native(np.array([[1 << 20, 0, 5]], dtype=np.int64), spans.HIST_BINS) is None
        assert native(np.array([[0, 0, 2**62], [0, 0, 2**62]], dtype=np.int64), spans.HIST_BINS) is None
        assert spans.aggregate(np.array([[1 << 20, 0, 5]], dtype=np.int64)) == {
            1 << 20: (1, 5, 5, 5, 0, 5, (0, 0, 0, 1))}
        with pytest.raises(ValueError):
            native(np.zeros(4, dtype=np.int64), spans.HIST_BINS)   # not whole triples
    # and against the definition, for one slot
    rows = calls[calls[:, 0] == 3]
    count, total, lo, hi, first, last, hist = loop[3]
    assert (count, total, lo, hi) == (len(rows), int(rows[:, 2].sum()), int(rows[:, 2].min()),
                                      int(rows[:, 2].max()))
    assert (first, last) == (int(rows[:, 1].min()), int((rows[:, 1] + rows[:, 2]).max()))
    assert sum(hist) == count and hist[-1] > 0


class _CountingExporter:
    """Counts exported spans (any objects: the thread only passes them on)."""

    def __init__(self):
        self.exported = 0
        self.exports = 0

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.exported += len(spans)
        self.exports += 1
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


def _record(step: int):
    from array import array

    from rtxops.telemetry.recorder import StepRecord

    return StepRecord(step, 0, 1, 1, 0, array("q"))


def test_the_export_thread_counts_the_steps_it_could_not_take_and_builds_the_rest():
    from rtxops.telemetry.exporters import ExportThread, StepProcessor

    seen: list[tuple[int, dict]] = []
    # it polls only at close here, so every submit below meets the queue as left by the last
    thread = ExportThread(lambda rec, counters: seen.append((rec.step, counters)) or 0,
                          StepProcessor(), _CountingExporter(), max_queue=8, interval_s=60, poll_s=60)
    for step in range(11):
        thread.submit(_record(step))
    assert thread.steps_dropped == 3
    thread.close()
    assert [step for step, _ in seen] == list(range(8))       # in order, none built twice
    assert seen[-1][1][S.DROPPED_STEPS] == 3 and thread.steps_built == 8


def test_a_step_that_fails_to_build_loses_only_itself():
    from rtxops.telemetry.exporters import ExportThread, StepProcessor

    processor, exporter = StepProcessor(), _CountingExporter()

    def build(rec, counters):
        if rec.step % 3 == 2:
            raise RuntimeError("a slot this builder cannot read")
        processor.on_end(("span of", rec.step))
        return 1

    thread = ExportThread(build, processor, exporter, max_queue=64, interval_s=60, poll_s=60)
    for step in range(9):
        thread.submit(_record(step))
    thread.close()
    assert exporter.exported == 6 and thread.steps_failed == 3
    assert thread.counters()[S.DROPPED_STEPS] == 3


def test_exports_go_out_while_the_job_submits_as_fast_as_steps_build():
    import threading
    import time

    from rtxops.telemetry.exporters import ExportThread, StepProcessor

    processor, exporter = StepProcessor(), _CountingExporter()

    def build(rec, counters):
        time.sleep(0.004)
        processor.on_end(("span of", rec.step))
        return 1

    thread = ExportThread(build, processor, exporter, max_queue=10_000, interval_s=0.2, poll_s=0.05)
    stop = threading.Event()

    def job():
        step = 0
        while not stop.is_set():
            thread.submit(_record(step))
            step += 1
            time.sleep(0.002)

    submitter = threading.Thread(target=job)
    submitter.start()
    # (a fixed 1.5 s saw one export on a loaded 2-core runner: the bound is the job's, not time's)
    deadline = time.monotonic() + 30
    while exporter.exports < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    exports_while_running = exporter.exports
    assert submitter.is_alive()   # the exports went out while the job was still submitting
    stop.set()
    joined(submitter)
    thread.close(timeout=60)
    assert exports_while_running >= 2


def test_a_queue_filling_up_between_polls_wakes_the_thread():
    import time

    from rtxops.telemetry.exporters import ExportThread, StepProcessor

    thread = ExportThread(lambda rec, counters: 0, StepProcessor(), _CountingExporter(),
                          max_queue=8, interval_s=60, poll_s=60)
    for step in range(40):
        thread.submit(_record(step))
        time.sleep(0.005)
    thread.close()
    # without being woken it would not look before close: all but 8 dropped
    assert thread.steps_dropped <= 5 and thread.steps_built == 40 - thread.steps_dropped


def _builder_with_totals(slots):
    """A span builder over ``slots`` adding up a run's totals, and the processor its spans reach."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    from rtxops.runtime.readings import CallStats
    from rtxops.telemetry.exporters import StepProcessor
    from rtxops.telemetry.spans import SpanBuilder

    stats = CallStats()
    for slot in slots:
        stats.register_slot(slot)
    provider = TracerProvider(resource=Resource.create(RESOURCE))
    processor = StepProcessor()
    provider.add_span_processor(processor)
    return SpanBuilder(provider.get_tracer("rtxops"), slots, totals=stats), processor, stats


def test_the_calls_of_steps_the_queue_refused_still_reach_the_runs_totals():
    """The summary's call counts come from the totals: a step dropped for want of queue room
    is counted (no spans), as the same step built would be."""
    from array import array

    from rtxops.runtime.readings import Slot
    from rtxops.telemetry.exporters import ExportThread
    from rtxops.telemetry.recorder import StepRecord

    slots = [Slot(i, "gelu", "eager", "{}", f"b{i}", "F.gelu", "eager") for i in range(3)]
    calls = array("q", [v for i in range(30) for v in (i % 3, 1000 * i, 100 + i)])

    def record(step):
        return StepRecord(step, 0, 50_000, 2, 123, calls, builds=[(2, 5, 300, False)])

    totals = {}
    for label, max_queue in (("built", 64), ("dropped", 2)):
        builder, processor, stats = _builder_with_totals(slots)
        thread = ExportThread(builder.build, processor, _CountingExporter(), max_queue=max_queue,
                              interval_s=60, poll_s=60, count=builder.count)
        # past what waits to be counted too (16 x max_queue): a thread stuck on a daemon that
        # is down; those steps' calls were lost to the summary
        for step in range(40):
            thread.submit(record(step))
        thread.close()
        totals[label] = (list(stats.calls), list(stats.total_ns), list(stats.build_misses),
                         thread.steps_dropped)
    assert totals["built"][:3] == totals["dropped"][:3] == (
        [400, 400, 400], [sum(100 + i for i in range(30) if i % 3 == s) * 40 for s in range(3)],
        [0, 0, 40])
    assert totals["built"][3] == 0 and totals["dropped"][3] == 38


def test_the_sdks_sampler_and_limits_from_the_environment_do_not_thin_the_measurements(monkeypatch):
    """OTEL_TRACES_SAMPLER (set for a job's own tracing) dropped most steps with their kernels,
    uncounted, and OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT cut bucket names into keys that exist nowhere."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.1")
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "16")
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "4")
    d, stats, spans, _ = _run(steps=20)
    assert [s.attributes[S.STEP_NUMBER] for s in _by_name(spans, S.STEP)] == list(range(1, 21))
    kernels = [k for k in _by_name(spans, S.KERNEL) if k.attributes[S.PHASE] == "fwd"]
    assert sum(k.attributes[S.COUNT] for k in kernels) == sum(stats.calls)
    assert {k.attributes[S.BUCKET] for k in kernels} == {s.bucket for s in stats.slots}


def test_the_step_that_ends_in_a_plan_swap_is_labelled_with_the_plan_it_ran_under():
    """It carried the new plan's version beside the old plan's variants."""
    import torch

    d = patching.enable(plan=Plan(version=1, defaults={"gelu": "eager"}))
    exporter = InMemorySpanExporter()
    telemetry = start_job_telemetry(d, exporter, resource=RESOURCE)
    try:
        net, x = TinyNet(), torch.randn(8, 32)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        for step in (1, 2, 3):
            if step == 2:
                d.install_plan(Plan(version=2, defaults={"gelu": "algebraic"}))
            net(x).sum().backward()
            opt.step()
        telemetry.close(d)
    finally:
        patching.disable()
    spans = exporter.get_finished_spans()
    assert {s.attributes[S.STEP_NUMBER]: s.attributes[S.PLAN_VERSION]
            for s in _by_name(spans, S.STEP)} == {1: 1, 2: 1, 3: 2}
    gelu = {k.attributes[S.STEP_NUMBER]: (k.attributes[S.VARIANT], k.attributes[S.PLAN_VERSION])
            for k in _by_name(spans, S.KERNEL) if k.attributes[S.OP] == "gelu"
            and k.attributes[S.PHASE] == "fwd"}
    assert gelu == {1: ("eager", 1), 2: ("eager", 1), 3: ("algebraic", 2)}


def test_a_build_or_a_memory_reading_a_step_before_its_calls_is_kept():
    """Both were shown only on a kernel span of the same step: a variant whose first call raised
    (its build, no call) vanished from the summary, and on CUDA, where calls are recorded once
    their events are done (the next step), every memory reading was lost."""
    from array import array

    from rtxops.runtime.readings import Slot
    from rtxops.telemetry.recorder import StepRecord

    slots = [Slot(i, "gelu", "eager", "{}", f"b{i}", "F.gelu", "eager") for i in range(2)]
    builder, processor, stats = _builder_with_totals(slots)
    builder.build(StepRecord(1, 0, 10, 1, 0, array("q", [0, 1, 5]), builds=[(1, 2, 3, False)],
                             memory={1: (4096, 8192)}))
    builder.build(StepRecord(2, 10, 20, 1, 0, array("q", [0, 11, 5, 1, 12, 5]),
                             memory={1: (-1024, 2048)}))
    assert stats.build_misses[1] == 1 and stats.calls[1] == 1
    kernels = {(k.attributes[S.STEP_NUMBER], k.attributes[S.BUCKET]): k.attributes
               for k in processor.drain() if k.name == S.KERNEL}
    assert (1, "b1") not in kernels
    assert (kernels[(2, "b1")][S.MEM_DELTA], kernels[(2, "b1")][S.MEM_PEAK]) == (3072, 8192)
    assert S.MEM_DELTA not in kernels[(2, "b0")]


def test_a_forked_child_counts_its_steps_and_keeps_none_of_them():
    """A forked child has no export thread: its steps queued for none (256, then 4096 more held
    for counting), kept in memory for good."""
    import json
    import os

    from rtxops.telemetry.exporters import ExportThread, StepProcessor

    thread = ExportThread(lambda rec, counters: 0, StepProcessor(), _CountingExporter(),
                          max_queue=8, interval_s=60, poll_s=60, count=lambda rec: None)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: report and leave without running the parent's exit handlers
        try:
            for step in range(100):
                thread.submit(_record(step))
            os.write(write, json.dumps([len(thread._pending), len(thread._count_only),
                                        thread.steps_dropped]).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        got = json.loads(read_all(read))
    finally:
        os.close(read)
        reaped(pid)
    thread.close()
    assert got == [0, 0, 100]


def test_cuda_timed_calls_still_pending_at_exit_are_reported():
    """Calls whose CUDA events were not done at the last step boundary were never reported.
    (No GPU here: events stand in that the device has finished.)"""
    from rtxops.runtime.timing import CudaEventTimer

    class DoneEvent:
        def query(self):
            return True

        def elapsed_time(self, other):
            return 0.5   # ms

    d = patching.enable(plan=Plan(version=1, defaults={"gelu": "eager"}))
    exporter = InMemorySpanExporter()
    telemetry = start_job_telemetry(d, exporter, resource=RESOURCE)
    try:
        train_losses(TinyNet(), steps=2)
        d.cuda_timer = CudaEventTimer(d.readings, memory=False)
        for _ in range(7):   # the last step's calls, their events not done at its boundary
            d.cuda_timer._pending.append((0, 123, DoneEvent(), DoneEvent(), 0))
        before = d.readings.totals.calls[0]
        telemetry.close(d)
    finally:
        patching.disable()
    assert not d.cuda_timer._pending
    tail = [k for k in _by_name(exporter.get_finished_spans(), S.KERNEL)
            if k.attributes[S.STEP_NUMBER] == -1 and k.attributes[S.PHASE] == "fwd"]
    assert [k.attributes[S.COUNT] for k in tail] == [7]
    assert d.readings.totals.calls[0] >= before + 7


def test_what_the_last_step_left_without_calls_is_flushed_at_exit():
    """A plan swap (a region falling back to eager), a backward timed after the last step or a
    memory reading, with no call after them: the exit flush handed nothing over."""
    from rtxops.runtime.readings import Slot
    from rtxops.telemetry.recorder import Recorder

    handed = []
    recorder = Recorder(handed.append)
    recorder.register_slot(Slot(0, "gelu", "eager", "{}", "b0", "F.gelu", "eager"))
    recorder.swap(7, 1, 2, "sha256:ab")
    recorder.backward(0, 100, 50)
    recorder.memory(0, 4096, 8192)
    recorder.flush(plan_version=2, rss_bytes=0)
    assert len(handed) == 1
    rec = handed[0]
    assert rec.swaps[0][:3] == (7, 1, 2) and rec.backward == [(0, 100, 50)]
    assert rec.memory == {0: (4096, 8192)}
    recorder.flush(plan_version=2, rss_bytes=0)
    assert len(handed) == 1   # nothing new: nothing handed over


def test_an_interval_with_more_spans_than_one_request_takes_goes_out_in_parts():
    """A fast job's 2-second interval held more spans than the daemon takes in one request
    (16 MiB): the request was refused whole (413), the step spans counting drops with it."""
    from opentelemetry.sdk.trace import TracerProvider

    from rtxops.telemetry.exporters import MAX_SPANS_PER_EXPORT, ExportThread, StepProcessor

    processor, exporter = StepProcessor(), _CountingExporter()
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("test")
    n = 2 * MAX_SPANS_PER_EXPORT + 100

    def build(rec, counters):
        for _ in range(n):
            tracer.start_span("rtx.kernel").end()
        return n

    thread = ExportThread(build, processor, exporter, interval_s=60, poll_s=60)
    thread.submit(_record(1))
    thread.close()
    assert exporter.exported == n == thread.spans_exported and exporter.exports == 3


def test_calls_a_full_cuda_timer_queue_refused_are_counted_on_the_step(monkeypatch):
    """A job with more CUDA-timed calls between two steps than the timer queues (an eval pass):
    the timer counted them on itself, where nothing read them; the step said 0 dropped. (No
    GPU here: the event class stands in.)"""
    from rtxops.runtime.readings import Slot
    from rtxops.runtime.timing import CudaEventTimer
    from rtxops.telemetry.recorder import Recorder

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self, stream=None):
            pass

    monkeypatch.setattr(torch.cuda, "Event", Event)
    handed = []
    recorder = Recorder(handed.append)
    recorder.register_slot(Slot(0, "gelu", "eager", "{}", "b0", "F.gelu", "eager"))
    timer = CudaEventTimer(recorder, max_pending=4, memory=False)
    stream = types.SimpleNamespace(device_index=0)
    for _ in range(10):
        timer.end(0, (123, Event(), None, stream))
    recorder.step(1, 1000, 1, 0)
    assert handed[0].dropped_records == 6
    recorder.step(2, 2000, 1, 0)
    assert handed[1].dropped_records == 0   # counted once


def test_cuda_timer_reuses_resolved_events_on_their_own_device(monkeypatch):
    """Two new CUDA events a call cost more host time than recording them (an H200 run of the
    example GPT: +13 % a step on the reference plan). Resolved events are reused, per device: an
    event recorded on one device cannot be recorded on another's stream. (No GPU here: the event
    and stream classes stand in.)"""
    from rtxops.runtime.timing import CudaEventTimer

    made = []

    class Event:
        def __init__(self, enable_timing=False):
            self.device = None
            made.append(self)

        def record(self, stream=None):
            assert self.device in (None, stream.device_index), "event moved to another device"
            self.device = stream.device_index

        def query(self):
            return True

        def elapsed_time(self, other):
            return 0.25

    streams = [types.SimpleNamespace(device_index=0), types.SimpleNamespace(device_index=1)]
    current = [streams[0]]
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    recorded = []
    readings = types.SimpleNamespace(record=lambda slot, t0, ns: recorded.append((slot, ns)),
                                     dropped=lambda n: None)
    timer = CudaEventTimer(readings, memory=False)
    call = timer.wrap(lambda x: x + 1, slot=3)
    for step in range(5):
        current[0] = streams[step % 2]
        for _ in range(4):
            assert call(1) == 2
        assert timer.drain() == 4
    assert recorded == [(3, 250_000)] * 20
    assert len(made) == 16   # 8 events a step, one set per device, then reused


def test_step_memory_is_read_from_the_training_threads_cuda_device(monkeypatch):
    """The allocator figures were read on the export thread, whose current CUDA device is 0
    whatever the rank set on its own thread: every rank reported device 0's memory. (No GPU
    here: torch's device getters stand in.)"""
    from rtxops.runtime.readings import Slot
    from rtxops.telemetry import job, recorder as recorder_module
    from rtxops.telemetry.recorder import Recorder

    monkeypatch.setattr(recorder_module, "_CUDA_BUILT", True)   # a build with CUDA
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)   # the rank's, set_device(3)
    asked = []

    def stats(device=None):
        asked.append(device)
        return {"allocated": 7, "reserved": 8, "fragmentation": 0.125, "peak": 7,
                "alloc_retries": 0, "ooms": 0}

    monkeypatch.setattr(job, "cuda_stats", stats)
    handed = []
    recorder = Recorder(handed.append)
    recorder.register_slot(Slot(0, "gelu", "eager", "{}", "b0", "F.gelu", "eager"))
    recorder.record(0, 100, 10)
    recorder.step(1, 1000, 1, 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)   # the export thread's
    attrs = job._step_attributes(handed[0])
    assert asked == [3] and attrs[S.CUDA_ALLOCATED] == 7


def test_a_call_is_timed_on_the_stream_of_its_tensors_device(monkeypatch):
    """A model spread over GPUs in one process (accelerate's device_map) runs a layer's kernels
    on its tensors' device, whatever device is current: the events were recorded on the current
    device's stream, timing whatever ran there. (No GPU here: the device getter, the stream and
    event classes and the tensor's device stand in.)"""
    from rtxops.runtime.timing import CudaEventTimer

    on_streams = []

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self, stream=None):
            on_streams.append(stream.device_index)

    class OnSecondGpu(torch.Tensor):
        def get_device(self):
            return 1

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream",   # device 0 is current
                        lambda device=None: types.SimpleNamespace(device_index=device or 0))
    readings = types.SimpleNamespace(record=lambda *a: None, dropped=lambda n: None)
    timer = CudaEventTimer(readings, memory=False)
    call = timer.wrap(lambda input: input, slot=0)
    call(torch.Tensor._make_subclass(OnSecondGpu, torch.zeros(2)))
    call(input=torch.zeros(2))   # no tensor to read it from: the current device
    assert on_streams == [1, 1, 0, 0]


def test_calls_captured_into_a_cuda_graph_are_not_timed(monkeypatch):
    """Under ``torch.cuda.graph`` capture a call runs no kernel (its replays never pass the
    wrapper): timing events recorded into the capture are refused by CUDA or never complete, and
    every later drain stopped at them. (No GPU here: the event and stream classes stand in.)"""
    from rtxops.runtime import timing

    capturing, recorded_while_capturing = [False], []

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self, stream=None):
            recorded_while_capturing.append(capturing[0])

        def query(self):
            return True

        def elapsed_time(self, other):
            return 0.5

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(device_index=0))
    monkeypatch.setattr(timing, "_capturing", lambda: capturing[0])
    for every in (1, 3):   # every call timed, or one in 3 (the others recorded untimed)
        recorded = []
        readings = types.SimpleNamespace(record=lambda slot, t0, ns: recorded.append((slot, ns)),
                                         dropped=lambda n: None)
        timer = timing.CudaEventTimer(readings, memory=False, every=every)
        call = timer.wrap(lambda x: x + 1, slot=2)
        assert call(1) == 2
        capturing[0] = True
        assert [call(1) for _ in range(3)] == [2, 2, 2]
        assert timer.end(5, timer.begin()) is None   # a region's clock, the same way
        capturing[0] = False
        assert call(1) == 2
        assert timer.drain() == 2, every
        assert recorded == [(2, 500_000)] * 2 and True not in recorded_while_capturing


def test_the_cuda_timer_reads_the_current_stream_from_torchs_getters_and_keeps_one_object_each(
        monkeypatch):
    """torch.cuda.current_stream() checks the device type on every call (an environment read
    among them): the largest part of a routed call's host time in a profile on an H200. The
    timer reads the raw getters and keeps one Stream object per stream. (No GPU here.)"""
    from rtxops.runtime.timing import _current_stream_reader

    made = []

    class Stream:
        def __init__(self, stream_id, device_index, device_type):
            self.key = (stream_id, device_index, device_type)
            made.append(self)

    current = [(11, 0, 1)]
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current[0][1], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream",
                        lambda index: current[0] if index == current[0][1] else None, raising=False)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    read = _current_stream_reader()
    first = read()
    assert first.key == (11, 0, 1) and read() is first
    current[0] = (12, 1, 1)            # another device's stream (a `with torch.cuda.stream(s)`)
    assert read().key == (12, 1, 1)
    current[0] = (11, 0, 1)
    assert read() is first and len(made) == 2


class _TimedEvent:
    """A CUDA event stand-in whose pairs read 1, 2, 3 ... ms in the order they are resolved."""
    made = 0
    resolved = 0

    def __init__(self, enable_timing=False):
        type(self).made += 1

    def record(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        type(self).resolved += 1
        return float(type(self).resolved)


def _fake_cuda(monkeypatch):
    _TimedEvent.made = _TimedEvent.resolved = 0
    monkeypatch.setattr(torch.cuda, "Event", _TimedEvent)
    stream = types.SimpleNamespace(device_index=0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)


def test_cuda_timer_times_one_call_in_every_and_counts_each_call(monkeypatch):
    """RTXOPS_CUDA_TIME_EVERY=N: a route's first call and then one in N get events; every call
    is still recorded, the ones between with the route's last timed figure. (No GPU here.)"""
    from rtxops.runtime.timing import CudaEventTimer

    _fake_cuda(monkeypatch)
    recorded = []
    readings = types.SimpleNamespace(record=lambda slot, t0, ns: recorded.append((slot, ns)),
                                     dropped=lambda n: None)
    timer = CudaEventTimer(readings, memory=False, every=4)
    gelu, silu = timer.wrap(lambda x: x + 1, slot=0), timer.wrap(lambda x: x * 2, slot=1)
    for _ in range(10):
        assert gelu(1) == 2
    assert silu(3) == 6
    assert timer.drain() == 11
    ms = 1_000_000
    assert recorded == ([(0, 1 * ms)] * 4 + [(0, 2 * ms)] * 4 + [(0, 3 * ms)] * 2
                        + [(1, 4 * ms)])
    assert _TimedEvent.made == 8   # calls 1, 5 and 9 of one route, 1 of the other


def test_cuda_timer_times_every_call_when_it_reads_memory(monkeypatch):
    """Per-call memory (RTXOPS_CALL_MEMORY=1) is read around timed calls: all of them are."""
    from rtxops.runtime.timing import CudaEventTimer

    _fake_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    readings = types.SimpleNamespace(record=lambda *a: None, memory=lambda *a: None,
                                     dropped=lambda n: None)
    timer = CudaEventTimer(readings, memory=True, every=4)
    call = timer.wrap(lambda x: x, slot=0)
    for _ in range(5):
        call(0)
    assert timer.drain() == 5 and _TimedEvent.made == 10



class _FailingExporter(_CountingExporter):
    """Fails its first ``failures`` exports (a daemon answering 503 for a moment)."""

    def __init__(self, failures):
        super().__init__()
        self.failures = failures

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        if self.failures:
            self.failures -= 1
            self.failed = getattr(self, "failed", 0) + 1
            return SpanExportResult.FAILURE
        return super().export(spans)


def _spans_through(exporter, steps: int):
    from opentelemetry.sdk.trace import TracerProvider

    from rtxops.telemetry.exporters import ExportThread, StepProcessor

    processor = StepProcessor()
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("test")

    def build(rec, counters):
        for _ in range(10):
            tracer.start_span("rtx.kernel").end()
        return 10

    thread = ExportThread(build, processor, exporter, interval_s=0.05, poll_s=0.01)

    def attempts() -> int:
        return exporter.exports + getattr(exporter, "failed", 0)

    for step in range(steps):
        before = attempts()
        thread.submit(_record(step))
        deadline = time.monotonic() + 30
        # the step's spans are built when their export is due and sent in the same look: an
        # export between steps (not at close)
        while (thread.steps_built <= step or attempts() == before) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert thread.steps_built > step and attempts() > before
    thread.close()
    return thread


def test_a_part_the_daemon_refused_once_goes_out_with_the_next_export():
    """A daemon busy for a moment answers 503 (nothing of the request written): the job's
    exporter gave up and the part was dropped; it now goes again with the next export."""
    exporter = _FailingExporter(failures=1)
    thread = _spans_through(exporter, steps=3)
    assert exporter.exported == 30 == thread.spans_exported and thread.spans_failed == 0


def test_a_part_refused_twice_is_dropped_and_counted():
    exporter = _FailingExporter(failures=10 ** 6)
    thread = _spans_through(exporter, steps=3)
    assert exporter.exported == 0 and thread.spans_failed == 30 and thread.spans_exported == 0


def test_cuda_is_not_initialized_for_the_resource_and_the_gpu_joins_it_once_the_job_did(monkeypatch):
    """Telemetry starts before the script's first line: asking torch for the GPU there
    initialized CUDA (a CUDA_VISIBLE_DEVICES the script set was ignored; forked workers could not
    use CUDA). No GPU here: a CUDA build of torch whose CUDA the job initializes mid-run stands in."""
    from rtxops.runtime.memory import cuda_stats
    from rtxops.runtime.plan import current_environment
    from rtxops.telemetry.resource import job_resource_attributes

    initialized = [False]

    def refused(*args):
        raise AssertionError("this would initialize CUDA")

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized[0])
    for name in ("is_available", "device_count", "get_device_name", "memory_stats", "init"):
        monkeypatch.setattr(torch.cuda, name, refused)
    attrs = job_resource_attributes()
    assert attrs[S.HW_GPU_COUNT] == 0 and S.HW_GPU_MODEL not in attrs
    assert cuda_stats() == {} and current_environment()["device"] == ""
    # a plan tuned on some GPU is not refused for a device the job has not opened yet
    assert Plan(version=2, environment={**current_environment(), "device": "NVIDIA H200"}
                ).environment_mismatch() is None

    d = patching.enable(plan=Plan(version=1, defaults={"gelu": "eager"}))
    exporter = InMemorySpanExporter()
    telemetry = start_job_telemetry(d, exporter, export_interval_s=0.2)   # the job's own resource
    try:
        train_losses(TinyNet(), steps=2)
        deadline = time.monotonic() + 30
        while not _by_name(exporter.get_finished_spans(), S.STEP) and time.monotonic() < deadline:
            time.sleep(0.05)
        first = _by_name(exporter.get_finished_spans(), S.STEP)[0]
        assert first.resource.attributes[S.HW_GPU_COUNT] == 0
        initialized[0] = True   # the job moved its model to the GPU
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
        monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {})
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        train_losses(TinyNet(), steps=2)
    finally:
        telemetry.close(d)
        patching.disable()
    last = _by_name(exporter.get_finished_spans(), S.STEP)[-1]
    assert last.resource.attributes[S.HW_GPU_MODEL] == "NVIDIA H200"
    assert last.resource.attributes[S.HW_GPU_COUNT] == 2
    assert last.resource.attributes[S.JOB_ID] == first.resource.attributes[S.JOB_ID]
