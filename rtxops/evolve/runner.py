"""Run :mod:`rtxops.evolve.worker` in a child process and collect its results."""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Callable


class WorkerError(RuntimeError):
    """The worker process failed, hung, or answered something unreadable. ``timed_out``: it was
    killed for running past its time (a busy machine, a slow compile: no verdict on what ran).
    ``results``: the result lines it sent before it failed (whole items, each ended)."""

    def __init__(self, message: str, timed_out: bool = False, results: list | None = None) -> None:
        super().__init__(message)
        self.timed_out = timed_out
        self.results = list(results or [])


# glibc's allocator moves its mmap threshold as blocks are freed, so whether a kernel's outputs
# come from fresh (page-faulting) mappings or reused heap depends on what ran before: on CPU the
# same arm then measured 1× or 2× from one worker to the next. The worker fixes it (as large as
# glibc allows, and freed memory is kept) unless the environment tunes malloc itself: then none
# of these is added (one of them alone would undo the user's setting).
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
                 "MALLOC_TOP_PAD_": str(64 << 20)}


def worker_environment(environ: dict[str, str]) -> dict[str, str]:
    """The worker's environment: ``environ``, rtxops itself off, malloc held steady."""
    own_malloc = (any(k.startswith("MALLOC_") and k.endswith("_") for k in environ)
                  or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""))
    return {**({} if own_malloc else STEADY_MALLOC), **environ, "RTXOPS_ENABLE": "0"}


def run_worker(request: dict, timeout_s: float = 600.0,
               on_progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """Send ``request`` to a fresh worker; return its result lines in order. A worker that runs
    past ``timeout_s`` is killed; a crash raises :class:`WorkerError` with its stderr tail."""
    # stderr goes to a file: a chatty kernel (compiler logs, warnings) must not fill a pipe
    # nobody drains and block the worker
    stderr = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-m", "rtxops.evolve.worker"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env=worker_environment(dict(os.environ)),
                            start_new_session=True)  # its group: whatever a kernel starts too

    def kill_group() -> None:
        # a process a kernel started holds stdout open: killing the worker alone would leave the
        # read below waiting on it (and it running)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    expired = threading.Event()

    def time_is_up() -> None:
        expired.set()
        kill_group()

    timer = threading.Timer(timeout_s, time_is_up)
    timer.start()
    results: list[dict] = []
    try:
        proc.stdin.write(json.dumps(request))
        proc.stdin.close()
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # (the worker sends kernels' output to stderr; whatever else came)
            if not isinstance(event, dict):
                continue
            if event.get("event") == "result":
                results.append(event)
            elif event.get("event") == "progress" and on_progress:
                on_progress(int(event["done"]), int(event["total"]))
            elif event.get("event") == "error":
                raise WorkerError(event.get("error", "worker error"), results=results)
        code = proc.wait()
    finally:
        timer.cancel()
        kill_group()  # the worker if it still runs, and anything left of its group
        proc.wait()
    stderr.seek(0)
    tail = stderr.read()[-2000:]
    stderr.close()
    if code != 0:
        reason = ("timed out" if expired.is_set() else "was killed" if code in (-9, 137)
                  else f"exited with {code}")
        raise WorkerError(f"evolve worker {reason}: {tail.strip()}", timed_out=expired.is_set(),
                          results=results)
    return results


_workers = itertools.count()


def run_isolating(request: dict, key: str, timeout_s: float = 600.0,
                  on_progress: Callable[[int, int], None] | None = None) -> list[dict | WorkerError]:
    """One result per element of ``request[key]``, in order: one worker runs them all; when it
    dies, each element it had not answered yet runs in a worker of its own, so only the element
    that kills the process fails and none is measured twice (an answer sent before the worker
    died stands, batch or alone). A failed element's entry is the :class:`WorkerError`. Each
    result carries ``worker``, a number that is the same for results of one worker process
    (benchmarks are comparable within one: processes differ by more than kernels do)."""
    items = request[key]
    worker = next(_workers)
    try:
        by_index = {r["index"]: {**r, "worker": worker}
                    for r in run_worker(request, timeout_s, on_progress)}
    except WorkerError as e:
        by_index = {r["index"]: {**r, "worker": worker} for r in e.results}
        if len(items) == 1:
            return [by_index.get(0, e)]
        for i, item in enumerate(items):
            if i not in by_index:
                by_index[i] = run_isolating({**request, key: [item]}, key, timeout_s, on_progress)[0]
    return [by_index.get(i, WorkerError("the worker gave no result")) for i in range(len(items))]
