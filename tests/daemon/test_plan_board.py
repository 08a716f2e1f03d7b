"""Issuing a plan on the board: whatever fails mid-issue is a PlanError (HTTP 422, not 500) and
leaves no staging directory behind."""
from __future__ import annotations

import pytest

from rtxops.daemon.plans import PlanBoard
from rtxops.governance.authority import Authority
from rtxops.runtime.errors import PlanError
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
    with pytest.raises(PlanError, match="could not be issued: RuntimeError"):
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
