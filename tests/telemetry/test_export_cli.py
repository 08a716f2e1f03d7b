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

from .otlp_helpers import kvs, request, span


def _stored(tmp_path, body: bytes, received_ns: int):
    """A home whose store holds the OTLP protobuf request ``body``, no daemon on it."""
    home = tmp_path / "home"
    home.mkdir()
    with Store(home / "rtxops.duckdb") as store:
        store.write(otlp.convert(body, otlp.PROTOBUF, received_ns), timeout=30)
    return home


def _home(tmp_path):
    t0 = time.time_ns()
    body = request([span("rtx.step", {"rtx.step": 1}, start=t0, duration=10**6),
                    span("rtx.kernel", {"rtx.op": "gelu", "rtx.variant": "eager", "rtx.count": 2,
                                        "rtx.total_ns": 900, "rtx.step": 1}, start=t0)],
                   {"service.name": "trainer", "rtx.job.id": "job-a", "rtx.rank": 0}).SerializeToString()
    return _stored(tmp_path, body, t0)


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


def test_an_output_in_the_home_or_on_the_store_is_refused_and_the_store_kept(tmp_path):
    """`-o .rtxops/rtxops.duckdb` replaced the store with the export (spans, jobs and the
    governance ledger gone), exit 0."""
    home = _home(tmp_path)
    store = home / "rtxops.duckdb"
    before = store.read_bytes()
    for target in (store, home / "rtxops.duckdb.wal", home / "token", home / "t.json"):
        r = export(home, "--format", "otlp-json", "-o", str(target))
        assert r.exit_code == 2 and "a file of the rtxops home" in " ".join(r.output.split()), r.output
    assert store.read_bytes() == before
    r = export(home, "--format", "otlp-json", "--job", "", "-o", str(tmp_path / "o.json"))
    assert r.exit_code == 2 and "empty job id" in r.output, r.output


def test_a_store_read_without_a_daemon_gets_the_stores_memory_limit(tmp_path, monkeypatch):
    """A read-only store ignored RTXOPS_STORE_MEMORY: an export's sort of a large store took
    gigabytes."""
    from rtxops.telemetry.store import ReadOnlyStore

    home = _home(tmp_path)
    monkeypatch.setenv("RTXOPS_STORE_MEMORY", "64MB")
    store = ReadOnlyStore(home / "rtxops.duckdb")
    try:
        limit = store.query("SELECT current_setting('memory_limit') AS m")[0]["m"]
    finally:
        store.close()
    assert limit.replace(" ", "") in ("61.0MiB", "64.0MB"), limit


def test_back_to_back_steps_do_not_overlap_in_the_chrome_trace(tmp_path):
    """Unix times in µs as doubles keep only 0.25 µs: steps that abut in the store overlapped."""
    t0, step_ns = 1_796_111_599_546_970_195, 3_000_123
    body = request([span("rtx.step", {"rtx.step": i}, start=t0 + i * step_ns, duration=step_ns)
                    for i in range(50)],
                   {"service.name": "trainer", "rtx.job.id": "job-a", "rtx.rank": 0}).SerializeToString()
    home = _stored(tmp_path, body, t0)
    r = export(home, "--format", "chrome-trace", "-o", str(tmp_path / "t.json"))
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "t.json").read_text())
    steps = sorted((e for e in doc["traceEvents"] if e["ph"] == "X"), key=lambda e: e["ts"])
    for a, b in zip(steps, steps[1:]):
        assert round((a["ts"] + a["dur"]) * 1000) <= round(b["ts"] * 1000), (a, b)
    assert doc["otherData"]["origin_unix_ns"] == t0


def test_kernel_spans_of_one_step_go_on_lanes_where_slices_nest(tmp_path):
    """A step's kernel spans each run from the kernel's first call to its last, so two kernels of
    one step overlap in part: all on one lane, which Perfetto needs nested, they did not nest."""
    t0, step_ns = 1_796_111_599_546_970_195, 10_000
    # two sites of gelu (one op, variant and bucket) overlap in part like two ops
    kernels = [("gelu", "eager", "F.gelu", 0, 7_000), ("linear", "aten", "F.linear", 1_000, 9_000),
               ("gelu", "eager", "mlp.py:12", 3_000, 8_000)]
    spans = []
    for i in range(3):
        base = t0 + i * step_ns
        spans.append(span("rtx.step", {"rtx.step": i}, start=base, duration=step_ns))
        spans += [span("rtx.kernel", {"rtx.op": op, "rtx.variant": v, "rtx.phase": "fwd",
                                      "rtx.bucket": "float32/cpu/rows=8", "rtx.site": site,
                                      "rtx.config": "{}", "rtx.step": i},
                       start=base + a, duration=b - a) for op, v, site, a, b in kernels]
    body = request(spans, {"service.name": "trainer", "rtx.job.id": "job-a",
                           "rtx.rank": 0}).SerializeToString()
    home = _stored(tmp_path, body, t0)
    r = export(home, "--format", "chrome-trace", "-o", str(tmp_path / "t.json"))
    assert r.exit_code == 0, r.output
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == 12
    by_lane: dict = {}
    for e in slices:
        by_lane.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for lane, spans_on_lane in by_lane.items():
        spans_on_lane.sort()
        for (a0, a1), (b0, b1) in zip(spans_on_lane, spans_on_lane[1:]):
            assert b0 >= a1 or b1 <= a1, f"partial overlap on lane {lane}"
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert sorted(names[tid] for (_, tid) in by_lane if names[tid].startswith("kernel")) == [
        "kernel gelu/eager fwd float32/cpu/rows=8 F.gelu",
        "kernel gelu/eager fwd float32/cpu/rows=8 mlp.py:12",
        "kernel linear/aten fwd float32/cpu/rows=8 F.linear"]


