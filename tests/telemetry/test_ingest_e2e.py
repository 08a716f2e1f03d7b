"""Ingest end to end with real processes: a stock OpenTelemetry SDK client, an overload flood
against a real uvicorn server, and kill -9 of a writer after it acknowledged batches."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import uvicorn

from rtxops.telemetry import store as store_module, synthetic
from rtxops.telemetry.otlp import PROTOBUF
from rtxops.telemetry.receiver import make_app
from rtxops.telemetry.store import Store

from .._bounded import joined, serving

TOKEN = "e2e-token"
ROOT = Path(__file__).resolve().parents[2]


class Server:
    """The receiver app on uvicorn, 127.0.0.1 and an ephemeral port, in a thread."""

    def __init__(self, store: Store, **options) -> None:
        config = uvicorn.Config(make_app(store, token=TOKEN, **options), host="127.0.0.1", port=0,
                                log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = serving(self.server, "receiver")
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1/traces"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "e2e.duckdb")
    yield s
    s.close()


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


SDK_CLIENT = textwrap.dedent("""
    import sys
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    url, token = sys.argv[1], sys.argv[2]
    provider = TracerProvider(resource=Resource.create({
        "service.name": "stock-sdk-client", "rtx.job.id": "sdk-job", "rtx.rank": 3,
        "deployment.environment": "test", "host.name": "client-host"}))
    exporter = OTLPSpanExporter(endpoint=url, headers={"Authorization": f"Bearer {token}"},
                                compression=Compression.Gzip)
    provider.add_span_processor(BatchSpanProcessor(exporter, max_export_batch_size=64))
    tracer = provider.get_tracer("stock.client", "1.2.3")
    for step in range(20):
        with tracer.start_as_current_span("rtx.step", attributes={"rtx.step": step,
                                          "rtx.plan.version": 7, "rtx.mem.rss_bytes": 1000 + step}) as s:
            s.add_event("rtx.variant.disabled", {"rtx.reason": f"boom {step}"})
            for op in ("gelu", "linear"):
                with tracer.start_as_current_span("rtx.kernel", attributes={
                        "rtx.op": op, "rtx.count": 3, "rtx.total_ns": 300 + step,
                        "rtx.hist_log2_ns": [0, 1, 2], "rtx.sampled": True, "ratio": 0.5,
                        "tags": ["a", "b"], "rtx.step": step}):
                    pass
    ok = provider.force_flush(30_000)
    provider.shutdown()
    print("flushed" if ok else "flush failed", flush=True)
