"""The DuckDB store: migrations, the writer (group commits, bounds, failures), and the queries."""
from __future__ import annotations

import json
import math
import threading
import time
from collections import defaultdict

import duckdb
import pyarrow as pa
import pytest

from rtxops.telemetry import otlp, store as store_module, synthetic
from rtxops.telemetry import schema as S
from rtxops.telemetry.store import Store, StoreBusy, StoreClosed, StoreError

from .._bounded import joined
from .otlp_helpers import RESOURCE, request, span


def batch_of(spans, resource=None, received_ns: int = 1) -> otlp.Batch:
    return otlp.convert(request(spans, resource).SerializeToString(), otlp.PROTOBUF, received_ns)


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "t.duckdb")
    yield s
    s.close()


class BlockedWriter:
    """Holds the writer inside its insert until released (to fill the queue deterministically)."""

    def __init__(self, monkeypatch) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        real = store_module._insert

        def slow_insert(*args):
            self.entered.set()
            self.release.wait(30)
            return real(*args)

        monkeypatch.setattr(store_module, "_insert", slow_insert)


def test_schema_matches_the_conversion_and_migrations_are_recorded(tmp_path):
    path = tmp_path / "m.duckdb"
    with Store(path) as s:
        assert s.migrated_from == 0
        for table, schema in (("spans", otlp.SPANS_SCHEMA), ("resources", otlp.RESOURCES_SCHEMA),
                              ("span_events", otlp.EVENTS_SCHEMA)):
            columns = [r["column_name"] for r in s.query(
                "SELECT column_name FROM information_schema.columns WHERE table_name = ? "
                "ORDER BY ordinal_position", [table])]
            assert columns == schema.names, table
        assert s.query("SELECT version FROM schema_version ORDER BY version") == [
            {"version": v} for v, _, _ in store_module.MIGRATIONS]
    with Store(path) as s:
        assert s.migrated_from == store_module.SCHEMA_VERSION
    con = duckdb.connect(str(path))
    con.execute("INSERT INTO schema_version VALUES (99, 'from the future', 0)")
    con.close()
    with pytest.raises(StoreError, match="newer than this rtxops"):
        Store(path)


def test_default_path_follows_rtxops_home(monkeypatch, tmp_path):
    monkeypatch.setenv("RTXOPS_HOME", str(tmp_path))
    assert store_module.default_path() == tmp_path / "rtxops.duckdb"
    monkeypatch.delenv("RTXOPS_HOME")
    assert str(store_module.default_path()) == ".rtxops/rtxops.duckdb"


def test_write_then_read_back(store):
    b = batch_of([span("rtx.step", {S.STEP_NUMBER: 1}), span(attrs={S.OP: "gelu"})], received_ns=42)
    store.write(b)
    store.write(b)                                   # same resource twice: stored once
    assert store.query("SELECT count(*) AS n FROM spans") == [{"n": 4}]
    assert store.query("SELECT count(*) AS n FROM resources") == [{"n": 1}]
    assert store.query("SELECT op FROM spans WHERE name = ?", ["rtx.kernel"]) == [{"op": "gelu"}] * 2
    stats = store.ingest_stats()
    assert (stats["batches_stored"], stats["spans_stored"], stats["spans_written"]) == (2, 4, 4)
    assert store.query("SELECT DISTINCT received_ns FROM ingest_batches") == [{"received_ns": 42}]


def test_group_commit_and_close_drain_everything(tmp_path, monkeypatch):
    blocked = BlockedWriter(monkeypatch)
    s = Store(tmp_path / "g.duckdb")
    futures = [s.submit(batch_of([span(attrs={S.STEP_NUMBER: i})])) for i in range(10)]
    blocked.entered.wait(5)
    assert not futures[-1].done()
    blocked.release.set()
    for f in futures:
        assert f.result(10) is None
    assert s.stats()["commits"] < 10                  # the queued ones went in together
    more = [s.submit(batch_of([span()])) for _ in range(5)]
    s.close()
    assert all(f.done() and f.exception() is None for f in more)
    with pytest.raises(StoreClosed):
        s.submit(batch_of([span()]))
    with Store(tmp_path / "g.duckdb") as again:
        assert again.query("SELECT count(*) AS n FROM spans") == [{"n": 15}]


