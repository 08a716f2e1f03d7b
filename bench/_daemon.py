"""A real rtxops daemon for a bench: its own process, any free port, a given home; its CPU time;
an exporter that outlives the job telemetry sending through it."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from opentelemetry.sdk.trace.export import SpanExporter


def start_daemon(home: Path, env: dict | None = None, log: Path | None = None,
                 timeout_s: float = 120) -> tuple[subprocess.Popen, str, str]:
    """Start ``rtxops daemon`` on ``home``; once it answers /readyz: (process, URL, token)."""
    with open(log or os.devnull, "wb") as stderr:  # the child keeps its own copy
        proc = subprocess.Popen([sys.executable, "-m", "rtxops.cli", "daemon", "--port", "0",
                                 "--home", str(home)], stdout=subprocess.DEVNULL, stderr=stderr,
                                env={**os.environ, **(env or {})}, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if (home / "daemon.pid").read_text().strip() == str(proc.pid):
                url = (home / "daemon.url").read_text().strip()
                if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                    return proc, url, (home / "token").read_text().strip()
        except (OSError, httpx.HTTPError):
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the daemon did not come up")


@contextlib.contextmanager
def running_daemon(home: Path, env: dict | None = None, log: Path | None = None):
    """:func:`start_daemon`, stopped on the way out (SIGTERM, then SIGKILL after 60 s)."""
    proc, url, token = start_daemon(home, env, log)
    try:
        yield proc, url, token
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_s(pid: int) -> float:
    """The process's CPU seconds so far (user and system)."""
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


class KeepOpen(SpanExporter):
    """``exporter`` for one block (or part) of a bench: its shutdown leaves it open for the next."""

    def __init__(self, exporter: SpanExporter) -> None:
        self.exporter = exporter

    def export(self, spans):
        return self.exporter.export(spans)

    def encode_request(self, spans):
        return self.exporter.encode_request(spans)

    def export_encoded(self, body, spans):
        return self.exporter.export_encoded(body, spans)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)

    def shutdown(self) -> None:
        pass
