"""Where a job's step-time overhead comes from, measured inside one process (issue #3).

The example GPT trains on; every ``--block`` steps the runtime is switched on or off at a step
boundary, so adjacent blocks share the host's slow spells (which move whole runs by +25 % on this
VM and swamp ``step_overhead.py``'s process pairs). Four layers, each its own alternation:

* ``runtime``: ops routed (default plan), calls counted;
* ``recorder``: plus the telemetry recorder and export thread, spans not built;
* ``telemetry``: plus the spans built per step and handed to an exporter that encodes them as an
  OTLP request, as the job's exporter does, and drops the bytes;
* ``daemon``: the whole default path of ``rtxops run``: the job's exporter sends the requests over
  OTLP/HTTP to a real ``rtxops daemon`` (its own process, evolve loop off, as in
  ``step_overhead.py``), whose receiver and store share the 2 cores with the job. The daemon runs
  through the off blocks too, idle. One exporter (its HTTP session) serves every on block, as one
  serves a job; each on block still ends with its own request (the spans of its last steps).

A block's figure is its mean step time (after ``--skip`` steps, where a new dispatcher builds its
routes, once per job in a real run). The mean, not the median: the export is a burst every
``--export-interval`` seconds that lands on a step or two, and a median of the steps would not
see it. Blocks are long (default 300 steps, ~8 s) so that several exports fall inside each; the
block's closing export, which the block waits for, is counted in it too (this overstates by
about that request's wall time, ~25 ms a block). The figure per layer is the median over blocks
of on ÷ the mean of the off blocks on either side, with a bootstrap 95 % interval of that median
(adjacent ratios share an off block, so the interval is somewhat too narrow). ``--settled``: each
on block exports as a job does once settled (every 10 s, so mostly its closing export), not as in
its first 30 s. JSON on stdout
(``--out`` writes it too).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from _daemon import KeepOpen, cpu_s, running_daemon
from _gpt import block_options, emit, median_interval, paired_ratios, stepper
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from rtxops import settings
from rtxops.runtime import patching
from rtxops.telemetry import exporters
from rtxops.telemetry.encode import encode
from rtxops.telemetry.exporters import DeferredExporter, otlp_http_exporter
from rtxops.telemetry.job import DEFAULT_EXPORT_INTERVAL_S, start_job_telemetry

LAYERS = ("runtime", "recorder", "telemetry", "daemon")


class _Drop(SpanExporter):
    """Encodes the spans as the job's OTLP exporter does (as they are built), sends nothing."""

    def export(self, spans):
        encode(spans)
        return SpanExportResult.SUCCESS

    def encode_request(self, spans):
        return encode(spans)

    def export_encoded(self, body, spans):
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def layer_cost(steps, layer: str, pairs: int, block: int, skip: int, daemon=None,
               export_interval_s: float = DEFAULT_EXPORT_INTERVAL_S,
               quiet_interval_s: float | None = None) -> dict:
    """``daemon``: (process, URL, token) of the daemon the ``daemon`` layer sends to."""
    blocks: dict[str, list[float]] = {"off": [], "on": []}
    medians: dict[str, list[float]] = {"off": [], "on": []}   # where the cost is: spread or bursts
    closings: list[float] = []
    threads: list = []
    daemon_cpu: dict[str, list[float]] = {"off": [], "on": []}
    shared = None
    if layer == "daemon":
        _, url, token = daemon
        shared = DeferredExporter(lambda: otlp_http_exporter(url, token))
    for i in range(2 * pairs + 1):  # off first and last
        on = i % 2 == 1
        telemetry = None
        if on:
            d = patching.enable()
            if layer == "daemon":
                telemetry = start_job_telemetry(d, KeepOpen(shared),
                                                export_interval_s=export_interval_s,
                                                quiet_interval_s=quiet_interval_s)
            elif layer != "runtime":
                telemetry = start_job_telemetry(d, _Drop(), export_interval_s=export_interval_s,
                                                quiet_interval_s=quiet_interval_s)
                if layer == "recorder":
                    telemetry.thread._build = lambda rec, extra: 0
            if telemetry is not None:
                threads.append(telemetry.thread)
        cpu_before = _cpu_s(daemon)
        times: list[float] = []
        closing = 0.0
        try:
            times = steps(block)[skip:]
        finally:
            if on:
                patching.disable()
                if telemetry is not None:
                    t0 = time.perf_counter()
                    telemetry.close()  # sends the last request: its cost is in the block
                    closing = time.perf_counter() - t0
            if daemon is not None:
                daemon_cpu["on" if on else "off"].append((_cpu_s(daemon) - cpu_before) / block)
        blocks["on" if on else "off"].append((sum(times) + closing) / len(times))
        medians["on" if on else "off"].append(statistics.median(times))
        if on:
            closings.append(closing)
    if shared is not None:
        shared.shutdown()
    ratios = paired_ratios(blocks, "off", "on")
    cpu = [t.cpu_s / t.steps_built for t in threads if t.steps_built]
    low, high = median_interval(ratios)
    out = {"overhead": round(statistics.median(ratios) - 1, 4),
           "overhead_95ci": [round(low - 1, 4), round(high - 1, 4)],
           "export_thread_cpu_ms_per_step": round(statistics.median(cpu) * 1e3, 3) if cpu else None,
           # the blocks' median steps, paired as the means are: near 0 where the cost is bursts
           "median_step_overhead": round(statistics.median(paired_ratios(medians, "off", "on")) - 1, 4),
           # the closing export's wait, a block's figure includes it
           "closing_ms_per_step": round(statistics.median(closings) / block * 1e3, 3) if closings
           else None,
           "block_ms": {k: [round(v * 1e3, 2) for v in vs] for k, vs in blocks.items()},
           "block_ratios": [round(r, 4) for r in ratios]}
    if daemon is not None:
        out["daemon_cpu_ms_per_step"] = {k: round(statistics.median(v) * 1e3, 3)
                                         for k, v in daemon_cpu.items()}
        out["spans_failed"] = sum(t.spans_failed for t in threads)
        out["spans_exported"] = sum(t.spans_exported for t in threads)
    return out


