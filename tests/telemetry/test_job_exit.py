"""The job's telemetry at exit and while its daemon is away: the last export waits a bounded
time (a request retrying against a daemon that is down gives up), and the exporter's warnings
reach the job's stderr once a minute, not every few seconds."""
from __future__ import annotations

import logging
import threading
import time

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from rtxops.runtime import patching
from rtxops.telemetry import job
from rtxops.telemetry.exporters import quiet_export_warnings
from rtxops.telemetry.job import start_job_telemetry

from ..runtime.helpers import TinyNet, train_losses


class _Unanswered(SpanExporter):
    """A daemon that never answers: export blocks until shutdown()."""

    def __init__(self):
        self.gave_up = threading.Event()
        self.exports = 0

    def export(self, spans):
        self.exports += 1
        self.gave_up.wait(60)
        return SpanExportResult.FAILURE

    def shutdown(self):
        self.gave_up.set()


def test_the_last_export_waits_a_bounded_time(monkeypatch):
    monkeypatch.setattr(job, "EXIT_FLUSH_S", 0.5)
    exporter = _Unanswered()
    d = patching.enable()
    telemetry = start_job_telemetry(d, exporter, export_interval_s=3600)
    train_losses(TinyNet(), steps=3)
    started = time.monotonic()
    telemetry.close(d)
    waited = time.monotonic() - started
    patching.disable()
    assert exporter.exports == 1 and exporter.gave_up.is_set()
    assert waited < 5, waited  # not the 60 s the request would have hung
    assert not telemetry.thread._thread.is_alive()


def test_export_warnings_reach_stderr_once_per_interval(capsys):
    otlp_logger = logging.getLogger("opentelemetry.exporter.otlp")
    for handler in list(otlp_logger.handlers):  # a fresh interval: another test may have warned
        otlp_logger.removeHandler(handler)
    quiet_export_warnings()
    sdk = logging.getLogger("opentelemetry.exporter.otlp.common.http")
    for i in range(5):
        sdk.warning("Transient error %d, retrying", i)
    err = capsys.readouterr().err
    assert err.count("rtxops: telemetry export: Transient error") == 1, err
    quiet_export_warnings()  # once: a second call adds no second handler
    assert len(logging.getLogger("opentelemetry.exporter.otlp").handlers) == 1
