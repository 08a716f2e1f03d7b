"""Tuning-task records in the store, as a later daemon reads them."""
from __future__ import annotations

from rtxops.telemetry import store_evolve
from rtxops.telemetry.store import Store


def task(task_id: str, state: str, at: int, **extra) -> dict:
    return {"id": task_id, "state": state, "params": {"op": "gelu", "budget": 3},
            "progress": {"done": 1}, "report": None, "error": None, "submitted_ns": at,
            "ended_ns": None, **extra}


def test_saved_tasks_come_back_newest_first_and_unfinished_ones_as_interrupted(tmp_path):
    with Store(tmp_path / "s.duckdb") as store:
        store_evolve.save_tune_task(store, task("a", "done", 1, report={"buckets": []})).result(30)
        store_evolve.save_tune_task(store, task("b", "running", 2)).result(30)
        store_evolve.save_tune_task(store, task("c", "queued", 3)).result(30)
        store_evolve.save_tune_task(store, task("a", "done", 1, report={"buckets": [1]})).result(30)
    with Store(tmp_path / "s.duckdb") as store:  # the next daemon
        saved = store_evolve.saved_tune_tasks(store)
        assert [(t["id"], t["state"]) for t in saved] == [("c", "failed"), ("b", "failed"), ("a", "done")]
        assert saved[0]["error"] == saved[1]["error"] == store_evolve.INTERRUPTED
        assert saved[2]["report"] == {"buckets": [1]} and saved[2]["error"] is None  # the last save wins
        summary = store_evolve.saved_tune_tasks(store, summary=True)
        assert all(set(t) == set(store_evolve.SUMMARY) for t in summary)
        assert store_evolve.saved_tune_tasks(store, "b")[0]["params"] == {"op": "gelu", "budget": 3}
        assert store_evolve.saved_tune_tasks(store, "nope") == []


def test_an_unreadable_record_is_left_out_and_the_rest_still_read(tmp_path):
    with Store(tmp_path / "s.duckdb") as store:
        store_evolve.save_tune_task(store, task("good", "done", 1)).result(30)
        store.run_write(lambda cur: cur.execute(
            "INSERT INTO tune_tasks VALUES ('bad', 'done', 2, NULL, '{not json', '[1, 2]')")).result(30)
        assert [t["id"] for t in store_evolve.saved_tune_tasks(store)] == ["good"]
        assert [t["id"] for t in store_evolve.saved_tune_tasks(store, summary=True)] == ["good"]
