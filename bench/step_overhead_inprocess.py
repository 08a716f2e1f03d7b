"""Where a job's step-time overhead comes from, measured inside one process (issue #3).

The example GPT trains on; every ``--block`` steps the runtime is switched on or off at a step
boundary, so adjacent blocks share the host's slow spells (which move whole runs by +25 % on this
VM and swamp ``step_overhead.py``'s process pairs). Three layers, each its own alternation:

* ``runtime``: ops routed (default plan), calls counted;
* ``recorder``: plus the telemetry recorder and export thread, spans not built;
* ``telemetry``: plus the spans built per step and handed to an exporter that encodes them as an
  OTLP request, as the job's exporter does, and drops the bytes.

What this leaves out is the daemon (its receiver and store share the cores in ``rtxops run``)
and sending the request. The figure per layer is the median over blocks of on ÷ the mean of
the off blocks on either side. JSON on stdout (``--out`` writes it too).
"""
from __future__ import annotations

import statistics

from _gpt import block_options, emit, paired_ratios, stepper
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from rtxops.runtime import patching
from rtxops.telemetry.encode import encode
from rtxops.telemetry.job import start_job_telemetry

LAYERS = ("runtime", "recorder", "telemetry")


class _Drop(SpanExporter):
    def export(self, spans):
        encode(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def layer_cost(steps, layer: str, pairs: int, block: int, skip: int) -> dict:
    blocks: dict[str, list[float]] = {"off": [], "on": []}
    threads: list = []
    for i in range(2 * pairs + 1):  # off first and last
        on = i % 2 == 1
        telemetry = None
        if on:
            d = patching.enable()
            if layer != "runtime":
                telemetry = start_job_telemetry(d, _Drop())
                threads.append(telemetry.thread)
                if layer == "recorder":
                    telemetry.thread._build = lambda rec, extra: 0
        try:
            blocks["on" if on else "off"].append(statistics.median(steps(block)[skip:]))
        finally:
            if on:
                patching.disable()
                if telemetry is not None:
                    telemetry.close()
    ratios = paired_ratios(blocks, "off", "on")
    cpu = [t.cpu_s / t.steps_built for t in threads if t.steps_built]
    return {"overhead": round(statistics.median(ratios) - 1, 4),
            "export_thread_cpu_ms_per_step": round(statistics.median(cpu) * 1e3, 3) if cpu else None,
            "block_ms": {k: [round(v * 1e3, 2) for v in vs] for k, vs in blocks.items()},
            "block_ratios": [round(r, 4) for r in ratios]}


def main() -> None:
    a = block_options(__doc__, block=45, skip=5)
    steps = stepper()
    steps(30)  # warm-up
    emit("step_overhead_inprocess",
         "one process, the runtime switched on and off every block at a step boundary", a,
         {"routed_calls_per_step": routed_calls_per_step(steps),
          "layers": {layer: layer_cost(steps, layer, a.pairs, a.block, a.skip) for layer in LAYERS},
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
