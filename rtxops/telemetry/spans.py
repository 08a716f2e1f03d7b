"""Turn a :class:`StepRecord` into OpenTelemetry spans (runs on the export thread, never the hot path).

Per step: one ``rtx.step`` span and, as its children, one ``rtx.kernel`` span per
(slot, phase) with count, total/min/max ns and a log2 latency histogram; a budget of sampled
``rtx.call`` spans per slot per window of steps; ``rtx.compile`` spans for variant builds;
``rtx.swap`` spans for plan swaps. Spans get explicit start and end times.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Callable, Sequence

import numpy as np
from opentelemetry import trace
from opentelemetry.sdk.trace import Event, ReadableSpan, Tracer, sampling
from opentelemetry.trace import SpanContext, TraceFlags

from rtxops.runtime.readings import Slot

from . import schema as S
from .recorder import RECORD_WIDTH, StepRecord

HIST_BINS = 40  # bit lengths of durations in ns: 2^39 ns ~ 9 minutes


@dataclass
class CallSampling:
    """At most ``per_window`` rtx.call spans per slot in every window of ``window_steps`` steps."""

    per_window: int = 2
    window_steps: int = 10

    @classmethod
    def parse(cls, text: str | None) -> CallSampling:
        """``"2/10"`` = 2 calls per slot every 10 steps; ``"0"`` turns sampling off."""
        if not text:
            return cls()
        per, _, window = text.partition("/")
        return cls(int(per), int(window or 10))


class SpanBuilder:
    """Builds the spans of one step record through ``tracer`` (an SDK tracer)."""

    def __init__(self, tracer: Tracer, slots: Sequence[Slot],
                 step_attributes: Callable[[], dict] | None = None,
                 sampling: CallSampling | None = None, totals=None) -> None:
        self.tracer = tracer
        self.slots = slots
        self.step_attributes = step_attributes or (lambda: {})
        self.sampling = sampling or CallSampling()
        self.totals = totals  # a CallStats the whole run's calls and time are added to
        self._sampled: dict[int, int] = {}
        self._window = 0
        self._direct = self._use_direct = _direct_spans(tracer)
        # as the SDK sets them: sampled, and W3C "random trace id" where the SDK knows that flag
        random_id = getattr(getattr(tracer, "id_generator", None), "is_trace_id_random", lambda: False)()
        self._root_flags = TraceFlags(TraceFlags.SAMPLED | (
            getattr(TraceFlags, "RANDOM_TRACE_ID", 0) if random_id else 0))
        # perf_counter_ns -> Unix epoch ns; both clocks are read together once
        self._epoch_offset = time.time_ns() - perf_counter_ns()

    def epoch(self, perf_ns: int) -> int:
        return int(perf_ns) + self._epoch_offset

    def build(self, rec: StepRecord, extra: dict | None = None) -> int:
        """Emit the spans for ``rec``; returns how many spans were made."""
        calls = np.frombuffer(rec.calls, dtype=np.int64).reshape(-1, RECORD_WIDTH)
        attrs = {
            S.STEP_NUMBER: rec.step,
            S.PLAN_VERSION: rec.plan_version,
            S.RSS: rec.rss_bytes,
            S.DROPPED_RECORDS: rec.dropped_records,
            S.COUNT: int(calls.shape[0]),
            **self.step_attributes(),
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

    def _start(self, name: str, parent, attrs: dict, start: int, events=()):
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
        context = SpanContext(trace_id, t.id_generator.generate_span_id(), is_remote=False,
                              trace_flags=flags)
        return [name, context, parent, _clean(attrs), start,
                tuple(Event(n, _clean(a), timestamp=at) for n, a, at in events)]

    def _end(self, span, end: int) -> None:
        if not self._use_direct:
            span.end(end_time=end)
            return
        name, context, parent, attrs, start, events = span
        t = self.tracer
        t.span_processor.on_end(ReadableSpan(
            name, context, parent, t.resource, attrs, events, (), trace.SpanKind.INTERNAL,
            t.instrumentation_info, _UNSET, start, end, t._instrumentation_scope))

    def _emit(self, name: str, parent, attrs: dict, start: int, end: int) -> None:
        self._end(self._start(name, parent, attrs, start), end)

    def _slot_attributes(self, slot: int, phase: str) -> dict:
        s = self.slots[slot]
        return {S.OP: s.op, S.VARIANT: s.variant, S.FAMILY: s.family, S.CONFIG: s.config,
                S.BUCKET: s.bucket, S.SITE: s.site, S.PHASE: phase}

    def _kernel_spans(self, ctx, calls: np.ndarray, rec: StepRecord, phase: str,
                      sampled: bool = False) -> int:
        if not len(calls):
            return 0
        slot, start, dur = calls[:, 0], calls[:, 1], calls[:, 2]
        n = len(self.slots)
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
        builds = np.zeros(n, dtype=np.int64)
        for b_slot, _, _, hit in rec.builds:
            if not hit:
                builds[b_slot] += 1
        made = 0
        for s in np.flatnonzero(count):
            s = int(s)
            attrs = self._slot_attributes(s, phase) | {
                S.COUNT: int(count[s]), S.TOTAL_NS: int(total[s]), S.MIN_NS: int(lo[s]),
                S.MAX_NS: int(hi[s]), S.HIST: _trim(hist[s]), S.PLAN_VERSION: rec.plan_version,
                S.STEP_NUMBER: rec.step,
            }
            if phase == "fwd" and s in rec.memory:
                attrs[S.MEM_DELTA], attrs[S.MEM_PEAK] = rec.memory[s]
            if phase == "fwd":
                misses = int(builds[s])
                attrs[S.CACHE_MISSES] = misses
                attrs[S.CACHE_HITS] = int(count[s]) - misses
                if self.totals is not None:
                    self.totals.calls[s] += int(count[s])
                    self.totals.total_ns[s] += int(total[s])
                    self.totals.build_misses[s] += misses
            if sampled:
                attrs[S.SAMPLED] = True
            self._emit(S.KERNEL, ctx, attrs, self.epoch(first[s]), self.epoch(last[s]))
            made += 1
        return made

    def _call_spans(self, ctx, calls: np.ndarray, step: int) -> int:
        per = self.sampling.per_window
        if per <= 0 or not len(calls):
            return 0
        window = step // max(1, self.sampling.window_steps) if step >= 0 else self._window
        if window != self._window:
            self._window, self._sampled = window, {}
        made = 0
        taken = self._sampled
        for slot, start, dur in calls.tolist():
            k = taken.get(slot, 0)
            if k >= per:
                continue
            taken[slot] = k + 1
            self._emit(S.CALL, ctx, self._slot_attributes(slot, "fwd") | {S.STEP_NUMBER: step},
                       self.epoch(start), self.epoch(start + dur))
            made += 1
            if len(taken) >= len(self.slots) and all(v >= per for v in taken.values()):
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


def _clean(attrs: dict) -> dict:
    """Attribute values as the SDK stores them (sequences become tuples)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in attrs.items()}


def _bit_length(values: np.ndarray) -> np.ndarray:
    out = np.zeros(values.shape, dtype=np.int64)
    positive = values > 0
    out[positive] = np.floor(np.log2(values[positive])).astype(np.int64) + 1
    return out


def _trim(hist: np.ndarray) -> list[int]:
    nz = np.flatnonzero(hist)
    return hist[: nz[-1] + 1].tolist() if len(nz) else []
