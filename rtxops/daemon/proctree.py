"""Find and kill every process a job owns, from /proc (Linux).

A job owns the processes of its session (each attempt starts as a session leader), the processes that
carry its token in their initial environment (torchrun starts workers in sessions of their own), and
every descendant of those. The one escape left: a process that leaves the session, clears its
environment and is orphaned before it is seen.
"""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

TOKEN_VARIABLE = "RTXOPS_JOB_TOKEN"


@dataclass(frozen=True)
class Proc:
    """One line of /proc/PID/stat, the fields this module needs."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str
    start_ticks: int

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X")


def read_proc(pid: int) -> Proc | None:
    """The process ``pid``, or None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return Proc(pid, int(fields[1]), int(fields[2]), int(fields[3]), fields[0], int(fields[19]))


def scan() -> dict[int, Proc]:
    """Every process visible now."""
    procs: dict[int, Proc] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                p = read_proc(int(name))
            except (OSError, ValueError, IndexError):
                continue
            if p is not None:
                procs[p.pid] = p
    return procs


def carries_token(pid: int, token: str) -> bool:
    """Whether ``pid`` started with ``RTXOPS_JOB_TOKEN=token`` in its environment."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    return f"{TOKEN_VARIABLE}={token}".encode() in env.split(b"\0")


def members(sid: int | None, token: str | None, procs: dict[int, Proc] | None = None) -> dict[int, Proc]:
    """The live processes a job owns: its session, its token carriers, and their descendants."""
    procs = scan() if procs is None else procs
    never = {os.getpid(), 1}
    roots = {p.pid for p in procs.values()
             if p.pid not in never and p.alive
             and ((sid is not None and p.sid == sid) or (token is not None and carries_token(p.pid, token)))}
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    owned: set[int] = set()
    stack = list(roots)
    while stack:
        pid = stack.pop()
        if pid in owned or pid in never:
            continue
        owned.add(pid)
        stack.extend(children.get(pid, ()))
    return {pid: procs[pid] for pid in owned if procs[pid].alive}


def signal_procs(procs: Iterable[Proc], sig: int) -> list[int]:
    """Send ``sig`` to each process that is still the same process; the pids signalled."""
    sent = []
    for p in procs:
        now = read_proc(p.pid)
        if now is None or now.start_ticks != p.start_ticks or not now.alive:
            continue
        try:
            os.kill(p.pid, sig)
            sent.append(p.pid)
        except (ProcessLookupError, PermissionError):
            pass
    return sent


@dataclass
class Termination:
    """What :func:`terminate` did."""

    sigterm: list[int] = field(default_factory=list)
    sigkill: list[int] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)

    @property
    def signalled(self) -> bool:
        return bool(self.sigterm or self.sigkill)


def terminate(sid: int | None, token: str | None, grace_s: float, *, poll_s: float = 0.05,
              kill_wait_s: float = 5.0, reap=None) -> Termination:
    """SIGTERM every owned process (and ones that appear), wait up to ``grace_s`` for them to exit,
    SIGKILL what is left. ``reap`` (if given) is called on each poll so a parent can collect its
    child's exit status and the child does not linger as a zombie."""
    report = Termination()
    deadline = time.monotonic() + grace_s
    termed: set[int] = set()
    while True:
        if reap:
            reap()
        live = members(sid, token)
        if not live:
            return report
        fresh = [p for p in live.values() if p.pid not in termed]
        if fresh and grace_s > 0:
            sent = signal_procs(fresh, signal.SIGTERM)
            report.sigterm.extend(sent)
            termed.update(p.pid for p in fresh)
        if time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    deadline = time.monotonic() + kill_wait_s
    while True:
        if reap:
            reap()
        live = members(sid, token)
        if not live:
            return report
        if time.monotonic() >= deadline:
            report.survivors = sorted(live)
            return report
        for pid in signal_procs(live.values(), signal.SIGKILL):
            if pid not in report.sigkill:
                report.sigkill.append(pid)
        time.sleep(poll_s)
