"""``rtx.trial`` spans: every trial, online or offline, is also an OpenTelemetry span in the store,
next to the kernel spans it was measured from (the real SDK, exported through the same OTLP →
Arrow path as everything else)."""
from __future__ import annotations

import threading

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from rtxops.telemetry import schema
from rtxops.telemetry.exporters import DuckDBSpanExporter
from rtxops.telemetry.store import Store

TRIAL_SPAN = "rtx.trial"


class TrialSpans:
    """Writes one ``rtx.trial`` span per trial row into ``store``."""

    def __init__(self, store: Store) -> None:
        provider = TracerProvider(resource=Resource.create({schema.SERVICE_NAME: "rtxops-evolve"}))
        provider.add_span_processor(SimpleSpanProcessor(DuckDBSpanExporter(store)))
        self._tracer = provider.get_tracer("rtxops.evolve")
        self._lock = threading.Lock()

    def record(self, trial: dict) -> None:
        attributes = {
            schema.OP: trial["op"], schema.BUCKET: trial["bucket"],
            schema.VARIANT: trial["variant"], schema.CONFIG: trial["config"],
            "rtx.trial.id": trial["trial_id"], "rtx.trial.mode": trial["mode"],
            "rtx.trial.strategy": trial.get("strategy") or "",
            "rtx.trial.status": trial["status"], "rtx.trial.samples": int(trial.get("samples") or 0),
            "rtx.job.id": trial.get("job_id") or "",
        }
        for key in ("median_ns", "p95_ns", "spread"):
            if trial.get(key) is not None:
                attributes[f"rtx.trial.{key}"] = float(trial[key])
        start = int(trial["started_ns"])
        end = max(int(trial.get("ended_ns") or start), start)
        with self._lock:
            span = self._tracer.start_span(TRIAL_SPAN, start_time=start, attributes=attributes)
            span.end(end_time=end)
