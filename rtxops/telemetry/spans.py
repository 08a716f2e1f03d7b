"""Turn a :class:`StepRecord` into OpenTelemetry spans (runs on the export thread, never the hot path).

Per step: one ``rtx.step`` span and, as its children, one ``rtx.kernel`` span per
(slot, phase) with count, total/min/max ns and a log2 latency histogram; a budget of sampled
``rtx.call`` spans per slot per window of steps; ``rtx.compile`` spans for variant builds;
``rtx.swap`` spans for plan swaps. Spans get explicit start and end times.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Callable, Sequence

import numpy as np
from opentelemetry import trace
from opentelemetry.sdk.trace import Event, ReadableSpan, Tracer, sampling
from opentelemetry.trace import SpanContext, TraceFlags
from opentelemetry.trace.span import DEFAULT_TRACE_STATE

from rtxops import settings
from rtxops.runtime.readings import Slot

from . import schema as S
from .encode import SPAN_TAIL, Unsupported, key_field, key_value, span_head
from .recorder import RECORD_WIDTH, StepRecord

try:   # built from _native/aggregate.c; RTXOPS_OTLP_NATIVE=0 turns it off with the codecs
    from ._aggregate import aggregate as _aggregate_native
    from ._aggregate import kernel_spans as _kernel_spans_native
except ImportError:  # built without a compiler: the Python loop and numpy below
    _aggregate_native = _kernel_spans_native = None

HIST_BINS = 40  # bit lengths of durations in ns: 2^39 ns ~ 9 minutes


@dataclass
class CallSampling:
    """At most ``per_window`` rtx.call spans per slot in every window of ``window_steps`` steps.
    The default, 2 every 100 steps: at 2 every 10 they were 16 % of a settled job's spans (the
    example GPT: 1.9 a step beside 9 kernel spans), sent and stored, and only trace views read them."""

    per_window: int = 2
    window_steps: int = 100

    @classmethod
    def from_env(cls) -> CallSampling:
        """From ``RTXOPS_CALL_SAMPLES`` (``"2/100"``: 2 calls per slot every 100 steps; ``"0"``: none)."""
        value = settings.call_samples("RTXOPS_CALL_SAMPLES")
        return cls() if value is None else cls(*value)


class SpanBuilder:
    """Builds the spans of one step record through ``tracer`` (an SDK tracer).

    ``encoded_to``: a processor with ``accepts_encoded`` and ``on_encoded(resource, scope,
    span_fields, spans)`` (:class:`~.exporters.StepProcessor`). While it accepts them, a step's
    rtx.kernel spans, most of its spans, go there as the OTLP bytes :func:`.encode.encode` would
    write for them, made in one C call from the step's call records (``_aggregate.kernel_spans``)
    instead of as ReadableSpans: a third or less of their cost on the export thread
    (`bench/export_cost.py`)."""

    def __init__(self, tracer: Tracer, slots: Sequence[Slot],
                 step_attributes: Callable[[StepRecord], dict] | None = None,
                 sampling: CallSampling | None = None, totals=None, encoded_to=None) -> None:
        self.tracer = tracer
        self.encoded_to = encoded_to
        self.slots = slots
        self.step_attributes = step_attributes or (lambda rec: {})
        self.sampling = sampling or CallSampling()
        self.totals = totals  # a CallStats the whole run's calls and time are added to
        self._sampled: dict[int, int] = {}
        self._static: dict[tuple[int, str], dict] = {}
        self._prefixes: dict[str, list[bytes]] = {"fwd": [], "bwd": []}   # per slot: static attributes' bytes
        self._memory_carried: dict[int, tuple[int, int]] = {}   # slot -> (delta, peak) not shown yet
        self._totals_lock = threading.Lock()
        self._window = 0
        self._window_full = (-1, 0)   # (window, slots then): every slot had its calls sampled
        self._direct = self._use_direct = _direct_spans(tracer)
        self._new_context = _context_maker()
        # as the SDK sets them: sampled, and W3C "random trace id" where the SDK knows that flag
        random_id = getattr(getattr(tracer, "id_generator", None), "is_trace_id_random", lambda: False)()
        self._root_flags = TraceFlags(TraceFlags.SAMPLED | (
            getattr(TraceFlags, "RANDOM_TRACE_ID", 0) if random_id else 0))
        # perf_counter_ns -> Unix epoch ns; both clocks are read together once
        self._epoch_offset = time.time_ns() - perf_counter_ns()

    def epoch(self, perf_ns: int) -> int:
        return int(perf_ns) + self._epoch_offset

    def count(self, rec: StepRecord) -> None:
        """Add ``rec``'s calls to the run's totals without making spans (a step the export
        queue had no room for)."""
        if self.totals is None:
            return
        calls = np.frombuffer(rec.calls, dtype=np.int64).reshape(-1, RECORD_WIDTH)
        misses = _misses(rec)
        rows = [(s, count, total, misses.pop(s, 0)) for s, (count, total, *_) in aggregate(calls).items()]
        # and a build whose calls are recorded later (CUDA)
        self._add_totals_many(rows + [(s, 0, 0, missed) for s, missed in misses.items()])

    def _add_totals_many(self, rows) -> None:
        """``rows`` of (slot, calls, total ns, build misses) added to the run's totals."""
        t = self.totals
        with self._totals_lock:   # the training thread counts here too when the export is stuck
            for slot, count, total, missed in rows:
                t.calls[slot] += count
                t.total_ns[slot] += total
                t.build_misses[slot] += missed

    def build(self, rec: StepRecord, extra: dict | None = None) -> int:
        """Emit the spans for ``rec``; returns how many spans were made."""
        calls = np.frombuffer(rec.calls, dtype=np.int64).reshape(-1, RECORD_WIDTH)
        attrs = {
            S.STEP_NUMBER: rec.step,
            S.PLAN_VERSION: rec.plan_version,
            S.RSS: rec.rss_bytes,
            S.DROPPED_RECORDS: rec.dropped_records,
            S.COUNT: int(calls.shape[0]),
            **self.step_attributes(rec),
            **(extra or {}),
        }
        events = [(S.ERROR_EVENT, self._slot_attributes(slot, "fwd") | {S.REASON: message}, self.epoch(at))
                  for slot, message, at in rec.errors]
        self._use_direct = self._direct and len(events) <= _MAX_EVENTS
        step_span = self._start(S.STEP, None, attrs, self.epoch(rec.start_ns), events)
        ctx = step_span[1] if self._use_direct else trace.set_span_in_context(step_span)
        made = 1
        made += self._kernel_spans(ctx, calls, rec, "fwd")
        if rec.backward:
            made += self._kernel_spans(ctx, np.array(rec.backward, dtype=np.int64), rec, "bwd",
                                       sampled=True)
        made += self._call_spans(ctx, calls, rec.step)
        made += self._compile_spans(ctx, rec)
        for step, old, new, digest, at in rec.swaps:
            self._emit(S.SWAP, ctx, {S.STEP_NUMBER: step, S.PLAN_FROM: old, S.PLAN_TO: new,
                                      S.PLAN_DIGEST: digest, S.PLAN_VERSION: new},
                       self.epoch(at), self.epoch(at))
            made += 1
        self._end(step_span, self.epoch(rec.end_ns))
        return made

    # Spans are either SDK ReadableSpans made here and handed to the provider's processors
    # (``_direct``: what the tracer would have made, for a fraction of its ~35 µs, which on a
    # 2-core machine comes straight out of the job's step time), or started and ended through the
    # tracer when it samples or limits differently from the SDK defaults.

    def _start(self, name: str, parent, attrs: dict, start: int, events=(), clean: bool = True):
        if not self._use_direct:
            span = self.tracer.start_span(name, context=parent, attributes=attrs, start_time=start)
            for event_name, event_attrs, at in events:
                span.add_event(event_name, event_attrs, timestamp=at)
            return span
        t = self.tracer
        if parent is None:
            trace_id, flags = t.id_generator.generate_trace_id(), self._root_flags
        else:
            trace_id, flags = parent.trace_id, parent.trace_flags
        context = self._new_context(trace_id, t.id_generator.generate_span_id(), flags)
        return [name, context, parent, _clean(attrs) if clean else attrs, start,
                tuple(Event(n, _clean(a), timestamp=at) for n, a, at in events)]

    def _end(self, span, end: int) -> None:
        if not self._use_direct:
            span.end(end_time=end)
            return
        name, context, parent, attrs, start, events = span
        self._finish(name, context, parent, attrs, events, start, end)

    def _finish(self, name: str, context, parent, attrs: dict, events, start: int, end: int) -> None:
        t = self.tracer
        t.span_processor.on_end(ReadableSpan(
            name, context, parent, t.resource, attrs, events, (), trace.SpanKind.INTERNAL,
            t.instrumentation_info, _UNSET, start, end, t._instrumentation_scope))

    def _emit(self, name: str, parent, attrs: dict, start: int, end: int, clean: bool = True) -> None:
        """``clean=False``: ``attrs`` is the caller's own new dict and holds no lists."""
        if self._use_direct:   # _start and _end in one: a step's kernel spans come here
            context = self._new_context(parent.trace_id, self.tracer.id_generator.generate_span_id(),
                                        parent.trace_flags)
            self._finish(name, context, parent, _clean(attrs) if clean else attrs, (), start, end)
            return
        self._end(self._start(name, parent, attrs, start, clean=clean), end)

    def _slot_attributes(self, slot: int, phase: str) -> dict:
        s = self.slots[slot]
        return {S.OP: s.op, S.VARIANT: s.variant, S.FAMILY: s.family, S.CONFIG: s.config,
                S.BUCKET: s.bucket, S.SITE: s.site, S.PHASE: phase}

    def _kernel_spans(self, ctx, calls: np.ndarray, rec: StepRecord, phase: str,
                      sampled: bool = False) -> int:
        fwd = phase == "fwd"
        misses = _misses(rec) if fwd else {}
        if fwd:
            # a slot's memory reading or build can come a step before its calls (on CUDA the
            # calls are recorded once their events are done): kept for its next kernel span
            for s, (delta, peak) in rec.memory.items():
                before = self._memory_carried.get(s)
                self._memory_carried[s] = (delta, peak) if before is None else (
                    before[0] + delta, max(before[1], peak))
        sink = self.encoded_to
        if (sink is not None and sink.accepts_encoded and self._use_direct and len(calls)
                and _kernel_spans_native is not None
                and os.environ.get("RTXOPS_OTLP_NATIVE", "1") != "0"):
            made = self._kernel_spans_encoded(sink, ctx, calls, rec, fwd, sampled, misses)
            if made is not None:
                return made
        made = 0
        totals: list[tuple[int, int, int, int]] = []
        emit, static, offset = self._emit, self._static_attributes, self._epoch_offset
        plan_version, step = rec.plan_version, rec.step
        for s, (count, total, lo, hi, first, last, hist) in (aggregate(calls).items() if len(calls) else ()):
            attrs = {**static(s, phase), S.COUNT: count, S.TOTAL_NS: total, S.MIN_NS: lo,
                     S.MAX_NS: hi, S.HIST: hist, S.PLAN_VERSION: plan_version, S.STEP_NUMBER: step}
            if fwd:
                memory = self._memory_carried.pop(s, None)
                if memory is not None:
                    attrs[S.MEM_DELTA], attrs[S.MEM_PEAK] = memory
                missed = misses.pop(s, 0)
                attrs[S.CACHE_MISSES] = missed
                attrs[S.CACHE_HITS] = count - missed
                totals.append((s, count, total, missed))
            if sampled:
                attrs[S.SAMPLED] = True
            emit(S.KERNEL, ctx, attrs, first + offset, last + offset, clean=False)
            made += 1
        # and builds with no call of theirs in this step
        totals.extend((s, 0, 0, missed) for s, missed in misses.items())
        if self.totals is not None and totals:
            self._add_totals_many(totals)
        return made

    def _kernel_spans_encoded(self, sink, ctx, calls: np.ndarray, rec: StepRecord, fwd: bool,
                              sampled: bool, misses: dict[int, int]) -> int | None:
        """:meth:`_kernel_spans` written as OTLP bytes to ``sink``; None where the C writer
        declines (nothing taken: the ReadableSpans are made instead)."""
        phase = "fwd" if fwd else "bwd"
        prefixes = self._prefixes[phase]
        t = self.tracer
        try:
            while len(prefixes) < len(self.slots):
                prefixes.append(b"".join(key_value(0x4A, k, v) for k, v in
                                         self._static_attributes(len(prefixes), phase).items()))
            ids = ctx.trace_id.to_bytes(16, "big") + ctx.span_id.to_bytes(8, "big")
            got = _kernel_spans_native(
                np.ascontiguousarray(calls, dtype=np.int64), HIST_BINS, prefixes, _KERNEL_LAYOUT,
                ids, t.id_generator.generate_span_id, self._epoch_offset, rec.plan_version,
                rec.step, self._memory_carried if fwd else None, misses if fwd else None, sampled)
        except (Unsupported, ValueError, OverflowError):
            # what the encoder declines too: an attribute it does not take, ids or a step
            # past their widths
            return None
        if got is None:
            return None
        fields, made, totals = got
        sink.on_encoded(t.resource, t._instrumentation_scope, fields, made)
        if fwd and self.totals is not None:
            # and builds with no call of theirs in this step
            self._add_totals_many(totals + [(s, 0, 0, missed) for s, missed in misses.items()])
        return made

    def _static_attributes(self, slot: int, phase: str) -> dict:
        """The slot's attributes for ``phase``, made once (a slot never changes)."""
        key = (slot, phase)
        got = self._static.get(key)
        if got is None:
            got = self._static[key] = self._slot_attributes(slot, phase)
        return got

    def _call_spans(self, ctx, calls: np.ndarray, step: int) -> int:
        per = self.sampling.per_window
        if per <= 0 or not len(calls):
            return 0
        window = step // max(1, self.sampling.window_steps) if step >= 0 else self._window
        if window != self._window:
            self._window, self._sampled = window, {}
        if self._window_full == (window, len(self.slots)):   # nothing more to take until the next
            return 0
        made = 0
        taken = self._sampled
        for slot, start, dur in calls.tolist():
            k = taken.get(slot, 0)
            if k >= per:
                continue
            taken[slot] = k + 1
            self._emit(S.CALL, ctx, {**self._static_attributes(slot, "fwd"), S.STEP_NUMBER: step},
                       self.epoch(start), self.epoch(start + dur), clean=False)
            made += 1
            if len(taken) >= len(self.slots) and all(v >= per for v in taken.values()):
                self._window_full = (window, len(self.slots))
                break
        return made

    def _compile_spans(self, ctx, rec: StepRecord) -> int:
        made = 0
        for slot, start, dur, hit in rec.builds:
            if hit:
                continue
            self._emit(S.COMPILE, ctx, self._slot_attributes(slot, "fwd") | {
                S.STEP_NUMBER: rec.step, S.CACHE_MISSES: 1}, self.epoch(start), self.epoch(start + dur))
            made += 1
        return made