def test_span_events_count_against_the_queue_bound(tmp_path, monkeypatch):
    """A request of few spans and many events was queued as its spans alone: 256 of them held
    millions of event rows in memory."""
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    blocked = BlockedWriter(monkeypatch)
    s = Store(tmp_path / "ev.duckdb", max_queue_batches=8, max_queue_spans=10)
    first = s.submit(batch_of([span()]))
    with pytest.raises(StoreBusy):
        s.submit(batch_of([span(events=[Span.Event(name="e")] * 10)]))
    assert s.stats()["queue_spans"] == 1
    blocked.release.set()
    first.result(10)
    s.close()


def test_queue_bounds_refuse_and_count(tmp_path, monkeypatch):
    blocked = BlockedWriter(monkeypatch)
    s = Store(tmp_path / "b.duckdb", max_queue_batches=3, max_queue_spans=10)
    accepted, refused_spans, hints = [], 0, []
    sizes = [4, 4, 1, 2, 1, 3, 1]
    for n in sizes:
        try:
            accepted.append((n, s.submit(batch_of([span() for _ in range(n)]))))
        except StoreBusy as e:
            refused_spans += n
            hints.append(e.retry_after)
        st = s.stats()
        assert st["queue_batches"] <= 3 and st["queue_spans"] <= 10
    assert refused_spans > 0 and all(h >= 1 for h in hints)
    stats = s.stats()
    assert stats["spans_refused"] == refused_spans
    assert stats["requests_refused"] == len(hints)
    blocked.release.set()
    for _, f in accepted:
        f.result(10)
    s.close()
    with Store(tmp_path / "b.duckdb") as again:
        assert again.query("SELECT count(*) AS n FROM spans")[0]["n"] == sum(n for n, _ in accepted)


def test_a_failing_batch_fails_alone(store):
    good = batch_of([span()])
    bad = otlp.Batch(good.resources, pa.table({"nonsense": [1]}), good.events, 1)
    futures = [store.submit(good), store.submit(bad), store.submit(good)]
    assert futures[0].result(10) is None and futures[2].result(10) is None
    with pytest.raises(StoreError, match="writing a batch failed"):
        futures[1].result(10)
    assert store.query("SELECT count(*) AS n FROM spans") == [{"n": 2}]
    assert store.stats()["write_errors"] == 1


def test_cancelled_submissions_are_not_written(tmp_path, monkeypatch):
    blocked = BlockedWriter(monkeypatch)
    s = Store(tmp_path / "c.duckdb")
    first = s.submit(batch_of([span()]))
    blocked.entered.wait(5)
    second = s.submit(batch_of([span(), span()]))
    assert second.cancel()
    blocked.release.set()
    first.result(10)
    s.close()
    with Store(tmp_path / "c.duckdb") as again:
        assert again.query("SELECT count(*) AS n FROM spans") == [{"n": 1}]
        assert again.stats()["queue_spans"] == 0


def test_readers_run_while_the_writer_writes(store):
    stop = threading.Event()
    seen: list[int] = []

    def read():
        while not stop.is_set():
            seen.append(store.query("SELECT count(*) AS n FROM spans")[0]["n"])

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(20):
        store.write(batch_of([span() for _ in range(50)]))
    stop.set()
    joined(reader)
    assert seen == sorted(seen) and len(seen) > 1


# ---- queries -----------------------------------------------------------------------------------

