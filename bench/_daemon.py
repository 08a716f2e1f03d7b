"""A real rtxops daemon for a bench: its own process, any free port, a given home."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


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
