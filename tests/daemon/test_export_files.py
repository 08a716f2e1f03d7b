"""The Parquet export's temporary file goes with its response, however the response ends."""
from __future__ import annotations

import tempfile

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from rtxops.daemon import api_telemetry
from rtxops.telemetry.store import Store


@pytest.mark.parametrize("headers", [{}, {"Range": "bytes=abc"}, {"Range": "bytes=99999999-"},
                                     {"Range": "bytes=0-3"}])
def test_a_parquet_export_leaves_no_file_behind(tmp_path, monkeypatch, headers):
    """A bad or unsatisfiable Range header made the file response answer 400/416 and skip the
    task that removed the file: any local process (reads need no token) could fill the disk."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with Store(tmp_path / "s.duckdb") as store:
        app = FastAPI()
        app.include_router(api_telemetry.make_router(store, lambda: None))
        with TestClient(app) as client:
            for _ in range(3):
                r = client.get("/v1/telemetry/export", params={"format": "parquet"}, headers=headers)
                assert r.status_code == 200 and r.content[:4] == b"PAR1"
                assert int(r.headers["content-length"]) == len(r.content)
                assert "rtxops-spans.parquet" in r.headers["content-disposition"]
    assert list(scratch.iterdir()) == []