def test_kernel_stats_against_a_python_computation(store):
    now = time.time_ns()
    b = synthetic.otlp_request(800, seed=5, start_ns=now - 10 * 60 * 10**9, job_id="job-q")
    old = synthetic.otlp_request(80, seed=6, start_ns=now - 3 * 3600 * 10**9, job_id="job-q")
    store.write(otlp.convert(b.SerializeToString(), otlp.PROTOBUF, now))
    store.write(otlp.convert(old.SerializeToString(), otlp.PROTOBUF, now))
    per_step: dict = defaultdict(lambda: defaultdict(lambda: [0, 0, 1 << 62, 0]))
    for s in b.resource_spans[0].scope_spans[0].spans:
        a = {kv.key: synthetic_value(kv.value) for kv in s.attributes}
        if s.name != S.KERNEL:
            continue
        key = (a[S.OP], a[S.BUCKET], a[S.VARIANT], a[S.CONFIG], a[S.PHASE])
        acc = per_step[key][a[S.STEP_NUMBER]]
        acc[0] += a[S.COUNT]
        acc[1] += a[S.TOTAL_NS]
        acc[2] = min(acc[2], a[S.MIN_NS])
        acc[3] = max(acc[3], a[S.MAX_NS])
    got = {(r["op"], r["bucket"], r["variant"], r["config"], r["phase"]): r
           for r in store.kernel_stats(job_id="job-q")}
    assert set(got) == set(per_step)
    for key, steps in per_step.items():
        r = got[key]
        calls = sum(v[0] for v in steps.values())
        total = sum(v[1] for v in steps.values())
        means = sorted(v[1] / v[0] for v in steps.values())
        assert (r["samples"], r["calls"], r["total_ns"]) == (len(steps), calls, total)
        assert r["mean_ns"] == pytest.approx(total / calls)
        assert r["min_ns"] == min(v[2] for v in steps.values())
        assert r["max_ns"] == max(v[3] for v in steps.values())
        for q, column in ((0.5, "p50_step_mean_ns"), (0.95, "p95_step_mean_ns")):
            assert r[column] == pytest.approx(_binned_quantile(means, q))
    assert store.kernel_stats(job_id="nobody") == []
    everything = store.kernel_stats(since_ns=0, job_id="job-q")
    assert sum(r["calls"] for r in everything) > sum(r["calls"] for r in got.values())


def synthetic_value(v):
    from rtxops.telemetry._wire import any_value

    return any_value(v)


def _binned_quantile(values: list[float], q: float) -> float:
    """The store's estimate: the centre of the 1/16-octave bin of the nearest-rank q-quantile
    (so within 2.2% of that value)."""
    k = next(i for i in range(len(values)) if i + 1 >= q * len(values))
    b = math.floor(math.log2(max(values[k], 1)) * store_module.HIST_BINS_PER_OCTAVE)
    return 2 ** ((b + 0.5) / store_module.HIST_BINS_PER_OCTAVE)


