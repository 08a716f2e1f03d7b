"""Telemetry inside a job process: recorder → export thread → spans → exporter.

The runtime bootstrap calls :func:`readings_for_job` (named in ``RTXOPS_READINGS_FACTORY``) so the
runtime itself never imports this package. Configuration:

``RTXOPS_TELEMETRY``  ``otlp`` (to ``RTXOPS_DAEMON``, followed through ``RTXOPS_DAEMON_URL_FILE``,
                      or the standard ``OTEL_EXPORTER_OTLP_*`` endpoint), ``duckdb`` (write
                      ``RTXOPS_STORE`` directly), or ``off``
``RTXOPS_CALL_SAMPLES`` sampled rtx.call spans, ``"per_slot/window_steps"`` (default ``2/100``)
``RTXOPS_RECORDER_CAPACITY`` call records held between steps (default 65536; a full buffer is handed over early)
``RTXOPS_EXPORT_INTERVAL_S`` seconds between exports while the job changes: its first 30 s, 30 s after
                      a plan or region swap, while its plan explores (default 2; spans of several
                      steps go together: each request costs the daemon ~14 ms of CPU however few
                      spans it holds, which on a small machine comes out of the job's step time;
                      OTel's batch default is 5)
``RTXOPS_EXPORT_QUIET_INTERVAL_S`` seconds between exports the rest of the time (default 10, or the
                      interval above where only that is set; the daemon lowers it to a tenth of a
                      job's hang timeout: its exports are the job's heartbeats)
``RTXOPS_TELEMETRY_STATS`` a file to write the export thread's figures to at exit (JSON; benchmarks)
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

import torch
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.trace.export import SpanExporter

from rtxops import settings
from rtxops.runtime.daemon_address import DaemonAddress
from rtxops.runtime.dispatcher import Dispatcher
from rtxops.runtime.memory import cuda_stats, rss_bytes

from . import schema as S
from .exporters import (DeferredExporter, DuckDBSpanExporter, ExportThread, StepProcessor,
                        otlp_http_exporter)
from .recorder import Recorder, StepRecord
from .resource import gpu_attributes, job_resource_attributes
from .spans import CallSampling, SpanBuilder

DEFAULT_DAEMON = "http://127.0.0.1:8765"
DEFAULT_EXPORT_INTERVAL_S = settings.EXPORT_INTERVAL_S
MAX_SPAN_ITEMS = 128  # attributes, events and links a span keeps (the SDK's default)
EXIT_FLUSH_S = 3.0  # what the job's exit waits for its last export (a daemon down retries for 10 s)


@dataclass
class JobTelemetry:
    """The pieces of one job's telemetry, so tests and shutdown can reach them."""

    recorder: Recorder
    builder: SpanBuilder
    thread: ExportThread
    provider: TracerProvider
    exporter: SpanExporter
    store: object | None = None

    def close(self, dispatcher: Dispatcher | None = None) -> None:
        """Export what is left (the part of a step after the last optimizer step too) and stop."""
        if dispatcher is not None:
            dispatcher.drain_timers()   # CUDA-timed calls whose events were not done at the last step
            self.recorder.flush(dispatcher.plan.version, rss_bytes())
        self.thread.close(EXIT_FLUSH_S)
        self.exporter.shutdown()  # a request still retrying gives up now
        self.thread.close(1.0)
        stats_path = os.environ.get("RTXOPS_TELEMETRY_STATS")
        if stats_path:
            t = self.thread
            with open(stats_path, "w") as f:
                json.dump({"export_thread_cpu_s": t.cpu_s, "steps": t.steps_built,
                           "exporter_setup_cpu_s": getattr(self.exporter, "setup_cpu_s", 0.0),
                           "spans_exported": t.spans_exported, "spans_failed": t.spans_failed}, f)
        if self.store is not None:
            self.store.close()


def _no_thread_yet(rec: StepRecord) -> None:
    raise RuntimeError("the recorder's export thread is not made yet")


