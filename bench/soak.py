"""Soak: a real daemon with a looping training job and a steady OTLP load.

Reports the daemon's RSS over time (growth after warm-up), spans acknowledged vs stored, the DB
size and job restarts. Prints JSON (``--out`` writes it). ``--minutes`` defaults to 60.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from _daemon import start_daemon
from _report import report

from rtxops.telemetry.synthetic import numbered, otlp_request

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--minutes", type=float, default=60)
    p.add_argument("--rate", type=int, default=5000, help="synthetic spans per second")
    p.add_argument("--batch", type=int, default=500, help="spans per OTLP request")
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--out")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rtxops-soak-"))
    home = tmp / "home"
    proc, url, token = start_daemon(home, log=home.parent / "daemon.log")
    try:
        run(a, home, proc, url, token)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)   # a 60-minute soak leaves ~650 MB


def run(a, home: Path, proc: subprocess.Popen, url: str, token: str) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    daemon = psutil.Process(proc.pid)
    job = httpx.post(url + "/v1/jobs", headers=headers, json={
        "name": "soak-gpt", "restarts": 1000, "backoff_s": 0,
        "command": [sys.executable, str(ROOT / "examples/train_gpt.py"), "--steps", "200"],
        "cwd": str(ROOT)}).json()
    # the job exits 0 after 200 steps; resubmitting keeps a job running for the whole soak
    stop = threading.Event()
    sent = {"acked": 0, "refused": 0, "errors": 0}
    bodies = [otlp_request(a.batch, seed=i, job_id="soak-load").SerializeToString() for i in range(8)]

    def load() -> None:
        client = httpx.Client(base_url=url, headers={**headers, "Content-Type": "application/x-protobuf"})
        interval = a.batch / a.rate
        i = 0
        next_at = time.monotonic()
        while not stop.is_set():
            try:
                r = client.post("/v1/traces", content=numbered(bodies[i % len(bodies)], i), timeout=30)
                key = "acked" if r.status_code == 200 else "refused"
                sent[key] += a.batch if key == "acked" else 1
            except httpx.HTTPError:
                sent["errors"] += 1
            i += 1
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    samples = []
    jobs_run = 1
    died = None   # what the soak exists to catch: reported, with every sample before it
    end = time.monotonic() + a.minutes * 60
    t0 = time.monotonic()
    while time.monotonic() < end:
        time.sleep(a.sample_s)
        try:
            state = httpx.get(f"{url}/v1/jobs/{job['id']}", timeout=30).json()["state"]
            if state in ("succeeded", "failed", "cancelled", "lost"):
                job = httpx.post(url + "/v1/jobs", headers=headers, timeout=30, json={
                    "name": "soak-gpt", "command": [sys.executable, str(ROOT / "examples/train_gpt.py"),
                                                    "--steps", "200"], "cwd": str(ROOT)}).json()
                jobs_run += 1
            samples.append({"t_s": round(time.monotonic() - t0, 1),
                            "rss_bytes": daemon.memory_info().rss,
                            "db_bytes": (home / "rtxops.duckdb").stat().st_size})
        except (httpx.HTTPError, psutil.Error, OSError, KeyError, ValueError) as e:
            died = {"at_s": round(time.monotonic() - t0, 1), "error": f"{type(e).__name__}: {e}",
                    "daemon_exit_code": proc.poll()}
            break
    stop.set()
    loader.join(60)
    jobs, stats, code = [], {}, proc.poll()
    if died is None:
        try:
            jobs = httpx.get(url + "/v1/jobs", timeout=30).json()["jobs"]
            stats = httpx.get(url + "/v1/telemetry/stats", timeout=30).json()
        except httpx.HTTPError as e:
            died = {"at_s": round(time.monotonic() - t0, 1), "error": f"{type(e).__name__}: {e}"}
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(120)
        except subprocess.TimeoutExpired:
            code = "did not stop within 120 s of SIGTERM"
    warm = samples[len(samples) // 4:] or samples or [{"rss_bytes": 0}]
    rss_start = statistics.median(s["rss_bytes"] for s in warm[:3])
    rss_end = statistics.median(s["rss_bytes"] for s in warm[-3:])
    load_stored = _stored_for(home, "soak-load")
    out = {
        "bench": "soak", "minutes": a.minutes, "rate_spans_s": a.rate,
        "daemon_died": died,
        "rss_growth_after_warmup": rss_end / rss_start - 1 if rss_start else None,
        "rss_bytes": {"after_warmup": rss_start, "end": rss_end,
                      "max": max((s["rss_bytes"] for s in samples), default=0)},
        "load_spans_acked": sent["acked"], "load_spans_stored": load_stored,
        "acked_missing": sent["acked"] - load_stored,
        "requests_refused": sent["refused"], "request_errors": sent["errors"],
        "jobs_run": jobs_run,
        "job_restarts": sum(j["crash_restarts"] + j["hang_restarts"] for j in jobs) if jobs else None,
        "db_bytes": (home / "rtxops.duckdb").stat().st_size,
        "daemon_stats": stats, "daemon_exit_code": code,
        "samples": samples,
        "targets": {"rss_growth_max": 0.10, "acked_missing": 0},
    }
    report(out, a.out)


def _stored_for(home: Path, job_id: str) -> int:
    from rtxops.telemetry.store import ReadOnlyStore

    s = ReadOnlyStore(home / "rtxops.duckdb")
    try:
        return s.query("SELECT count(*) AS n FROM spans WHERE job_id = $job", {"job": job_id})[0]["n"]
    finally:
        s.close()


if __name__ == "__main__":
    main()