def test_steps_memory_swaps_and_cache_rates(store):
    t = time.time_ns() - 10**9
    steps = [span("rtx.step", {S.STEP_NUMBER: i, S.PLAN_VERSION: 1 + (i >= 2), S.RSS: 100 + i,
                               S.CUDA_ALLOCATED: 10 * i, S.CUDA_FRAGMENTATION: 0.5,
                               S.INDUCTOR_FXGRAPH_HITS: 2 * i, S.INDUCTOR_FXGRAPH_MISSES: 1},
                  start=t + i * 1000, duration=500 + i) for i in range(4)]
    swap = span("rtx.swap", {S.STEP_NUMBER: 2, S.PLAN_FROM: 1, S.PLAN_TO: 2, S.PLAN_DIGEST: "ab"},
                start=t + 2000, duration=0)
    kernels = [span(attrs={S.OP: "gelu", S.VARIANT: "aten", S.BUCKET: "b", S.COUNT: 5,
                           S.CACHE_HITS: 4, S.CACHE_MISSES: 1}, start=t + i) for i in range(3)]
    store.write(batch_of(steps + [swap] + kernels))
    times = store.step_times(job_id="job-a")
    assert [(r["step"], r["duration_ns"], r["plan_version"]) for r in times] == [
        (3, 503, 2), (2, 502, 2), (1, 501, 1), (0, 500, 1)]
    mem = store.memory_timeline(job_id="job-a")
    assert [(r["step"], r["rss_bytes"], r["cuda_allocated_bytes"]) for r in mem] == [
        (3, 103, 30), (2, 102, 20), (1, 101, 10), (0, 100, 0)]
    assert mem[0]["cuda_fragmentation"] == 0.5 and mem[0]["cuda_reserved_bytes"] is None
    assert [(r["step"], r["plan_from"], r["plan_to"], r["plan_digest"]) for r in store.swaps()] == [
        (2, 1, 2, "ab")]
    rates = {r["cache"]: r for r in store.cache_hit_rates(job_id="job-a")}
    assert (rates["variant"]["hits"], rates["variant"]["misses"]) == (12, 3)
    assert rates["variant"]["hit_rate"] == pytest.approx(0.8)
    assert (rates["inductor.fxgraph"]["hits"], rates["inductor.fxgraph"]["misses"]) == (6, 1)
    assert "triton.autotune" not in rates
    assert [j["job_id"] for j in store.jobs()] == ["job-a"]


def test_compiler_cache_rates_are_what_each_process_counted_in_the_window(store):
    """The counters on step spans count from each process's start: the window's figure is the
    last value in it less the last one before it, summed over a job's processes (a restart's
    old and new). It was the last value seen, all time, of one process a rank."""
    now = time.time_ns()
    minute = 60 * 10**9

    def steps(hits, misses, at):
        return [span("rtx.step", {S.STEP_NUMBER: i, S.INDUCTOR_FXGRAPH_HITS: h,
                                  S.INDUCTOR_FXGRAPH_MISSES: m}, start=t, duration=10)
                for i, (h, m, t) in enumerate(zip(hits, misses, at))]

    # one process: 1000 hits and 100 misses before the last 5 minutes, 10 more hits in them
    store.write(batch_of(steps([1000, 1000, 1010], [100, 100, 100],
                               [now - 8 * minute, now - 6 * minute, now - 2 * minute])))
    rates = {r["cache"]: r for r in store.cache_hit_rates(job_id="job-a", since_ns=now - 5 * minute,
                                                          until_ns=now)}
    assert (rates["inductor.fxgraph"]["hits"], rates["inductor.fxgraph"]["misses"]) == (10, 0)
    # the job restarted: a new process on the same rank counts from 0 again
    store.write(batch_of(steps([4, 7], [1, 2], [now - 90 * 10**9, now - 30 * 10**9]),
                         {**RESOURCE, "process.pid": 78}))
    rates = {r["cache"]: r for r in store.cache_hit_rates(job_id="job-a", since_ns=now - 5 * minute,
                                                          until_ns=now)}
    assert (rates["inductor.fxgraph"]["hits"], rates["inductor.fxgraph"]["misses"]) == (17, 2)
    hour = {r["cache"]: r for r in store.cache_hit_rates(job_id="job-a", since_ns=now - 60 * minute,
                                                         until_ns=now)}
    assert (hour["inductor.fxgraph"]["hits"], hour["inductor.fxgraph"]["misses"]) == (1017, 102)


def test_queries_are_parameterized(store):
    store.write(batch_of([span(attrs={S.OP: "x"})]))
    assert store.kernel_stats(job_id="job-a' OR '1'='1") == []
    assert store.query("SELECT ? AS v", ["'; DROP TABLE spans; --"]) == [
        {"v": "'; DROP TABLE spans; --"}]
    assert store.query("SELECT count(*) AS n FROM spans") == [{"n": 1}]


def test_attribute_json_is_queryable(store):
    store.write(batch_of([span(attrs={S.HIST: [1, 2, 3], "x.y": 7})]))
    row = store.query("""SELECT attributes->'rtx.hist_log2_ns' AS h, attributes->>'x.y' AS xy
                         FROM spans""")[0]
    assert json.loads(row["h"]) == [1, 2, 3] and row["xy"] == "7"


