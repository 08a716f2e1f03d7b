"""Job records and the sink that persists them.

A :class:`Job` is the supervisor's whole view of one submitted job; it is plain data that round-trips
through :meth:`Job.to_dict` / :meth:`Job.from_dict` (JSON-safe), so a store can keep it as one JSON
column beside a few typed ones. Log lines and events are append-only and go through :class:`JobSink`.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

from .errors import JobSpecError

LAUNCHER_RANK = -1
"""Rank recorded for lines printed by torchrun itself rather than by one of its workers."""

STREAMS = ("stdout", "stderr")


class JobState(str, enum.Enum):
    """Where a job is in its life. Terminal: succeeded, failed, cancelled, lost."""

    PENDING = "pending"          # accepted; first attempt not started yet
    RUNNING = "running"          # an attempt's process tree is alive
    HUNG = "hung"                # no step within the hang timeout; stacks being captured, tree killed
    RESTARTING = "restarting"    # the last attempt crashed or hung; waiting out the backoff
    CANCELLING = "cancelling"    # cancel requested; SIGTERM sent, SIGKILL after the grace period
    SUCCEEDED = "succeeded"      # the last attempt exited 0
    FAILED = "failed"            # crash or hang budget spent, or the command could not start
    CANCELLED = "cancelled"      # cancelled by a user or by the daemon shutting down
    LOST = "lost"                # the daemon restarted and the job's exit status is unknown

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.LOST)


class Outcome(str, enum.Enum):
    """How one attempt ended."""

    SUCCEEDED = "succeeded"        # exit code 0
    CRASHED = "crashed"            # exit code > 0, or killed by a signal rtxops did not send
    OOM = "oom"                    # SIGKILL with an OOM-kill counter that moved during the attempt
    HUNG = "hung"                  # killed by rtxops after the hang timeout
    CANCELLED = "cancelled"        # killed by rtxops on cancel or shutdown
    START_FAILED = "start_failed"  # the command could not be executed
    LOST = "lost"                  # ended while the daemon was not watching; status unknown


MAX_NAME = 200   # characters of a job's name


@dataclass(frozen=True)
class JobSpec:
    """What to run and how to supervise it.

    ``command`` runs as given when ``nproc_per_node`` is 1. With ``nproc_per_node`` > 1 it runs under
    torchrun (``torch.distributed.run --standalone``, one node): ``python SCRIPT ARGS`` and
    ``python -m MODULE ARGS`` run with that interpreter; any other command runs through torchrun's
    ``--no-python`` with the daemon's interpreter as the launcher. ``backoff_s * 2**n`` (capped at
    ``backoff_max_s``) is the wait before restart n+1. ``hang_timeout_s``: the job is hung when a rank
    that has stepped sends no step heartbeat for that long, or when no step arrives within
    ``first_step_timeout_s`` (default: ``hang_timeout_s``) of an attempt's start. ``runtime=False``
    runs the command without the rtxops runtime (a plain supervised process). ``base_env``: the
    environment the job starts from instead of the daemon's (``rtxops run`` sends its caller's,
    so a job sees the same variables whether a daemon was running or not).
    """

    command: tuple[str, ...]
    name: str = ""
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    max_crash_restarts: int = 0
    max_hang_restarts: int = 0
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    hang_timeout_s: float | None = None
    first_step_timeout_s: float | None = None
    nproc_per_node: int = 1
    grace_s: float = 10.0
    plan: str | None = None
    runtime: bool = True
    base_env: dict[str, str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(self.command))
        object.__setattr__(self, "env", dict(self.env))
        if self.base_env is not None:
            object.__setattr__(self, "base_env", dict(self.base_env))
        if not self.command or not all(isinstance(a, str) and a for a in self.command[:1]):
            raise JobSpecError("command: expected a non-empty list of strings")
        if not all(isinstance(a, str) for a in self.command):
            raise JobSpecError("command: every argument must be a string")
        for name in ("env", "base_env"):
            values = getattr(self, name) or {}
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in values.items()):
                raise JobSpecError(f"{name}: keys and values must be strings")
        for name in ("max_crash_restarts", "max_hang_restarts"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise JobSpecError(f"{name}: expected an integer >= 0, got {getattr(self, name)!r}")
        if not isinstance(self.nproc_per_node, int) or self.nproc_per_node < 1:
            raise JobSpecError(f"nproc_per_node: expected an integer >= 1, got {self.nproc_per_node!r}")
        for name in ("backoff_s", "backoff_max_s", "grace_s"):
            if not getattr(self, name) >= 0 or not math.isfinite(getattr(self, name)):
                raise JobSpecError(f"{name}: expected seconds >= 0, got {getattr(self, name)!r}")
        for name in ("hang_timeout_s", "first_step_timeout_s"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise JobSpecError(f"{name}: expected seconds > 0 or None, got {value!r}")
        if self.first_step_timeout_s is not None and self.hang_timeout_s is None:
            raise JobSpecError("first_step_timeout_s needs hang_timeout_s")

    def backoff(self, restarts_done: int) -> float:
        """Seconds to wait before the restart that follows ``restarts_done`` earlier restarts:
        ``backoff_s`` doubled each time, up to ``backoff_max_s`` (or ``backoff_s``, when that is
        more: a first wait asked for is never cut)."""
        return min(self.backoff_s * 2 ** min(restarts_done, 62), max(self.backoff_max_s, self.backoff_s))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["command"] = list(self.command)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class Attempt:
    """One launch of a job's command. ``start_ticks`` (from /proc) tells a pid apart from a reused one."""

    number: int
    started_at_ns: int
    pid: int | None = None
    start_ticks: int | None = None
    ended_at_ns: int | None = None
    outcome: Outcome | None = None
    exit_code: int | None = None
    signal: str | None = None
    detail: str = ""
    log_offsets: dict[str, int] = field(default_factory=dict)
    log_seqs: dict[str, int] = field(default_factory=dict)  # seq of the last line stored at log_offsets
    stop_signal: str | None = None  # a stop signal sent on request (Ctrl-C at `rtxops run`)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["outcome"] = self.outcome.value if self.outcome else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Attempt:
        d = dict(d)
        d["outcome"] = Outcome(d["outcome"]) if d.get("outcome") else None
        return cls(**d)


