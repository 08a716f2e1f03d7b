"""The daemon's CPU per OTLP request of a job's spans, by request size (issue #3).

A job exports every ``RTXOPS_EXPORT_INTERVAL_S`` seconds; what one request costs the daemon
(HTTP, decoding, the DuckDB transaction) splits into a part per request and a part per span, and
the interval trades the first against telemetry latency. Requests of 1, 10 and 75 steps of a job's
spans (the span builder's, ~30 a step, encoded as the job encodes them) go to a real
``rtxops daemon`` process one after another, a gap between them; the daemon's process CPU time
(all threads, less its idle rate) per request, and a least-squares line through the sizes: CPU =
fixed + per_span × spans. JSON on stdout (``--out`` writes it too).
"""
from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import httpx
from _daemon import cpu_s, running_daemon
from _report import report
from export_cost import records
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from rtxops.runtime.readings import Slot
from rtxops.telemetry.encode import encode
from rtxops.telemetry.exporters import StepProcessor
from rtxops.telemetry.resource import job_resource_attributes
from rtxops.telemetry.spans import CallSampling, SpanBuilder

SIZES = (1, 10, 75)  # steps per request: 75 is a 2-second export of a ~26 ms step


def request_bodies(steps_per_request: int, count: int, seed: int) -> tuple[list[bytes], int]:
    """``count`` OTLP request bodies of ``steps_per_request`` steps each, and spans per body."""
    slots = [Slot(i, ("linear", "rms_norm", "softmax", "gelu")[i % 4], "eager", "{}",
                  f"float32/cpu/hidden=128,rows={2 ** (i % 5 + 6)}", f"F.site{i}", "eager")
             for i in range(20)]
    provider = TracerProvider(resource=Resource.create(job_resource_attributes()))
    processor = StepProcessor()
    provider.add_span_processor(processor)
    builder = SpanBuilder(provider.get_tracer("rtxops"), slots, lambda rec: {}, CallSampling())
    recs = records(steps_per_request * count, 20, 54, seed)
    bodies, spans = [], 0
    for i in range(count):
        for rec in recs[i * steps_per_request:(i + 1) * steps_per_request]:
            builder.build(rec, {})
        made = processor.drain()
        spans = len(made)
        bodies.append(encode(made))
    return bodies, spans


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=20, help="requests per size")
    p.add_argument("--gap", type=float, default=0.2, help="seconds between requests")
    p.add_argument("--out")
    a = p.parse_args()
    sizes = {n: request_bodies(n, a.requests + 2, seed=n) for n in SIZES}
    with tempfile.TemporaryDirectory(prefix="rtxops-reqcost-") as tmp, \
            running_daemon(Path(tmp) / "home", env={"RTXOPS_EVOLVE": "0"}) as (proc, url, token):
        def cpu() -> float:
            return cpu_s(proc.pid)

        client = httpx.Client(headers={"Authorization": f"Bearer {token}",
                                       "Content-Type": "application/x-protobuf"}, timeout=60)
        time.sleep(2)
        c0, w0 = cpu(), time.monotonic()
        time.sleep(5)
        idle_per_s = (cpu() - c0) / (time.monotonic() - w0)
        rows = []
        for steps, (bodies, spans) in sizes.items():
            for body in bodies[:2]:  # warm: the first requests store the resource and span keys
                client.post(url + "/v1/traces", content=body).raise_for_status()
            time.sleep(1)
            c0, w0 = cpu(), time.monotonic()
            for body in bodies[2:]:
                client.post(url + "/v1/traces", content=body).raise_for_status()
                time.sleep(a.gap)
            time.sleep(1)
            used = cpu() - c0 - idle_per_s * (time.monotonic() - w0)
            rows.append({"steps_per_request": steps, "spans_per_request": spans,
                         "bytes_per_request": len(bodies[2]),
                         "daemon_cpu_ms_per_request": round(used / a.requests * 1e3, 2)})
        client.close()
    xs = [r["spans_per_request"] for r in rows]
    ys = [r["daemon_cpu_ms_per_request"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    out = {"bench": "daemon_request_cost", "python": platform.python_version(),
           "cpus": os.cpu_count(), "load_average": os.getloadavg(), "requests_per_size": a.requests,
           "idle_cpu_ms_per_s": round(idle_per_s * 1e3, 2), "sizes": rows,
           "fit": {"fixed_ms_per_request": round(my - slope * mx, 2),
                   "us_per_span": round(slope * 1e3, 2)}}
    report(out, a.out)


if __name__ == "__main__":
    main()
