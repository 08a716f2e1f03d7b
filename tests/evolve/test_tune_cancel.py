"""Tuning tasks can be cancelled (Ctrl-C at `rtxops tune` left the daemon's task running, with
no way to stop it but stopping the daemon): a queued one never runs, the running one stops after
the benchmark in flight and keeps its trials so far."""
from __future__ import annotations

import threading
import time

from rtxops.evolve import offline
from rtxops.telemetry.store import Store


def until(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_queued_task_is_dropped_and_the_running_one_stops_between_benchmarks(tmp_path, monkeypatch):
    ran: list[str] = []
    runs = threading.Semaphore(0)

    def fake_tune(store, registry, *, stop, on_progress, **params):  # benchmarks until stopped
        ran.append(params["op"])
        rounds = 0
        while not stop.is_set():
            rounds += 1
            on_progress({"round": rounds})
            runs.release()
            time.sleep(0.05)
        return {"buckets": [], "rounds": rounds}

    monkeypatch.setattr(offline, "validate", lambda *a: None)
    monkeypatch.setattr(offline, "targets", lambda *a: [])
    monkeypatch.setattr(offline, "tune", fake_tune)
    with Store(tmp_path / "s.duckdb") as store:
        tasks = offline.TuneTasks(store, lambda: None)
        first = tasks.submit({"op": "gelu"})["id"]
        second = tasks.submit({"op": "silu"})["id"]
        assert runs.acquire(timeout=10)
        assert tasks.cancel(second)["state"] == "cancelled"
        assert tasks.cancel(first)["cancelling"] is True
        until(lambda: tasks.get(first)["state"] == "cancelled")
        assert tasks.get(first)["report"]["rounds"] >= 1       # the trials so far are kept
        time.sleep(0.3)
        assert ran == ["gelu"] and tasks.get(second)["state"] == "cancelled"
        assert tasks.cancel("no-such-task") is None
        third = tasks.submit({"op": "rope"})["id"]              # the runner goes on with the next
        until(lambda: ran == ["gelu", "rope"])
        tasks.cancel(third)
        until(lambda: tasks.get(third)["state"] == "cancelled")
