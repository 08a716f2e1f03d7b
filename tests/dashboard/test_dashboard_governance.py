"""The dashboard's governance view on a daemon of its own: a denied bundle's entry never shows
another bundle's verification, and the last denial is the ledger's, not the page's."""
from __future__ import annotations

import httpx
import pytest

from rtxops.daemon.home import Home
from rtxops.daemon.server import Daemon
from rtxops.runtime.errors import PlanError
from rtxops.runtime.plan import Plan

UNPROVEN = {"kind": "promote", "gain": 0.0, "ci_low": -0.1, "ci_high": 0.1}   # the policy denies


@pytest.fixture
def daemon(tmp_path, monkeypatch):
    monkeypatch.setenv("RTXOPS_EVOLVE", "0")
    d = Daemon(Home.resolve(tmp_path / "home"), port=0, job_grace_s=2).start_in_thread()
    try:
        with httpx.Client(base_url=d.url, headers={"Authorization": f"Bearer {d.token}"},
                          timeout=60) as client:
            yield d, client
    finally:
        d.shutdown()


def _deny_then_publish(d, client, scope: str, version: int) -> None:
    with pytest.raises(PlanError, match="refused by governance"):
        d.board.publish(Plan.from_dict({"version": version, "defaults": {"silu": "tanh"}}), scope,
                        decision=UNPROVEN)
    r = client.post("/v1/plans", params={"job": scope}, json={"version": version,
                                                             "defaults": {"silu": "tanh"}})
    assert r.status_code == 201, r.text


def test_a_denied_entry_does_not_show_the_bundle_issued_after_it_for_the_same_version(daemon):
    """The report was made from the scope's version folder whatever its digest: the denied
    bundle's page showed the later accepted bundle of that version as verified."""
    d, client = daemon
    _deny_then_publish(d, client, "job-x", 1)
    entries = client.get("/api/governance").json()["ledger"]["items"]
    deny, = [e for e in entries if e["kind"] == "deny"]
    accepted, = [e for e in entries if e["kind"] == "manual"]
    assert client.get(f"/api/governance/bundles/{deny['subject_digest']}").json()["verify"] is None
    report = client.get(f"/api/governance/bundles/{accepted['subject_digest']}").json()["verify"]
    assert report["ok"] and report["facts"]["digest"] == accepted["subject_digest"]
    assert 'id="verify-status">verified' not in client.get(
        f"/governance/bundles/{deny['subject_digest']}").text


def test_the_last_denial_is_the_ledgers_whatever_page_is_shown(daemon):
    """It was looked for among the entries of the page shown: 50 entries after it, gone."""
    d, client = daemon
    _deny_then_publish(d, client, "job-x", 1)
    for v in range(1, 51):
        r = client.post("/v1/plans", params={"job": "job-y"}, json={"version": v,
                                                                   "defaults": {"silu": "tanh"}})
        assert r.status_code == 201, r.text
    g = client.get("/api/governance").json()
    assert g["ledger"]["total"] == 52 and "deny" not in {e["kind"] for e in g["ledger"]["items"]}
    assert g["last_denial"]["kind"] == "deny" and g["last_denial"]["scope"] == "job-x"
    assert "last denial" in client.get("/governance").text


def test_a_tampered_bundle_shows_as_failed_not_as_missing(daemon):
    """A failed report has no facts, so its digest matched no entry: the page said the bundle
    was not on the daemon's disk instead of that it failed verification."""
    d, client = daemon
    r = client.post("/v1/plans", params={"job": "job-t"}, json={"version": 1, "defaults": {"silu": "tanh"}})
    assert r.status_code == 201, r.text
    entry, = [e for e in client.get("/api/governance").json()["ledger"]["items"] if e["scope"] == "job-t"]
    plan = d.authority.bundle_dir("job-t", 1) / "plan.json"
    plan.write_text(plan.read_text() + " ")
    report = client.get(f"/api/governance/bundles/{entry['subject_digest']}").json()["verify"]
    assert report is not None and not report["ok"], report
    assert any(not c["ok"] and "plan.json" in c["message"] for c in report["checks"]), report
    assert 'id="verify-status">verification FAILED' in client.get(
        f"/governance/bundles/{entry['subject_digest']}").text
