"""The newest stored log lines held in memory answer a read exactly as the store would, and say
so (None) where they cannot."""
from __future__ import annotations

import random
import time

import pytest

from rtxops.daemon import recent_logs
from rtxops.daemon.job_sink import DuckDBJobSink
from rtxops.daemon.recent_logs import LINE_OVERHEAD, RecentLogs
from rtxops.telemetry.store import Store

NOW = time.time_ns()   # (lines read an hour ago are let go)


@pytest.fixture
def sink(tmp_path):
    store = Store(tmp_path / "logs.duckdb")
    yield DuckDBJobSink(store)
    store.close()


def _store_both(sink, recent, job_id, attempt, rank, stream, lines):
    sink.log_lines(job_id, attempt, rank, stream, lines)
    recent.add(job_id, attempt, rank, stream, lines)


def test_reads_equal_the_stores_wherever_the_lines_are_held(sink):
    rng = random.Random(7)
    recent = RecentLogs(max_bytes=3000)     # lets most of the older lines go
    seq = {"a": 0, "b": 0}
    for _ in range(120):
        job_id = rng.choice("ab")
        lines = []
        for _ in range(rng.randint(1, 4)):
            seq[job_id] += 1 + (rng.random() < 0.1)   # a failed write leaves a gap
            lines.append((NOW + seq[job_id], seq[job_id], "é" * rng.randint(0, 40)))
        _store_both(sink, recent, job_id, 1, rng.choice([0, 1]), rng.choice(["stdout", "stderr"]),
                    lines)
    answered = 0
    for job_id in "ab":
        for after in range(0, seq[job_id] + 2):
            for rank in (None, 0, 1):
                for limit in (1, 3, 1000):
                    held = recent.read(job_id, rank=rank, after_seq=after, limit=limit)
                    if held is not None:
                        answered += 1
                        assert held == sink.read_logs(job_id, rank=rank, after_seq=after, limit=limit)
    assert answered > 100       # the newest lines of both jobs are held
    assert recent.read("a", after_seq=0) is None    # the oldest are not: the store answers


def test_a_page_stops_where_the_stores_does_at_the_byte_budget(sink, monkeypatch):
    monkeypatch.setattr(recent_logs, "MAX_PAGE_BYTES", 100)
    import rtxops.telemetry.store_jobs as store_jobs
    monkeypatch.setattr(store_jobs, "MAX_PAGE_BYTES", 100)
    recent = RecentLogs()
    _store_both(sink, recent, "j", 1, 0, "stdout",
                [(NOW + i, i, "x" * n) for i, n in enumerate([30, 60, 20, 5, 300, 1], start=1)])
    for after in range(7):
        held = recent.read("j", after_seq=after)
        assert held == sink.read_logs("j", after_seq=after)
    assert [ln.seq for ln in recent.read("j", after_seq=0)] == [1, 2, 3]
    assert [ln.seq for ln in recent.read("j", after_seq=4)] == [5]   # one line, however long


def test_lines_stored_out_of_order_are_read_in_seq_order():
    recent = RecentLogs()
    recent.add("j", 1, 0, "stdout", [(NOW, 1, "a"), (NOW, 4, "d")])
    recent.add("j", 2, 0, "stdout", [(NOW, 2, "b"), (NOW, 3, "c")])
    assert [ln.text for ln in recent.read("j", after_seq=0)] == ["a", "b", "c", "d"]
    assert [ln.text for ln in recent.read("j", after_seq=2)] == ["c", "d"]


def test_the_job_written_to_least_recently_is_let_go_first():
    line = "x" * 72
    recent = RecentLogs(max_bytes=4 * (len(line) + LINE_OVERHEAD))
    recent.add("old", 1, 0, "stdout", [(NOW, 1, line), (NOW, 2, line)])
    recent.add("new", 1, 0, "stdout", [(NOW, 1, line), (NOW, 2, line)])
    recent.add("new", 1, 0, "stdout", [(NOW, 3, line)])
    assert recent.read("old", after_seq=0) is None
    assert [ln.seq for ln in recent.read("old", after_seq=1)] == [2]
    assert [ln.seq for ln in recent.read("new", after_seq=0)] == [1, 2, 3]
    recent.add("new", 1, 0, "stdout", [(NOW, 4, line), (NOW, 5, line)])
    assert recent.read("old", after_seq=1) is None      # all of it gone: the store answers
    assert recent.read("new", after_seq=0) is None
    assert [ln.seq for ln in recent.read("new", after_seq=1)] == [2, 3, 4, 5]


def test_a_job_not_held_or_forgotten_is_the_stores_to_answer():
    recent = RecentLogs()
    assert recent.read("j", after_seq=0) is None
    recent.add("j", 1, 0, "stdout", [(NOW, 7, "resumed after a restart")])
    assert recent.read("j", after_seq=5) is None        # lines 1..6 were stored before
    assert [ln.seq for ln in recent.read("j", after_seq=6)] == [7]
    recent.forget("j")
    assert recent.read("j", after_seq=6) is None


def test_the_floor_never_goes_down_when_lines_stored_out_of_order_are_let_go():
    line = "x" * 72
    recent = RecentLogs(max_bytes=3 * (len(line) + LINE_OVERHEAD))
    recent.add("j", 1, 0, "stdout", [(NOW, 5, line), (NOW, 6, line), (NOW, 7, line)])
    recent.add("j", 1, 0, "stdout", [(NOW, 8, line)])          # lets 5 go: floor 5
    recent.add("j", 2, 0, "stdout", [(NOW, 3, line)])          # a late tail's line, below it
    assert recent.read("j", after_seq=4) is None
    assert [ln.seq for ln in recent.read("j", after_seq=5)] == [6, 7, 8]
    recent.add("j", 1, 0, "stdout", [(NOW, 9, line)])
    assert recent.read("j", after_seq=5) is None               # 6 went; never back to 3
    assert [ln.seq for ln in recent.read("j", after_seq=6)] == [7, 8, 9]


def test_lines_read_over_an_hour_ago_are_the_stores_to_answer(monkeypatch):
    recent = RecentLogs()
    hour = 3600 * 10**9
    recent.add("j", 1, 0, "stdout", [(NOW - 2 * hour, 1, "old"), (NOW, 2, "new")])
    assert recent.read("j", after_seq=0) is None     # the store's retention may have taken it
    assert [ln.text for ln in recent.read("j", after_seq=1)] == ["new"]