def _misses(rec: StepRecord) -> dict[int, int]:
    """Per slot, the variant builds of the step that missed the cache."""
    misses: dict[int, int] = {}
    for slot, _, _, hit in rec.builds:
        if not hit:
            misses[slot] = misses.get(slot, 0) + 1
    return misses


# What ``_aggregate.kernel_spans`` writes around a kernel span's figures, in its order: head
# (name, kind), tail (status, flags), the rtx.sampled attribute, then the key fields of count,
# total, min, max, histogram, plan version, step, memory delta and peak, cache misses and hits
# (the attributes' order in SpanBuilder._kernel_spans).
_KERNEL_LAYOUT = (span_head(S.KERNEL), SPAN_TAIL, key_value(0x4A, S.SAMPLED, True),
                  *(key_field(k) for k in (S.COUNT, S.TOTAL_NS, S.MIN_NS, S.MAX_NS, S.HIST,
                                           S.PLAN_VERSION, S.STEP_NUMBER, S.MEM_DELTA,
                                           S.MEM_PEAK, S.CACHE_MISSES, S.CACHE_HITS)))


_MAX_EVENTS = 128                      # the SDK's default span limit, checked in _direct_spans
_UNSET = trace.Status(trace.StatusCode.UNSET)


def _direct_spans(tracer) -> bool:
    """Whether spans may be made without the tracer: an SDK tracer that records every span
    (the default sampler) under the default attribute limits."""

    limits = getattr(tracer, "_span_limits", None)
    return (getattr(tracer, "sampler", None) in (sampling.DEFAULT_ON, sampling.ALWAYS_ON)
            and hasattr(tracer, "_instrumentation_scope") and hasattr(tracer, "span_processor")
            and limits is not None and limits.max_span_attributes >= 128
            and limits.max_event_attributes >= 128 and limits.max_attribute_length is None
            and limits.max_events >= 128)


