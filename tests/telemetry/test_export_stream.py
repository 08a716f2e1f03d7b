"""`rtxops telemetry export` writes its JSON documents piece by piece: every span of a long job
is in the file (there was a silent 5 M-row cap), spans stay grouped under their resource and
scope across the pieces, and memory stays far below the document's size (it was built whole:
~16 KB a span, so a day-long job's export could take the daemon down)."""
from __future__ import annotations

import json
import time
import tracemalloc

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans
from typer.testing import CliRunner

from rtxops.cli import app
from rtxops.telemetry import export, otlp
from rtxops.telemetry import store_export
from rtxops.telemetry.store import Store

from .otlp_helpers import kvs, span

JOBS = ("job-a", "job-b")
SCOPES = ("rtxops", "user", "")  # an unnamed scope is stored as NULL and exported as "rtxops"


def _store(home, spans_per_scope: int, jobs=JOBS, width: int = 200) -> int:
    """Spans of two jobs (two resources), each under two scopes, interleaved in time."""
    home.mkdir()
    t0 = time.time_ns()
    total = 0
    with Store(home / "rtxops.duckdb") as store:
        for chunk in range(0, spans_per_scope, 1000):
            n = min(1000, spans_per_scope - chunk)
            req = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
                resource=Resource(attributes=kvs({"service.name": "trainer", "rtx.job.id": job,
                                                  "rtx.rank": 0})),
                scope_spans=[ScopeSpans(scope=InstrumentationScope(name=scope), spans=[
                    span("rtx.kernel", {"rtx.op": "gelu", "rtx.variant": "eager", "rtx.count": 1,
                                        "rtx.total_ns": 10, "rtx.step": chunk + i, "k": "v" * width},
                         start=t0 + (chunk + i) * 1000 + j * 10 + s)
                    for i in range(n)])
                    for s, scope in enumerate(SCOPES)]) for j, job in enumerate(jobs)])
            store.write(otlp.convert(req.SerializeToString(), otlp.PROTOBUF, t0), timeout=60)
            total += len(jobs) * len(SCOPES) * n
    return total


def _export(home, out, fmt):
    return CliRunner().invoke(app, ["telemetry", "export", "--home", str(home), "--format", fmt,
                                    "-o", str(out)])


@pytest.mark.parametrize("slice_rows", [100_000, 50], ids=["one slice", "slices of 50 spans"])
def test_every_span_is_exported_grouped_across_the_pieces(tmp_path, monkeypatch, slice_rows):
    monkeypatch.setattr(store_export, "EXPORT_FETCH_ROWS", 7)   # many fetches and pieces
    monkeypatch.setattr(store_export, "EXPORT_SLICE_ROWS", slice_rows)
    monkeypatch.setattr(export, "_CHUNK_ITEMS", 5)
    home = tmp_path / "home"
    total = _store(home, 60)
    r = _export(home, tmp_path / "o.json", "otlp-json")
    assert r.exit_code == 0, r.output
    assert f"wrote {total} spans" in r.output
    doc = json.loads((tmp_path / "o.json").read_text())
    groups: dict[tuple, list] = {}   # a resource recurs once per slice of time
    for rs in doc["resourceSpans"]:
        (job,) = [kv["value"]["stringValue"] for kv in rs["resource"]["attributes"]
                  if kv["key"] == "rtx.job.id"]
        for ss in rs["scopeSpans"]:
            groups.setdefault((job, ss["scope"]["name"]), []).extend(
                int(s["startTimeUnixNano"]) for s in ss["spans"])
    assert sorted((k, len(v)) for k, v in groups.items()) == [
        ((job, scope), n) for job in JOBS for scope, n in (("rtxops", 120), ("user", 60))]
    assert all(starts == sorted(starts) for starts in groups.values())
    if slice_rows < total:
        assert len(doc["resourceSpans"]) > len(JOBS)
    r = _export(home, tmp_path / "t.json", "chrome-trace")
    assert r.exit_code == 0, r.output
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == total
    assert [e["ts"] for e in slices] == sorted(e["ts"] for e in slices)
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {
        f"job {job} rank 0" for job in JOBS}