def test_otlp_json_puts_the_resource_and_scopes_back(tmp_path):
    home = _home(tmp_path)
    r = export(home, "--format", "otlp-json", "-o", str(tmp_path / "o.json"))
    assert r.exit_code == 0, r.output
    [resource] = json.loads((tmp_path / "o.json").read_text())["resourceSpans"]
    attrs = {kv["key"]: kv["value"] for kv in resource["resource"]["attributes"]}
    assert attrs["service.name"] == {"stringValue": "trainer"}
    assert attrs["rtx.job.id"] == {"stringValue": "job-a"} and attrs["rtx.rank"] == {"intValue": "0"}
    assert [s["scope"]["name"] for s in resource["scopeSpans"]] == ["test"]


def test_otlp_json_carries_the_span_events(tmp_path):
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    t0 = time.time_ns()
    event = Span.Event(time_unix_nano=t0 + 5, name="rtx.error", attributes=kvs({"rtx.reason": "boom"}))
    body = request([span("rtx.step", {"rtx.step": 1}, start=t0, events=[event])],
                   {"service.name": "trainer", "rtx.job.id": "job-a", "rtx.rank": 0}).SerializeToString()
    home = _stored(tmp_path, body, t0)
    r = export(home, "--format", "otlp-json", "--job", "job-a", "-o", str(tmp_path / "o.json"))
    assert r.exit_code == 0, r.output
    [resource] = json.loads((tmp_path / "o.json").read_text())["resourceSpans"]
    [span_json] = resource["scopeSpans"][0]["spans"]
    assert span_json["events"] == [{"timeUnixNano": str(t0 + 5), "name": "rtx.error",
                                    "attributes": [{"key": "rtx.reason", "value": {"stringValue": "boom"}}]}]


