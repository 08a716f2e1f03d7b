"""The loop's readers over a real store: hot-spot shares over the whole window, and kernel spans
without a total (any OTLP client may omit it) left out rather than counted as calls."""
from __future__ import annotations

import time

from rtxops.telemetry import otlp, store_evolve
from rtxops.telemetry.store import Store

from ..telemetry.otlp_helpers import request, span

RESOURCE = {"service.name": "trainer", "rtx.job.id": "job", "rtx.rank": 0}


def _kernel(step, op, bucket, total_ns, *, variant="reference", phase="fwd", start):
    attrs = {"rtx.step": step, "rtx.op": op, "rtx.bucket": bucket, "rtx.variant": variant,
             "rtx.config": "{}", "rtx.phase": phase, "rtx.count": 1}
    if total_ns is not None:
        attrs["rtx.total_ns"] = total_ns
    return span("rtx.kernel", attrs, start=start)


def _store(tmp_path, spans) -> Store:
    store = Store(tmp_path / "s.duckdb")
    store.write(otlp.convert(request(spans, RESOURCE).SerializeToString(), otlp.PROTOBUF,
                             time.time_ns()), timeout=30)
    return store


def test_a_bucket_called_in_few_steps_has_its_share_of_the_whole_window(tmp_path):
    t0 = time.time_ns()
    spans = []
    for s in range(50):
        spans.append(span("rtx.step", {"rtx.step": s}, start=t0 + s * 10**6, duration=10**6))
        spans.append(_kernel(s, "gelu", "every_step", 100_000, start=t0 + s * 10**6))
        if s in (3, 4):  # a shape seen twice: 2 x 0.5 ms of a 50 ms window
            spans.append(_kernel(s, "rms_norm", "twice", 500_000, start=t0 + s * 10**6 + 1))
    with _store(tmp_path, spans) as store:
        shares = {r["bucket"]: r["share"] for r in store_evolve.hotspots(store, "job", 0)}
    assert abs(shares["every_step"] - 0.10) < 1e-9
    assert abs(shares["twice"] - 0.02) < 1e-9  # not 0.5, its time per step it ran in


def test_kernel_spans_without_a_total_are_left_out(tmp_path):
    t0 = time.time_ns()
    spans = [span("rtx.step", {"rtx.step": 10}, start=t0, duration=10**6),
             _kernel(10, "gelu", "b", 100_000, start=t0),
             _kernel(10, "gelu", "b", None, start=t0 + 1),  # same step and arm, no total
             _kernel(11, "gelu", "b", None, start=t0 + 2)]  # a step with only such a span
    with _store(tmp_path, spans) as store:
        rows = store_evolve.arm_steps(store, "job", "gelu", "b", 0)
    assert [(r["step"], r["calls"], r["total_ns"]) for r in rows] == [(10, 1, 100_000)]


def test_a_sampled_backward_counts_for_every_call_of_the_step(tmp_path):
    """The runtime times one backward call a route every few steps: a bucket called 24 times a
    step had its backward counted as one call's, and ranked under a bucket of less time."""
    t0, spans = time.time_ns(), []
    for s in range(64):
        st = t0 + s * 10**8          # 100 ms steps
        spans.append(span("rtx.step", {"rtx.step": s}, start=st, duration=100 * 10**6))
        spans.append(_kernel(s, "gelu", "once", 1_000_000, start=st + 1))
        spans.append(span("rtx.kernel", {"rtx.step": s, "rtx.op": "gelu", "rtx.bucket": "often",
                                         "rtx.variant": "reference", "rtx.config": "{}",
                                         "rtx.phase": "fwd", "rtx.count": 24,
                                         "rtx.total_ns": 24 * 100_000}, start=st + 2))
        if s % 8 == 0:
            spans.append(_kernel(s, "gelu", "once", 2_000_000, phase="bwd", start=st + 3))
            spans.append(_kernel(s, "gelu", "often", 200_000, phase="bwd", start=st + 4))
    with _store(tmp_path, spans) as store:
        rows = store_evolve.hotspots(store, "job", 0)
    assert [r["bucket"] for r in rows] == ["often", "once"]
    shares = {r["bucket"]: r["share"] for r in rows}
    assert abs(shares["once"] - 0.03) < 1e-9 and abs(shares["often"] - 0.072) < 1e-9


def test_step_durations_say_how_many_ranks_reported_each_step(tmp_path):
    t0 = time.time_ns()
    spans = [span("rtx.step", {"rtx.step": 1}, start=t0, duration=10**6)]
    with _store(tmp_path, spans) as store:
        store.write(otlp.convert(request([span("rtx.step", {"rtx.step": 1}, start=t0, duration=2 * 10**6)],
                                         {**RESOURCE, "rtx.rank": 1}).SerializeToString(),
                                 otlp.PROTOBUF, time.time_ns()), timeout=30)
        assert store_evolve.step_durations(store, "job", 0) == [
            {"step": 1, "duration_ns": 10**6, "ranks": 2}]