def test_one_resource_whose_scopes_span_a_slice_boundary_exports(tmp_path, monkeypatch):
    """One resource with two scopes over two slices: the second slice opened with the scope the
    first had closed, and the OTLP/JSON export failed with a traceback."""
    monkeypatch.setattr(store_export, "EXPORT_SLICE_ROWS", 50)
    home = tmp_path / "home"
    total = _store(home, 60, jobs=("job-a",))
    r = _export(home, tmp_path / "o.json", "otlp-json")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "o.json").read_text())
    spans = [s for rs in doc["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    assert len(spans) == total == len({s["spanId"] for s in spans})


@pytest.mark.parametrize("fmt", ["parquet", "chrome-trace", "otlp-json"])
def test_spans_with_long_attributes_export_within_the_stores_memory_limit(tmp_path, monkeypatch, fmt):
    """Slices were 100 000 rows however wide: 1.5 KB of attributes a span ran the sort out of
    the store's memory limit (DuckDB's OutOfMemoryException) in every format."""
    monkeypatch.setenv("RTXOPS_STORE_MEMORY", "24MB")   # as 96 MB is with 4 x the spans
    home = tmp_path / "home"
    total = _store(home, 1500, width=3000)   # ~27 MB of attributes
    r = _export(home, tmp_path / "out", fmt)
    assert r.exit_code == 0, r.output
    assert f"wrote {total} spans" in r.output


@pytest.mark.parametrize("fmt", ["otlp-json", "chrome-trace"])
def test_memory_stays_far_below_the_document_size(tmp_path, monkeypatch, fmt):
    monkeypatch.setattr(store_export, "EXPORT_FETCH_ROWS", 200)
    monkeypatch.setattr(export, "_CHUNK_ITEMS", 200)
    home = tmp_path / "home"
    total = _store(home, 2500)
    out = tmp_path / "doc.json"
    assert _export(home, out, fmt).exit_code == 0  # first use: imports, caches
    tracemalloc.start()
    try:
        r = _export(home, out, fmt)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.exit_code == 0, r.output
    size = out.stat().st_size
    assert size > 3_000_000 and f"wrote {total} spans" in r.output
    # built whole, the document alone took its size in memory, and its dicts ~10 x that
    assert peak < size / 2, f"peak {peak} bytes of Python memory for a {size}-byte document"


def test_a_failed_export_leaves_no_file(tmp_path, monkeypatch):
    home = tmp_path / "home"
    _store(home, 10)

    def broken(*args, **kwargs):
        yield '{"traceEvents":['
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "chrome_trace_chunks", broken)
    out = tmp_path / "t.json"
    r = _export(home, out, "chrome-trace")
    assert r.exit_code == 2 and "No space left on device" in " ".join(r.output.split()), r.output
    assert not out.exists() and not (tmp_path / "t.json.part").exists()


@pytest.mark.parametrize("fmt", ["chrome-trace", "otlp-json", "parquet"])
def test_a_store_out_of_memory_is_one_line_that_names_the_setting(tmp_path, fmt):
    """Spans of one start time cannot be sliced: past the memory limit the export failed with
    DuckDB's traceback, then a second one from its reader closed after the store."""
    import os
    import subprocess
    import sys

    home = tmp_path / "home"
    home.mkdir()
    t0 = time.time_ns()
    with Store(home / "rtxops.duckdb") as store:
        for _ in range(4):
            req = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
                resource=Resource(attributes=kvs({"service.name": "svc"})),
                scope_spans=[ScopeSpans(spans=[span("s", {"k": "v" * 4000}, start=t0)
                                               for _ in range(1000)])])])
            store.write(otlp.convert(req.SerializeToString(), otlp.PROTOBUF, t0), timeout=60)
    env = {**os.environ, "RTXOPS_STORE_MEMORY": "8MB"}
    r = subprocess.run([sys.executable, "-m", "rtxops.cli", "telemetry", "export", "--home", str(home),
                        "--format", fmt, "-o", str(tmp_path / "out.json")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "ran out of memory" in r.stderr and "RTXOPS_STORE_MEMORY" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    assert not (tmp_path / "out.json").exists()


def test_span_events_count_toward_a_slice_so_memory_stays_bounded(tmp_path, monkeypatch):
    """A slice's span events were all read into Python at once, however many: 10 events a span
    took ~1 GB for 100 000 spans (slices were sized by their spans alone)."""
    monkeypatch.setenv("RTXOPS_STORE_MEMORY", "24MB")   # slices of ~4 MB
    home = tmp_path / "home"
    home.mkdir()
    t0 = time.time_ns()
    with Store(home / "rtxops.duckdb") as store:
        for chunk in range(4):
            spans = []
            for i in range(500):
                s = span("req", start=t0 + (chunk * 500 + i) * 10_000, duration=5_000)
                for k in range(20):
                    s.events.add(time_unix_nano=s.start_time_unix_nano + k, name="e",
                                 attributes=kvs({"detail": "x" * 300}))
                spans.append(s)
            req = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
                resource=Resource(attributes=kvs({"service.name": "svc"})),
                scope_spans=[ScopeSpans(spans=spans)])])
            store.write(otlp.convert(req.SerializeToString(), otlp.PROTOBUF, t0), timeout=60)
    out = tmp_path / "o.json"
    assert _export(home, out, "otlp-json").exit_code == 0   # first use: imports, caches
    tracemalloc.start()
    try:
        r = _export(home, out, "otlp-json")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.exit_code == 0 and "wrote 2000 spans" in r.output, r.output
    doc = json.loads(out.read_text())
    assert sum(len(s.get("events", [])) for rs in doc["resourceSpans"] for ss in rs["scopeSpans"]
               for s in ss["spans"]) == 40_000
    # the events' text alone is 12 MB: held at once, their dicts took several times that
    assert peak < 12_000_000, f"peak {peak} bytes"


def test_a_kernel_span_whose_bucket_is_a_list_still_exports_a_chrome_trace(tmp_path):
    """Another OTLP client may send an array where rtxops sends a string: it is kept in the
    attributes, and the trace's lane key of it failed ('unhashable type: list', every export)."""
    from .otlp_helpers import request
    home = tmp_path / "home"
    home.mkdir()
    with Store(home / "rtxops.duckdb") as store:
        spans = [span("rtx.kernel", {"rtx.op": "gelu", "rtx.bucket": [1, 2], "rtx.site": ["a"]}),
                 span("rtx.kernel", {"rtx.op": "gelu", "rtx.bucket": "float32/cpu/n=8"})]
        store.write(otlp.convert(request(spans, {"rtx.job.id": "j"}).SerializeToString(),
                                 otlp.PROTOBUF, time.time_ns()), timeout=60)
    out = tmp_path / "trace.json"
    result = _export(home, out, "chrome-trace")
    assert result.exit_code == 0, result.output
    lanes = [e["args"]["name"] for e in json.loads(out.read_text())["traceEvents"]
             if e.get("name") == "thread_name" and "kernel" in e["args"]["name"]]
    assert len(lanes) == 2 and any("[1,2]" in name for name in lanes), lanes
