"""`rtxops telemetry export` from a store no daemon holds: each format has the job's spans; an
unknown job and an unwritable path are clear errors (no empty file with exit 0, no traceback)."""
from __future__ import annotations

import json
import time

import pyarrow.parquet as pq
from typer.testing import CliRunner

from rtxops.cli import app
from rtxops.telemetry import otlp
from rtxops.telemetry.store import Store

from .otlp_helpers import request, span


def _home(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    t0 = time.time_ns()
    body = request([span("rtx.step", {"rtx.step": 1}, start=t0, duration=10**6),
                    span("rtx.kernel", {"rtx.op": "gelu", "rtx.variant": "eager", "rtx.count": 2,
                                        "rtx.total_ns": 900, "rtx.step": 1}, start=t0)],
                   {"service.name": "trainer", "rtx.job.id": "job-a", "rtx.rank": 0}).SerializeToString()
    with Store(home / "rtxops.duckdb") as store:
        store.write(otlp.convert(body, otlp.PROTOBUF, t0), timeout=30)
    return home


def export(home, *args):
    return CliRunner().invoke(app, ["telemetry", "export", "--home", str(home), *args])


def test_each_format_holds_the_jobs_spans(tmp_path):
    home = _home(tmp_path)
    r = export(home, "--format", "chrome-trace", "--job", "job-a", "-o", str(tmp_path / "t.json"))
    assert r.exit_code == 0, r.output
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert sorted(e["name"] for e in events if e["ph"] == "X") == ["gelu/eager", "step 1"]
    r = export(home, "--format", "otlp-json", "--job", "job-a", "-o", str(tmp_path / "o.json"))
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "o.json").read_text())
    assert sum(len(ss["spans"]) for rs in doc["resourceSpans"] for ss in rs["scopeSpans"]) == 2
    r = export(home, "--format", "parquet", "--job", "job-a", "-o", str(tmp_path / "s.parquet"))
    assert r.exit_code == 0, r.output
    assert pq.read_table(tmp_path / "s.parquet").num_rows == 2


def test_an_unknown_job_or_a_missing_folder_is_a_clear_error(tmp_path):
    home = _home(tmp_path)
    r = export(home, "--format", "chrome-trace", "--job", "no-such-job", "-o", str(tmp_path / "t.json"))
    assert r.exit_code == 1 and "no job 'no-such-job'" in r.output, r.output
    assert not (tmp_path / "t.json").exists()
    r = export(home, "--format", "otlp-json", "-o", str(tmp_path / "missing" / "o.json"))
    assert r.exit_code == 2 and "folder does not exist" in r.output, (r.output, r.exception)