def test_rollup_migration_backfills_existing_spans(tmp_path, monkeypatch):
    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    monkeypatch.setattr(store_module, "MIGRATIONS", store_module.MIGRATIONS[:2])
    monkeypatch.setattr(store_module, "SCHEMA_VERSION", 2)
    store_module.migrate(con)
    b = batch_of([span(attrs={S.OP: "gelu", S.COUNT: 2, S.TOTAL_NS: 300, S.CACHE_HITS: 2})
                  for _ in range(3)])
    con.register("b", b.spans)
    con.execute("INSERT INTO spans SELECT * FROM b")
    con.close()
    monkeypatch.undo()
    with Store(path) as s:
        assert s.migrated_from == 2
        (row,) = s.kernel_stats(op="gelu")
        assert (row["samples"], row["calls"], row["total_ns"]) == (3, 6, 900)
        assert [r["hits"] for r in s.cache_hit_rates() if r["cache"] == "variant"] == [6]


def test_compaction_merges_minute_rows_without_changing_results(store):
    start = time.time_ns() - 20 * 60 * 10**9
    for seed in range(4):                            # four commits into the same minutes
        req = synthetic.otlp_request(400, seed=seed, start_ns=start, step_ns=10**9)
        store.write(otlp.convert(req.SerializeToString(), otlp.PROTOBUF, 1))
    def rollup_rows():
        return store.query("SELECT count(*) AS n, count(DISTINCT (key_id, minute)) AS k "
                           "FROM kernel_minutes")[0]
    before = rollup_rows()
    assert before["n"] > before["k"]
    stats = sorted(store.kernel_stats(), key=lambda r: (r["op"], r["bucket"], r["variant"], r["phase"]))
    store.compact(before_ns=time.time_ns() + 120 * 10**9)
    assert rollup_rows() == {"n": before["k"], "k": before["k"]}
    again = sorted(store.kernel_stats(), key=lambda r: (r["op"], r["bucket"], r["variant"], r["phase"]))
    assert again == stats


@pytest.mark.parametrize("every_s, merged", [(0.0, True), (3600.0, False)])
def test_the_writer_compacts_every_compact_every_s(tmp_path, every_s, merged):
    """The writer merges earlier minutes' rows itself, after a commit, once ``compact_every_s``
    has passed since its last pass; not before."""
    start = time.time_ns() - 20 * 60 * 10**9
    with Store(tmp_path / "t.duckdb", compact_every_s=every_s) as s:
        for seed in range(3):
            req = synthetic.otlp_request(200, seed=seed, start_ns=start, step_ns=10**9)
            s.write(otlp.convert(req.SerializeToString(), otlp.PROTOBUF, 1))
        s.call(lambda cur: None)   # the writer's next turn: after its pass, if it made one
        row = s.query("SELECT count(*) AS n, count(DISTINCT (key_id, minute)) AS k "
                      "FROM kernel_minutes")[0]
    assert (row["n"] == row["k"]) is merged


