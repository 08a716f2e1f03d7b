"""The evolve page's sections show what the evolve loop writes: canaries are decisions of kind
canary_pass or rollback; explorations are the latest trials of jobs still running; a rollback
marker stands on its decision's time and plan version (the loop sets no bundle digest)."""
from __future__ import annotations

import pytest

from rtxops.dashboard import data
from rtxops.dashboard.params import Window
from rtxops.telemetry import store_views as V
from rtxops.telemetry.store import Store

NS = 10**9


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "rtxops.duckdb")
    rows = {
        "jobs": [("job-run", "a", "running", 0, 0, "{}"), ("job-done", "b", "succeeded", 0, 0, "{}")],
        "trials": [(f"t-{j}-{i}", j, "gelu", "b1", "tanh", "{}", "explore", "thompson", i * NS,
                    i * NS + 1, 10, 1.0, 1.0, 0.1, 0, status, "") for j in ("job-run", "job-done")
                   for i, status in enumerate(("ok", "no_samples", "failed"))],
        "decisions": [(f"d-{k}", "job-run", "gelu", "b1", k, "tanh", "{}", "reference", "{}", v,
                       0.1, 0.05, 0.2, 0.01, k, "{}", None, (10 + v) * NS)
                      for v, k in enumerate(("promote", "canary_pass", "rollback", "reject", "drift"), 1)],
    }

    def insert(cur):
        for table, values in rows.items():
            for r in values:
                cur.execute(f"INSERT INTO {table} VALUES ({', '.join('?' * len(r))})", list(r))

    s.run_write(insert).result(10)
    yield s
    s.close()


def test_sections_show_what_the_loop_writes(store):
    summary = data.evolve(store, job_id=None, window=Window(3600, 0, 100 * NS, True))
    assert {t["job_id"] for t in summary["running"]} == {"job-run"} and len(summary["running"]) == 3
    assert [d["kind"] for d in summary["canaries"]] == ["rollback", "canary_pass"]
    assert [d["kind"] for d in summary["rollbacks"]] == ["rollback"]


def test_rollback_marker_needs_no_bundle_digest(store):
    markers = V.swap_markers(store, job_id="job-run", since_ns=0, until_ns=100 * NS, limit=10)
    assert [(m["kind"], m["at_ns"], m["plan_to"]) for m in markers] == [("rollback", 13 * NS, 3)]


def test_tuning_pages_neither_skip_nor_repeat_rows_that_tie(tmp_path):
    from rtxops.telemetry.store_evolve import upsert_tuning

    s = Store(tmp_path / "tuning.duckdb")
    try:
        for i in range(120):  # one op and bucket; untested configs tie on a NULL median
            key = {"op": "gelu", "bucket": "b1", "variant": "chunked", "config": f'{{"c":{i}}}',
                   "device": "cpu", "torch_version": "t", "triton_version": "", "source_hash": "h"}
            upsert_tuning(s, key, {"trials": 0, "median_ns": None if i % 3 else 5.0,
                                   "status": "untested", "updated_ns": i})
        seen = []
        for offset in range(0, 120, 50):
            total, rows = V.tuning(s, op=None, variant=None, status=None, device=None, limit=50,
                                   offset=offset)
            seen += [r["config"] for r in rows]
        assert total == 120 and len(seen) == 120 and len(set(seen)) == 120
    finally:
        s.close()


def test_the_decisions_table_names_the_level_of_its_intervals(store):
    """The header said "95 % CI" beside intervals the loop computes at 99 % (its reasons say so)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from rtxops import dashboard
    from rtxops.evolve.stats import CONFIDENCE

    app = FastAPI()
    app.include_router(dashboard.make_router(store))
    page = TestClient(app).get("/evolve").text
    assert f"<th>{round(100 * CONFIDENCE)} % CI</th>" in page and "95 % CI" not in page


def test_swap_markers_past_the_limit_are_the_newest(tmp_path):
    """Markers were the oldest ``limit`` swaps: the breakdown's default "last swap" was the
    1000th, not the last, for a job that swapped more often."""
    from rtxops.telemetry import otlp

    from ..telemetry.otlp_helpers import request, span

    swaps = [span("rtx.swap", {"rtx.step": i, "rtx.plan.from": i, "rtx.plan.to": i + 1,
                               "rtx.plan.digest": "d"}, start=(i + 1) * NS) for i in range(30)]
    body = request(swaps, {"service.name": "t", "rtx.job.id": "job-a", "rtx.rank": 0})
    with Store(tmp_path / "s.duckdb") as s:
        s.write(otlp.convert(body.SerializeToString(), otlp.PROTOBUF, 0), timeout=30)
        markers = V.swap_markers(s, job_id="job-a", since_ns=0, until_ns=100 * NS, limit=10)
    assert [m["step"] for m in markers] == list(range(20, 30))


def test_a_kernels_share_of_step_time_is_over_the_same_minutes_as_its_time(tmp_path):
    """Kernel time is read over the window's whole minutes, step time over the window alone: a
    kernel taking 90 % of each step showed 180 % in a minute-long window starting mid-minute."""
    from rtxops.dashboard.params import Paging
    from rtxops.telemetry import otlp

    from ..telemetry.otlp_helpers import request, span

    base = 1_800_000_000 * NS // (60 * NS) * (60 * NS)   # a minute's start
    spans = []
    for i in range(180):                                  # a step a second, 3 minutes
        t = base + i * NS
        spans.append(span("rtx.step", {"rtx.step": i}, start=t, duration=100_000_000))
        spans.append(span("rtx.kernel", {"rtx.op": "gelu", "rtx.variant": "eager", "rtx.bucket": "b",
                                         "rtx.phase": "fwd", "rtx.count": 1,
                                         "rtx.total_ns": 90_000_000, "rtx.step": i}, start=t + 1))
    body = request(spans, {"service.name": "t", "rtx.job.id": "job-a", "rtx.rank": 0})
    with Store(tmp_path / "s.duckdb") as s:
        s.write(otlp.convert(body.SerializeToString(), otlp.PROTOBUF, 0), timeout=30)
        since = base + 110 * NS
        got = data.kernels(s, job_id="job-a", op=None, window=Window(60, since, since + 60 * NS, False),
                           paging=Paging(50, 0))
    [row] = got["items"]
    assert abs(row["share"] - 0.9) < 0.01, row["share"]


def test_a_jobs_long_output_lines_are_shown_cut_and_do_not_exhaust_the_store(tmp_path):
    """A job printing lines of a mebibyte: sorting them whole ran the store (96 MB) out of
    memory, and the job's page and its logs API answered 500 for good."""
    line = "x" * (1 << 20)
    with Store(tmp_path / "s.duckdb") as s:
        s.run_write(lambda cur: cur.executemany(
            "INSERT INTO job_logs VALUES ('job-a', ?, ?, 1, 0, 'stdout', ?)",
            [(i, i, line if i % 2 else f"short {i}") for i in range(1, 151)])).result(60)
        tail = V.job_logs_tail(s, "job-a", search=None, limit=500)
        page = V.job_logs(s, "job-a", rank=None, stream=None, search=None, after_seq=100, limit=5000)
    assert [r["seq"] for r in tail] == list(range(1, 151)) and [r["seq"] for r in page] == list(range(101, 151))
    long_one, short_one = tail[0], tail[1]
    assert long_one["cut"] and long_one["size"] == 1 << 20 and len(long_one["text"]) == V.LINE_SHOWN_CHARS
    assert not short_one["cut"] and short_one["text"] == "short 2"
