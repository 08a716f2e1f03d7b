"""Capture the Python stacks of a hung job's processes.

py-spy (``py-spy dump``) when it is installed; otherwise SIGUSR1 to each process that handles it (the
runtime bootstrap registers ``faulthandler`` on SIGUSR1), whose dump lands in the job's stderr log. A
process that does not handle SIGUSR1 is left alone: the default action of SIGUSR1 is to terminate.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from .proctree import Proc

DUMP_TIMEOUT_S = 10.0


def py_spy_path() -> str | None:
    """The py-spy executable on PATH or next to this interpreter, if any."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def handles_signal(pid: int, signum: int) -> bool:
    """Whether ``pid`` has a handler installed for ``signum`` (``SigCgt`` in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


@dataclass
class Stacks:
    """The stacks captured, by pid, and what went wrong per pid."""

    method: str
    stacks: dict[int, str] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"method": self.method, "stacks": {str(k): v for k, v in self.stacks.items()},
                "errors": {str(k): v for k, v in self.errors.items()}}


def capture(procs: Iterable[Proc], *, py_spy: str | None = None, settle_s: float = 0.5) -> Stacks:
    """Dump the stacks of ``procs``. Never raises for a process that cannot be dumped."""
    procs = sorted(procs, key=lambda p: p.pid)
    tool = py_spy if py_spy is not None else py_spy_path()
    if tool:
        out = Stacks("py-spy")
        for p in procs:
            try:
                r = subprocess.run([tool, "dump", "--pid", str(p.pid)], capture_output=True, text=True,
                                   timeout=DUMP_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError) as e:
                out.errors[p.pid] = f"{type(e).__name__}: {e}"
                continue
            if r.returncode == 0:
                out.stacks[p.pid] = r.stdout
            else:
                out.errors[p.pid] = (r.stderr or r.stdout).strip()[-2000:]
        return out
    out = Stacks("faulthandler")
    sent = False
    for p in procs:
        if not handles_signal(p.pid, signal.SIGUSR1):
            out.errors[p.pid] = "no SIGUSR1 handler (faulthandler not registered); not dumped"
            continue
        try:
            os.kill(p.pid, signal.SIGUSR1)
            out.stacks[p.pid] = "dumped to the job's stderr log (faulthandler)"
            sent = True
        except OSError as e:
            out.errors[p.pid] = f"{type(e).__name__}: {e}"
    if sent:
        time.sleep(settle_s)
    return out
