"""Dashboard API latency at volume, while ingest runs: fill a store with ``--spans`` rtxops-shaped
spans (default 10 M, as ``store_query.py`` does), start a real daemon on it (``rtxops daemon``,
its own process), keep posting OTLP batches to ``/v1/traces`` at ``--ingest-spans-per-s``, and
call every ``/api`` endpoint ``--runs`` times in turn. Reports p50/p95/max per endpoint and the
ingest rate achieved. Prints JSON (``--out`` writes it). Target: every endpoint p95 < 200 ms.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from _daemon import start_daemon
from _report import report

from rtxops.telemetry import synthetic
from rtxops.telemetry.store import Store

sys.path.insert(0, str(Path(__file__).parent))
from store_query import fill

TARGET_P95_MS = 200
BULK = {"trace_one_job_5_min"}   # a file download (up to 50 000 spans), reported, not targeted


def endpoints(job: str, op: str, bucket: str) -> dict[str, str]:
    """Every /api endpoint with the parameters its page sends (the default window, 15 min), and
    the heavier ones again over the last hour (``*_1h``: the whole synthetic hour)."""
    paths = {
        "jobs": "/api/jobs", "job": f"/api/jobs/{job}", "job_events": f"/api/jobs/{job}/events",
        "job_logs": f"/api/jobs/{job}/logs", "steps_all": "/api/steps",
        "steps_one_job": f"/api/steps?job={job}", "speedups": "/api/speedups", "ingest": "/api/ingest",
        "kernels_all": "/api/kernels", "kernels_one_job": f"/api/kernels?job={job}",
        "kernel_series_all": "/api/kernels/series",
        "kernel_series_op": f"/api/kernels/series?job={job}&op={op}",
        "kernel_series_bucket": f"/api/kernels/series?job={job}&op={op}&bucket={bucket}",
        "breakdown": f"/api/kernels/breakdown?job={job}", "evolve": "/api/evolve",
        "trials": "/api/evolve/trials", "decisions": "/api/evolve/decisions",
        "tuning": "/api/evolve/tuning", "memory_all": "/api/memory",
        "memory_one_job": f"/api/memory?job={job}", "caches_all": "/api/caches",
        "caches_one_job": f"/api/caches?job={job}", "governance": "/api/governance",
        "trace_one_job_5_min": f"/api/trace?job={job}&window_s=300",
    }
    for name in ("steps_all", "speedups", "ingest", "kernels_all", "kernel_series_all",
                 "evolve", "memory_all", "caches_all"):
        sep = "&" if "?" in paths[name] else "?"
        paths[f"{name}_1h"] = paths[name] + sep + "window_s=3600"
    return paths


class Ingest(threading.Thread):
    """Posts prepared OTLP requests at a steady span rate until stopped."""

    def __init__(self, url: str, token: str, spans_per_s: int, batch: int = 2000) -> None:
        super().__init__(daemon=True)
        self.url, self.token, self.rate, self.batch = url, token, spans_per_s, batch
        self.stop = threading.Event()
        self.sent = self.refused = self.errors = 0
        self.bodies = [synthetic.otlp_request(batch, seed=i, job_id="ingest-job",
                                              start_ns=time.time_ns()).SerializeToString()
                       for i in range(8)]

    def run(self) -> None:
        if self.rate <= 0:
            return
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/x-protobuf"}
        every = self.batch / self.rate
        with httpx.Client(base_url=self.url, headers=headers, timeout=60) as c:
            i, next_at = 0, time.monotonic()
            while not self.stop.is_set():
                try:
                    r = c.post("/v1/traces", content=synthetic.numbered(self.bodies[i % len(self.bodies)], i))
                    if r.status_code == 200:
                        self.sent += self.batch
                    else:
                        self.refused += 1
                except httpx.HTTPError:
                    self.errors += 1
                i += 1
                next_at += every
                self.stop.wait(max(0.0, next_at - time.monotonic()))


def timed(client: httpx.Client, path: str, runs: int) -> dict:
    r = client.get(path)                              # warm once, as a server would be
    r.raise_for_status()
    times, size = [], len(r.content)
    for _ in range(runs):
        t = time.perf_counter()
        r = client.get(path)
        times.append((time.perf_counter() - t) * 1000)
        r.raise_for_status()
    times.sort()
    return {"p50_ms": round(statistics.median(times), 1),
            # the nearest-rank p95 (of 20 runs: the 19th; int(0.95 n) took the slowest)
            "p95_ms": round(times[max(0, math.ceil(0.95 * len(times)) - 1)], 1),
            "max_ms": round(times[-1], 1), "runs": runs, "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spans", type=int, default=10_000_000)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--ingest-spans-per-s", type=int, default=5000)
    parser.add_argument("--home", help="keep the daemon's home here (default: a temporary directory)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rtxops-bench-") as tmp:
        home = Path(args.home or tmp)
        home.mkdir(parents=True, exist_ok=True)
        store = Store(home / "rtxops.duckdb")
        filled = fill(store, args.spans, time.time_ns())
        store.close()
        proc, url, token = start_daemon(home)
        ingest = Ingest(url, token, args.ingest_spans_per_s)
        try:
            with httpx.Client(base_url=url, timeout=120) as c:
                job = "job-1"
                kernel = c.get("/api/kernels", params={"job": job, "limit": 1}).json()["items"][0]
                paths = endpoints(job, kernel["op"], kernel["bucket"])
                ingest.start()
                started = time.monotonic()
                results = {name: timed(c, path, args.runs) for name, path in paths.items()}
                elapsed = time.monotonic() - started
        finally:
            ingest.stop.set()
            ingest.join(30)
            proc.terminate()
            proc.wait(60)
        default = {k: v for k, v in results.items() if not k.endswith("_1h") and k not in BULK}
        result = {
            "bench": "dashboard_api", "python": platform.python_version(), "cpus": os.cpu_count(),
            "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
            "spans": args.spans, "fill": filled, "target": {"p95_ms": TARGET_P95_MS},
            "ingest_during_calls": {"target_spans_per_s": args.ingest_spans_per_s,
                                    "spans_per_s": round(ingest.sent / elapsed),
                                    "refused_requests": ingest.refused, "errors": ingest.errors},
            "max_p95_ms_default_window": max(r["p95_ms"] for r in default.values()),
            "max_p95_ms_1h_window": max(r["p95_ms"] for k, r in results.items() if k not in BULK),
            "over_target": sorted(k for k, r in results.items()
                                  if r["p95_ms"] >= TARGET_P95_MS and k not in BULK),
            "endpoints": results,
        }
    report(result, args.out)


if __name__ == "__main__":
    main()