def test_a_span_without_a_start_time_is_not_the_chrome_traces_origin(tmp_path):
    """A span sent with start 0 became the origin: every other span's ts was ~1.8e15 µs, where a
    double keeps 0.25 µs (the origin exists to avoid that)."""
    t0 = 1_796_111_599_546_970_195
    body = request([span("zero", start=0, duration=5), span("rtx.step", {"rtx.step": 1}, start=t0)],
                   {"service.name": "trainer", "rtx.job.id": "job-a", "rtx.rank": 0}).SerializeToString()
    home = _stored(tmp_path, body, t0)
    r = export(home, "--format", "chrome-trace", "-o", str(tmp_path / "t.json"))
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["otherData"]["origin_unix_ns"] == t0
    [step] = [e for e in doc["traceEvents"] if e.get("cat") == "rtx.step"]
    assert step["ts"] == 0
    lanes = {e["tid"] for e in doc["traceEvents"] if e["ph"] == "X"}
    named = {e["tid"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert lanes <= named


def test_an_attribute_sent_without_a_value_is_exported_without_one(tmp_path):
    req = request([span("rtx.step", {"rtx.step": 1})],
                  {"service.name": "trainer", "rtx.job.id": "job-a", "rtx.rank": 0})
    req.resource_spans[0].scope_spans[0].spans[0].attributes.add(key="unset")
    home = _stored(tmp_path, req.SerializeToString(), 1)
    r = export(home, "--format", "otlp-json", "-o", str(tmp_path / "o.json"))
    assert r.exit_code == 0, r.output
    [resource] = json.loads((tmp_path / "o.json").read_text())["resourceSpans"]
    [sp] = resource["scopeSpans"][0]["spans"]
    assert {kv["key"]: kv["value"] for kv in sp["attributes"]}["unset"] == {}


def test_a_store_read_in_slices_exports_every_span_once_with_its_events(tmp_path, monkeypatch):
    """The export sorted the whole store at once: past ~1 M spans the store's memory limit
    failed it (the daemon's and the CLI's), so spans are read in slices of start time."""
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    from rtxops.telemetry import store_export

    monkeypatch.setattr(store_export, "EXPORT_SLICE_ROWS", 3)
    t0 = time.time_ns()
    body = request([span("rtx.step", {"rtx.step": i}, start=t0 + 1000 * (9 - i),
                         events=[Span.Event(time_unix_nano=t0 + 1, name=f"event {i}")])
                    for i in range(10)],
                   {"service.name": "trainer", "rtx.job.id": "job-a", "rtx.rank": 0}).SerializeToString()
    home = _stored(tmp_path, body, t0)
    assert export(home, "--format", "otlp-json", "-o", str(tmp_path / "o.json")).exit_code == 0
    doc = json.loads((tmp_path / "o.json").read_text())
    spans = [s for rs in doc["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    steps = [{kv["key"]: kv["value"] for kv in s["attributes"]}["rtx.step"]["intValue"] for s in spans]
    assert steps == [str(i) for i in range(9, -1, -1)]       # every span once, oldest first
    assert [s["events"][0]["name"] for s in spans] == [f"event {i}" for i in range(9, -1, -1)]
    assert export(home, "--format", "parquet", "-o", str(tmp_path / "s.parquet")).exit_code == 0
    assert pq.read_table(tmp_path / "s.parquet")["step"].to_pylist() == list(range(9, -1, -1))
    assert export(home, "--format", "chrome-trace", "-o", str(tmp_path / "t.json")).exit_code == 0
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert [e["name"] for e in events if e["ph"] == "X"] == [f"step {i}" for i in range(9, -1, -1)]


def test_spans_of_no_job_get_a_process_per_resource_in_the_chrome_trace(tmp_path):
    """Two services sending no job id shared one process: their steps overlapped on its lane."""
    t0 = time.time_ns()
    home = tmp_path / "home"
    home.mkdir()
    with Store(home / "rtxops.duckdb") as store:
        for pid, offset in ((101, 0), (202, 500)):
            body = request([span("rtx.step", {"rtx.step": i}, start=t0 + i * 1000 + offset,
                                 duration=1000) for i in range(3)],
                           {"service.name": f"svc{pid}", "process.pid": pid}).SerializeToString()
            store.write(otlp.convert(body, otlp.PROTOBUF, t0), timeout=30)
    assert export(home, "--format", "chrome-trace", "-o", str(tmp_path / "t.json")).exit_code == 0
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(names.values()) == ["svc101 pid 101", "svc202 pid 202"]
    for pid in names:
        steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X" and e["pid"] == pid)
        assert len(steps) == 3 and all(a[1] <= b[0] for a, b in zip(steps, steps[1:]))


def test_a_services_overlapping_spans_go_on_lanes_where_slices_nest(tmp_path):
    """Any OTLP client's spans (concurrent requests) went on one lane whatever their times:
    Perfetto drops a slice that overlaps another on its lane in part."""
    t0 = time.time_ns()
    spans = [span("GET /a", start=t0, duration=1000), span("db", start=t0 + 100, duration=300),
             span("GET /b", start=t0 + 500, duration=1000), span("GET /c", start=t0 + 1600, duration=100)]
    home = _stored(tmp_path, request(spans, {"service.name": "web"}).SerializeToString(), t0)
    assert export(home, "--format", "chrome-trace", "-o", str(tmp_path / "t.json")).exit_code == 0
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    lane = {e["name"]: e["tid"] for e in events if e["ph"] == "X"}
    assert lane["db"] == lane["GET /a"] == lane["GET /c"] != lane["GET /b"]   # nested, after, overlapping
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert names[lane["GET /a"]] == "other spans" and names[lane["GET /b"]] == "other spans (overlapping)"


def test_a_parquet_export_that_cannot_write_says_so(tmp_path, monkeypatch):
    """A full disk while writing: the snapshot's ROLLBACK, with the store's reader still open,
    failed and its error ("Resource In Use ... cannot read the spans", exit 1) replaced this one."""
    import errno

    home = _home(tmp_path)

    def full(self, batch, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq.ParquetWriter, "write_batch", full)
    r = export(home, "--format", "parquet", "-o", str(tmp_path / "s.parquet"))
    assert r.exit_code == 2 and "No space left on device" in " ".join(r.output.split()), r.output
    assert "Resource" not in r.output


def test_a_span_row_without_times_is_exported_not_a_crash(tmp_path):
    """Rows with no start time (written by hand, or by an old version): the chrome trace raised
    TypeError, and the OTLP JSON said "None" for the time."""
    home = _home(tmp_path)
    with Store(home / "rtxops.duckdb") as store:
        store.call(lambda cur: cur.execute(
            "INSERT INTO span_rows SELECT * REPLACE (NULL AS start_ns, span_id + 1 AS span_id) "
            "FROM span_rows LIMIT 1"), 30)
    r = export(home, "--format", "chrome-trace", "-o", str(tmp_path / "t.json"))
    assert r.exit_code == 0, (r.output, r.exception)
    assert len([e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]
                if e["ph"] == "X"]) == 3
    r = export(home, "--format", "otlp-json", "-o", str(tmp_path / "o.json"))
    assert r.exit_code == 0, (r.output, r.exception)
    text = (tmp_path / "o.json").read_text()
    assert '"None"' not in text and text.count('"startTimeUnixNano"') == 3
