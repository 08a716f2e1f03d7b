"""Capture the Python stacks of a hung job's processes.

py-spy (``py-spy dump``) when it is installed; for each process it could not dump (or without it),
SIGUSR1 when the process handles it (``faulthandler.register(SIGUSR1)``), whose dump lands in the job's
stderr log. A process without a SIGUSR1 handler is left alone: SIGUSR1's default action terminates.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

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


def capture(procs: Iterable[Proc], *, use_py_spy: bool = True, settle_s: float = 0.5) -> Stacks:
    """Dump the stacks of ``procs``: py-spy first, faulthandler for what py-spy could not dump. Never
    raises for a process that cannot be dumped."""
    procs = sorted(procs, key=lambda p: p.pid)
    tool = py_spy_path() if use_py_spy else None
    out = Stacks("py-spy" if tool else "faulthandler")
    if tool:
        for p in procs:
            try:
                r = subprocess.run([tool, "dump", "--pid", str(p.pid)], capture_output=True, text=True,
                                   timeout=DUMP_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError) as e:
                out.errors[p.pid] = f"py-spy: {type(e).__name__}: {e}"
                continue
            if r.returncode == 0:
                out.stacks[p.pid] = r.stdout
            else:
                out.errors[p.pid] = "py-spy: " + (r.stderr or r.stdout).strip()[-2000:]
    sent = False
    for p in procs:
        if p.pid in out.stacks:
            continue
        if not handles_signal(p.pid, signal.SIGUSR1):
            out.errors[p.pid] = "; ".join(filter(None, (
                out.errors.get(p.pid), "no SIGUSR1 handler (faulthandler not registered); not signalled")))
            continue
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except OSError as e:
            out.errors[p.pid] = f"SIGUSR1: {type(e).__name__}: {e}"
            continue
        out.stacks[p.pid] = "dumped to the job's stderr log (faulthandler, SIGUSR1)"
        out.errors.pop(p.pid, None)
        sent = True
    if sent:
        time.sleep(settle_s)
    return out