@dataclass
class Job:
    """A job as the supervisor sees it. Snapshots handed out are copies; mutating them changes nothing."""

    id: str
    spec: JobSpec
    state: JobState
    created_at_ns: int
    updated_at_ns: int
    token: str
    log_dir: str
    attempts: list[Attempt] = field(default_factory=list)
    crash_restarts: int = 0
    hang_restarts: int = 0
    reason: str = ""
    last_step: int | None = None
    last_heartbeat_ns: int | None = None
    next_attempt_at_ns: int | None = None
    log_seq: int = 0
    adopted: bool = False

    @property
    def name(self) -> str:
        return self.spec.name or self.id

    @property
    def attempt(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def exit_code(self) -> int | None:
        return self.attempts[-1].exit_code if self.attempts else None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["spec"] = self.spec.to_dict()
        d["state"] = self.state.value
        d["attempts"] = [a.to_dict() for a in self.attempts]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Job:
        d = dict(d)
        d["spec"] = JobSpec.from_dict(d["spec"])
        d["state"] = JobState(d["state"])
        d["attempts"] = [Attempt.from_dict(a) for a in d.get("attempts", ())]
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def copy(self) -> Job:
        return Job.from_dict(json.loads(json.dumps(self.to_dict())))


class LogLine(NamedTuple):
    """One stored line of output. ``seq`` grows by one per line within a job, across attempts and ranks."""

    job_id: str
    seq: int
    ts_ns: int
    attempt: int
    rank: int
    stream: str
    text: str


class JobEvent(NamedTuple):
    """Something that happened to a job; ``detail`` is a JSON object (text)."""

    job_id: str
    ts_ns: int
    kind: str
    detail: str


@runtime_checkable
class JobSink(Protocol):
    """Where the supervisor persists jobs, log lines and events, and reads logs back.

    Methods are called from the supervisor's threads (several at once) and must be thread-safe. They
    should return quickly; an exception is logged and counted by the supervisor (``sink_errors``) and
    never changes a job's state.
    """

    def job_saved(self, job: Job) -> None:
        """Insert or replace the record of ``job.id`` (called on every state change and every few
        seconds while log offsets move). ``Job.to_dict()`` is the JSON to keep; ``Job.from_dict`` of
        it is what ``Supervisor(recovered_jobs=...)`` takes back."""

    def log_lines(self, job_id: str, attempt: int, rank: int, stream: str,
                  lines: Sequence[tuple[int, int, str]]) -> None:
        """Append ``(ts_ns, seq, text)`` lines of one attempt, rank and stream (``stdout``/``stderr``).
        ``rank`` is ``LAUNCHER_RANK`` (-1) for torchrun's own lines. ``text`` has no trailing newline.
        Within a job ``seq`` is unique and increasing in call order."""

    def event(self, job_id: str, ts_ns: int, kind: str, detail_json: str) -> None:
        """Append an event: ``submitted``, ``started``, ``exited``, ``hung``, ``stacks``,
        ``restart_scheduled``, ``cancel_requested``, ``leftovers_killed``, ``adopted``, ``lost``,
        ``probe_error``. ``detail_json`` is a JSON object."""

    def read_logs(self, job_id: str, *, rank: int | None = None, after_seq: int = 0,
                  limit: int = 1000) -> list[LogLine]:
        """Lines of ``job_id`` with ``seq > after_seq`` (of ``rank`` only unless None), by seq, at most
        ``limit``."""

    def read_events(self, job_id: str, *, offset: int = 0, limit: int | None = None) -> list[JobEvent]:
        """Events of ``job_id`` in the order they were appended (``limit`` of them from ``offset``)."""

    def last_log_seq(self, job_id: str) -> int:
        """The highest ``seq`` stored for ``job_id``; 0 when none."""


class InMemoryJobSink:
    """A :class:`JobSink` that keeps everything in lists (tests; a daemon without a store)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.jobs: dict[str, dict[str, Any]] = {}
        self.lines: dict[str, list[LogLine]] = {}
        self.events: dict[str, list[JobEvent]] = {}

    def job_saved(self, job: Job) -> None:
        with self._lock:
            self.jobs[job.id] = job.to_dict()

    def log_lines(self, job_id: str, attempt: int, rank: int, stream: str,
                  lines: Sequence[tuple[int, int, str]]) -> None:
        with self._lock:
            out = self.lines.setdefault(job_id, [])
            out.extend(LogLine(job_id, seq, ts, attempt, rank, stream, text) for ts, seq, text in lines)

    def event(self, job_id: str, ts_ns: int, kind: str, detail_json: str) -> None:
        with self._lock:
            self.events.setdefault(job_id, []).append(JobEvent(job_id, ts_ns, kind, detail_json))

    def read_logs(self, job_id: str, *, rank: int | None = None, after_seq: int = 0,
                  limit: int = 1000) -> list[LogLine]:
        with self._lock:
            found = [ln for ln in self.lines.get(job_id, ())
                     if ln.seq > after_seq and (rank is None or ln.rank == rank)]
        return sorted(found, key=lambda ln: ln.seq)[:limit]

    def read_events(self, job_id: str, *, offset: int = 0, limit: int | None = None) -> list[JobEvent]:
        with self._lock:
            events = self.events.get(job_id, [])
            return list(events[offset:None if limit is None else offset + limit])

    def last_log_seq(self, job_id: str) -> int:
        with self._lock:
            return max((ln.seq for ln in self.lines.get(job_id, ())), default=0)

    def recovered_jobs(self) -> list[Job]:
        """The saved jobs, as ``Supervisor(recovered_jobs=...)`` takes them."""
        with self._lock:
            return [Job.from_dict(d) for d in self.jobs.values()]
