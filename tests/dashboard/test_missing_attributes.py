"""Kernel spans an OTLP client sent without some of rtxops' attributes (valid input, stored as
nulls) leave the kernel table and series answering, with nulls where the figures are missing."""
from __future__ import annotations

import time

from rtxops.dashboard import data
from rtxops.dashboard.params import Paging, Window
from rtxops.telemetry import otlp
from rtxops.telemetry.store import Store

from ..telemetry.otlp_helpers import request, span


def test_kernel_views_answer_with_spans_that_lack_attributes(tmp_path):
    now = time.time_ns()
    kernel = {"rtx.op": "gelu", "rtx.variant": "eager", "rtx.count": 1}
    body = request([span("rtx.step", {"rtx.step": 1}, start=now, duration=10**6),
                    span("rtx.kernel", {**kernel, "rtx.bucket": "b", "rtx.total_ns": 100}, start=now),
                    span("rtx.kernel", {**kernel, "rtx.total_ns": 100}, start=now + 1),  # no bucket
                    span("rtx.kernel", {**kernel, "rtx.bucket": "c"}, start=now + 2)],   # no total
                   {"rtx.job.id": "job-a"}).SerializeToString()
    window = Window(600, now - 60 * 10**9, now + 60 * 10**9, pinned=True)
    with Store(tmp_path / "s.duckdb") as store:
        store.write(otlp.convert(body, "application/x-protobuf", now), timeout=30)
        table = data.kernels(store, job_id=None, op=None, window=window, paging=Paging(50, 0))
        series = data.kernel_series(store, job_id=None, op=None, bucket=None, window=window, points=10)
    rows = {r["bucket"]: r for r in table["items"]}
    assert set(rows) == {"b", "c", None}
    assert rows["c"]["share"] is None and rows["b"]["share"] == 100 / 10**6
    by_bucket = {s["bucket"]: s for s in series["series"]}
    assert {"b", "c"} <= set(by_bucket)  # a span without a bucket matches no series' bucket
    assert by_bucket["c"]["p50_us"] == [None] and by_bucket["b"]["p50_us"] == [0.1]
