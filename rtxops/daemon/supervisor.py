"""The job supervisor: launches jobs in sessions of their own, restarts them, kills them, keeps their logs.

Threads: one runner per job (its whole life: launch, watch, kill, classify, back off, restart) and one
log tail per running attempt. Public methods only take a lock, flip flags and wake runners, so they
return at once; :meth:`Supervisor.wait`, :meth:`Supervisor.wait_for_logs` and
:meth:`Supervisor.shutdown` block by design.

States (:class:`~rtxops.daemon.jobs.JobState`)::

    pending → running → succeeded                         exit code 0
    pending | restarting → failed                         the command cannot start
    running → restarting → running                        crashed or OOM-killed, crash budget left
    running → failed                                      crashed or OOM-killed, crash budget spent
    running → hung → restarting | failed                  no step within the hang timeout (hang budget)
    any non-terminal → cancelling → cancelled             cancel() or shutdown()
    recovered non-terminal → running (adopted)            processes still alive, or ended meanwhile
                                                          (the waiter kept the exit status)
    recovered pending | restarting → running              the next attempt starts
    recovered non-terminal → lost                         ended, exit status unknown
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import subprocess
import signal
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .. import settings
from . import launch, proctree, stacks
from .errors import JobNotFound, JobSpecError, SupervisorClosed
from .exits import ExitInfo, OomCounters, classify_exit, signal_name
from .jobs import (MAX_NAME, STREAMS, Attempt, Job, JobEvent, JobSink, JobSpec, JobState, LogLine,
                   Outcome)
from .logtail import MAX_STORED_BYTES, LogTail
from .recent_logs import RecentLogs

log = logging.getLogger(__name__)

SAVE_EVERY_S = 5.0
"""While a job runs, its record (log offsets, last step) is saved at most this often."""
LOG_DRAIN_S = 120.0
"""How long an ended attempt waits for its last log lines to be stored before it moves on."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Sent on request (``rtxops run`` forwards Ctrl-C): an attempt that then fails was stopped."""
FULL_DISK_BYTES = 1 << 20   # less free than this on the disk of a job's output files: full
RESAVE_S = 5.0
"""How often job records and events the sink refused are offered to it again."""
MAX_UNSENT_EVENTS = 10_000
STATUS_WAIT_S = 5.0
"""How long an adopted attempt that ended waits for its waiter to write the exit status."""


