"""CPU cost of the job's telemetry export thread per training step: building a step's spans and
encoding them as an OTLP request, the SDK way (tracer.start_span/end, the OTLP exporters' encoder)
vs rtxops' (``rtxops_spans``: ReadableSpans made directly, cached attribute bytes; ``rtxops``: the
kernel spans written straight to bytes in C, as a job does once its exporter takes bytes). Same
spans, same bytes. Thread CPU time, so a busy machine moves it less than wall time. Prints JSON
(and writes it with ``--out``).
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from array import array
from time import perf_counter_ns

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from _report import report
from rtxops.runtime.readings import Slot
from rtxops.telemetry.encode import encode, merge
from rtxops.telemetry.exporters import StepProcessor
from rtxops.telemetry.recorder import StepRecord
from rtxops.telemetry.resource import job_resource_attributes
from rtxops.telemetry.spans import CallSampling, SpanBuilder


def records(steps: int, slots: int, calls: int, seed: int = 0) -> list[StepRecord]:
    rnd = random.Random(seed)
    out = []
    for step in range(steps):
        t = perf_counter_ns()
        flat = array("q")
        for i in range(calls):
            flat.extend([i % slots, t + i * 1000, rnd.randrange(1000, 100_000)])
        out.append(StepRecord(step, t, t + 24_000_000, 1, 1 << 30, flat,
                              [(i % slots, t, 5000) for i in range(0, calls, 8)]))
    return out


def measure(direct: bool, fast_encode: bool, recs: list[StepRecord], slots: list[Slot],
            kernel_bytes: bool = False) -> dict:
    provider = TracerProvider(resource=Resource.create(job_resource_attributes()))
    processor = StepProcessor()
    processor.accepts_encoded = kernel_bytes
    provider.add_span_processor(processor)
    builder = SpanBuilder(provider.get_tracer("rtxops"), slots, lambda rec: {}, CallSampling(),
                          encoded_to=processor)
    builder._direct = direct
    cpu_build = cpu_encode = 0.0
    spans = 0
    for rec in recs:
        t = time.thread_time()
        spans += builder.build(rec, {})
        cpu_build += time.thread_time() - t
        made = processor.drain()
        t = time.thread_time()
        body = encode(made) if fast_encode else encode_spans(made).SerializeToString()
        # the kernel spans the builder wrote as bytes, as a request merged with the step's
        body = merge([body], [(e.resource, e.scope, e.span_fields)
                              for e in processor.drain_encoded()])
        cpu_encode += time.thread_time() - t
        assert body
    n = len(recs)
    return {"build_ms_per_step": round(cpu_build / n * 1e3, 3),
            "encode_ms_per_step": round(cpu_encode / n * 1e3, 3),
            "total_ms_per_step": round((cpu_build + cpu_encode) / n * 1e3, 3),
            "us_per_span": round((cpu_build + cpu_encode) / spans * 1e6, 1), "spans_per_step": spans / n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--slots", type=int, default=20, help="kernel slots (op × variant × bucket × site)")
    p.add_argument("--calls", type=int, default=200, help="dispatched calls per step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    a = p.parse_args()
    slots = [Slot(i, ("linear", "rms_norm", "softmax", "gelu")[i % 4], "eager", "{}",
                  f"float32/cpu/hidden=128,rows={2 ** (i % 5 + 6)}", f"F.site{i}", "eager")
             for i in range(a.slots)]
    recs = records(a.steps, a.slots, a.calls)
    # rtxops: kernel spans written as bytes (the job's path once its exporter takes bytes);
    # rtxops_spans: every span a ReadableSpan, encoded by rtxops' encoder
    runs: dict[str, list[dict]] = {"sdk": [], "rtxops_spans": [], "rtxops": []}
    for _ in range(a.repeats):
        runs["sdk"].append(measure(False, False, recs, slots))
        runs["rtxops_spans"].append(measure(True, True, recs, slots))
        runs["rtxops"].append(measure(True, True, recs, slots, kernel_bytes=True))
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    out = {"bench": "export_cost", "python": platform.python_version(), "cpus": os.cpu_count(),
           "load_average": os.getloadavg(), "steps": a.steps, "slots": a.slots,
           "calls_per_step": a.calls, "median": med,
           "ratio": round(med["sdk"]["total_ms_per_step"] / med["rtxops"]["total_ms_per_step"], 2)}
    report(out, a.out)


if __name__ == "__main__":
    main()