""")


def test_stock_otel_sdk_client_in_another_process(store, tmp_path):
    server = Server(store)
    try:
        script = tmp_path / "client.py"
        script.write_text(SDK_CLIENT)
        out = subprocess.run([sys.executable, str(script), server.url, TOKEN], env=_env(),
                             capture_output=True, text=True, timeout=90)
        assert out.returncode == 0 and out.stdout.strip() == "flushed", out.stderr[-2000:]
    finally:
        server.stop()
    assert store.stats()["requests_rejected"] == 0
    resources = store.query("SELECT * FROM resources")
    assert len(resources) == 1
    res = resources[0]
    assert (res["service_name"], res["job_id"], res["rank"], res["host_name"]) == (
        "stock-sdk-client", "sdk-job", 3, "client-host")
    extra = json.loads(res["attributes"])
    assert extra["deployment.environment"] == "test" and extra["telemetry.sdk.name"] == "opentelemetry"
    spans = store.query("SELECT * FROM spans ORDER BY start_ns")
    assert len(spans) == 60
    steps = [s for s in spans if s["name"] == "rtx.step"]
    kernels = [s for s in spans if s["name"] == "rtx.kernel"]
    assert sorted(s["step"] for s in steps) == list(range(20))
    assert all(s["plan_version"] == 7 and s["job_id"] == "sdk-job" and s["rank"] == 3 for s in steps)
    assert {json.loads(s["attributes"])["rtx.mem.rss_bytes"] - s["step"] for s in steps} == {1000}
    by_id = {s["span_id"]: s for s in steps}
    for k in kernels:
        parent = by_id[k["parent_span_id"]]
        assert parent["trace_id"] == k["trace_id"] and parent["step"] == k["step"]
        assert k["op"] in ("gelu", "linear") and k["count"] == 3 and k["total_ns"] == 300 + k["step"]
        assert json.loads(k["attributes"]) == {"rtx.hist_log2_ns": [0, 1, 2], "rtx.sampled": True,
                                               "ratio": 0.5, "tags": ["a", "b"]}
        assert k["scope_name"] == "stock.client" and k["resource_id"] == res["resource_id"]
    events = store.query("SELECT * FROM span_events")
    assert sorted(json.loads(e["attributes"])["rtx.reason"] for e in events) == sorted(
        f"boom {i}" for i in range(20))
    assert {e["span_id"] for e in events} == set(by_id)


def test_overload_flood_gets_429s_with_bounded_memory_and_exact_counts(tmp_path, monkeypatch):
    release = threading.Event()
    real_insert = store_module._insert

    def slow_insert(*args):                         # the disk is slow: the queue fills up
        release.wait(30)
        return real_insert(*args)

    monkeypatch.setattr(store_module, "_insert", slow_insert)
    max_spans = 5_000
    store = Store(tmp_path / "flood.duckdb", max_queue_batches=8, max_queue_spans=max_spans)
    server = Server(store, max_inflight=4, slot_wait_s=30)   # refusals here: the queue only
    per_request = 500
    base = synthetic.otlp_request(per_request, seed=0).SerializeToString()

    first, second = 60, 150                           # 105,000 spans: 26x what the queue holds
    # each request a body of its own: a repeated one is a retry, stored once
    bodies = [synthetic.numbered(base, i) for i in range(first + second)]
    process = psutil.Process()
    rss_before = process.memory_info().rss
    peak = {"queue": 0, "rss": rss_before}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak["queue"] = max(peak["queue"], store.stats()["queue_spans"])
            peak["rss"] = max(peak["rss"], process.memory_info().rss)
            time.sleep(0.005)

    def send(i: int) -> tuple[int, str | None]:
        r = client.post(server.url, content=bodies[i],
                        headers={"Content-Type": PROTOBUF, "Authorization": f"Bearer {TOKEN}"})
        return r.status_code, r.headers.get("retry-after")

    def wait_until(futures, count: int) -> None:
        deadline = time.monotonic() + 60
        while sum(f.done() for f in futures) < count:
            assert time.monotonic() < deadline, "the flood did not get answers while blocked"
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    queued = min(8, max_spans // per_request)         # what the queue can hold while blocked
    try:
        with httpx.Client(timeout=60) as client, concurrent.futures.ThreadPoolExecutor(16) as pool:
            phase1 = [pool.submit(send, i) for i in range(first)]
            wait_until(phase1, first - queued)
            rss_after_first = peak["rss"]
            phase2 = [pool.submit(send, i) for i in range(first, first + second)]
            wait_until(phase2, second)                # all refused: nothing more fits
            rss_after_second = peak["rss"]
            release.set()                             # the disk catches up: queued ones commit
            results = [f.result() for f in phase1 + phase2]
    finally:
        release.set()
        stop.set()
        joined(watcher)
        server.stop()
    n_requests = first + second
    statuses = [s for s, _ in results]
    refused = statuses.count(429)
    assert set(statuses) <= {200, 429} and refused > 0 and statuses.count(200) > 0
    assert all(ra is not None and int(ra) >= 1 for s, ra in results if s == 429)
    stats = store.stats()
    assert stats["spans_refused"] == refused * per_request
    assert stats["requests_refused"] == refused
    assert stats["spans_written"] == statuses.count(200) * per_request
    assert peak["queue"] <= max_spans
    assert [s for s, _ in results[first:]] == [429] * second
    second_bytes = sum(len(bodies[i]) for i in range(first, n_requests))
    assert rss_after_second - rss_after_first < second_bytes / 4, (
        rss_before, rss_after_first, rss_after_second, second_bytes)
    store.close()
    with Store(tmp_path / "flood.duckdb") as again:
        assert again.query("SELECT count(*) AS n FROM spans")[0]["n"] == statuses.count(200) * per_request


WRITER = textwrap.dedent("""
    import sys, time
    from rtxops.telemetry import otlp, synthetic
    from rtxops.telemetry.store import Store

    store = Store(sys.argv[1])
    i = 0
    while True:
        req = synthetic.otlp_request(200, seed=i, job_id=f"batch-{i}")
        store.write(otlp.convert(req.SerializeToString(), otlp.PROTOBUF, time.time_ns()))
        print(f"ack {i}", flush=True)
        i += 1
