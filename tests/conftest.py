from __future__ import annotations

import os

# One OpenMP thread per process (the test processes and every job they start inherit it): the
# suite runs two workers that each start training jobs, and on a 2-core machine OpenMP threads
# spinning at barriers against each other made 12 ms steps take 900 ms. Set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from rtxops.runtime import patching

# in-process daemons (``rtxops run`` without a daemon) run no evolve loop unless a test asks
os.environ.setdefault("RTXOPS_EVOLVE", "0")


@pytest.fixture(autouse=True)
def _runtime_off_and_seeded():
    """Every test starts and ends with torch unpatched and a fixed seed."""
    patching.disable()
    torch.manual_seed(0)
    yield
    patching.disable()


# ---- a test hung where no Python runs (a C call holding the GIL) --------------------------------
# pytest-timeout's signal (timeout = 300 in pyproject) needs the main thread to run Python. Past
# HANG_EXIT_S, faulthandler's own thread dumps every thread's stack and ends the process: an
# xdist worker (xdist names the test it crashed in) writes them to a file the run prints at its
# end; a run without workers writes them to its stderr.
HANG_EXIT_S = float(os.environ.get("TESTS_HANG_EXIT_S", 420))   # (lower to try this out)
# xdist gives a crashed worker's unfinished tests back to its queue, but once the other workers
# are done it may hand them to no one: the run then waits for good (seen after a hang). Past
# STALL_EXIT_S with no test reported, the controller prints the hung tests' stacks and ends.
STALL_EXIT_S = HANG_EXIT_S + 180
_HANG_DIR = "TESTS_HANG_DUMP_DIR"   # (shared with the xdist workers through their environment)
_hangs = {"stderr": None, "file": None, "made": None, "reported": 0.0, "done": None}


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        return
    import tempfile

    # stderr as it is before pytest captures it, for a run without workers
    _hangs["stderr"] = os.fdopen(os.dup(2), "w")
    if getattr(config.option, "numprocesses", None) and _HANG_DIR not in os.environ:   # xdist
        _hangs["made"] = os.environ[_HANG_DIR] = tempfile.mkdtemp(prefix="rtxops-test-hangs-")
        _watch_for_a_stall()


def _watch_for_a_stall() -> None:
    import threading
    import time

    _hangs["reported"], done = time.monotonic(), threading.Event()
    _hangs["done"] = done

    def watch():
        while not done.wait(10):
            quiet = time.monotonic() - _hangs["reported"]
            if quiet > STALL_EXIT_S:
                out = _hangs["stderr"]
                out.write(f"\n!!! no test reported for {quiet:.0f} s: the run is stuck (a worker "
                          "that crashed left tests no worker was given); ending it\n")
                out.write(_hung_stacks() or "(no worker's stacks were dumped)\n")
                out.flush()
                os._exit(3)

    threading.Thread(target=watch, name="tests-stall-watch", daemon=True).start()


def pytest_runtest_logreport(report):
    import time

    _hangs["reported"] = time.monotonic()


def pytest_unconfigure(config):
    if _hangs["done"] is not None:
        _hangs["done"].set()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import faulthandler

    worker = hasattr(item.config, "workerinput")
    dump = _worker_dump() if worker else _hangs["stderr"]
    if dump is None:
        yield
        return
    if worker:
        dump.write(f"{item.nodeid} ran over {HANG_EXIT_S:g} s; the stacks when it was ended:\n")
        dump.flush()
    faulthandler.dump_traceback_later(HANG_EXIT_S, exit=True, file=dump)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        if worker:   # it ended: nothing to tell
            dump.seek(0)
            dump.truncate()


def _worker_dump():
    """This xdist worker's dump file, empty between tests."""
    if _hangs["file"] is None and os.environ.get(_HANG_DIR):
        _hangs["file"] = open(os.path.join(os.environ[_HANG_DIR], f"{os.getpid()}.txt"), "w+")
    return _hangs["file"]


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput") or not os.environ.get(_HANG_DIR):
        return
    import shutil

    stacks = _hung_stacks(unlink=True)
    if stacks:
        terminalreporter.section("hung test (faulthandler)", sep="!")
        terminalreporter.write(stacks)
    if _hangs["made"]:
        shutil.rmtree(_hangs["made"], ignore_errors=True)


def _hung_stacks(unlink: bool = False) -> str:
    """What faulthandler dumped of the workers it ended (a worker that died otherwise left no
    stacks)."""
    import pathlib

    texts = []
    for path in sorted(pathlib.Path(os.environ[_HANG_DIR]).glob("*.txt")):
        text = path.read_text(errors="replace")
        if "most recent call first" in text:
            texts.append(text)
        if unlink:
            path.unlink()
    return "".join(texts)
