"""Retention: pruning deletes telemetry older than the age and nothing else; rows written after
a prune are whole (the keys and resources it deleted are written again); a failed prune deletes
nothing; ages are checked."""
from __future__ import annotations

import time

import pytest

from rtxops.telemetry import otlp, store_jobs, store_ledger, store_retention, synthetic
from rtxops.telemetry.store import MINUTE_NS, Store

from .otlp_helpers import RESOURCE, request, span

DAY_NS = 86400 * 10**9


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "r.duckdb")
    yield s
    s.close()


def otlp_batch(n: int, *, start_ns: int, seed: int = 0, job_id: str = "job-r") -> otlp.Batch:
    body = synthetic.otlp_request(n, seed=seed, job_id=job_id, start_ns=start_ns).SerializeToString()
    return otlp.convert(body, otlp.PROTOBUF, start_ns)


def count(store: Store, sql: str, *params) -> int:
    return store.query(f"SELECT count(*) AS n FROM {sql}", list(params))[0]["n"]


def fill(store: Store, now: int) -> None:
    """Telemetry 40 days old and 10 minutes old, of every kind retention touches or keeps."""
    for start, seed, job in ((now - 40 * DAY_NS, 1, "old-job"), (now - 600 * 10**9, 2, "new-job")):
        store.write(otlp_batch(400, start_ns=start, seed=seed, job_id=job))
        store.call(lambda cur, t=start, j=job: cur.execute(
            "INSERT INTO span_events VALUES ('00', '00', ?, 'ev', '{}')", [t]))
        store_jobs.append_logs(store, job, 1, 0, "stdout", [(start, 1, "a line")])
        store_jobs.append_event(store, job, start, "started", "{}")
        store_jobs.save_job(store, job, job, "succeeded", start, start, "{}")
    store_ledger.append_entry(store, kind="promote", scope="old-job", version=1,
                              subject_digest="sha256:" + "1" * 64, decision=None, signer="test")