def _context_maker() -> Callable[[int, int, TraceFlags], SpanContext]:
    """``new(trace_id, span_id, flags)``: a local SpanContext as ``SpanContext(trace_id, span_id,
    is_remote=False, trace_flags=flags)`` makes it, without its keyword and default handling
    (half a span's cost on the export thread), where this SDK's SpanContext is the tuple that
    reproduces; else that constructor."""
    max_trace, max_span = (1 << 128) - 1, (1 << 64) - 1
    make = tuple.__new__

    def new(trace_id: int, span_id: int, flags: TraceFlags) -> SpanContext:
        return make(SpanContext, (trace_id, span_id, False, flags, DEFAULT_TRACE_STATE,
                                  0 < trace_id <= max_trace and 0 < span_id <= max_span))

    def sdk(trace_id: int, span_id: int, flags: TraceFlags) -> SpanContext:
        return SpanContext(trace_id, span_id, is_remote=False, trace_flags=flags)

    flags = TraceFlags(TraceFlags.SAMPLED)
    try:
        same = all(tuple(new(*args)) == tuple(sdk(*args)) and type(new(*args)) is SpanContext
                   and new(*args).is_valid == sdk(*args).is_valid
                   for args in ((3, 5, flags), (0, 5, flags), (3, 0, flags), (1 << 128, 1, flags)))
    except Exception:  # noqa: BLE001 - a SpanContext this cannot make: the SDK's own
        same = False
    return new if same else sdk


