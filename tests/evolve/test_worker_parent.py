"""A gate or benchmark worker goes when the process that started it does: a daemon killed -9
left its workers (and whatever their kernels started) running beside the next jobs."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

CHILD = ("import os, time; from rtxops.evolve.worker import exit_with_parent; "
         "exit_with_parent(os.getppid(), every_s=0.05); print('ready', flush=True); time.sleep(600)")
PARENT = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_dies_with_the_process_that_started_it():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert _alive(child)
        time.sleep(0.3)
        assert _alive(child)  # the parent is there: the worker works on
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the worker outlived the process that started it"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
        parent.kill()