def test_a_prune_deletes_what_is_older_than_the_age_and_keeps_the_rest(store):
    now = time.time_ns()
    fill(store, now)
    old_spans = count(store, "spans WHERE job_id = 'old-job'")
    new_spans = count(store, "spans WHERE job_id = 'new-job'")
    assert old_spans == new_spans == 400
    assert count(store, "ingest_batches") == 2
    old_minutes = count(store, "kernel_minutes WHERE job_id = 'old-job'")
    kept = {table: count(store, table) for table in ("jobs", "job_events", "ledger")}

    dry = store_retention.prune(store, 30 * 86400, dry_run=True)
    assert count(store, "spans") == 800        # a dry run deletes nothing
    report = store_retention.prune(store, 30 * 86400)
    assert report.rows == dry.rows
    assert report.rows["spans"] == old_spans
    assert report.rows["span events"] == report.rows["job log lines"] == 1
    assert report.rows["ingest batches"] == 1  # the one received 40 days ago
    assert report.rows["kernel minutes"] == old_minutes > 0
    assert report.rows["span keys"] > 0 and report.rows["resources"] == 1

    assert count(store, "spans WHERE job_id = 'old-job'") == 0
    assert count(store, "spans WHERE job_id = 'new-job'") == new_spans
    assert count(store, "kernel_minutes WHERE minute < ?", report.before_ns // MINUTE_NS) == 0
    assert count(store, "kernel_minutes WHERE job_id = 'new-job'") > 0
    assert count(store, "span_events") == count(store, "job_logs") == 1
    assert count(store, "resources") == 1
    assert count(store, "span_keys WHERE job_id = 'old-job'") == 0
    assert {table: count(store, table) for table in kept} == kept   # jobs, events, the ledger
    assert store_retention.prune(store, 30 * 86400).total == 0


def test_rows_written_after_a_prune_reuse_its_deleted_keys_and_resources_whole(store):
    """The writer remembers which span keys and resources it committed: a prune that deleted
    them must make it write them again, or the new spans would vanish from the spans view."""
    now = time.time_ns()
    store.write(otlp_batch(200, start_ns=now - 40 * DAY_NS, seed=5))
    assert store_retention.prune(store, 30 * 86400).rows["span keys"] > 0
    assert count(store, "span_keys") == count(store, "resources") == 0
    store.write(otlp_batch(200, start_ns=now - 60 * 10**9, seed=5))   # the same job and sites
    assert count(store, "span_rows") == 200
    assert count(store, "spans") == 200
    assert count(store, "resources") == 1


def test_a_failed_prune_deletes_nothing(store, monkeypatch):
    now = time.time_ns()
    fill(store, now)
    before = {t: count(store, t) for t in ("span_rows", "span_keys", "span_events", "job_logs",
                                           "kernel_minutes", "ingest_batches", "resources")}
    real = store_retention._scalar

    def failing(cur, sql, *params):
        if "kernel_minutes" in sql:
            raise RuntimeError("disk on fire")
        return real(cur, sql, *params)

    monkeypatch.setattr(store_retention, "_scalar", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        store_retention.prune(store, 30 * 86400)
    assert {t: count(store, t) for t in before} == before
    store.write(otlp_batch(100, start_ns=now, seed=9))   # the writer goes on
    assert count(store, "spans") == before["span_rows"] + 100


def test_plan_swaps_are_kept_whatever_their_age(store):
    """The evolve loop finds the step a plan swap took effect at by its rtx.swap span."""
    now = time.time_ns()
    old = now - 40 * DAY_NS
    body = request([span("rtx.swap", {"rtx.step": 100, "rtx.plan.from": 1, "rtx.plan.to": 2},
                         start=old),
                    span("rtx.step", {"rtx.step": 100}, start=old)],
                   {**RESOURCE, "rtx.job.id": "swapper"}).SerializeToString()
    store.write(otlp.convert(body, otlp.PROTOBUF, old))
    dry = store_retention.prune(store, 30 * 86400, dry_run=True)
    report = store_retention.prune(store, 30 * 86400)
    assert report.rows == dry.rows
    assert report.rows["spans"] == 1 and report.rows["resources"] == 0
    assert store.query("SELECT name, step, plan_to FROM swaps JOIN spans USING (job_id, step)") == [
        {"name": "rtx.swap", "step": 100, "plan_to": 2}]


@pytest.mark.parametrize("text, seconds", [("30d", 30 * 86400), ("12h", 43200), ("90m", 5400),
                                           ("2w", 14 * 86400), (" 1.5h ", 5400), ("3600s", 3600)])
def test_ages_parse(text, seconds):
    assert store_retention.parse_age(text) == seconds


@pytest.mark.parametrize("text", ["", "30", "d", "30 days", "-1d", "1e3d", "nan", "30y"])
def test_a_malformed_age_is_refused(text):
    with pytest.raises(ValueError, match="not an age"):
        store_retention.parse_age(text)


def test_a_retention_under_a_day_is_refused(store):
    with pytest.raises(ValueError, match="1d or more"):
        store_retention.prune(store, 23 * 3600)


@pytest.mark.parametrize("text", ["9" * 400 + "d", "99999999999d", "3000w"])
def test_an_age_past_what_the_store_can_hold_is_refused(text):
    """400 nines of days overflowed (an OverflowError traceback; the daemon logged prune_failed),
    and 99999999999d pruned before a time in year -270 million."""
    with pytest.raises(ValueError, match="over 50 years"):
        store_retention.check_age(store_retention.parse_age(text))


def test_a_prune_leaves_the_kernel_rollup_and_the_spans_agreeing(store, monkeypatch):
    """A cutoff inside a minute deleted that minute's spans before it, and kept their rollup
    row: kernel stats counted spans that were gone."""
    import types

    now = time.time_ns() // MINUTE_NS * MINUTE_NS + 30 * 10**9     # half a minute in
    monkeypatch.setattr(store_retention, "time", types.SimpleNamespace(
        time_ns=lambda: now, perf_counter=time.perf_counter))
    cut = now - 2 * DAY_NS
    for seed, start in enumerate((cut - 10 * 10**9, cut + 10 * 10**9)):   # one minute, both sides
        body = synthetic.otlp_request(2, start_ns=start, kernels_per_step=1, seed=seed)
        store.write(otlp.convert(body.SerializeToString(), otlp.PROTOBUF, time.time_ns()))

    def figures():
        rollup = store.kernel_stats(since_ns=cut - 5 * MINUTE_NS, until_ns=cut + 5 * MINUTE_NS)
        spans = store.query("SELECT count(*) AS n, coalesce(sum(count), 0) AS c FROM kernel_spans")[0]
        return sum(r["calls"] for r in rollup), spans["c"]

    before = figures()
    store_retention.prune(store, 2 * 86400)
    calls_rolled_up, calls_in_spans = figures()
    assert calls_rolled_up == calls_in_spans == before[1]   # the minute kept whole
