"""The daemon process: one per machine, the only DuckDB writer.

:class:`Daemon` assembles the store, the plan board and the job supervisor behind the FastAPI app
and serves it with uvicorn, in the foreground (``rtxops daemon``) or on a thread (``rtxops run``
with no daemon around). SIGTERM/SIGINT: stop accepting jobs, stop the running ones gracefully while
the server still takes their last spans, stop serving, flush the store, exit 0. SIGHUP: reload
plans from disk.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import httpx
import uvicorn

from rtxops import settings
from rtxops.evolve.config import LoopConfig
from rtxops.evolve.scheduler import EvolveScheduler
from rtxops.evolve.scheduler import enabled as evolve_enabled
from rtxops.telemetry.store import Store

from . import systemd
from .home import DEFAULT_HOST, DEFAULT_PORT, Home
from .hosts import is_loopback
from .job_sink import DuckDBJobSink
from .logtail import MAX_STORED_BYTES
from .plans import PlanBoard
from .quiet_server import QuietServer
from .retention import RetentionThread, retention_from
from .supervisor import Supervisor

log = logging.getLogger("rtxops.daemon")

# seconds between a plan's publication and its installation in a job: the job's poll interval
# (2 s by default) and fetching + verifying the signed bundle (the telemetry's lag, up to an
# export interval, is made up from the job's step rate: Daemon.current_step)
PLAN_LEAD_S = 4.0
MAX_BEHIND_S = 20.0   # a job's step is extrapolated this far at most past its newest reported one


WRITE_ERROR_SHOWN_S = 30.0  # /readyz reports a failed store write this long
LOG_BUSY_POLL_S = 1.0  # a job's output files are read this often while it keeps printing
SERVER_GRACE_S = 5.0  # how long requests in flight at shutdown may take to finish


class Daemon:
    def __init__(self, home: Home, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 job_grace_s: float = 10.0, retention: str | None = None) -> None:
        # a malformed RTXOPS_EVOLVE_* setting stops the daemon here, before it touches anything
        self.evolve_config = LoopConfig.from_env() if evolve_enabled() else None
        self.retention_s = retention_from(retention)   # and so does a malformed retention
        _check_policies()  # and so does a misspelt RTXOPS_POLICIES (it would at the first plan)
        self.job_log_max_bytes = settings.whole_number("RTXOPS_JOB_LOG_MAX_BYTES", MAX_STORED_BYTES)
        if port:
            _check_port_free(host, port)   # and so does a port in use (uvicorn: a log line, exit 3)
        self.home = home.ensure()
        self.host, self.port = host, port or _free_port(host)
        self.job_grace_s = job_grace_s
        self.token = home.token(create=True)
        self.store = Store(home.store)
        from rtxops.governance import GovernanceError
        from rtxops.governance.authority import Authority  # signing key: made and trusted on first start

        try:
            self.authority = Authority(home.root, self.store)
        except GovernanceError as e:   # an unreadable keyring, say: one line, and the store closed
            self.store.close()
            raise ValueError(str(e)) from None
        except BaseException:
            self.store.close()
            raise
        self.board = PlanBoard(home.plans, authority=self.authority)
        self.jobs_sink = DuckDBJobSink(self.store)
        self.supervisor: Supervisor | None = None
        self.evolve: EvolveScheduler | None = None
        self.retention: RetentionThread | None = None
        self._step_marks: dict[str, tuple[int, int]] = {}
        self._step_rates: dict[str, float] = {}
        self._rate_settled: set[str] = set()
        self._newest_steps: dict[str, tuple[int, int]] = {}   # job → (step, its end ns)
        self.server: QuietServer | None = None
        self._stopping = threading.Event()
        self._shutdown_lock = threading.Lock()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._served = threading.Event()  # the server's run() has returned (it no longer answers)
        self.exit_code = 0

    # ---- parts ------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host   # an IPv6 address
        return f"http://{host}:{self.port}"

    def _make_supervisor(self) -> Supervisor:
        env = {
            "RTXOPS_TELEMETRY": "otlp",
            "RTXOPS_DAEMON": self.url,
            "RTXOPS_DAEMON_URL_FILE": str(self.home.url_file),
            "RTXOPS_TOKEN": self.token or "",
            "RTXOPS_READINGS_FACTORY": "rtxops.telemetry.job:readings_for_job",
            "RTXOPS_KEYRING": str(self.authority.keyring_file),  # jobs verify plan bundles
            "RTXOPS_PLAN_VERIFIER": "rtxops.governance.authority:plan_verifier_for_job",
            # `python` in a submitted command is the interpreter rtxops is installed in (put in
            # front of the PATH the job has: the caller's, or the daemon's)
            "PATH": os.path.dirname(sys.executable),
        }
        # polls at 5 Hz: a busier supervisor steals CPU from the jobs it watches on small machines;
        # a job's output is stored at most once a second while it keeps printing (each store is a
        # DuckDB transaction and a follower's request; `bench/run_cpu.py`)
        return Supervisor(self.jobs_sink, self.home.jobs, extra_env=env,
                          recovered_jobs=self.jobs_sink.saved_jobs(), tick_s=0.2, log_poll_s=0.2,
                          log_busy_poll_s=LOG_BUSY_POLL_S,
                          log_max_bytes=self.job_log_max_bytes)

    def _make_evolve_loop(self):
        from rtxops.evolve.loop import EvolveLoop
        from rtxops.runtime.registry import default_registry

        return EvolveLoop(self.store, self.board, default_registry(), self.running_jobs,
                          self.evolve_config, unfinished_jobs=self.unfinished_jobs,
                          current_step=self.current_step)

    def _a_job_is_warm(self) -> bool:
        """Whether a running job has reported the loop's ``min_steps`` (before that the loop has
        nothing to look at, and building it would slow the job's start)."""
        if self.supervisor is None or self._stopping.is_set():
            return False
        return any(last is not None and last >= self.evolve_config.min_steps
                   for last in self.supervisor.running().values())

    def unfinished_jobs(self) -> set[str]:
        if self.supervisor is None:
            return set()
        return self.supervisor.unfinished()

    def running_jobs(self) -> list[str]:
        if self.supervisor is None or self._stopping.is_set():
            return []
        return list(self.supervisor.running())

    def on_batch(self, batch) -> None:
        """Heartbeats for the supervisor from every decoded batch's step spans (stored or not)."""
        spans = batch.spans
        if self.supervisor is None or spans.num_rows == 0:
            return
        import pyarrow.compute as pc

        # the four columns read, not the whole table (~40 columns: ~0.15 ms a request)
        steps = spans.select(["job_id", "rank", "step", "end_ns"]).filter(
            pc.equal(spans["name"], "rtx.step"))
        for job_id, rank, step, end_ns in zip(steps["job_id"].to_pylist(), steps["rank"].to_pylist(),
                                              steps["step"].to_pylist(), steps["end_ns"].to_pylist()):
            # step rates only for the supervisor's running jobs: spans of any other job id (any
            # OTLP client) would grow these maps for good
            if job_id and step is not None and self.supervisor.heartbeat(job_id, step, rank or 0):
                self._note_step(job_id, step, end_ns)

    def _note_step(self, job_id: str, step: int, end_ns: int | None) -> None:
        """Keep each job's step rate (steps per second of its own clock, over ≥ 1 s; before a
        whole second is seen, over what has been seen: a plan published early still gets a lead)."""
        if end_ns is None:
            return
        if step > self._newest_steps.get(job_id, (-1, 0))[0]:
            self._newest_steps[job_id] = (step, end_ns)
        first = self._step_marks.setdefault(job_id, (step, end_ns))
        if step <= first[0] or end_ns <= first[1]:
            return
        rate = (step - first[0]) / ((end_ns - first[1]) / 1e9)
        if end_ns - first[1] >= 1_000_000_000:
            self._step_rates[job_id] = rate
            self._step_marks[job_id] = (step, end_ns)
            self._rate_settled.add(job_id)
        elif job_id not in self._rate_settled:  # an estimate until a whole second is seen
            self._step_rates[job_id] = rate

    def current_step(self, job_id: str) -> int | None:
        """The step a running job has reached by now, or None: its newest reported step plus
        its step rate times the time since that step ended (a settled job reports every 10 s)."""
        try:
            job = self.supervisor.job(job_id)
        except Exception:
            return None
        if job.state.terminal or job.last_step is None:
            return None
        return reached_step(job.last_step, self._newest_steps.get(job_id),
                            self._step_rates.get(job_id, 0.0), time.time_ns())

    def last_step(self, job_id: str) -> int | None:
        """The step a running job will have reached by the time it installs a plan published now,
        or None: :meth:`current_step` plus its step rate times PLAN_LEAD_S (the job polls,
        fetches and verifies the bundle)."""
        now = self.current_step(job_id)
        if now is None:
            return None
        return now + math.ceil(self._step_rates.get(job_id, 0.0) * PLAN_LEAD_S)

    def readiness_problems(self) -> list[str]:
        problems = []
        if self.store.closed:
            problems.append("the store is closed")
        if self._stopping.is_set():
            problems.append("the daemon is stopping")
        stats = self.store.stats()
        if stats.get("queue_batches", 0) >= self.store.max_queue_batches:
            problems.append("the store's write queue is full")
        if self.store.broken:
            problems.append(f"the store is being reopened after a fatal error: {self.store.broken}")
        failed = self.store.last_write_error
        if failed and time.monotonic() - failed[0] < WRITE_ERROR_SHOWN_S:
            problems.append(f"a store write failed {time.monotonic() - failed[0]:.0f} s ago: {failed[1]}")
        return problems

    def swap_count(self) -> int:
        return self.store.query("SELECT count(*) AS n FROM swaps")[0]["n"]

    # ---- serving ----------------------------------------------------------------------------
    def prepare(self) -> Daemon:
        """Start the supervisor (and the evolve scheduler): jobs can be submitted before the HTTP
        server is built, so ``rtxops run``'s job starts while the app comes up."""
        if self.supervisor is None:
            self.supervisor = self._make_supervisor()
        if self.evolve_config is not None and self.evolve is None:
            self.evolve = EvolveScheduler(self._make_evolve_loop, self.evolve_config.interval_s,
                                          wait_for=self._a_job_is_warm).start()
        if self.retention_s is not None and self.retention is None:
            self.retention = RetentionThread(self.store, self.retention_s).start()
        return self

    def _server(self) -> QuietServer:
        from .app import create_app

        self.prepare()
        # the policies load here, after prepare(): `rtxops run`'s job is already starting, and a
        # first plan published soon after start does not wait for them
        self.authority.policies  # noqa: B018
        config = uvicorn.Config(create_app(self), host=self.host, port=self.port,
                                log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=SERVER_GRACE_S)
        self.server = QuietServer(config)
        return self.server

    def _bound_port(self) -> int:
        for server in self.server.servers:
            for sock in server.sockets:
                return sock.getsockname()[1]
        return self.port

    def _announce(self) -> None:
        self.port = self._bound_port()
        # whole or not at all: running jobs read it to find a daemon restarted on another port
        tmp = self.home.url_file.with_name(f"{self.home.url_file.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(self.url + "\n")
            tmp.replace(self.home.url_file)
        finally:
            tmp.unlink(missing_ok=True)
        self.home.pid_file.write_text(f"{os.getpid()}\n")
        log.info(json.dumps({"event": "ready", "url": self.url, "home": str(self.home.root)}))
        if not is_loopback(self.host):
            log.warning(json.dumps({"event": "not_loopback", "host": self.host, "note": (
                "reachable from other machines: every request needs the token, the dashboard "
                "too (use an SSH tunnel to a loopback daemon to browse it)")}))
        systemd.notify(f"READY=1\nSTATUS=serving {self.url}")

    def serve_forever(self) -> int:
        """Foreground: serve until SIGTERM/SIGINT, then shut down cleanly. Returns the exit code."""
        server = self._server()
        watchdog_stop = threading.Event()
        # our own handlers: uvicorn's re-raise the signal after shutdown, and SIGTERM must exit 0
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        # jobs are stopped while the server still answers: their last spans and plan reports land,
        # /readyz says 503 and submits get 503 meanwhile; then the server stops (see shutdown)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: threading.Thread(target=self.shutdown, name="rtxops-shutdown",
                                                           daemon=True).start())
        signal.signal(signal.SIGHUP, self._on_sighup)

        announcer = threading.Thread(target=self._announce_when_started, daemon=True)
        announcer.start()
        systemd.start_watchdog(watchdog_stop, self.answers)
        try:
            server.run()
        finally:
            self._served.set()
            watchdog_stop.set()
            self.shutdown()
        return self.exit_code

    def answers(self, timeout: float = 5.0) -> bool:
        """Whether the server answers ``/healthz`` within ``timeout`` (its event loop and worker
        threads are not stuck): the systemd watchdog pings only then."""
        try:
            return httpx.get(self.url + "/healthz", timeout=timeout, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def _announce_when_started(self) -> None:
        while not self.server.started and not self.server.should_exit:
            time.sleep(0.02)
        if not self.server.started:
            return
        try:
            self._announce()
        except OSError as e:   # (a full disk): a daemon no client can find must not go on
            log.error(json.dumps({"event": "cannot_announce", "error": str(e),
                                  "files": [str(self.home.url_file), str(self.home.pid_file)]}))
            self.exit_code = 1
            self.server.should_exit = True

    def start_in_thread(self, wait: bool = True, timeout: float = 30.0) -> Daemon:
        """Serve on a background thread (for ``rtxops run`` without a running daemon). With
        ``wait=False`` the supervisor can take jobs at once while the server comes up; call
        :meth:`wait_started` before using the HTTP API."""
        server = self._server()
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  (older uvicorn)
        self._thread = threading.Thread(target=self._serve, name="rtxops-daemon", daemon=True)
        self._thread.start()
        return self.wait_started(timeout) if wait else self

    def _serve(self) -> None:
        try:
            self.server.run()
        finally:
            self._served.set()

    def wait_started(self, timeout: float = 30.0,
                     stopping: Callable[[], bool] = lambda: False) -> Daemon:
        """Wait for :meth:`start_in_thread`'s server to serve, then announce it; return early,
        unannounced, once ``stopping()`` says so (the caller shuts it down)."""
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if stopping():
                return self
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the in-process daemon did not start")
            time.sleep(0.01)
        try:
            self._announce()
        except OSError as e:
            raise RuntimeError(f"the in-process daemon cannot write {self.home.url_file}: {e}") from None
        return self

    def _on_sighup(self, *_) -> None:
        # signal handlers run on the main thread, which is the event loop's: the reload (it waits
        # for a publish in flight, parses the policies) goes to a thread of its own
        threading.Thread(target=self.reload, name="rtxops-reload", daemon=True).start()

    def reload(self) -> None:
        """SIGHUP: re-read plans and policies from disk. A broken file is logged and the policies
        in force stay (raising here would end the reload's thread with a traceback)."""
        try:
            self.board.reload()
        except Exception as e:
            log.error(json.dumps({"event": "reload_failed", "error": f"{type(e).__name__}: {e}",
                                  "kept": "the policies loaded before stay in force"}))
            return
        log.info(json.dumps({"event": "reloaded"}))

    def shutdown(self) -> None:
        """Stop accepting jobs, stop the running ones gracefully while the server still takes their
        telemetry (and answers 503 on /readyz), stop serving, flush the store. Idempotent; a second
        caller waits for the first to finish."""
        with self._shutdown_lock:
            if self._stopped:
                return
            self._stopping.set()
            self.board.stop_waits()   # plan long polls answer now: none holds the server's stop
            if self.supervisor is not None:   # from the moment /readyz says it is stopping
                self.supervisor.refuse_new_jobs()
            systemd.notify("STOPPING=1")
            if self.evolve is not None:
                self.evolve.stop()
            if self.retention is not None:
                self.retention.stop()
            if self.supervisor is not None:
                self.supervisor.shutdown(self.job_grace_s)
            if self.server is not None:
                self.server.should_exit = True
                # the store closes after the last request is answered: uvicorn gives requests in
                # flight SERVER_GRACE_S, then cancels them (a log follower's long poll, say)
                if (self.server.started or self._thread is not None) \
                        and not self._served.wait(SERVER_GRACE_S + 5):
                    log.error(json.dumps({"event": "server_did_not_stop",
                                          "waited_s": SERVER_GRACE_S + 5}))
            self.authority.close()  # last: the jobs and submits above must not wait for it
            self.store.close()
            for f in (self.home.pid_file, self.home.url_file):
                try:
                    if f.read_text().strip() in (str(os.getpid()), self.url):
                        f.unlink()
                except OSError:
                    pass
            self._stopped = True
            log.info(json.dumps({"event": "stopped"}))


def _check_policies() -> None:
    """ValueError when the policy folder cannot be found (RTXOPS_POLICIES names none)."""
    from rtxops.governance import UsageError
    from rtxops.governance.policy import default_policy_dir

    try:
        default_policy_dir()
    except UsageError as e:
        raise ValueError(str(e)) from None


def _check_port_free(host: str, port: int) -> None:
    """ValueError when ``host:port`` cannot be listened on (in use, or no such address here)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds
            sock.bind(address)
    except OSError as e:
        raise ValueError(f"cannot listen on {host} port {port}: {e.strerror or e} (another "
                         "daemon or program holds it? `--port 0` takes a free one)") from None


def _free_port(host: str) -> int:
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as sock:   # an IPv6 host needs an IPv6 socket
        sock.bind(address)
        return sock.getsockname()[1]


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        try:
            body = json.loads(msg) if msg.startswith("{") else {"message": msg}
        except ValueError:
            body = {"message": msg}
        if record.exc_info:   # (log.exception: the reason is in the exception)
            body["error"] = self.formatException(record.exc_info)
        return json.dumps({"ts": round(record.created, 3), "level": record.levelname.lower(),
                           "logger": record.name, **body})


def configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter())
    root = logging.getLogger("rtxops")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False


def reached_step(reported: int, newest: tuple[int, int] | None, rate: float, now_ns: int) -> int:
    """A job's step now: ``reported`` (its heartbeat's), or ``newest`` = (step, end ns) carried on
    at ``rate`` steps a second for the time since it ended, up to MAX_BEHIND_S."""
    if newest is None:
        return reported
    step, end_ns = newest
    behind_s = min(max(now_ns - end_ns, 0) / 1e9, MAX_BEHIND_S)
    return max(reported, step + math.floor(rate * behind_s))
