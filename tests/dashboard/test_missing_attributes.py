"""Kernel spans an OTLP client sent without some of rtxops' attributes (valid input, stored as
nulls) leave the kernel table and series answering, with nulls where the figures are missing."""
from __future__ import annotations

import time

import pytest

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
    # the span without a bucket is a series too (it matched no series' bucket before)
    assert set(by_bucket) == {"b", "c", None}
    assert by_bucket["c"]["p50_us"] == [None] and by_bucket["b"]["p50_us"] == [0.1]
    assert by_bucket[None]["p50_us"] == [0.1]


@pytest.mark.parametrize("minutes", [2, 12], ids=["from spans", "from the rollup"])
def test_two_jobs_with_one_kernel_key_are_two_series(tmp_path, minutes):
    """With no job chosen, two jobs running one (op, bucket, variant, config, phase) were merged
    into one series whose points went back and forth between them (1 µs, 1 ms, 1 µs, ...)."""
    now = time.time_ns() - 20 * 60 * 10**9
    kernel = {"rtx.op": "gelu", "rtx.variant": "eager", "rtx.bucket": "b", "rtx.phase": "fwd",
              "rtx.count": 1}
    window = Window(3600, now - 60 * 10**9, now + 20 * 60 * 10**9, pinned=True)
    with Store(tmp_path / "s.duckdb") as store:
        for job, ns in (("fast", 1_000), ("slow", 1_000_000)):
            spans = [span("rtx.kernel", {**kernel, "rtx.total_ns": ns}, start=now + m * 60 * 10**9)
                     for m in range(minutes)]
            body = request(spans, {"rtx.job.id": job}).SerializeToString()
            store.write(otlp.convert(body, "application/x-protobuf", now), timeout=30)
        series = data.kernel_series(store, job_id=None, op=None, bucket=None, window=window,
                                    points=60)["series"]
    assert sorted(s["job_id"] for s in series) == ["fast", "slow"]
    for s in series:
        assert s["t_ns"] == sorted(set(s["t_ns"])) and len(s["t_ns"]) == minutes
        expected = 1.0 if s["job_id"] == "fast" else 1000.0
        assert all(abs(p - expected) / expected < 0.05 for p in s["p50_us"]), s


@pytest.fixture
def pages(tmp_path):
    """The dashboard's pages over a store holding kernel spans with and without a bucket."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from rtxops import dashboard

    now = time.time_ns()
    kernel = {"rtx.op": "gelu", "rtx.variant": "eager", "rtx.count": 1, "rtx.total_ns": 100}
    body = request([span("rtx.kernel", {**kernel, "rtx.bucket": "b"}, start=now),
                    span("rtx.kernel", kernel, start=now + 1)],   # no bucket
                   {"rtx.job.id": "job-a"}).SerializeToString()
    trials = [[f"trial-{i}", "job-a", "gelu", "b", "eager", "{}", "online", "grid", now - 10**9,
               now, 40, 1000.0 + i, 1200.0, 0.03, None, "done", ""] for i in range(7)]
    with Store(tmp_path / "s.duckdb") as store:
        store.write(otlp.convert(body, "application/x-protobuf", now), timeout=30)
        store.run_write(lambda cur: [cur.execute("INSERT INTO trials VALUES (" + ", ".join("?" * 17)
                                                 + ")", row) for row in trials]).result(30)
        app = FastAPI()
        app.include_router(dashboard.make_router(store))
        with TestClient(app) as client:
            yield client


def _links(html: str, cls: str) -> list[str]:
    import re

    return re.findall(rf'class="{cls}" href="([^"]*)"', html)


def test_a_span_without_a_bucket_links_without_one(pages):
    """Its links asked for ``bucket=None``, the text, and the chart there found nothing."""
    html = pages.get("/kernels", params={"window_s": 3600}).text
    series, trials = _links(html, "series-link"), _links(html, "trials-link")
    assert len(series) == len(trials) == 2
    assert not [link for link in series + trials if "None" in link]
    assert sum("bucket=" not in link for link in series) == 1
    evolve = pages.get("/evolve").text
    assert "bucket=None" not in evolve


def test_the_trials_chart_reads_every_trial_whatever_page_the_table_is_on(pages):
    """Its source took the table's ``offset``: the chart left out the newest trials."""
    import html as html_module
    import re

    html = pages.get("/evolve", params={"offset": 5, "limit": 2, "op": "gelu"}).text
    src = html_module.unescape(re.search(r'id="trials-chart"[^>]*data-src="([^"]*)"', html).group(1))
    assert "offset" not in src and "op=gelu" in src
    assert len(pages.get(src).json()["items"]) == 7


def test_a_window_that_is_no_preset_is_shown_as_chosen(pages):
    html = pages.get("/", params={"window_s": 1800}).text
    assert '<option value="1800" selected>' in html
    assert html.count(" selected>") == 1
    pinned = pages.get("/", params={"window_s": 900, "until_ns": 1_700_000_000_000_000_000}).text
    assert 'class="pinned">until ' in pinned and 'class="pinned"' not in html


@pytest.mark.parametrize("path", ["/kernels?window_s=3600", "/evolve?op=gelu"])
def test_a_page_past_the_end_says_so_and_links_back(pages, path):
    """Past the last row the pages said "No jobs yet." or "The ledger is empty." with no pager."""
    html = pages.get(f"{path}&offset=1000").text
    assert 'class="empty past-end">No rows at offset 1000:' in html, html[-2000:]
    assert "offset=0" in html.split("past-end", 1)[1].split("</p>", 1)[0]
