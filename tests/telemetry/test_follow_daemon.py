"""A job follows its daemon: the exporter and the plan poller read the daemon's URL file, so a
daemon restarted on another port gets the job's spans (a batch that failed at the old address is
sent again to the new one) and serves its plans."""
from __future__ import annotations

import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rtxops.runtime.daemon_address import DaemonAddress
from rtxops.telemetry.exporters import DeferredExporter

from .._bounded import joined


class _Collector:
    """A real HTTP endpoint on 127.0.0.1 that keeps the span names of every OTLP request."""

    def __init__(self) -> None:
        names = self.names = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                names.extend(s.name for rs in request.resource_spans for ss in rs.scope_spans
                             for s in ss.spans)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collectors():
    made: list[_Collector] = []
    yield lambda: made.append(_Collector()) or made[-1]
    for c in made:
        c.close()


def _dead_url() -> str:
    with socket.socket() as s:  # a port just free: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _spans(*names: str):
    provider, memory = TracerProvider(), InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    for name in names:
        provider.get_tracer("t").start_span(name).end()
    return memory.get_finished_spans()


def _announce(url_file, url: str) -> None:
    tmp = url_file.with_name("daemon.url.tmp")
    tmp.write_text(url + "\n")
    os.replace(tmp, url_file)


def _exporter(address: DaemonAddress) -> DeferredExporter:
    return DeferredExporter(lambda url: OTLPSpanExporter(endpoint=url + "/v1/traces", timeout=2),
                            address.current)


def test_the_address_follows_the_url_file(tmp_path):
    url_file = tmp_path / "daemon.url"
    address = DaemonAddress("http://127.0.0.1:1/", url_file)
    assert address.current() == "http://127.0.0.1:1"          # no file yet: the launch URL
    _announce(url_file, "http://127.0.0.1:2")
    assert address.current() == "http://127.0.0.1:2"
    url_file.write_text("not a url\n")                         # nothing usable: the last one kept
    assert address.current() == "http://127.0.0.1:2"
    url_file.unlink()                                          # a daemon that stopped removes it
    assert address.current() == "http://127.0.0.1:2"
    _announce(url_file, "http://127.0.0.1:3/")
    assert address.current() == "http://127.0.0.1:3"
    assert DaemonAddress("http://127.0.0.1:4", None).current() == "http://127.0.0.1:4"


def test_spans_go_to_the_daemon_the_url_file_names(tmp_path, collectors):
    first, second = collectors(), collectors()
    url_file = tmp_path / "daemon.url"
    exporter = _exporter(DaemonAddress(first.url, url_file))
    assert exporter.export(_spans("a")) is SpanExportResult.SUCCESS
    _announce(url_file, second.url)
    assert exporter.export(_spans("b")) is SpanExportResult.SUCCESS
    exporter.shutdown()
    assert (first.names, second.names) == (["a"], ["b"])


def test_a_batch_failed_at_a_gone_daemon_is_sent_to_the_one_announced_meanwhile(tmp_path, collectors):
    live = collectors()
    url_file = tmp_path / "daemon.url"
    exporter = _exporter(DaemonAddress(_dead_url(), url_file))
    # the new daemon announces itself while the export retries at the dead address
    announcer = threading.Timer(0.3, _announce, (url_file, live.url))
    announcer.start()
    started = time.monotonic()
    result = exporter.export(_spans("lost?"))
    joined(announcer)
    exporter.shutdown()
    assert time.monotonic() - started > 0.3, "the export did not try the dead address first"
    assert result is SpanExportResult.SUCCESS and live.names == ["lost?"]


def test_without_a_new_address_a_failed_batch_is_a_failure(tmp_path):
    exporter = _exporter(DaemonAddress(_dead_url(), tmp_path / "daemon.url"))
    assert exporter.export(_spans("x")) is SpanExportResult.FAILURE
    exporter.shutdown()


def test_a_supervised_jobs_spans_go_to_its_daemon_whatever_otlp_endpoint_the_shell_set(
        tmp_path, collectors, monkeypatch):
    """An OTEL_EXPORTER_OTLP_ENDPOINT in the caller's shell (for the job's own tracing) took a
    supervised job's spans away from its daemon: no evolve loop, no step heartbeats. A job no
    daemon supervises still sends there."""
    from rtxops.telemetry.exporters import otlp_http_exporter

    daemon, collector = collectors(), collectors()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
    monkeypatch.delenv("RTXOPS_DAEMON_URL_FILE", raising=False)
    alone = otlp_http_exporter(daemon.url, "token")
    assert alone.export(_spans("standalone")) is SpanExportResult.SUCCESS
    monkeypatch.setenv("RTXOPS_DAEMON_URL_FILE", str(tmp_path / "daemon.url"))
    supervised = otlp_http_exporter(daemon.url, "token")
    assert supervised.export(_spans("supervised")) is SpanExportResult.SUCCESS
    for exporter in (alone, supervised):
        exporter.shutdown()
    assert (daemon.names, collector.names) == (["supervised"], ["standalone"])