def _cpu_s(daemon) -> float:
    return 0.0 if daemon is None else cpu_s(daemon[0].pid)


def main() -> None:
    a = block_options(__doc__, block=300, skip=5, extra=lambda p: (
        p.add_argument("--layers", default=",".join(LAYERS)),
        p.add_argument("--export-interval", type=float, default=DEFAULT_EXPORT_INTERVAL_S,
                       help="seconds between the job's exports (RTXOPS_EXPORT_INTERVAL_S)"),
        p.add_argument("--settled", action="store_true",
                       help="every block exports as a settled job does: every "
                            "RTXOPS_EXPORT_QUIET_INTERVAL_S (10 s), not every --export-interval "
                            "as in a job's first 30 s")))
    quiet = None
    if a.settled:
        exporters.ACTIVE_S = 0.0
        quiet = settings.EXPORT_QUIET_INTERVAL_S
    layers_wanted = a.layers.split(",")
    steps = stepper()
    steps(30)  # warm-up
    layers = {}
    for layer in (x for x in LAYERS if x in layers_wanted):
        if layer != "daemon":
            layers[layer] = layer_cost(steps, layer, a.pairs, a.block, a.skip,
                                       export_interval_s=a.export_interval, quiet_interval_s=quiet)
            continue
        with tempfile.TemporaryDirectory(prefix="rtxops-overhead-") as tmp, \
                running_daemon(Path(tmp) / "home", env={"RTXOPS_EVOLVE": "0"}) as daemon:
            layers[layer] = layer_cost(steps, layer, a.pairs, a.block, a.skip, daemon,
                                       a.export_interval, quiet)
    emit("step_overhead_inprocess",
         "one process, the runtime switched on and off every block at a step boundary", a,
         {"routed_calls_per_step": routed_calls_per_step(steps),
          "export_interval_s": a.export_interval, "quiet_export_interval_s": quiet,
          "layers": layers,
          "target_overhead_max": 0.02})


def routed_calls_per_step(steps, n: int = 10) -> float:
    """Calls the runtime routes (and times) in one step of the GPT."""
    d = patching.enable()
    try:
        steps(2)
        before = sum(d.readings.calls)
        steps(n)
        return (sum(d.readings.calls) - before) / n
    finally:
        patching.disable()


if __name__ == "__main__":
    main()