def start_job_telemetry(dispatcher: Dispatcher, exporter: SpanExporter, *, store=None,
                        sampling: CallSampling | None = None, capacity: int = 1 << 16,
                        resource: dict | None = None,
                        export_interval_s: float = DEFAULT_EXPORT_INTERVAL_S,
                        quiet_interval_s: float | None = None) -> JobTelemetry:
    """Wire a recorder into ``dispatcher`` that exports through ``exporter``."""
    # always on, no length limit: these spans are the run's measurements (each an aggregate of
    # a step), not a sample of traces. OTEL_TRACES_SAMPLER or a span limit from the environment
    # dropped whole steps uncounted, or cut bucket names into keys that exist nowhere
    limits = SpanLimits(max_span_attributes=MAX_SPAN_ITEMS, max_events=MAX_SPAN_ITEMS,
                        max_links=MAX_SPAN_ITEMS, max_event_attributes=MAX_SPAN_ITEMS,
                        max_link_attributes=MAX_SPAN_ITEMS, max_attribute_length=SpanLimits.UNSET,
                        max_span_attribute_length=SpanLimits.UNSET)
    provider = TracerProvider(resource=Resource.create(resource or job_resource_attributes()),
                              sampler=ALWAYS_ON, span_limits=limits)
    processor = StepProcessor()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("rtxops")
    # a job that has not stepped an optimizer hands its calls over every export interval; its
    # steps go to the export thread's submit, set once the thread exists (below)
    recorder = Recorder(_no_thread_yet, capacity=capacity, flush_every_s=export_interval_s)
    builder = SpanBuilder(tracer, recorder.slots, _step_attributes, sampling, recorder.totals,
                          encoded_to=processor)
    build = builder.build
    if resource is None and torch.version.cuda and not torch.cuda.is_initialized():
        build = _with_gpu_once_initialized(builder.build, tracer)
    thread = ExportThread(build, processor, exporter, interval_s=export_interval_s,
                          count=builder.count, quiet_interval_s=quiet_interval_s,
                          exploring=lambda: any(e.explore for e in dispatcher.plan.entries))
    recorder.on_step = thread.submit
    # the recorder replaces the default CallStats: its totals (added up off-thread) serve the summary
    dispatcher.set_readings(recorder)
    telemetry = JobTelemetry(recorder, builder, thread, provider, exporter, store)
    recorder.on_close = lambda: telemetry.close(dispatcher)
    return telemetry


def readings_for_job(dispatcher: Dispatcher) -> JobTelemetry | None:
    """Start telemetry as the environment asks (the runtime bootstrap calls this)."""
    mode = os.environ.get("RTXOPS_TELEMETRY", "otlp")
    if mode == "off":
        return None
    # read before the store opens: a malformed setting must not leave the store's file locked
    sampling = CallSampling.from_env()
    capacity, export_interval_s = settings.recorder_capacity(), settings.export_interval_s()
    quiet_interval_s = settings.export_quiet_interval_s()
    store = None
    if mode == "duckdb":
        from .store import default_path
        from .store_claim import ClaimedStore

        # one process writes the file (DuckDB's lock): the first of the job's processes that
        # has spans, not the first that imported torch (a launcher that trains nothing)
        store = ClaimedStore(os.environ.get("RTXOPS_STORE") or default_path())
        exporter: SpanExporter = DuckDBSpanExporter(store)
    elif mode == "otlp":
        address, token = DaemonAddress.from_env(DEFAULT_DAEMON), os.environ.get("RTXOPS_TOKEN")
        exporter = DeferredExporter(lambda url: otlp_http_exporter(url, token), address.current)
    else:
        raise ValueError(f"RTXOPS_TELEMETRY={mode!r}: expected otlp, duckdb or off")
    telemetry = start_job_telemetry(
        dispatcher, exporter, store=store,
        sampling=sampling, capacity=capacity, export_interval_s=export_interval_s,
        quiet_interval_s=quiet_interval_s,
    )
    return telemetry  # the bootstrap closes it at exit (Readings.close)


def _with_gpu_once_initialized(build, tracer):
    """``build``, which adds the GPU attributes to ``tracer``'s resource at the first export
    after the job initialized CUDA (the spans from then on carry them; the job's newest resource
    is the one the evolve loop keys its results by). Asking at start would initialize CUDA
    as the script imports torch (:func:`.resource.gpu_attributes`)."""
    pending = [True]

    def build_then(rec, extra=None):
        if pending[0] and torch.cuda.is_initialized():
            pending[0] = False
            tracer.resource = tracer.resource.merge(Resource(gpu_attributes()))
        return build(rec, extra)

    return build_then


def _step_attributes(rec: StepRecord) -> dict:
    attrs: dict = {}
    cuda = cuda_stats(rec.cuda_device) if rec.cuda_device >= 0 else {}
    if cuda:
        attrs.update({
            S.CUDA_ALLOCATED: cuda["allocated"], S.CUDA_RESERVED: cuda["reserved"],
            S.CUDA_FRAGMENTATION: cuda["fragmentation"], S.CUDA_PEAK: cuda["peak"],
            S.CUDA_ALLOC_RETRIES: cuda["alloc_retries"], S.CUDA_OOMS: cuda["ooms"],
        })
    # dynamo's counters only once the job itself loaded dynamo: importing it here would pull
    # dynamo and Triton into every process that never compiles (seconds, and ~150 MB)
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    inductor = getattr(dynamo_utils, "counters", {}).get("inductor", {})
    attrs[S.INDUCTOR_FXGRAPH_HITS] = int(inductor.get("fxgraph_cache_hit", 0))
    attrs[S.INDUCTOR_FXGRAPH_MISSES] = int(inductor.get("fxgraph_cache_miss", 0))
    return attrs  # the RSS is the step record's, read at the step's end