""")


def test_kill_9_after_acks_keeps_every_acknowledged_batch(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    path = tmp_path / "durable.duckdb"
    child = subprocess.Popen([sys.executable, str(script), str(path)], env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    acked = -1
    try:
        while acked < 24:
            line = child.stdout.readline()
            assert line, child.stderr.read()[-2000:]
            acked = int(line.split()[1])
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert child.returncode == -signal.SIGKILL
    with Store(path) as store:
        counts = {r["job_id"]: r["n"] for r in store.query(
            "SELECT job_id, count(*) AS n FROM spans GROUP BY job_id")}
        for i in range(acked + 1):
            assert counts.get(f"batch-{i}") == 200, f"acknowledged batch {i} is missing"
        assert all(n == 200 for n in counts.values())           # no half-written batch either
        assert store.query("SELECT count(*) AS n FROM ingest_batches")[0]["n"] == len(counts)


def test_stalled_uploads_time_out_and_give_their_slots_back(store):
    """Clients that send headers and a little of the body, then nothing (a job stopped with
    SIGSTOP, a wedged connection), hold every slot only until the body timeout: 408 for them,
    and the next export goes through."""
    import socket
    from urllib.parse import urlparse

    server = Server(store, max_inflight=2, slot_wait_s=0.5, body_timeout_s=1.0)
    url = urlparse(server.url)
    stalled = []
    try:
        for _ in range(2):
            s = socket.create_connection((url.hostname, url.port))
            s.sendall((f"POST {url.path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                       f"Content-Type: {PROTOBUF}\r\nContent-Length: 100000\r\n\r\n").encode() + b"x" * 10)
            stalled.append(s)
        time.sleep(0.2)
        body = synthetic.otlp_request(20, seed=1).SerializeToString()
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": PROTOBUF}
        assert httpx.post(server.url, content=body, headers=headers, timeout=30).status_code == 429
        for s in stalled:
            s.settimeout(10)
            assert s.recv(64).startswith(b"HTTP/1.1 408"), "the stalled upload was not timed out"
        assert httpx.post(server.url, content=body, headers=headers, timeout=30).status_code == 200
    finally:
        for s in stalled:
            s.close()
        server.stop()


def test_numbered_copies_of_a_body_are_distinct_requests_of_the_same_spans():
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = synthetic.otlp_request(100, seed=5)
    body = request.SerializeToString()
    copies = [synthetic.numbered(body, i) for i in range(20)]
    assert len(set(copies)) == 20 and {len(c) for c in copies} == {len(body)}
    again = ExportTraceServiceRequest.FromString(copies[3]).resource_spans[0].scope_spans[0].spans
    spans = request.resource_spans[0].scope_spans[0].spans
    assert again[0].span_id != spans[0].span_id and again[0].name == spans[0].name
    children = [s for s in again if s.parent_span_id == again[0].span_id]
    assert len(children) == len([s for s in spans if s.parent_span_id == spans[0].span_id]) > 0
    assert [s.attributes for s in again] == [s.attributes for s in spans]
