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
# HANG_EXIT_S, faulthandler's own thread dumps every thread's stack to a file and ends the worker
# (xdist names the test it crashed in); the run prints the dumps at its end instead of hanging.
HANG_EXIT_S = 420
_HANG_DIR = "TESTS_HANG_DUMP_DIR"   # (shared with the xdist workers through their environment)


def pytest_configure(config):
    if not hasattr(config, "workerinput") and _HANG_DIR not in os.environ:   # the controller
        import tempfile

        os.environ[_HANG_DIR] = tempfile.mkdtemp(prefix="rtxops-test-hangs-")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import faulthandler

    dump = _hang_file()
    dump.seek(0)
    dump.truncate()
    dump.write(f"{item.nodeid} ran over {HANG_EXIT_S} s; the stacks when it was ended:\n")
    dump.flush()
    faulthandler.dump_traceback_later(HANG_EXIT_S, exit=True, file=dump)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        dump.seek(0)
        dump.truncate()


_dump = None


def _hang_file():
    global _dump
    if _dump is None:
        _dump = open(os.path.join(os.environ[_HANG_DIR], f"{os.getpid()}.txt"), "w+")
    return _dump


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"):
        return
    import pathlib
    import shutil

    folder = pathlib.Path(os.environ[_HANG_DIR])
    for path in sorted(folder.glob("*.txt")):
        text = path.read_text(errors="replace")
        if text.strip():
            terminalreporter.section("hung test (faulthandler)", sep="!")
            terminalreporter.write(text)
    shutil.rmtree(folder, ignore_errors=True)
