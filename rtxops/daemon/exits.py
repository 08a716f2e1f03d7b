"""Decode how a process ended: exit code, signal name, and whether the OOM killer is to blame.

The OOM verdict needs evidence: an ``oom_kill`` counter that moved while the attempt ran — the memory
cgroup's (v2 ``memory.events``, v1 ``memory.oom_control``) or the machine's (``/proc/vmstat``). Without
one, a SIGKILL nobody in rtxops sent is reported as "possibly OOM", never as OOM.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

from .jobs import Outcome

_DESCRIPTIONS = {
    signal.SIGSEGV: "segmentation fault", signal.SIGABRT: "aborted", signal.SIGBUS: "bus error",
    signal.SIGFPE: "floating-point exception", signal.SIGILL: "illegal instruction",
    signal.SIGTERM: "terminated", signal.SIGINT: "interrupted", signal.SIGHUP: "hang-up",
    signal.SIGPIPE: "broken pipe", signal.SIGKILL: "killed",
}


def signal_name(signum: int) -> str:
    """``SIGSEGV`` for 11; ``SIG<n>`` for numbers Python does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIG{signum}"


def _own_cgroup_dirs() -> list[Path]:
    dirs = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return dirs
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0":
            dirs.append(Path("/sys/fs/cgroup") / path.lstrip("/"))
        elif "memory" in controllers.split(","):
            dirs.append(Path("/sys/fs/cgroup/memory") / path.lstrip("/"))
            dirs.append(Path("/sys/fs/cgroup/memory"))
    return dirs


def _read_counter(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        return None
    return None


@dataclass(frozen=True)
class OomCounters:
    """``oom_kill`` counters readable now, by source file."""

    values: tuple[tuple[str, int], ...]

    @classmethod
    def read(cls) -> OomCounters:
        found: dict[str, int] = {}
        for d in _own_cgroup_dirs():
            for name in ("memory.events", "memory.oom_control"):
                value = _read_counter(d / name, "oom_kill")
                if value is not None:
                    found.setdefault(str(d / name), value)
        vmstat = _read_counter(Path("/proc/vmstat"), "oom_kill")
        if vmstat is not None:
            found["/proc/vmstat"] = vmstat
        return cls(tuple(sorted(found.items())))

    def moved_since(self, before: OomCounters) -> list[str]:
        """Sources whose counter grew since ``before``, e.g. ``['/proc/vmstat oom_kill +1']``."""
        old = dict(before.values)
        return [f"{src} oom_kill +{v - old[src]}" for src, v in self.values if src in old and v > old[src]]


@dataclass(frozen=True)
class ExitInfo:
    """A decoded end of an attempt (not counting kills rtxops made: the supervisor knows those)."""

    outcome: Outcome
    exit_code: int | None
    signal: str | None
    detail: str


def classify_exit(returncode: int, oom_evidence: list[str] | None = None) -> ExitInfo:
    """Decode a ``Popen.returncode`` of a process rtxops did not signal.

    ``oom_evidence``: the counters that moved during the attempt (:meth:`OomCounters.moved_since`).
    """
    evidence = list(oom_evidence or ())
    if returncode == 0:
        return ExitInfo(Outcome.SUCCEEDED, 0, None, "exited with code 0")
    if returncode > 0:
        detail = f"exited with code {returncode}"
        if 128 < returncode < 128 + 65:
            detail += f" (a shell reports 128+N when its child died of signal N: {signal_name(returncode - 128)})"
        if evidence:
            detail += "; the OOM killer fired during the attempt (" + ", ".join(evidence) + ")"
        return ExitInfo(Outcome.CRASHED, returncode, None, detail)
    signum = -returncode
    name = signal_name(signum)
    what = _DESCRIPTIONS.get(signum)
    detail = f"killed by {name}" + (f" ({what})" if what and signum != signal.SIGKILL else "")
    if signum == signal.SIGKILL:
        if evidence:
            return ExitInfo(Outcome.OOM, None, name,
                            "killed by the OOM killer (SIGKILL; " + ", ".join(evidence) + ")")
        detail += " not sent by rtxops (possibly the OOM killer; no oom_kill counter moved)"
    return ExitInfo(Outcome.CRASHED, None, name, detail)
