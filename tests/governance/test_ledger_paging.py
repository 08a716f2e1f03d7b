"""The daemon's ledger is served in pages (limit 1..1000) and its chain is verified incrementally:
entries verified once are not verified again, and a broken new entry is still caught."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from rtxops.daemon.api_plans import make_router
from rtxops.daemon.app import _GovernanceReports
from rtxops.governance import ledger as gl
from rtxops.telemetry.store import Store


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "rtxops.duckdb")
    yield s
    s.close()


def append(store, head, n, start=1):
    for v in range(start, start + n):
        gl.append(store, head, kind="manual", scope="job-1", version=v,
                  subject_digest="sha256:" + "ab" * 32, decision={"kind": "manual"}, signer="k")


def test_ledger_endpoint_pages(store, tmp_path):
    head = tmp_path / "ledger.head"
    append(store, head, 5)
    board = SimpleNamespace(authority=SimpleNamespace(store=store, head_file=head,
                                                      ledger_lock=threading.Lock()),
                            on_change=lambda listener: None)
    app = FastAPI()
    app.include_router(make_router(board, auth=lambda: None))
    client = TestClient(app)
    page = client.get("/v1/plans/ledger?limit=2&offset=1").json()
    assert [e["seq"] for e in page["entries"]] == [2, 3] and page["total"] == 5
    assert page["head"]["seq"] == 5
    assert [e["seq"] for e in client.get("/v1/plans/ledger").json()["entries"]] == [1, 2, 3, 4, 5]
    # past DuckDB's int64 offsets: a 422, not a 500
    assert client.get("/v1/plans/ledger", params={"offset": 2**63}).status_code == 422
    assert client.get("/v1/plans/ledger", params={"offset": 10**9}).json()["entries"] == []
    for bad in ("limit=0", "limit=1001", "offset=-1", "limit=x"):
        assert client.get(f"/v1/plans/ledger?{bad}").status_code == 422, bad


def test_chain_is_verified_incrementally(store, tmp_path, monkeypatch):
    head = tmp_path / "ledger.head"
    append(store, head, 3)
    reports = _GovernanceReports(SimpleNamespace(store=store, authority=SimpleNamespace(
        head_file=head, ledger_lock=threading.Lock())))
    checked = []
    real = gl.check_chain
    monkeypatch.setattr(gl, "check_chain", lambda rows, *a, **k: checked.append(len(rows)) or real(rows, *a, **k))
    assert reports.verify_chain() == {"ok": True, "problems": []}
    append(store, head, 2, start=4)
    assert reports.verify_chain()["ok"] and reports.verify_chain()["ok"]
    assert checked == [3, 2, 0]
    # a new entry edited behind the daemon's back: caught, and caught again on the next request
    append(store, head, 1, start=6)
    store.run_write(lambda cur: cur.execute("UPDATE ledger SET reason = 'x' WHERE seq = 6")).result(10)
    for _ in range(2):
        result = reports.verify_chain()
        assert not result["ok"] and "entry 6" in result["problems"][0]
    # a deleted tail (the head says more than the store holds) is caught too
    head.write_text('{"seq": 9, "entry_hash": "sha256:00"}\n')
    assert "head file says 9" in " ".join(reports.verify_chain()["problems"])