class Supervisor:
    """Runs jobs as process trees it owns; see the module docstring for the states.

    ``sink`` persists jobs, logs and events and serves logs back. ``work_dir`` holds each attempt's
    stdout/stderr files until they are stored. ``extra_env`` goes into every job's environment (the
    daemon passes RTXOPS_TELEMETRY, RTXOPS_DAEMON, RTXOPS_TOKEN, RTXOPS_READINGS_FACTORY).
    ``recovered_jobs``: the jobs a previous daemon saved; unfinished ones whose processes still run
    are re-adopted (watched, heartbeats, cancel, restarts), the others become ``lost``.
    """

    def __init__(self, sink: JobSink, work_dir: str | os.PathLike[str], *,
                 extra_env: Mapping[str, str] | None = None, recovered_jobs: Iterable[Job] = (),
                 tick_s: float = 0.05, log_poll_s: float = 0.05,
                 log_busy_poll_s: float | None = None, keep_log_files: bool = False,
                 log_max_bytes: int | None = None) -> None:
        self.sink = sink
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.extra_env = dict(extra_env or {})
        self.tick_s = tick_s
        self.log_poll_s = log_poll_s
        self.log_busy_poll_s = log_busy_poll_s   # (LogTail's busy_poll_s)
        # what the store keeps of each stream of an attempt (the files keep everything)
        self.log_max_bytes = log_max_bytes if log_max_bytes is not None else settings.whole_number(
            "RTXOPS_JOB_LOG_MAX_BYTES", MAX_STORED_BYTES)
        self.keep_log_files = keep_log_files
        self.sink_errors = 0
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._version = 0
        self._jobs: dict[str, Job] = {}
        self._recent = RecentLogs()   # the newest stored lines: what followers read
        self._runners: dict[str, _Runner] = {}
        self._save_locks: dict[str, threading.Lock] = {}
        self._closed = False
        self._unsaved: set[str] = set()           # job records the sink refused: saved again
        self._unsent: collections.deque = collections.deque(maxlen=MAX_UNSENT_EVENTS)
        self._resave: threading.Timer | None = None
        self._resaving = threading.Lock()
        self._shut = False
        for job in recovered_jobs:
            self._recover(job.copy())

    def submit(self, spec: JobSpec) -> Job:
        """Accept ``spec`` and start its first attempt in the background. Raises JobSpecError for a
        command that cannot be launched as asked, SupervisorClosed after shutdown began."""
        launch.command_line(spec, self.work_dir)
        if len(spec.name) > MAX_NAME:   # (at submit only: a saved job is taken back as it was)
            raise JobSpecError(f"name: at most {MAX_NAME} characters")
        if spec.cwd is not None and not os.path.isdir(spec.cwd):   # at submit only: a folder
            raise JobSpecError(f"cwd: {spec.cwd!r} is not a directory")  # gone later is a start failure
        now = time.time_ns()
        with self._lock:
            if self._closed:
                raise SupervisorClosed("the supervisor is shutting down; no new jobs")
            job_id = _new_id(self._jobs)
            job = Job(id=job_id, spec=spec, state=JobState.PENDING, created_at_ns=now, updated_at_ns=now,
                      token=f"{job_id}.{secrets.token_hex(8)}", log_dir=str(self.work_dir / job_id))
            self._jobs[job_id] = job
            self._save_locks[job_id] = threading.Lock()
            runner = self._runners[job_id] = _Runner(self, job_id)
        Path(job.log_dir).mkdir(parents=True, exist_ok=True)
        self._save(job_id)
        self._event(job_id, "submitted", name=spec.name, command=list(spec.command))
        runner.start(adopt=False)
        return self.job(job_id)

    def jobs(self) -> list[Job]:
        """Every known job, oldest first (copies: slow with thousands of jobs; the periodic
        callers use :meth:`running`, :meth:`page` and :meth:`tally`)."""
        with self._lock:
            return [j.copy() for j in sorted(self._jobs.values(), key=lambda j: j.created_at_ns)]

    def running(self) -> dict[str, int | None]:
        """The running jobs' ids and last steps. Copies nothing: the lock is held
        for microseconds (heartbeats from the ingest path wait on it)."""
        with self._lock:
            return {j.id: j.last_step for j in self._jobs.values() if j.state is JobState.RUNNING}

    def unfinished(self) -> set[str]:
        """The ids of jobs not in a terminal state (running, restarting, hung, ...)."""
        with self._lock:
            return {j.id for j in self._jobs.values() if not j.state.terminal}

    def close_if_idle(self, own: str | None = None) -> bool:
        """Take no new jobs from now on if no job but ``own`` is unfinished; True if so. One step
        (under the lock): a job submitted just before keeps the supervisor open, and one submitted
        just after is refused (SupervisorClosed), never accepted and then cancelled by a shutdown."""
        with self._lock:
            if any(not j.state.terminal for j in self._jobs.values() if j.id != own):
                return False
            self._closed = True
            return True

    def page(self, offset: int, limit: int) -> tuple[int, list[Job]]:
        """How many jobs there are, and copies of ``limit`` of them from ``offset``, newest first."""
        with self._lock:
            newest = sorted(self._jobs.values(), key=lambda j: j.created_at_ns, reverse=True)
            return len(newest), [j.copy() for j in newest[offset:offset + limit]]

    def tally(self) -> tuple[dict[str, int], int, int]:
        """Jobs by state, and crash and hang restarts over all jobs (for /metrics)."""
        with self._lock:
            states: dict[str, int] = {}
            for j in self._jobs.values():
                states[j.state.value] = states.get(j.state.value, 0) + 1
            return (states, sum(j.crash_restarts for j in self._jobs.values()),
                    sum(j.hang_restarts for j in self._jobs.values()))

    def job(self, job_id: str) -> Job:
        """A copy of one job; JobNotFound for an unknown id."""
        with self._lock:
            return self._get(job_id).copy()

    def cancel(self, job_id: str) -> Job:
        """Stop the job for good: SIGTERM to its whole tree, SIGKILL after ``grace_s``. Returns at once;
        a finished job is returned unchanged."""
        with self._lock:
            job = self._get(job_id)
            runner = self._runners.get(job_id)
            if job.state.terminal or runner is None or runner.cancel_reason:
                return job.copy()
            runner.request_cancel("cancelled by request", job.spec.grace_s)
            self._set(job, JobState.CANCELLING, reason="cancelled by request")
        self._save(job_id)
        self._event(job_id, "cancel_requested")
        return self.job(job_id)

    def signal(self, job_id: str, signum: int, stop: bool = False) -> list[int]:
        """Send ``signum`` to every process of the job's running attempt (as Ctrl-C at a terminal
        reaches the whole foreground group); the pids signalled. The job goes on being supervised:
        it may handle the signal (save a checkpoint) and exit as it chooses. With ``stop`` (a
        stop signal asked to end the job: Ctrl-C at ``rtxops run``) an attempt that then fails is
        cancelled rather than restarted."""
        with self._lock:
            job = self._get(job_id)
            attempt = job.attempt if not job.state.terminal else None
            if attempt is None or attempt.outcome is not None:
                return []
            sid, token = _own_session(attempt), job.token
            runner = self._runners.get(job_id)
            stopping = runner is not None and stop and signum in STOP_SIGNALS
            if stopping:
                # asked to stop (Ctrl-C forwarded by `rtxops run`): if the attempt then fails,
                # that is the stop, not a crash to restart (saved: a daemon restarted meanwhile
                # must know it too)
                runner.stop_requested = (attempt.number, signal.Signals(signum).name)
                attempt.stop_signal = signal.Signals(signum).name
        if stopping:
            self._save(job_id)
        sent = proctree.signal_procs(proctree.members(sid, token).values(), signum)
        self._event(job_id, "signalled", signal=signal.Signals(signum).name, pids=sent)
        return sent

    def heartbeat(self, job_id: str, step: int, rank: int = 0) -> bool:
        """Record that ``rank`` of the job finished optimizer step ``step`` (from an rtx.step span).
        False when the job is unknown or not running (spans of unsupervised jobs land here too)."""
        with self._lock:
            job = self._jobs.get(job_id)
            runner = self._runners.get(job_id)
            if job is None or runner is None or job.state.terminal:
                return False
            # the last spans of an attempt may commit after it exited: the step still counts
            # (a restart goes on from it), but only a running attempt has a heartbeat
            job.last_step = step if job.last_step is None else max(job.last_step, step)
            if job.state is not JobState.RUNNING:
                return False
            runner.heartbeats[rank] = time.monotonic()
            job.last_heartbeat_ns = time.time_ns()
            return True

    def logs(self, job_id: str, *, rank: int | None = None, after_seq: int = 0,
             limit: int = 1000) -> list[LogLine]:
        """Stored lines with ``seq > after_seq`` (one rank, or all when None), oldest first."""
        with self._lock:
            self._get(job_id)
        held = self._recent.read(job_id, rank=rank, after_seq=after_seq, limit=limit)
        if held is not None:
            return held
        return self.sink.read_logs(job_id, rank=rank, after_seq=after_seq, limit=limit)

    def wait_for_logs(self, job_id: str, *, after_seq: int = 0, rank: int | None = None,
                      timeout: float = 10.0, limit: int = 1000) -> list[LogLine]:
        """Like :meth:`logs` but waits up to ``timeout`` for a line. An empty list after the job has
        finished means no line will ever come (``--follow`` stops)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                version = self._version
                job = self._get(job_id)
                done = job.state.terminal
                # a running job's lines are numbered up to log_seq before they are stored: past
                # it the store has nothing yet (a follower caught up costs it no query a wake-up)
                caught_up = not done and after_seq >= job.log_seq
            lines = [] if caught_up else self.logs(job_id, rank=rank, after_seq=after_seq, limit=limit)
            remaining = deadline - time.monotonic()
            if lines or done or remaining <= 0:
                return lines
            with self._changed:
                if self._version == version:
                    self._changed.wait(remaining)

    def events(self, job_id: str, *, offset: int = 0, limit: int | None = None) -> list[JobEvent]:
        """The job's events, oldest first (``limit`` of them from ``offset``)."""
        with self._lock:
            self._get(job_id)
        return self.sink.read_events(job_id, offset=offset, limit=limit)

    def wait(self, job_id: str, timeout: float | None = None) -> Job:
        """Block until the job is in a terminal state or ``timeout`` passes; the job either way."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while not self._get(job_id).state.terminal:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._changed.wait(remaining)
            return self._get(job_id).copy()

    def refuse_new_jobs(self) -> None:
        """Take no more jobs (SupervisorClosed), before a shutdown that may begin later."""
        with self._lock:
            self._closed = True

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Accept no more jobs; SIGTERM every job's tree, SIGKILL what is left after ``grace_s``; wait
        for the runners. Jobs stopped this way end ``cancelled``."""
        reason = "daemon shut down"
        with self._lock:
            self._closed = True
            runners = list(self._runners.items())
            stopping = [job_id for job_id, runner in runners
                        if not self._jobs[job_id].state.terminal and not runner.cancel_reason]
            for job_id in stopping:
                self._set(self._jobs[job_id], JobState.CANCELLING, reason=reason)
        # saved before the first signal: a daemon killed during the grace leaves the next one a
        # cancel to carry on, not a job to re-adopt as running (or restart once its tree is gone)
        for job_id in stopping:
            self._save(job_id)
        with self._lock:
            for job_id, runner in runners:
                job = self._jobs[job_id]
                if job.state.terminal:
                    continue
                if not runner.cancel_reason:
                    runner.request_cancel(reason, min(grace_s, job.spec.grace_s))
                    if job.state is not JobState.CANCELLING:   # an attempt started meanwhile
                        self._set(job, JobState.CANCELLING, reason=reason)
                else:
                    runner.grace_s = min(runner.grace_s, grace_s)
        deadline = time.monotonic() + grace_s + 10.0
        for _, runner in runners:
            runner.join(max(0.0, deadline - time.monotonic()))
        for job_id, runner in runners:
            if runner.alive:
                log.warning("job %s: runner still busy after shutdown grace; killing its tree", job_id)
                with self._lock:
                    job = self._jobs[job_id]
                    sid = _own_session(job.attempt) if job.attempt else None
                proctree.terminate(sid, job.token, 0.0)
        with self._lock:
            resave, self._resave, self._shut = self._resave, None, True
        if resave is not None:   # a last try at what the sink refused
            resave.cancel()
            self._save_again()

    def _recover(self, job: Job) -> None:
        self._jobs[job.id] = job
        self._save_locks[job.id] = threading.Lock()
        if job.state.terminal:
            return
        job.log_seq = max(job.log_seq, self._sink_call(0, self.sink.last_log_seq, job.id))
        attempt = job.attempt
        alive = True
        if attempt is None or attempt.outcome is not None:
            alive = False
        else:
            try:
                alive = _attempt_alive(attempt, job.token)
            except Exception as e:  # a failing probe never ends a job; the runner probes again
                self._event(job.id, "probe_error", probe="recover", error=f"{type(e).__name__}: {e}")
        cancelling = job.state is JobState.CANCELLING  # a cancel the previous daemon began
        # ended while no daemon watched: its waiter left the exit status; the runner takes it
        # from there (its last log lines, then a restart if the job has budget left)
        ended_unseen = (not alive and attempt is not None and attempt.outcome is None
                        and (launch.read_status(_status_file(job, attempt.number)) is not None
                             or _awaiting_its_waiter(attempt)))
        if alive or ended_unseen:
            job.adopted = True
            self._runners[job.id] = runner = _Runner(self, job.id)
            if attempt.stop_signal:
                runner.stop_requested = (attempt.number, attempt.stop_signal)
            with self._lock:
                if cancelling:  # carried on: the tree gets SIGTERM, then SIGKILL after the grace
                    runner.request_cancel(job.reason or "cancelled by request", job.spec.grace_s)
                elif job.state is JobState.HUNG:  # so is a hang kill (and its restart budget)
                    runner.hang_kill = True
                else:
                    self._set(job, JobState.RUNNING, reason="re-adopted after a daemon restart")
            self._save(job.id)
            self._event(job.id, "adopted", pid=attempt.pid, attempt=attempt.number)
            runner.start(adopt=True)
            return
        self._stop_strays(job)
        if not cancelling and attempt is not None and attempt.outcome is not None \
                and job.state in (JobState.RUNNING, JobState.HUNG):
            # its attempt's end was saved, and not what follows from it (that save failed, or
            # the daemon died between the two): decided now, as the runner would have; resuming
            # it as if a restart were due ran a job that had succeeded once more
            self._runners[job.id] = runner = _Runner(self, job.id)
            self._event(job.id, "resumed", after="a daemon restart", attempt_outcome=attempt.outcome.value)
            runner.start(adopt=False, decide=True)
            return
        if not cancelling and (attempt is None or attempt.outcome is not None):
            # pending, or waiting to restart: the next attempt starts when it was due
            self._runners[job.id] = runner = _Runner(self, job.id)
            self._event(job.id, "resumed", after="a daemon restart")
            runner.start(adopt=False, resume=True)
            return
        reason = "the daemon restarted while the job ran; its exit status is unknown"
        if attempt is not None and attempt.outcome is None:
            attempt.outcome, attempt.ended_at_ns, attempt.detail = Outcome.LOST, time.time_ns(), reason
        if cancelling:  # it ended while no daemon watched, as asked
            self._set(job, JobState.CANCELLED, reason=job.reason or "cancelled by request")
            self._save(job.id)
            self._event(job.id, "cancelled", reason=job.reason)
        else:
            self._set(job, JobState.LOST, reason=reason)
            self._save(job.id)
            self._event(job.id, "lost", reason=reason)
        if attempt is not None:
            threading.Thread(target=self._store_last_lines, args=(job, attempt), daemon=True,
                             name=f"rtxops-job-{job.id}-logs").start()

    def _store_last_lines(self, job: Job, attempt: Attempt) -> None:
        """Store what an attempt that ended unseen wrote after the last lines a daemon stored
        (often its traceback), then remove its output files: they were left for good."""
        runner = _Runner(self, job.id)   # for its log tail only: no thread of its own
        tail = runner._new_tail(attempt, attempt.log_offsets, attempt.log_seqs,
                                runner._stored_after_checkpoint(attempt))
        drained = tail.stop(LOG_DRAIN_S)
        with self._lock:
            attempt.log_offsets, attempt.log_seqs = tail.committed()
        self._save(job.id)
        if drained and not self.keep_log_files:   # (else the tail's late drain removes them)
            _remove_attempt_files(job.log_dir, attempt.number)
            try:
                Path(job.log_dir).rmdir()
            except OSError:
                pass

    def _stop_strays(self, job: Job) -> None:
        """Kill what carries the job's token though no saved attempt owns it: the previous daemon
        died between starting an attempt and saving it, and nothing else would ever stop it."""
        try:
            strays = proctree.members(None, job.token)
            if strays:
                proctree.terminate(None, job.token, 0.0)
                self._event(job.id, "strays_killed", pids=sorted(strays))
        except Exception as e:  # a failing probe must not stop the daemon from starting
            self._event(job.id, "probe_error", probe="strays", error=f"{type(e).__name__}: {e}")

    def _get(self, job_id: str) -> Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def _set(self, job: Job, state: JobState, **changes: Any) -> None:
        """Change a job under the lock and wake waiters (caller holds the lock)."""
        job.state = state
        for k, v in changes.items():
            setattr(job, k, v)
        job.updated_at_ns = time.time_ns()
        self._notify()

    def _notify(self) -> None:
        with self._changed:
            self._version += 1
            self._changed.notify_all()

    def _save(self, job_id: str) -> bool:
        """Save the job's record; False when the sink refused it (saved again later)."""
        with self._save_locks[job_id]:
            with self._lock:
                snapshot = self._jobs[job_id].copy()
            saved = self._sink_call(False, _called(self.sink.job_saved), snapshot)
            with self._lock:
                (self._unsaved.discard if saved else self._unsaved.add)(job_id)
        if not saved:
            self._save_later()
        elif snapshot.state.terminal and snapshot.attempt is not None:
            # its exit status is saved, with what follows from it: the waiter's file has done
            # its job (kept while unsaved: a daemon that starts from the older record reads it)
            _status_file(snapshot, snapshot.attempt.number).unlink(missing_ok=True)
        return saved

    def _event(self, job_id: str, kind: str, /, **detail: Any) -> None:
        event = (job_id, time.time_ns(), kind, json.dumps(detail, default=str))
        with self._lock:
            waiting = bool(self._unsent)
        if waiting or not self._sink_call(False, _called(self.sink.event), *event):
            with self._lock:   # in order, after those that wait already
                self._unsent.append(event)
            self._save_later()

    def _save_later(self) -> None:
        """Save the records and events the sink refused (a full disk, say) once it takes them:
        a job's last state is often saved only once, when it ends."""
        with self._lock:
            if self._resave is not None or self._shut:
                return
            self._resave = threading.Timer(RESAVE_S, self._save_again)
            self._resave.daemon = True
            self._resave.start()

    def _save_again(self) -> None:
        with self._lock:
            self._resave = None
        if not self._resaving.acquire(blocking=False):
            self._save_later()   # one at a time (a sink call may wait 30 s on a store)
            return
        try:
            with self._lock:
                unsaved = sorted(self._unsaved)
            for job_id in unsaved:
                self._save(job_id)
            while True:
                with self._lock:
                    if not self._unsent:
                        return
                    event = self._unsent[0]
                if not self._sink_call(False, _called(self.sink.event), *event):
                    self._save_later()
                    return
                with self._lock:
                    if self._unsent and self._unsent[0] is event:
                        self._unsent.popleft()
        finally:
            self._resaving.release()

    def _lines(self, job_id: str, attempt: int, stream: str, lines: list[tuple[int, int, str]]) -> int:
        """Number and store lines; the seq of the last. Raises when the store cannot take them
        (the tail reads them again: a failed write leaves a gap in the numbers, not in the log)."""
        with self._lock:
            job = self._jobs[job_id]
            first = job.log_seq + 1
            job.log_seq += len(lines)
        run: list[tuple[int, int, str]] = []
        for i, (ts, rank, text) in enumerate(lines):
            run.append((ts, first + i, text))
            if i + 1 == len(lines) or lines[i + 1][1] != rank:
                try:
                    self.sink.log_lines(job_id, attempt, rank, stream, run)
                except Exception:
                    with self._lock:
                        self.sink_errors += 1
                    raise
                self._recent.add(job_id, attempt, rank, stream, run)
                run = []
        self._notify()
        return first + len(lines) - 1

    def _sink_call(self, default: Any, fn, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:
            with self._lock:
                self.sink_errors += 1
            log.exception("job sink %s failed", getattr(fn, "__name__", fn))
            return default


class _Runner:
    """The thread that drives one job from launch to a terminal state."""

    def __init__(self, sup: Supervisor, job_id: str) -> None:
        self.sup = sup
        self.job_id = job_id
        self.cancel_reason: str | None = None
        self.stop_requested: tuple[int, str] | None = None  # (attempt, signal) sent on request
        self.grace_s = 0.0
        self.heartbeats: dict[int, float] = {}
        self.wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.hang_kill = False  # (set before start: an adopted attempt a hang kill was ending)
        self._waiter_lost: int | None = None   # the waiter's status, when it died before the job
        self._proc: subprocess.Popen | None = None
        self._tail: LogTail | None = None
        self._started_mono = 0.0
        self._oom_before: OomCounters | None = None
        self._probe_errors: set[str] = set()
        self._delay = 0.0
        self._scheduled: str | None = None   # the kind of restart the backoff waits for
        self._adopted = False   # the attempt was started by an earlier daemon

    def start(self, adopt: bool, resume: bool = False, decide: bool = False) -> None:
        target = (self._run_adopted if adopt else self._run_resumed if resume
                  else self._run_decided if decide else self._run)
        self._thread = threading.Thread(target=self._guard, args=(target,), daemon=True,
                                        name=f"rtxops-job-{self.job_id}")
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def request_cancel(self, reason: str, grace_s: float) -> None:
        """Caller holds the supervisor lock."""
        self.cancel_reason = reason
        self.grace_s = grace_s
        self.wake.set()

    @property
    def job(self) -> Job:
        return self.sup._jobs[self.job_id]

    def _guard(self, target) -> None:
        try:
            target()
        except Exception as e:  # a bug here must not leave the job's processes unowned
            log.exception("job %s: supervisor runner failed", self.job_id)
            try:
                proctree.terminate(self._sid(), self.job.token, 0.0, reap=self._reap)
            finally:
                with self.sup._lock:
                    self.sup._set(self.job, JobState.FAILED, reason=f"supervisor error: {type(e).__name__}: {e}")
                self.sup._save(self.job_id)

    def _run(self) -> None:
        while True:
            if self.cancel_reason:
                self._finish(JobState.CANCELLED, self.cancel_reason)
                return
            attempt = self._launch()
            if attempt is None:
                return
            self._follow(attempt, self._watch(attempt))
            if self._decide(attempt):
                return
            if self._backoff():
                return

    def _run_adopted(self) -> None:
        with self.sup._lock:
            attempt = self.job.attempt
            assert attempt is not None
            self._started_mono = time.monotonic()
            self._adopted = True
        self._tail = self._new_tail(attempt, attempt.log_offsets, attempt.log_seqs,
                                    self._stored_after_checkpoint(attempt))
        if self.hang_kill:   # the previous daemon was killing it for a hang: carry that on
            self._follow(attempt, (Outcome.HUNG, self._kill(attempt, self.job.spec.grace_s)))
        else:
            self._follow(attempt, self._watch(attempt))
        if self._decide(attempt) or self._backoff():
            return
        self._run()

    def _run_resumed(self) -> None:
        """A job a previous daemon left pending or waiting out a restart's backoff."""
        due = self.job.next_attempt_at_ns
        self._delay = max(0.0, (due - time.time_ns()) / 1e9) if due else 0.0
        if not self._backoff():
            self._run()

    def _run_decided(self) -> None:
        """A job a previous daemon left with its last attempt ended and nothing decided."""
        if self._decide(self.job.attempt) or self._backoff():
            return
        self._run()

    def _launch(self) -> Attempt | None:
        sup, job = self.sup, self.job
        spec = job.spec
        number = len(job.attempts) + 1
        job_dir = Path(job.log_dir)
        job_dir.mkdir(parents=True, exist_ok=True)
        paths = {s: job_dir / f"attempt-{number}.{s}" for s in STREAMS}
        argv = launch.command_line(spec, job_dir / f"torchrun-{number}")
        # a restart counts steps on from the last one heard of: the evolve loop's windows, plan
        # effective steps and the telemetry name steps by (job, step). The store's figure counts
        # the batches still queued when the attempt ended
        step_base = None
        if number > 1:
            stored = self._probe("last_step", getattr(sup.sink, "last_step", lambda _: None),
                                 None, job.id)
            step_base = max(job.last_step or 0, stored or 0) or None
            if self.cancel_reason:  # cancelled (or the daemon stopping) while the store answered
                self._finish(JobState.CANCELLED, self.cancel_reason)
                return None
        env = launch.environment(spec, job_id=job.id, token=job.token, attempt=number,
                                 base=os.environ, extra_env=sup.extra_env, step_base=step_base)
        self._oom_before = self._probe("oom_counters", OomCounters.read, None)
        attempt = Attempt(number=number, started_at_ns=time.time_ns())
        self._waiter_lost = None
        status_file = _status_file(job, number)
        status_file.unlink(missing_ok=True)
        try:
            with open(paths["stdout"], "wb") as out, open(paths["stderr"], "wb") as err:
                self._proc, attempt.pid = launch.spawn(argv, env=env, cwd=spec.cwd, stdout=out,
                                                       stderr=err, status_file=status_file)
        except launch.StartFailed as e:
            attempt.ended_at_ns = time.time_ns()
            attempt.outcome = Outcome.START_FAILED
            attempt.exit_code, attempt.detail = e.exit_code, e.detail
            for path in (paths["stdout"], paths["stderr"]):   # empty unless the waiter failed
                with contextlib.suppress(OSError):
                    if not os.path.getsize(path):
                        os.unlink(path)
            with sup._lock:
                job.attempts.append(attempt)
            sup._event(job.id, "exited", attempt=number, outcome=attempt.outcome.value, detail=attempt.detail)
            self._finish(JobState.FAILED, attempt.detail)
            return None
        proc = self._probe("start_ticks", proctree.read_proc, None, attempt.pid)
        attempt.start_ticks = proc.start_ticks if proc else None
        self._started_mono = time.monotonic()
        self._adopted = False
        with sup._lock:
            self.heartbeats.clear()
            job.attempts.append(attempt)
            if not self.cancel_reason:
                sup._set(job, JobState.RUNNING, next_attempt_at_ns=None)
        self._tail = self._new_tail(attempt, {})
        sup._save(job.id)
        sup._event(job.id, "started", attempt=number, pid=attempt.pid, argv=argv)
        return attempt

    def _stored_after_checkpoint(self, attempt: Attempt) -> dict[str, tuple[int, int]]:
        """Per stream, (count, last seq) of the attempt's lines stored after its saved log offsets:
        the previous daemon stored them between its last checkpoint and its end, so the new tail
        must not store them again. Records from before ``log_seqs`` existed resume at the offsets."""
        floor = {s: attempt.log_seqs.get(s, 0) for s in STREAMS
                 if s in attempt.log_seqs or s not in attempt.log_offsets}
        found = {s: (0, 0) for s in floor}
        # from the highest: one tail thread numbers and stores an attempt's lines in turn, so all
        # stored after the checkpoint are above every seq it holds (from the lowest, a stream that
        # never wrote, at 0, had a re-adopted job's whole log read before it was watched again)
        after = max(floor.values(), default=None)
        while after is not None:
            page = self._probe("stored_logs", lambda: self.sup.sink.read_logs(
                self.job_id, after_seq=after, limit=10_000), [])
            for ln in page:
                if ln.attempt == attempt.number and ln.stream in floor and ln.seq > floor[ln.stream]:
                    found[ln.stream] = (found[ln.stream][0] + 1, ln.seq)
            # to the end: a page is short of its limit where long lines fill its bytes (the
            # rest was taken for not stored, and stored a second time)
            after = page[-1].seq if page else None
        return {s: f for s, f in found.items() if f[0]}

    def _new_tail(self, attempt: Attempt, offsets: dict[str, int], seqs: dict[str, int] | None = None,
                  skip: dict[str, tuple[int, int]] | None = None) -> LogTail:
        paths = {s: Path(self.job.log_dir) / f"attempt-{attempt.number}.{s}" for s in STREAMS}

        def on_lines(stream: str, lines) -> int:
            return self.sup._lines(self.job_id, attempt.number, stream, lines)

        def on_error(e: Exception) -> None:
            self._probe_error("log_read", e)

        def on_late_drain() -> None:   # the attempt ended with lines the store took only later
            self.sup._event(self.job_id, "logs_stored", attempt=attempt.number)
            if not self.sup.keep_log_files:
                _remove_attempt_files(self.job.log_dir, attempt.number)

        return LogTail(paths, on_lines, offsets=offsets, seqs=seqs, skip=skip,
                       torchrun=self.job.spec.nproc_per_node > 1, poll_s=self.sup.log_poll_s,
                       busy_poll_s=self.sup.log_busy_poll_s,
                       on_error=on_error, max_bytes=self.sup.log_max_bytes,
                       on_late_drain=on_late_drain).start()

    def _watch(self, attempt: Attempt) -> tuple[Outcome | None, int | None]:
        """Wait for the attempt to end; kill it on cancel or hang. Returns (kill reason, returncode)."""
        spec = self.job.spec
        last_save = time.monotonic()
        while True:
            ended, rc = self._ended(attempt)
            if ended:
                return None, rc
            if self.cancel_reason:
                return Outcome.CANCELLED, self._kill(attempt, self.grace_s)
            hung_for = self._hung_for(spec)
            if hung_for is not None:
                self._hang(attempt, hung_for)
                return Outcome.HUNG, self._kill(attempt, self.grace_s if self.cancel_reason else spec.grace_s)
            if time.monotonic() - last_save >= SAVE_EVERY_S:
                self._checkpoint(attempt)
                last_save = time.monotonic()
            self.wake.wait(self.sup.tick_s)

    def _ended(self, attempt: Attempt) -> tuple[bool, int | None]:
        if self._proc is not None:    # the waiter: it ends just after the job
            rc = self._proc.poll()
            if rc is None:
                return False, None
            status = launch.read_status(_status_file(self.job, attempt.number))
            if status is not None:
                return True, status
            if not self._probe("alive", _attempt_alive, False, attempt, self.job.token):
                return True, rc   # (the waiter died with the job, or could not write the file)
            self._proc = None     # someone killed the waiter alone: watch the job as adopted
            self._waiter_lost = rc
            self.sup._event(self.job_id, "waiter_lost", attempt=attempt.number, exit=rc)
            return False, None
        # adopted: the job's own process ended when its waiter wrote the exit status, whatever
        # it left running (a data-loader worker, `tensorboard &`: killed as leftovers after)
        status = launch.read_status(_status_file(self.job, attempt.number))
        if status is not None:
            return True, status
        try:
            ended = not _attempt_alive(attempt, self.job.token)
        except Exception as e:  # a failing probe never counts as the job ending
            self._probe_error("alive", e)
            return False, None
        return ended, self._exit_status(attempt, None) if ended else None

    def _exit_status(self, attempt: Attempt, waiter_rc: int | None) -> int | None:
        """The job's exit status from its waiter's file; an adopted attempt's waiter writes it
        just after the job ended. Without the file: the waiter's own status (it was killed
        along with the job), or None (a waiter of an older rtxops, or none left)."""
        status_file = _status_file(self.job, attempt.number)
        deadline = time.monotonic() + (0.0 if waiter_rc is not None else STATUS_WAIT_S)
        while True:
            rc = launch.read_status(status_file)
            if rc is not None or time.monotonic() >= deadline:
                return rc if rc is not None else waiter_rc
            time.sleep(0.05)

    def _hung_for(self, spec: JobSpec) -> float | None:
        if spec.hang_timeout_s is None:
            return None
        now = time.monotonic()
        with self.sup._lock:
            beats = dict(self.heartbeats)
        if beats:
            silent = now - min(beats.values())
            return silent if silent > spec.hang_timeout_s else None
        if self._adopted:
            # no step heard since adoption: the job may be stepping and sending its spans to the
            # address of the daemon that started it (another port): silence is no evidence
            return None
        waited = now - self._started_mono
        return waited if waited > (spec.first_step_timeout_s or spec.hang_timeout_s) else None

    def _hang(self, attempt: Attempt, silent_s: float) -> None:
        sup, job = self.sup, self.job
        with sup._lock:
            if not self.cancel_reason:
                sup._set(job, JobState.HUNG, reason=f"no step for {silent_s:.1f} s")
            stepped = sorted(self.heartbeats)
        sup._save(job.id)
        sup._event(job.id, "hung", attempt=attempt.number, silent_s=round(silent_s, 3),
                   ranks_that_stepped=stepped, last_step=job.last_step)
        procs = self._probe("members", proctree.members, {}, self._sid(), job.token)
        captured = self._probe("stacks", stacks.capture, None, procs.values())
        if captured is not None:
            sup._event(job.id, "stacks", attempt=attempt.number, **captured.to_dict())

    def _kill(self, attempt: Attempt, grace_s: float) -> int | None:
        report = proctree.terminate(self._sid(), self.job.token, grace_s, reap=self._reap)
        if report.survivors:
            self.sup._event(self.job_id, "probe_error", probe="kill",
                            error=f"processes survived SIGKILL: {report.survivors}")
        return self._wait_leader(attempt)

    def _reap(self) -> None:
        if self._proc is not None:
            self._proc.poll()

    def _wait_leader(self, attempt: Attempt) -> int | None:
        if self._proc is None:
            return self._exit_status(attempt, None)
        try:
            return self._exit_status(attempt, self._proc.wait(timeout=5.0))
        except subprocess.TimeoutExpired:
            return None

    def _sid(self) -> int | None:
        attempt = self.job.attempt
        return _own_session(attempt) if attempt else None

    def _follow(self, attempt: Attempt, result: tuple[Outcome | None, int | None]) -> None:
        """After the leader ended: kill leftovers, store the last lines, record how the attempt ended."""
        killed_by, rc = result
        sup, job = self.sup, self.job
        if killed_by is None:
            grace = self.grace_s if self.cancel_reason else job.spec.grace_s
            report = self._probe("leftovers", proctree.terminate, None, self._sid(), job.token, grace)
            if report is not None and report.signalled:
                sup._event(job.id, "leftovers_killed", attempt=attempt.number, sigterm=report.sigterm,
                           sigkill=report.sigkill)
        drained = True
        if self._tail is not None:
            # the last lines are often the traceback: wait for the store to take them
            drained = self._tail.stop(LOG_DRAIN_S)
            offsets, seqs = self._tail.committed()
            self._tail = None
        else:
            offsets, seqs = {}, {}
        if not drained:  # the tail goes on reading; the files stay for it (and for a restart)
            sup._event(job.id, "logs_pending", attempt=attempt.number,
                       detail=f"the last lines were not stored within {LOG_DRAIN_S:.0f} s")
        info = self._classify(killed_by, rc)
        if info.outcome is Outcome.CRASHED:
            info = _with_full_disk(info, job.log_dir)
        with sup._lock:
            attempt.ended_at_ns = time.time_ns()
            attempt.outcome, attempt.exit_code, attempt.signal = info.outcome, info.exit_code, info.signal
            attempt.detail = info.detail
            attempt.log_offsets, attempt.log_seqs = offsets, seqs
        self._proc = None
        sup._event(job.id, "exited", attempt=attempt.number, outcome=info.outcome.value,
                   exit_code=info.exit_code, signal=info.signal, detail=info.detail)
        if drained and not sup.keep_log_files:   # (drained: every line is stored)
            _remove_attempt_files(job.log_dir, attempt.number)

    def _classify(self, killed_by: Outcome | None, rc: int | None) -> ExitInfo:
        if rc is None:
            decoded = None
        elif killed_by is not None:
            # rtxops signalled it: its SIGKILL is not the one classify_exit suspects
            decoded = ExitInfo(Outcome.CRASHED, None, None, f"killed by {signal_name(-rc)}") \
                if rc < 0 else classify_exit(rc)
        else:
            after = self._probe("oom_counters", OomCounters.read, None)
            evidence = after.moved_since(self._oom_before) if after and self._oom_before else []
            return classify_exit(rc, evidence)
        how = ""
        if decoded is not None:
            how = f" ({decoded.detail})"
        if killed_by is Outcome.CANCELLED:
            return ExitInfo(Outcome.CANCELLED, rc if rc and rc > 0 else None,
                            signal_name(-rc) if rc and rc < 0 else None, f"{self.cancel_reason}{how}")
        if killed_by is Outcome.HUNG:
            return ExitInfo(Outcome.HUNG, rc if rc and rc > 0 else None,
                            signal_name(-rc) if rc and rc < 0 else None, f"killed after a hang{how}")
        if self._waiter_lost is not None:
            rc = self._waiter_lost
            how = f"by {signal_name(-rc)}" if rc < 0 else f"(exit {rc})"
            return ExitInfo(Outcome.LOST, None, None,
                            f"ended after its waiter, which keeps its exit status, was killed {how}; "
                            "exit status unknown")
        return ExitInfo(Outcome.LOST, None, None,
                        "ended while re-adopted after a daemon restart; exit status unknown")

    def _decide(self, attempt: Attempt) -> bool:
        """Set the next state after an attempt; True when the job is finished."""
        sup, job, outcome = self.sup, self.job, attempt.outcome
        spec = job.spec
        if outcome is Outcome.CANCELLED or (self.cancel_reason and outcome is not Outcome.SUCCEEDED):
            self._finish(JobState.CANCELLED, self.cancel_reason or "cancelled")
            return True
        if outcome is Outcome.SUCCEEDED:
            self._finish(JobState.SUCCEEDED, attempt.detail)
            return True
        if outcome is Outcome.LOST:
            self._finish(JobState.LOST, attempt.detail)
            return True
        if self.stop_requested and self.stop_requested[0] == attempt.number:
            self._finish(JobState.CANCELLED,
                         f"stopped by {self.stop_requested[1]} sent on request: {attempt.detail}")
            return True
        hang = outcome is Outcome.HUNG
        used = job.hang_restarts if hang else job.crash_restarts
        budget = spec.max_hang_restarts if hang else spec.max_crash_restarts
        kind = "hang" if hang else "crash"
        if used >= budget:
            self._finish(JobState.FAILED, f"{attempt.detail}; {kind} restart budget ({budget}) spent")
            return True
        delay = spec.backoff(job.crash_restarts + job.hang_restarts)
        with sup._lock:
            if hang:
                job.hang_restarts += 1
            else:
                job.crash_restarts += 1
            if self.cancel_reason:
                return False
            sup._set(job, JobState.RESTARTING, reason=f"{attempt.detail}; restarting in {delay:g} s",
                     next_attempt_at_ns=time.time_ns() + int(delay * 1e9))
        if sup._save(job.id):   # saved, with what follows: a next daemon resumes the backoff
            _status_file(job, attempt.number).unlink(missing_ok=True)
        sup._event(job.id, "restart_scheduled", kind=kind, delay_s=delay, restarts_left=budget - used - 1)
        self._delay, self._scheduled = delay, kind
        return False

    def _backoff(self) -> bool:
        """Wait out the backoff; True when the job was cancelled meanwhile (and is now finished)."""
        deadline = time.monotonic() + self._delay
        while not self.cancel_reason:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.wake.wait(min(remaining, self.sup.tick_s * 4))
        with self.sup._lock:   # the restart scheduled never happened: it is not counted
            if self._scheduled == "hang":
                self.job.hang_restarts = max(0, self.job.hang_restarts - 1)
            elif self._scheduled == "crash":
                self.job.crash_restarts = max(0, self.job.crash_restarts - 1)
        self._finish(JobState.CANCELLED, self.cancel_reason)
        return True

    def _finish(self, state: JobState, reason: str) -> None:
        with self.sup._lock:
            self.sup._set(self.job, state, reason=reason, next_attempt_at_ns=None)
        self.sup._save(self.job_id)   # (which removes the attempt's status file once saved)
        if not self.sup.keep_log_files and not self.sup.sink_errors:
            try:
                Path(self.job.log_dir).rmdir()
            except OSError:
                pass

    def _checkpoint(self, attempt: Attempt) -> None:
        if self._tail is not None:
            with self.sup._lock:
                attempt.log_offsets, attempt.log_seqs = self._tail.committed()
        self.sup._save(self.job_id)

    def _probe(self, name: str, fn, default, *args):
        try:
            return fn(*args)
        except Exception as e:  # status probes never fail a job
            self._probe_error(name, e)
            return default

    def _probe_error(self, name: str, e: Exception) -> None:
        if name not in self._probe_errors:
            self._probe_errors.add(name)
            log.warning("job %s: probe %s failed: %s", self.job_id, name, e)
            self.sup._event(self.job_id, "probe_error", probe=name, error=f"{type(e).__name__}: {e}")


def _awaiting_its_waiter(attempt: Attempt) -> bool:
    """Whether the attempt's leader has exited and its waiter has not reaped it yet: the waiter
    writes the exit status as it does (the runner of an adopted attempt waits for it; taken for
    lost at once, a job that had just succeeded read ``lost``)."""
    p = proctree.read_proc(attempt.pid) if attempt.pid is not None else None
    return (p is not None and p.state == "Z"
            and (attempt.start_ticks is None or p.start_ticks == attempt.start_ticks))


def _attempt_alive(attempt: Attempt, token: str) -> bool:
    """Whether any process of the attempt still runs (its leader, its session, its token carriers)."""
    if attempt.pid is not None:
        p = proctree.read_proc(attempt.pid)
        if p is not None and p.alive and (attempt.start_ticks is None or p.start_ticks == attempt.start_ticks):
            return True
    return bool(proctree.members(_own_session(attempt), token))


def _with_full_disk(info: ExitInfo, log_dir: str) -> ExitInfo:
    """``info`` with a word on the disk of the job's output files when it is full: the job's
    writes to stdout and stderr then fail, and a crash has no traceback to show why."""
    try:
        free = shutil.disk_usage(log_dir).free
    except OSError:
        return info
    if free >= FULL_DISK_BYTES:
        return info
    return dataclasses.replace(info, detail=f"{info.detail}; the disk of its output files ({log_dir}) "
                                            f"is full ({free} bytes free)")


def _called(fn):
    """``fn`` returning True once it returned (for :meth:`Supervisor._sink_call`'s default)."""
    def call(*args: Any) -> bool:
        fn(*args)
        return True
    call.__name__ = getattr(fn, "__name__", "sink call")
    return call


def _remove_attempt_files(log_dir: str, number: int) -> None:
    """Delete an attempt's output files once every line of them is stored."""
    for stream in STREAMS:
        Path(log_dir, f"attempt-{number}.{stream}").unlink(missing_ok=True)
    shutil.rmtree(Path(log_dir, f"torchrun-{number}"), ignore_errors=True)


def _status_file(job: Job, attempt: int) -> Path:
    """Where the attempt's waiter writes its exit status."""
    return Path(job.log_dir, f"attempt-{attempt}.exit")


def _own_session(attempt: Attempt) -> int | None:
    """The attempt's session id (its leader's pid), or None once that pid is another process's:
    after a daemon restart the number may lead an unrelated session, which is not the job's."""
    if attempt.pid is None:
        return None
    if attempt.start_ticks is not None:
        p = proctree.read_proc(attempt.pid)
        if p is not None and p.start_ticks != attempt.start_ticks:
            return None
    return attempt.pid


def _new_id(taken: Mapping[str, Any]) -> str:
    while True:
        job_id = f"j-{secrets.token_hex(4)}"
        if job_id not in taken:
            return job_id
