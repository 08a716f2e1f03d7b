"""Issuing a plan on the board: whatever fails mid-issue is a PlanError (not an HTTP 500) and
leaves no staging directory behind; one that is not the plan's fault (the ledger, the disk) is a
PlanNotIssued, which the API answers 503 (retry), not 422 (refused)."""
from __future__ import annotations

import pytest

from fastapi import FastAPI
from fastapi.testclient import TestClient

from rtxops.daemon import api_plans
from rtxops.daemon.auth import require_token
from rtxops.daemon.plans import PlanBoard
from rtxops.governance.authority import Authority
from rtxops.runtime.errors import PlanError, PlanNotIssued
from rtxops.runtime.plan import Plan


def test_an_unexpected_error_while_issuing_is_a_plan_error_and_leaves_no_staging(tmp_path):
    """The ledger (or the disk) failing mid-issue: a PlanError (HTTP 422, not 500), no staging dir."""
    authority = Authority(tmp_path / "gov")

    def broken_ledger(**entry):
        raise RuntimeError("Conversion Error: value out of range for BIGINT")

    authority._record = broken_ledger
    (tmp_path / "plans").mkdir()
    board = PlanBoard(tmp_path / "plans", authority)
    plan = Plan.from_dict({"version": 3, "defaults": {"gelu": "reference"}})
    with pytest.raises(PlanNotIssued, match="could not be issued: RuntimeError"):
        board.publish(plan, "job-1")
    assert not list((tmp_path / "gov" / "bundles").rglob("*.staging"))
    assert board.current("job-1") is None


def test_a_plan_file_damaged_before_a_reload_keeps_the_plan_read_before(tmp_path):
    """Versions only grow: a reload (SIGHUP) that finds a job's plan file damaged keeps the plan
    it had, so the next publish for the job is still refused unless newer than what it runs."""
    (tmp_path / "plans").mkdir()
    board = PlanBoard(tmp_path / "plans")
    board.publish(Plan.from_dict({"version": 5, "defaults": {"gelu": "reference"}}), "job-1")
    (tmp_path / "plans" / "job-1.json").write_text("{ damaged")
    board.reload()
    assert board.current("job-1").version == 5
    with pytest.raises(PlanError, match="not newer than the published version 5"):
        board.publish(Plan.from_dict({"version": 2, "defaults": {"gelu": "reference"}}), "job-1")
    assert PlanBoard(tmp_path / "plans").current("job-1") is None  # a new board has only the file


def test_a_plan_the_disk_cannot_take_is_a_503_to_retry_not_a_refusal(tmp_path):
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans" / "job-1.tmp").mkdir()     # what cannot be written (a full disk)
    board = PlanBoard(tmp_path / "plans")
    app = FastAPI()
    app.include_router(api_plans.make_router(board, require_token(None), lambda job: None))
    with TestClient(app) as client:
        r = client.post("/v1/plans", params={"job": "job-1"},
                        json={"version": 1, "defaults": {"gelu": "reference"}})
        assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
        assert "could not be saved" in r.json()["detail"]
        r = client.post("/v1/plans", params={"job": "job-1"}, json={"version": 1, "defaults": {"gelu": "nope"}})
        assert r.status_code == 422
    assert board.current("job-1") is None


def test_refusals_are_counted_past_the_reports_kept(tmp_path):
    """rtxops_plans_refused_total was the length of the kept reports: it stopped at 1000 for
    good, and rate() read 0 while jobs went on refusing plans."""
    (tmp_path / "plans").mkdir()
    board = PlanBoard(tmp_path / "plans")
    for i in range(1100):
        board.report("job-1", i + 1, "bad signature")
    assert len(board.reports) == 1000 and board.refused_total == 1100


def test_a_jobs_first_plan_must_be_newer_than_the_default_it_runs(tmp_path):
    """A job without a plan of its own runs the default; one older than that would be refused by
    the job (versions only grow), while the board went on naming it the job's plan."""
    (tmp_path / "plans").mkdir()
    board = PlanBoard(tmp_path / "plans")
    board.publish(Plan.from_dict({"version": 5, "defaults": {"gelu": "reference"}}))
    app = FastAPI()
    app.include_router(api_plans.make_router(board, require_token(None), lambda job: None))
    with TestClient(app) as client:
        r = client.post("/v1/plans", params={"job": "job-1"},
                        json={"version": 3, "defaults": {"gelu": "reference"}})
        # 409: the plan is valid, its version is not newer (422 is for a plan that is not one)
        assert r.status_code == 409, r.text
        assert "not newer than the default plan's version 5, which job job-1 runs" in r.json()["detail"]
        assert board.current("job-1").version == 5
        r = client.post("/v1/plans", params={"job": "job-1"},
                        json={"version": 6, "defaults": {"gelu": "reference"}})
        assert r.status_code == 201 and board.current("job-1").version == 6
    # a job's own plan is its floor from then on, whatever the default does
    board.publish(Plan.from_dict({"version": 9, "defaults": {"gelu": "reference"}}))
    board.publish(Plan.from_dict({"version": 7, "defaults": {"gelu": "reference"}}), "job-1")


def test_a_plan_of_version_0_is_refused():
    """Every job starts on the built-in plan, version 0, and takes only newer ones: a published
    version 0 was accepted (201) and then never installed, refused or reported by any job."""
    board = PlanBoard.__new__(PlanBoard)
    for job in (None, "job-1"):
        with pytest.raises(PlanError, match="version is at least 1"):
            board.validate(Plan.from_dict({"version": 0, "defaults": {"gelu": "reference"}}), job)
