"""Helpers for tests against a real daemon process: start it (``rtxops daemon --port 0 --home H``),
talk to it over HTTP, stop or kill it, and find every process a test left behind.

Every process a test starts (the daemon, and through it the jobs) carries ``MARK=<uuid>`` in its
environment, so a fixture can find and kill them all afterwards, whatever session they moved to.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Callable

import httpx

from rtxops.daemon import proctree
from rtxops.telemetry import synthetic

PY = sys.executable
RTXOPS = [PY, "-m", "rtxops.cli"]
MARK = "RTXOPS_TEST_MARK"
TERMINAL = {"succeeded", "failed", "cancelled", "lost"}


def until(predicate: Callable, timeout: float = 30.0, every: float = 0.05, what: str = ""):
    """The first truthy value of ``predicate()``; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(every)


def script(directory: Path, name: str, body: str) -> str:
    path = directory / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def clean_env(mark: str, **extra: str) -> dict[str, str]:
    """This process's environment without any RTXOPS_/OTEL_ setting, plus the test's mark. The
    evolve loop is off unless a test turns it on (it would publish plans the test does not expect)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RTXOPS_", "OTEL_"))}
    env.update({MARK: mark, "COLUMNS": "250", "PYTHONUNBUFFERED": "1", "PYTHONIOENCODING": "utf-8",
                "RTXOPS_EVOLVE": "0"}, **extra)
    return env


def marked(mark: str) -> list[int]:
    """Live processes whose environment carries ``mark``."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for p in proctree.scan().values():
        if not p.alive or p.pid == os.getpid():
            continue
        try:
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(p.pid)
        except OSError:
            pass
    return found


def gone(pid: int) -> bool:
    p = proctree.read_proc(pid)
    return p is None or not p.alive


class LiveDaemon:
    """One ``rtxops daemon`` process serving ``home``."""

    def __init__(self, home: Path, mark: str, log: Path, args: tuple[str, ...] = ()) -> None:
        self.home, self.mark, self.log_path, self.args = home, mark, log, args
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.token = ""
        self._clients: dict[tuple, httpx.Client] = {}

    # ---- process ----
    def start(self, timeout: float = 60.0) -> LiveDaemon:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*RTXOPS, "daemon", "--port", "0", "--home", str(self.home), *self.args], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, env=clean_env(self.mark),
                cwd=self.home.parent, start_new_session=True)
        pid_file, url_file = self.home / "daemon.pid", self.home / "daemon.url"

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"the daemon exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if pid_file.read_text().strip() != str(self.proc.pid):
                    return False
                self.url = url_file.read_text().strip()
            except OSError:
                return False
            try:
                return httpx.get(self.url + "/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        until(ready, timeout, what="the daemon to serve")
        self.token = (self.home / "token").read_text().strip()
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM; wait for the exit; the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill9(self) -> None:
        """SIGKILL the daemon alone (its jobs live in sessions of their own and survive it)."""
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        """Stop the daemon if it still runs: SIGTERM (it stops its jobs), SIGKILL if that hangs."""
        for c in self._clients.values():
            c.close()
        if self.running():
            try:
                self.terminate(30)
            except subprocess.TimeoutExpired:
                pass
        if self.running():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)

    # ---- HTTP ----
    def client(self, token: str | None = ...) -> httpx.Client:
        """A client for the daemon's API (one per token, kept until :meth:`close`); with the
        daemon's token unless ``token`` says otherwise (None: no Authorization header)."""
        token = self.token if token is ... else token
        key = (self.url, token)
        if key not in self._clients:
            headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
            self._clients[key] = httpx.Client(base_url=self.url, headers=headers, timeout=30.0)
        return self._clients[key]

    def submit(self, command: list[str], **spec) -> dict:
        r = self.client().post("/v1/jobs", json={"command": command, "grace_s": 5, **spec})
        assert r.status_code == 201, r.text
        return r.json()

    def job(self, job_id: str) -> dict:
        r = self.client().get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def wait(self, job_id: str, timeout: float = 60.0, states=TERMINAL) -> dict:
        return until(lambda: (j := self.job(job_id))["state"] in states and j, timeout,
                     what=f"job {job_id} to reach {sorted(states)}")

    def logs(self, job_id: str, **params) -> list[dict]:
        r = self.client().get(f"/v1/jobs/{job_id}/logs", params=params)
        assert r.status_code == 200, r.text
        return r.json()["lines"]

    def texts(self, job_id: str, stream: str | None = None) -> list[str]:
        return [ln["text"] for ln in self.logs(job_id, limit=10000)
                if stream is None or ln["stream"] == stream]

    def ingest(self, request, client: httpx.Client | None = None) -> httpx.Response:
        """POST one ExportTraceServiceRequest (protobuf) to /v1/traces."""
        return (client or self.client()).post(
            "/v1/traces", content=request.SerializeToString(),
            headers={"Content-Type": "application/x-protobuf"})


def otlp_batch(n_spans: int, seed: int, job_id: str):
    """A synthetic OTLP request and the hex span ids it carries."""
    request = synthetic.otlp_request(n_spans, seed=seed, job_id=job_id)
    ids = {s.span_id.hex() for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans}
    return request, ids


def cli(*args: str, mark: str, timeout: float = 60.0, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``rtxops ARGS`` as a user would."""
    return subprocess.run([*RTXOPS, *args], capture_output=True, text=True, timeout=timeout,
                          env=clean_env(mark), cwd=cwd, stdin=subprocess.DEVNULL)


class Daemons:
    """Starts daemons for a test and cleans up after it: every daemon killed, every marked process
    (the jobs, which live in sessions of their own) killed and reported."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.mark = uuid.uuid4().hex
        self.started: list[LiveDaemon] = []

    def start(self, home: Path | None = None, args: tuple[str, ...] = ()) -> LiveDaemon:
        home = home or self.tmp_path / "home"
        d = LiveDaemon(home, self.mark, self.tmp_path / f"daemon-{len(self.started)}.log", args)
        self.started.append(d)
        return d.start()

    def cleanup(self) -> list[int]:
        """Kill what is left; the pids of job processes that outlived the test (should be none)."""
        for d in self.started:
            d.close()
        leftovers = marked(self.mark)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return leftovers
