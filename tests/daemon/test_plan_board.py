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