def _clean(attrs: dict) -> dict:
    """Attribute values as the SDK stores them (sequences become tuples)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in attrs.items()}


# Below this many calls a plain loop aggregates a step faster than numpy's per-call overheads.
_LOOP_MAX_CALLS = 256
Aggregate = tuple[int, int, int, int, int, int, tuple]  # count, total, min, max, first, last, hist


def aggregate(calls: np.ndarray) -> dict[int, Aggregate]:
    """Per slot in ``calls`` (rows of slot, start_ns, duration_ns): count, total, min and max
    duration, first start, last end, and the log2 histogram of durations (trailing zeros cut)."""
    if _aggregate_native is not None and os.environ.get("RTXOPS_OTLP_NATIVE", "1") != "0":
        got = _aggregate_native(np.ascontiguousarray(calls, dtype=np.int64), HIST_BINS)
        if got is not None:   # None: a slot or sum it does not take
            return got
    if len(calls) <= _LOOP_MAX_CALLS:
        return _aggregate_loop(calls.tolist())
    return _aggregate_numpy(calls)


def _aggregate_loop(rows: list) -> dict[int, Aggregate]:
    acc: dict[int, list] = {}
    for slot, start, dur in rows:
        a = acc.get(slot)
        end = start + dur
        b = min(dur.bit_length() if dur > 0 else 0, HIST_BINS - 1)
        if a is None:
            hist = [0] * (b + 1)
            hist[b] = 1
            acc[slot] = [1, dur, dur, dur, start, end, hist]
            continue
        a[0] += 1
        a[1] += dur
        if dur < a[2]:
            a[2] = dur
        if dur > a[3]:
            a[3] = dur
        if start < a[4]:
            a[4] = start
        if end > a[5]:
            a[5] = end
        hist = a[6]
        if b >= len(hist):
            hist.extend([0] * (b + 1 - len(hist)))
        hist[b] += 1
    return {s: (*a[:6], tuple(a[6])) for s, a in sorted(acc.items())}


def _aggregate_numpy(calls: np.ndarray) -> dict[int, Aggregate]:
    slot, start, dur = calls[:, 0], calls[:, 1], calls[:, 2]
    n = int(slot.max()) + 1
    count = np.bincount(slot, minlength=n)
    total = np.bincount(slot, weights=dur, minlength=n)
    lo = np.full(n, np.iinfo(np.int64).max)
    hi = np.zeros(n, dtype=np.int64)
    first = np.full(n, np.iinfo(np.int64).max)
    last = np.zeros(n, dtype=np.int64)
    np.minimum.at(lo, slot, dur)
    np.maximum.at(hi, slot, dur)
    np.minimum.at(first, slot, start)
    np.maximum.at(last, slot, start + dur)
    bits = np.minimum(_bit_length(dur), HIST_BINS - 1)
    hist = np.bincount(slot * HIST_BINS + bits, minlength=n * HIST_BINS).reshape(n, HIST_BINS)
    return {int(s): (int(count[s]), int(total[s]), int(lo[s]), int(hi[s]), int(first[s]),
                     int(last[s]), tuple(_trim(hist[s])))
            for s in np.flatnonzero(count)}


def _bit_length(values: np.ndarray) -> np.ndarray:
    out = np.zeros(values.shape, dtype=np.int64)
    positive = values > 0
    out[positive] = np.floor(np.log2(values[positive])).astype(np.int64) + 1
    return out


def _trim(hist: np.ndarray) -> list[int]:
    nz = np.flatnonzero(hist)
    return hist[: nz[-1] + 1].tolist() if len(nz) else []
