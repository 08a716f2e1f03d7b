"""The Parquet export's temporary file goes with its response, however the response ends."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from rtxops.daemon import api_telemetry
from rtxops.telemetry.store import Store

from .._bounded import serving


@pytest.mark.parametrize("headers", [{}, {"Range": "bytes=abc"}, {"Range": "bytes=99999999-"},
                                     {"Range": "bytes=0-3"}])
def test_a_parquet_export_leaves_no_file_behind(tmp_path, monkeypatch, headers):
    """A bad or unsatisfiable Range header made the file response answer 400/416 and skip the
    task that removed the file: any local process (reads need no token) could fill the disk."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    (tmp_path / "home").mkdir(mode=0o700)
    made_in = []
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args, **kwargs):
        fd, name = real_mkstemp(*args, **kwargs)
        made_in.append(Path(name).parent)
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    with Store(tmp_path / "home" / "s.duckdb") as store:
        app = FastAPI()
        app.include_router(api_telemetry.make_router(store, lambda: None))
        with TestClient(app) as client:
            for _ in range(3):
                r = client.get("/v1/telemetry/export", params={"format": "parquet"}, headers=headers)
                assert r.status_code == 200 and r.content[:4] == b"PAR1"
                assert int(r.headers["content-length"]) == len(r.content)
                assert "rtxops-spans.parquet" in r.headers["content-disposition"]
    # written beside the store (not in /tmp, often memory) and gone with the response
    assert list(scratch.iterdir()) == []
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["s.duckdb"]
    assert made_in and set(made_in) == {tmp_path / "home"}


def test_an_export_the_daemon_stops_midway_is_said_so_and_leaves_no_file(tmp_path, monkeypatch):
    """A JSON export fails after its answer began (its status already sent): the client said
    only httpx's 'peer closed connection without sending complete message body'."""
    import uvicorn

    from rtxops.daemon.client import DaemonClient, DaemonError
    from rtxops.telemetry import export

    def broken(rows):
        yield '{"traceEvents":['
        raise RuntimeError("the store went away")

    monkeypatch.setattr(export, "chrome_trace_chunks", broken)
    with Store(tmp_path / "s.duckdb") as store:
        app = FastAPI()
        app.include_router(api_telemetry.make_router(store, lambda: None))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical",
                                               lifespan="off"))
        thread = serving(server, "telemetry router")
        try:
            port = server.servers[0].sockets[0].getsockname()[1]
            out = tmp_path / "t.json"
            with pytest.raises(DaemonError, match="stopped the export midway"):
                DaemonClient(f"http://127.0.0.1:{port}", None).export("chrome-trace", None, out)
            assert not out.exists() and not (tmp_path / "t.json.part").exists()
        finally:
            server.should_exit = True
            thread.join(10)


def test_a_prune_while_the_store_is_reopened_is_503_with_retry_after(tmp_path):
    """It was a bare 500: a client could not tell a moment's wait from a failure."""
    with Store(tmp_path / "s.duckdb") as store:
        app = FastAPI()
        app.include_router(api_telemetry.make_router(store, lambda: None))
        store.broken = "a checkpoint failed"   # (what the writer sets until the file is reopened)
        try:
            with TestClient(app, raise_server_exceptions=False) as client:
                r = client.post("/v1/telemetry/prune", json={"older_than": "30d"})
        finally:
            store.broken = None
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, (r.status_code, r.text)
    assert "being reopened" in r.json()["detail"]
