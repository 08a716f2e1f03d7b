"""Waits a test makes on threads it starts, each with a bound: a wedged thread fails the test
with its name instead of holding the whole run (and CI with it) until something kills it."""
from __future__ import annotations

import os
import select
import signal
import threading
import time

import uvicorn


def joined(thread: threading.Thread, timeout: float = 120) -> None:
    """Join ``thread``; fail if it is still running after ``timeout`` seconds."""
    thread.join(timeout)
    assert not thread.is_alive(), f"thread {thread.name!r} still running after {timeout} s"


def serving(server: uvicorn.Server, what: str, timeout: float = 10, **run_kwargs) -> threading.Thread:
    """Run ``server`` on a daemon thread and return once it accepts connections; raise if it
    dies or does not start within ``timeout`` seconds (a bind error ends the thread at once)."""
    thread = threading.Thread(target=server.run, kwargs=run_kwargs, daemon=True, name=what)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True   # (one still starting stops when it can)
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.01)
    return thread


def reaped(pid: int, timeout: float = 10) -> None:
    """Wait for the forked child ``pid``; kill it if it has not exited within ``timeout`` s (a
    child forked from a threaded process can inherit a lock held for good)."""
    deadline = time.monotonic() + timeout
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(0.01)


def read_all(fd: int, timeout: float = 60) -> bytes:
    """All a pipe's writer sends until it closes; fail if that takes over ``timeout`` s."""
    deadline, chunks = time.monotonic() + timeout, []
    while True:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"the pipe's writer did not finish in {timeout} s"
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