def test_kernel_totals_past_int64_saturate_and_compaction_goes_on(store):
    """1100 kernel spans of 2^53 ns each (within the figures the store takes) summed to a negative
    total in the rollup, and the compaction, which sums in SQL, failed on every run after, so no
    other key's rows were merged again either."""
    minute = (time.time_ns() // 60_000_000_000 - 5) * 60_000_000_000

    def kernels(n: int, total: int, op: str, at: int):
        return batch_of([span("rtx.kernel", {S.OP: op, S.COUNT: 1, S.TOTAL_NS: total},
                              start=at + i, duration=1) for i in range(n)], {"rtx.job.id": "J"})

    store.write(kernels(1100, 2**53, "big", minute))          # one batch past int64
    row = store.query("SELECT total_ns, calls FROM kernel_minutes")[0]
    assert row == {"total_ns": 2**63 - 1, "calls": 1100}
    store.write(kernels(100, 2**53, "big", minute))           # and the compaction's sum
    for _ in range(2):
        store.write(kernels(3, 1000, "mm", minute + 60_000_000_000))    # an ordinary key
    store.compact(before_ns=time.time_ns())
    rows = store.query("SELECT op, total_ns, calls FROM kernel_minutes ORDER BY op")
    assert rows == [{"op": "big", "total_ns": 2**63 - 1, "calls": 1200},
                    {"op": "mm", "total_ns": 6000, "calls": 6}]
    assert store.last_write_error is None


def test_a_batch_larger_than_the_queue_goes_in_when_the_queue_is_empty(tmp_path, monkeypatch):
    """Refused with the queue empty, it would be refused on every retry (a 429 for good)."""
    blocked = BlockedWriter(monkeypatch)
    s = Store(tmp_path / "big.duckdb", max_queue_batches=3, max_queue_spans=10)
    first = s.submit(batch_of([span() for _ in range(25)]))
    with pytest.raises(StoreBusy):  # while it waits, nothing more fits
        s.submit(batch_of([span()]))
    blocked.release.set()
    assert first.result(10) is None
    s.close()
    with Store(tmp_path / "big.duckdb") as again:
        assert again.query("SELECT count(*) AS n FROM spans")[0]["n"] == 25


def test_speedups_leave_out_each_attempts_warm_up_steps(store):
    """A job restarted by its supervisor counts steps on from the attempt before
    (RTXOPS_STEP_BASE): the new process's first steps are warm-up too, whatever their number."""
    from rtxops.telemetry import store_views

    t = time.time_ns() - 10**9

    def step(i: int, duration: int):
        return span("rtx.step", {S.STEP_NUMBER: i}, start=t + i * 10**6, duration=duration)

    first = [step(i, 9000 if i < 3 else 1000 if i < 9 else 500) for i in range(10)]
    swap = span("rtx.swap", {S.STEP_NUMBER: 9, S.PLAN_FROM: 1, S.PLAN_TO: 2},
                start=t + 9 * 10**6, duration=0)
    again = [step(i, 50_000 if i < 13 else 500) for i in range(10, 15)]
    store.write(batch_of(first + [swap]))
    store.write(batch_of(again, {**RESOURCE, "process.pid": 78}))
    (row,) = store_views.speedups(store, job_id="job-a", since_ns=t - 10**9, until_ns=t + 10**9)
    assert (row["before_ns"], row["after_ns"], row["speedup"]) == (1000, 500, 2.0)


def test_a_page_of_job_log_lines_stops_at_its_byte_budget_but_holds_at_least_one(store, monkeypatch):
    from rtxops.telemetry import store_jobs

    monkeypatch.setattr(store_jobs, "MAX_PAGE_BYTES", 100)
    store_jobs.append_logs(store, "j-1", 1, 0, "stdout",
                           [(i, i, f"{i:02d}" + "x" * 38) for i in range(1, 11)])
    store_jobs.append_logs(store, "j-1", 1, 0, "stdout", [(11, 11, "y" * 500)])
    page = store_jobs.read_logs(store, "j-1")
    assert [r["seq"] for r in page] == [1, 2, 3]        # 0, 40, 80 bytes before each: < 100
    assert [r["seq"] for r in store_jobs.read_logs(store, "j-1", after_seq=3, limit=2)] == [4, 5]
    assert [r["seq"] for r in store_jobs.read_logs(store, "j-1", after_seq=10)] == [11]
    assert [r["text"] for r in store_jobs.read_logs(store, "j-1", after_seq=10)] == ["y" * 500]


def test_a_store_holding_a_table_named_like_the_writers_rows_is_refused(tmp_path):
    """DuckDB reads a catalog table before a Python variable of the same name: the writer's rows
    would silently be that table's."""
    path = tmp_path / "odd.duckdb"
    Store(path).close()
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE _rtx_rows (x INTEGER)")
    con.close()
    with pytest.raises(StoreError, match="named _rtx_rows"):
        Store(path)


def test_the_tail_after_the_last_optimizer_step_is_no_step_in_step_times(tmp_path):
    """The exit flush is an rtx.step numbered -1 (it spans from the last step to the exit): it
    counted as a step, a slow one, in step times and the loop's step figures."""
    import torch

    from rtxops.runtime import patching
    from rtxops.runtime.plan import Plan
    from rtxops.telemetry.exporters import DuckDBSpanExporter
    from rtxops.telemetry.job import start_job_telemetry

    from ..runtime.helpers import TinyNet, train_losses

    store = Store(tmp_path / "s.duckdb")
    d = patching.enable(plan=Plan(version=1, defaults={"gelu": "eager"}))
    telemetry = start_job_telemetry(d, DuckDBSpanExporter(store), store=None,
                                    resource={S.SERVICE_NAME: "t", S.JOB_ID: "job-tail", S.RANK: 0})
    try:
        net = TinyNet()
        train_losses(net, steps=3)
        net(torch.randn(4, 32))   # an evaluation after the last step: the tail
        telemetry.close(d)
    finally:
        patching.disable()
    try:
        assert sorted(r["step"] for r in store.step_times(job_id="job-tail")) == [1, 2, 3]
        tail = store.query("SELECT count(*) AS n FROM spans WHERE name = 'rtx.kernel' AND step = -1")
        assert tail[0]["n"] > 0   # its calls are still stored, as kernel spans
    finally:
        store.close()


def _big_and_small_kernel_spans():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = TracerProvider()
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("t")
    for count, total in ((1, 2**53 + 2), (2, 500)):
        tracer.start_span(S.KERNEL, attributes={S.OP: "gelu", S.COUNT: count, S.TOTAL_NS: total,
                                                 S.CACHE_HITS: 1}).end()
    return memory.get_finished_spans()


def _assert_big_figure_kept_out_of_the_sums(store):
    rows = {r["count"]: r for r in store.query("SELECT count, total_ns, attributes FROM spans")}
    assert rows[1]["total_ns"] is None
    assert json.loads(rows[1]["attributes"])[S.TOTAL_NS] == 2**53 + 2
    assert store.query("SELECT sum(total_ns) AS t, sum(calls) AS c FROM kernel_minutes") == [
        {"t": 500, "c": 3}]


def test_the_direct_exporter_keeps_figures_past_2_53_out_of_the_sums(tmp_path):
    """The receiver took figures past 2^53 out of the summed columns; the direct DuckDB
    exporter (`rtxops run --direct`, tests) stored them as they were, into the rollup's sums."""
    from rtxops.telemetry.exporters import DuckDBSpanExporter

    with Store(tmp_path / "s.duckdb") as store:
        assert DuckDBSpanExporter(store).export(_big_and_small_kernel_spans()).name == "SUCCESS"
        _assert_big_figure_kept_out_of_the_sums(store)


def test_a_batch_written_unprepared_keeps_figures_past_2_53_out_of_the_sums(tmp_path):
    from rtxops.telemetry.otlp import encode_readable_spans, to_arrow

    batch = to_arrow(encode_readable_spans(_big_and_small_kernel_spans()), time.time_ns())
    with Store(tmp_path / "s.duckdb") as store:
        store.write(batch)
        _assert_big_figure_kept_out_of_the_sums(store)


def test_reported_drops_count_what_was_dropped_in_the_window(tmp_path):
    """Dropped steps and spans are counted per process since it started: the window's figure
    was the whole count since then (a job that dropped 1000 steps an hour ago reported them in
    every later window)."""
    from rtxops.telemetry import store_views

    minute = 60 * 10**9
    t = time.time_ns() - 30 * minute

    def steps(job, values, start, pid=1):
        return request([span("rtx.step", {"rtx.dropped.steps": s, "rtx.dropped.spans": 10 * s,
                                          "rtx.dropped.records": 1}, start=start + i)
                        for i, s in enumerate(values)],
                       {**RESOURCE, "rtx.job.id": job, "process.pid": pid})

    with Store(tmp_path / "s.duckdb") as store:
        for body in (steps("long", [1000, 1000], t - 10 * minute),    # before the window
                     steps("long", [1000, 1003], t),                  # in it: 3 more
                     steps("new", [2, 4], t),                         # started in it
                     steps("again", [50], t - 10 * minute, pid=1),    # a process before...
                     steps("again", [6], t, pid=2),                   # ...and a new one since
                     steps("more", [100], t - 10 * minute, pid=1),    # one that dropped more
                     steps("more", [120], t, pid=2),                  # than its successor
                     steps("both", [100, 150], t, pid=1),             # two processes in it
                     steps("both", [0, 30], t + minute, pid=2)):
            store.write(otlp.convert(body.SerializeToString(), otlp.PROTOBUF, time.time_ns()))
        drops = store_views.reported_drops(store, since_ns=t, until_ns=t + 15 * minute)
        assert drops == {"records": 10, "steps": 3 + 4 + 6 + 120 + 150 + 30,
                         "spans": 10 * (3 + 4 + 6 + 120 + 150 + 30)}


def test_telemetry_stats_add_up_the_drops_of_every_process_of_a_job(tmp_path):
    """A restarted attempt keeps its job id and rank and counts its drops from zero: the
    largest count of any of them was reported, not their sum."""
    from rtxops.telemetry.store import telemetry_summary

    def steps(values, pid):
        return request([span("rtx.step", {"rtx.dropped.steps": s, "rtx.dropped.spans": 10 * s},
                             start=time.time_ns() + i) for i, s in enumerate(values)],
                       {**RESOURCE, "rtx.job.id": "job", "process.pid": pid})

    with Store(tmp_path / "s.duckdb") as store:
        for body in (steps([3, 7], pid=5000), steps([1, 2], pid=5001)):
            store.write(otlp.convert(body.SerializeToString(), otlp.PROTOBUF, time.time_ns()))
        stats = telemetry_summary(store)
    assert (stats["dropped steps (jobs)"], stats["dropped spans (jobs)"]) == (9, 90)


def test_a_variant_the_runtime_disabled_is_found_for_its_job(tmp_path):
    """From the runtime's own event to the store's view: a job that differentiates gradients
    refuses the plan's compiled gelu, and the store names it, for that job only."""
    import torch

    from rtxops.runtime import patching
    from rtxops.runtime.plan import Plan
    from rtxops.telemetry import store_evolve, store_views
    from rtxops.telemetry.exporters import DuckDBSpanExporter
    from rtxops.telemetry.job import start_job_telemetry

    from ..runtime.helpers import TinyNet, train_losses

    store = Store(tmp_path / "s.duckdb")
    d = patching.enable(plan=Plan(version=1, defaults={"gelu": "compiled"}))
    telemetry = start_job_telemetry(d, DuckDBSpanExporter(store), store=None,
                                    resource={S.SERVICE_NAME: "t", S.JOB_ID: "job-pen", S.RANK: 0})
    try:
        x = torch.randn(4, requires_grad=True)
        torch.autograd.grad((x * x).sum(), x, create_graph=True)   # the job's first penalty
        train_losses(TinyNet(), steps=2)
        telemetry.close(d)
    finally:
        patching.disable()
    try:
        (row,) = store_views.disabled_variants(store, "job-pen")
        assert (row["op"], row["variant"]) == ("gelu", "compiled") and "create_graph" in row["reason"]
        assert store_evolve.disabled_arms(store, "job-pen", "gelu", row["bucket"]) == \
            {("compiled", row["config"])}
        assert store_views.disabled_variants(store, "another-job") == []
    finally:
        store.close()
