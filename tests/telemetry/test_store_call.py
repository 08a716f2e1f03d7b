"""``Store.call`` waits for a write on the writer thread. A caller that timed out used to leave its
write queued, and it committed later: a publish refused on a timeout still got its ledger entry
(a false "entries deleted" alarm after), a retried trial was stored twice. Now a write still
queued at the timeout is withdrawn, and one already running is waited for."""
from __future__ import annotations

import threading

import pytest

from rtxops.telemetry.store import Store

TABLE = "CREATE TABLE IF NOT EXISTS probe (n INTEGER)"


def _rows(store: Store) -> list[int]:
    return [r["n"] for r in store.query("SELECT n FROM probe ORDER BY n")]


def test_a_queued_write_is_withdrawn_at_the_timeout(tmp_path):
    with Store(tmp_path / "s.duckdb") as store:
        store.call(lambda cur: cur.execute(TABLE))
        busy, release = threading.Event(), threading.Event()
        blocker = store.run_write(lambda cur: (busy.set(), release.wait(30)))
        assert busy.wait(10)
        with pytest.raises(TimeoutError):
            store.call(lambda cur: cur.execute("INSERT INTO probe VALUES (1)"), timeout=0.2)
        release.set()
        blocker.result(10)
        store.call(lambda cur: cur.execute("INSERT INTO probe VALUES (2)"))
        assert _rows(store) == [2]


def test_a_running_write_is_waited_for_past_the_timeout(tmp_path):
    with Store(tmp_path / "s.duckdb") as store:
        store.call(lambda cur: cur.execute(TABLE))
        release = threading.Event()
        threading.Timer(0.5, release.set).start()

        def slow_insert(cur):
            release.wait(10)
            cur.execute("INSERT INTO probe VALUES (3)")
            return "committed"

        assert store.call(slow_insert, timeout=0.1) == "committed"
        assert _rows(store) == [3]


def test_a_job_event_that_timed_out_is_not_written_later(tmp_path):
    from rtxops.telemetry import store_jobs

    with Store(tmp_path / "s.duckdb") as store:
        busy, release = threading.Event(), threading.Event()
        blocker = store.run_write(lambda cur: (busy.set(), release.wait(30)))
        assert busy.wait(10)
        with pytest.raises(TimeoutError):
            store_jobs.append_event(store, "j-1", 1, "submitted", "{}", timeout_s=0.2)
        release.set()
        blocker.result(10)
        store.run_write(lambda cur: None).result(10)  # the writer is past the queued event
        assert store.query("SELECT count(*) AS n FROM job_events")[0]["n"] == 0
