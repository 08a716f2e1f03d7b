"""Summaries of several processes of one job add up (ranks, restarted attempts)."""
from __future__ import annotations

import json
import os

from rtxops.runtime.bootstrap import _add_summary
from rtxops.runtime.summary import merged


def _summary(*, job="job-1", first=0, steps=10, calls=5, version=1, rss=100, disabled=()):
    return {"job_id": job, "processes": 1, "first_step": first, "steps": steps,
            "plan_version": version, "plan_digest": f"d{version}", "peak_rss_bytes": rss,
            "slots": [{"op": "softmax", "bucket": "b", "variant": "eager", "config": "{}",
                       "site": "F.softmax", "calls": calls, "total_ns": calls * 10,
                       "builds": 1}] if calls else [],
            "disabled": list(disabled), "modules_on_own_forward": [], "plan_rejections": []}


def test_a_restarted_attempt_counts_on_from_its_predecessor():
    first, second = _summary(first=0, steps=100, calls=7), _summary(first=100, steps=50, calls=3)
    data = merged(first, second)
    assert (data["first_step"], data["steps"], data["processes"]) == (0, 150, 2)
    (slot,) = data["slots"]
    assert (slot["calls"], slot["total_ns"], slot["builds"]) == (10, 100, 2)


def test_the_newer_plan_the_larger_peak_and_every_disabled_variant_are_kept():
    why = {"op": "softmax", "variant": "triton", "config": "{}", "bucket": "b", "reason": "NaN"}
    data = merged(_summary(version=3, rss=500, disabled=[why]),
                  _summary(version=4, rss=200, disabled=[why, {**why, "reason": "slow"}]))
    assert (data["plan_version"], data["plan_digest"], data["peak_rss_bytes"]) == (4, "d4", 500)
    assert [d["reason"] for d in data["disabled"]] == ["NaN", "slow"]


def test_processes_of_one_job_add_up_in_the_file_and_idle_ones_leave_no_mark(tmp_path):
    path = tmp_path / "summary.json"
    _add_summary(path, _summary(calls=4))
    _add_summary(path, _summary(steps=0, calls=0))      # a spawned DataLoader worker
    _add_summary(path, _summary(calls=6))
    data = json.loads(path.read_text())
    assert data["processes"] == 2 and data["slots"][0]["calls"] == 10
    assert os.listdir(tmp_path) == ["summary.json"]


def test_a_summary_left_by_a_run_with_no_job_id_is_replaced_not_added_to(tmp_path):
    """`RTXOPS_SUMMARY=s.json python train.py` twice: the second run added itself to the
    first's file."""
    path = tmp_path / "summary.json"
    _add_summary(path, _summary(job="", calls=4))
    _add_summary(path, _summary(job="", calls=6))
    assert json.loads(path.read_text())["slots"][0]["calls"] == 6


def test_another_jobs_summary_in_the_file_is_replaced_not_added_to(tmp_path):
    path = tmp_path / "summary.json"
    _add_summary(path, _summary(job="earlier", calls=4))
    _add_summary(path, _summary(job="this", calls=6))
    data = json.loads(path.read_text())
    assert (data["job_id"], data["processes"], data["slots"][0]["calls"]) == ("this", 1, 6)
    path.write_text("{not json")
    _add_summary(path, _summary(job="this", calls=2))
    assert json.loads(path.read_text())["slots"][0]["calls"] == 2
