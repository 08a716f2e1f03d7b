"""A job's page shows its newest events: a job restarting for hours has more than the page
shows, and the oldest 1000 (what it showed) left out where the job stands now."""
from __future__ import annotations

import json

from rtxops.dashboard import data
from rtxops.telemetry import store_jobs
from rtxops.telemetry.store import Store


def test_the_job_page_shows_the_newest_events_and_says_how_many_it_left_out(tmp_path):
    with Store(tmp_path / "s.duckdb") as store:
        store_jobs.save_job(store, "j-1", "restarts", "failed", 1, 2, json.dumps({"spec": {}}))
        for i in range(1203):
            kind = "stacks" if i % 40 == 0 else "restart_scheduled"
            store_jobs.append_event(store, "j-1", 1_000 + i, kind, json.dumps({"n": i}))
        store_jobs.append_event(store, "j-1", 10_000, "exited", json.dumps({"attempt": 401}))
        detail = data.job_detail(store, "j-1")
    assert detail["history"][-1]["kind"] == "exited"
    assert detail["events_left_out"] == 1204 - data.EVENTS_SHOWN
    shown = len(detail["history"]) + len(detail["stacks"]) + detail["stacks_left_out"]
    assert shown == data.EVENTS_SHOWN
    assert len(detail["stacks"]) == data.STACKS_SHOWN and detail["stacks"][-1]["detail"] == {"n": 1200}
