"""The ``rtxops`` command. Thin: parse, call a package function, print."""
from __future__ import annotations

import contextlib

import json
import math
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rtxops.cli_evolve import register as _register_evolve
from rtxops.cli_governance import register as _register_governance
from rtxops.cli_text import HomeOpt, inert, plain

app = typer.Typer(help="rtxops: a self-optimizing runtime for PyTorch training jobs.",
                  no_args_is_help=True, add_completion=False)
daemon_app = typer.Typer(help="The rtxops daemon: supervises jobs, stores telemetry, serves plans.")
telemetry_app = typer.Typer(help="Look at and export stored telemetry.", no_args_is_help=True)
app.add_typer(daemon_app, name="daemon")
app.add_typer(telemetry_app, name="telemetry")
_register_governance(app)
_register_evolve(app)
class _Messages(Console):
    """stderr. A reader that went away (``rtxops run ... 2>&1 | head``) loses the messages that
    follow, not the exit status: Rich's default exits 1 there, in place of the job's."""

    def on_broken_pipe(self) -> None:
        _silence(self.file)


err = _Messages(stderr=True, emoji=False)
out = Console(highlight=False, soft_wrap=True, markup=False, emoji=False)  # names, paths as they are
TELEMETRY_FACTORY = "rtxops.telemetry.job:readings_for_job"
PLAN_VERIFIER = "rtxops.governance.authority:plan_verifier_for_job"  # a job verifies signed plans
FOLLOW_PACE_S = 0.5      # a follower caught up asks for a job's new lines this often at most
FOLLOW_PAGE_LINES = 1000  # the daemon's page of lines (a full page: more are waiting)
# the command's own options stay its own: rtxops' options come before the command
PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True,
               "allow_interspersed_args": False}


def _fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"[red]rtxops: {escape(message)}[/red]")
    return typer.Exit(code)


def _home(home: Optional[Path] = None):
    from rtxops.daemon.home import Home

    return Home.resolve(home)


def _client(home: Optional[Path] = None):
    from rtxops.daemon.client import DaemonClient

    client = DaemonClient.find(_home(home))
    if client is None:
        raise _fail("no daemon is running for this RTXOPS_HOME (start one with `rtxops daemon --detach`)", 1)
    return client


def _refuse_unknown_option(command: List[str], name: str) -> None:
    """An option this command does not know, before ``--``, is taken for the job's command
    (``rtxops run --hom x -- python t.py`` would try to start ``--hom``): refused, named."""
    if command and command[0].startswith("-") and command[0] != "-":
        raise _fail(f"`{name}` has no option {command[0]} (`rtxops {name} --help` lists them); "
                    "the job's command goes after --")


@app.callback()
def main() -> None:
    """rtxops: a self-optimizing runtime for PyTorch training jobs."""


# ---- run -----------------------------------------------------------------------------------------
@app.command(context_settings=PASSTHROUGH)
def run(
    command: List[str] = typer.Argument(..., help="the command to run, after --"),
    plan: Optional[Path] = typer.Option(None, help="plan JSON or signed plan bundle folder to start with (default: reference)"),
    summary: bool = typer.Option(True, help="print what the runtime did when the job ends"),
    json_summary: Optional[Path] = typer.Option(None, "--json", help="also write the summary JSON here"),
    direct: bool = typer.Option(False, help="no daemon: run the command as a plain child process "
                                            "and write telemetry straight to the store"),
    name: str = typer.Option("", help="job name (daemon mode)"),
    telemetry: bool = typer.Option(True, help="record and export spans (--no-telemetry: runtime only)"),
    compile_model: bool = typer.Option(False, help="compile the whole model with torch.compile in "
                                       "the background; swap it in when ready, keep it if faster"),
    fuse_optimizer: bool = typer.Option(False, help="try torch's fused implementation of the job's "
                                        "optimizer (Adam, AdamW, SGD, Adagrad); keep it if faster"),
    home: Optional[Path] = HomeOpt,
) -> None:
    """Run COMMAND with the runtime enabled: ``rtxops run -- python train.py ARGS``.

    With a daemon running, the job is submitted to it and its output followed; without one, a
    daemon is started in this process for the job's lifetime."""
    _refuse_unknown_option(command, "run")
    if home is not None:
        os.environ["RTXOPS_HOME"] = str(home.resolve())   # the job and its daemon use it too
    if plan is not None:
        _check_plan(plan)
    if json_summary is not None and (json_summary.is_dir() or not json_summary.resolve().parent.is_dir()
                                     or not os.access(json_summary.resolve().parent, os.W_OK)):
        # found out before the job runs, not after hours of training
        raise _fail(f"--json {json_summary}: not a file in an existing folder this user may write")
    if not direct:
        _reconnect_s()  # a malformed RTXOPS_RECONNECT_S is said before the job is submitted
    _check_job_environment(command, plan_given=plan is not None, direct=direct, telemetry=telemetry)
    if compile_model:
        os.environ["RTXOPS_COMPILE_MODEL"] = "1"  # the job inherits it, directly or via the daemon
    if fuse_optimizer:
        os.environ["RTXOPS_FUSE_OPTIMIZER"] = "1"
    with tempfile.TemporaryDirectory(prefix="rtxops-run-") as tmp:
        summary_file = Path(tmp) / "summary.json"
        if direct:
            code = _run_direct(command, plan, summary_file, telemetry)
        else:
            code = _run_supervised(command, plan, summary_file, name, telemetry)
        data, unreadable = _read_summary(summary_file)
    _report(data, unreadable, summary, json_summary)
    raise typer.Exit(code)


def _report(data: Optional[dict], unreadable: str, summary: bool, json_summary: Optional[Path]) -> None:
    """What ``rtxops run`` says once the job ended: its summary, and ``--json``'s file."""
    if data is None:
        if summary or json_summary:
            _note("rtxops: the job left " + (f"an unreadable summary ({unreadable})" if unreadable
                  else "no summary (no Python process of it imported torch, which starts the "
                     "runtime; or a runtime that did not start, as its output says; or it was killed)"))
        return
    if json_summary:
        try:
            json_summary.write_text(json.dumps(data, indent=2))
        except OSError as e:
            _note(f"rtxops: cannot write {json_summary}: {e.strerror or e}")
    if summary:
        from rtxops.runtime.summary import per_op

        try:
            _print_summary(data, per_op(data))
        except Exception as e:   # the job's to write: any shape, never our exit status
            _note(f"rtxops: the job left an unreadable summary ({type(e).__name__}: {e})")


def _silence(stream) -> None:
    """Send what is still written to ``stream`` nowhere (its reader went away), so that neither
    a later write nor the flush at exit fails."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def _check_job_environment(command: list[str], *, plan_given: bool = False, direct: bool = False,
                           telemetry: bool = True) -> None:
    """What a job started from this environment reads of it, checked before it starts (it would
    train on without them, saying why only in its output): a plan ``RTXOPS_PLAN`` names (unless
    ``--plan`` gave one), the runtime's settings, its plugin modules (without them it would run
    without rtxops) and, with ``telemetry``, its export settings."""
    if not plan_given and os.environ.get("RTXOPS_PLAN"):   # the job reads it as it would --plan
        _check_plan(Path(os.environ["RTXOPS_PLAN"]), "RTXOPS_PLAN=")
    from rtxops import settings

    try:
        settings.check_runtime()
        if os.environ.get("RTXOPS_VARIANT_MODULES"):   # (finding the job's Python costs an import)
            settings.variant_modules(_job_search_path(command), python=_other_python(command, direct))
        if telemetry:
            settings.check_job(direct)
    except settings.SettingError as e:
        raise _fail(str(e)) from None


def _other_python(command: list[str], direct: bool) -> Optional[str]:
    """The job's interpreter when it is a Python of another environment than this one's (its
    packages are not this one's); None for this one's, or a command that is no Python (this
    one's path is then the best guess)."""
    import shutil

    from rtxops.daemon.launch import is_python

    if not is_python(command[0]):
        return None
    # a daemon's job finds a bare `python` in this one's folder first (the daemon puts it in
    # front of the job's PATH)
    path = None if direct or os.sep in command[0] else os.pathsep.join(
        [os.path.dirname(sys.executable), os.environ.get("PATH", os.defpath)])
    found = shutil.which(command[0], path=path)
    if found is None:
        return None
    # the same folder and file: a venv's pythons all link to their base interpreter, which
    # the base's own folder holds too; the folder alone would take python3.11 for python3.12
    same = (os.path.dirname(os.path.abspath(found)) == os.path.dirname(os.path.abspath(sys.executable))
            and os.path.samefile(found, sys.executable))
    return None if same else found


def _job_search_path(command: list[str]) -> tuple[str, ...]:
    """Where the job's Python looks for modules before the path it shares with this one: its
    script's folder (``python train.py``) and the working directory (``-c``, ``-m``)."""
    scripts = [a for a in command[1:] if a.endswith(".py") and os.path.isfile(a)]
    return tuple(os.path.dirname(os.path.abspath(a)) for a in scripts[:1]) + (os.getcwd(),)


MAX_PLAN_BYTES = 64 << 20


def _check_plan(plan: Path, given_as: str = "") -> None:
    """A plan the job could not read or parse is refused before it runs (the job would train on
    the reference plan); whether its variants exist is for the job's registry to say, and a
    bundle folder is verified by the job, with its keyring. ``given_as``: the variable that
    named it, for the message."""
    from rtxops.runtime.errors import PlanError
    from rtxops.runtime.plan import Plan

    name = f"plan {given_as}{plan}"
    if not plan.exists():   # a plan JSON file or a signed bundle folder
        raise _fail(f"{name} does not exist")
    if plan.is_dir():
        from rtxops.governance import SIGNATURE

        if not (plan / SIGNATURE).is_file():
            raise _fail(f"{name} is a folder but no signed plan bundle (it has no {SIGNATURE}; "
                        "`rtxops sign --kind plan` makes one)")
        return
    try:
        if not stat.S_ISREG(plan.stat().st_mode):   # opening a FIFO would wait for a writer
            raise _fail(f"{name} is not a regular file")
        with open(plan, "rb") as f:
            raw = f.read(MAX_PLAN_BYTES + 1)
        if len(raw) > MAX_PLAN_BYTES:
            raise _fail(f"{name} is over {MAX_PLAN_BYTES >> 20} MB: no plan is")
        Plan.from_json(raw)
    except OSError as e:
        raise _fail(f"cannot read {name}: {e.strerror or e}") from None
    except PlanError as e:
        raise _fail(f"{name}: {e}") from None


def _run_direct(command: list[str], plan: Optional[Path], summary_file: Path, telemetry: bool) -> int:
    from rtxops.runtime.bootstrap import child_environment
    from rtxops.telemetry.store import default_path

    env = child_environment(os.environ, plan=str(plan) if plan else None, summary=str(summary_file),
                            readings_factory=TELEMETRY_FACTORY, plan_verifier=PLAN_VERIFIER)
    env["RTXOPS_TELEMETRY"] = "duckdb" if telemetry else "off"
    env["RTXOPS_RUN_ID"] = uuid.uuid4().hex   # its processes add their summaries up
    store = Path(env.get("RTXOPS_STORE") or default_path()).resolve()
    if telemetry and store == (_home().root / "rtxops.duckdb").resolve():
        from rtxops.daemon.client import DaemonClient

        client = DaemonClient.find(_home())
        if client is not None:  # it holds the store: every span of the job would be lost
            raise _fail(f"a daemon serves {_home().root} at {client.url} and holds its store: "
                        "run without --direct (the job goes to that daemon), or stop it first")
    if store.parent == _home().root:
        _home().ensure()
    store.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    env["RTXOPS_STORE"] = str(store)
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as e:
        err.print(f"[red]rtxops: cannot start {escape(repr(command[0]))}: {escape(str(e.strerror))}[/red]")
        return 127 if isinstance(e, FileNotFoundError) else 126

    interrupts = []

    def forward(signum, frame):
        # Ctrl-C (at a terminal, or a runner signalling the group) reaches the job in this process
        # group as well: a second SIGINT would interrupt its exit handlers (its last telemetry).
        # A SIGINT sent to rtxops alone is forwarded when it comes again.
        if signum == signal.SIGINT:
            interrupts.append(signum)
            if len(interrupts) == 1 and _same_process_group(child.pid):
                return
        child.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        code = child.wait()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code


def _run_supervised(command: list[str], plan: Optional[Path], summary_file: Path, name: str,
                    telemetry: bool, handovers: int = 3) -> int:
    from rtxops.daemon.client import DaemonClient, DaemonClosing, DaemonError
    from rtxops.daemon.server import Daemon

    home = _home()
    client = DaemonClient.find(home)
    local = None
    env = {"RTXOPS_SUMMARY": str(summary_file)}
    for region in ("RTXOPS_COMPILE_MODEL", "RTXOPS_FUSE_OPTIMIZER"):
        if os.environ.get(region):
            env[region] = os.environ[region]
    if not telemetry:
        env["RTXOPS_TELEMETRY"] = "off"
    if plan:
        env["RTXOPS_PLAN"] = str(plan.resolve())
    # SIGTERM/SIGHUP (kill, timeout, a scheduler's preemption) stop the job as Ctrl-C does: the
    # job runs in its own session, so it would outlive this process otherwise. While the run
    # starts they are only recorded, and raised where the start looks (check_stop): raised from
    # the handler, one landed between importlib's `_imp.acquire_lock()` and its `try` (the weakref
    # callback of a module lock), left the import lock held for good, and this process's daemon
    # hung on its first import
    signalled: list[int] = []
    starting = True

    def stop_by_signal(signum, frame):
        signalled.append(signum)
        if not starting:
            _stop_by_signal(signum, frame)

    def check_stop() -> None:
        if signalled:
            raise _Stopped(signalled[0])

    previous_hook = sys.unraisablehook

    def unraisable(hook_args, default=previous_hook):
        # a stop raised where Python cannot pass it on (a weakref callback of an import under
        # way, a __del__) is dropped there without a report; before the follow loop none is
        # raised from the handler (check_stop raises it)
        if not isinstance(hook_args.exc_value, _Stopped):
            default(hook_args)

    def cancel_own_job(signum: int) -> int:
        """Stopped before the follow loop took over: the job, if it exists, is cancelled."""
        if job_id is not None:
            with contextlib.suppress(Exception):   # (a local daemon's shutdown stops it anyway)
                if client is not None:
                    client.cancel(job_id)
                else:
                    local.supervisor.cancel(job_id)
            err.print(f"rtxops: cancelled job {job_id}")
        return 128 + signum

    stops = {s: signal.signal(s, stop_by_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    sys.unraisablehook = unraisable
    job_id = None
    try:
        if client is None:
            # no daemon: one in this process; the job starts while its HTTP server comes up
            from rtxops.daemon.errors import JobSpecError
            from rtxops.daemon.jobs import JobSpec

            import duckdb

            from rtxops.telemetry.store import StoreError

            def open_here():
                """A daemon in this process, or None while another process holds the store."""
                try:
                    return Daemon(home, port=0).prepare()
                except ValueError as e:  # a malformed RTXOPS_EVOLVE_* setting
                    raise DaemonError(str(e)) from None
                except (StoreError, duckdb.IOException) as e:
                    if "Could not set lock" not in str(e):   # a damaged store, or of a newer rtxops
                        raise DaemonError(f"cannot open the store of {home.root}: {e}") from None
                    return None

            local = open_here()
            if local is None:
                stuck = _silent_daemon(home)   # a daemon that does not answer holds it
                if stuck:
                    raise DaemonError(f"cannot open the store of {home.root}: daemon process "
                                      f"{stuck} holds it but does not answer (stopped, or hung?)")
                # another `rtxops run` (or a restarted daemon) is starting its daemon there (its
                # store is open before it answers), or one is shutting down (its store is open
                # until it has stopped serving): submit to the first, take over from the second
                client, local = _daemon_coming_up(home, open_here, check_stop)
        if client is None:
            before = local.supervisor.unfinished()   # (jobs a daemon before this one left)
            try:
                job_id = local.supervisor.submit(JobSpec(command=list(command), name=name, env=env,
                                                         cwd=os.getcwd())).id
            except JobSpecError as e:
                raise DaemonError(str(e)) from None
            except KeyboardInterrupt:   # the job may exist by now: this run's, to cancel
                job_id = next(iter(local.supervisor.unfinished() - before), None)
                raise
            local.start_in_thread(wait=False)  # the job starts while the server comes up
            try:
                local.wait_started(stopping=lambda: bool(signalled))
            except RuntimeError as e:   # (the job is stopped with it)
                local.shutdown()
                raise DaemonError(str(e)) from None
            check_stop()
            client = DaemonClient(local.url, local.token)
            _at_terminal(f"rtxops: job {job_id} on a daemon in this process until it ends; "
                         f"dashboard: {local.url}/jobs/{job_id} (`rtxops daemon` keeps one running)")
        else:
            # the job starts from this environment, as it does with a daemon in this process
            try:
                job_id = client.submit(command=list(command), name=name, env=env, cwd=os.getcwd(),
                                       base_env=dict(os.environ))["id"]
            except DaemonClosing:
                if handovers <= 0:
                    raise
                # the `rtxops run` whose daemon this is found no other job and is ending: once
                # its daemon is gone, this run starts one (or submits to whoever did meanwhile)
                _wait_until_gone(home, client.url, check_stop)
                for s, handler in stops.items():
                    signal.signal(s, handler)
                stops = {}
                return _run_supervised(command, plan, summary_file, name, telemetry, handovers - 1)
            _at_terminal(f"rtxops: job {job_id} on the daemon at {client.url}; dashboard: "
                         f"{client.url}/jobs/{job_id}")
            # a daemon of its own (not this process's) may go down and come back: follow it there
            client = _Reconnecting(client, home, job_id)
        check_stop()
        starting = False
        check_stop()   # (one that came in between)
        return _follow(client, job_id, cancel_on_interrupt=True)
    except KeyboardInterrupt as e:   # Ctrl-C, SIGTERM or SIGHUP before the follow loop took over
        return cancel_own_job(getattr(e, "signum", signal.SIGINT))
    except _DaemonGone as e:
        err.print(escape(f"rtxops: {e}"), style="red")
        raise typer.Exit(2) from None
    except DaemonError as e:
        err.print(f"[red]rtxops: {escape(str(e))}[/red]")
        if job_id is None:  # refused before a job existed: there is no summary to miss
            raise typer.Exit(2) from None
        return 2
    except Exception:
        if not signalled:
            raise
        # a stop raised inside a library's own code may come out as that library's error
        # (pydantic building a validator wraps it in a SchemaError): the stop all the same
        return cancel_own_job(signalled[0])
    finally:
        try:
            if local is not None:
                if not signalled:   # `rtxops daemon stop` (SIGTERM) stops the other jobs too
                    _serve_other_jobs(local, job_id)
                local.shutdown()
        finally:
            for s, handler in stops.items():
                signal.signal(s, handler)
            sys.unraisablehook = previous_hook


def _serve_other_jobs(local, own_job: str | None) -> None:
    """Keep this process's daemon up while jobs that other ``rtxops run``/``submit`` commands
    gave it (it announced itself in the home) are unfinished: stopping it would cancel them.
    Ctrl-C (or SIGTERM) stops waiting; the daemon's shutdown then stops them. Once none is left
    the daemon takes no more (a ``run`` that submits then waits for it to go, and starts its own)."""
    if local.supervisor.close_if_idle(own_job):
        return
    others = local.supervisor.unfinished() - {own_job}
    err.print(f"rtxops: {len(others)} other job(s) run on the daemon this command started; it "
              "stops once they end (Ctrl-C stops them now)")
    try:
        while not local.supervisor.close_if_idle(own_job):
            time.sleep(0.5)
    except (KeyboardInterrupt, _Stopped):
        pass


def _follow(client, job_id: str, rank: Optional[int] = None, cancel_on_interrupt: bool = False,
            follow: bool = True) -> int:
    """Print a job's output as it comes (stdout lines to stdout, stderr lines to stderr); return
    the job's exit status as a shell would (128 + signal when it was killed)."""
    from rtxops.daemon.client import DaemonUnreachable

    for stream in (sys.stdout, sys.stderr):   # a terminal's encoding may not hold a job's text
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(errors="replace")
    after, interrupted, stopped = 0, False, None
    while True:
        try:
            while True:
                asked = time.monotonic()
                page = client.logs(job_id, after=after, rank=rank, wait_s=1.0 if follow else 0)
                for line in page["lines"]:
                    stream = sys.stderr if line["stream"] == "stderr" else sys.stdout
                    prefix = f"[rank{line['rank']}] " if rank is None and line["rank"] > 0 else ""
                    print(prefix + line["text"], file=stream, flush=True)
                    after = line["seq"]
                if not page["lines"] and (page["done"] or not follow):
                    break
                if follow and 0 < len(page["lines"]) < FOLLOW_PAGE_LINES:
                    # caught up with a job that prints as it goes (a line a step): each answer
                    # would hold the few lines of one log read and cost the daemon a query
                    # beside the job; a few a second suffice at a terminal
                    time.sleep(max(0.0, FOLLOW_PACE_S - (time.monotonic() - asked)))
            break
        except BrokenPipeError:
            # the reader went away (`| head`): the output has nowhere to go, which would end a
            # plain script by SIGPIPE; a job `rtxops run` follows is cancelled rather than left
            # running unseen
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # (no flush error at exit)
            if cancel_on_interrupt:
                client.cancel(job_id)
            return 128 + signal.SIGPIPE
        except KeyboardInterrupt as e:
            signum = getattr(e, "signum", signal.SIGINT)
            if not cancel_on_interrupt:  # `rtxops logs -f`: the job goes on; we end as interrupted
                raise typer.Exit(128 + signum) from None
            try:
                if not interrupted:
                    interrupted = True
                    if signum == signal.SIGINT and client.signal(job_id, "SIGINT", stop=True)["pids"]:
                        # the job runs in a session of its own, out of the terminal's reach: it
                        # gets Ctrl-C as it would have at a terminal and exits as it chooses (its
                        # handlers, a checkpoint); its own exit status is ours
                        err.print(f"rtxops: SIGINT sent to job {job_id} (again to cancel it)")
                    else:
                        # SIGINT with no process to take it (the job waits to start or to
                        # restart) cancels it, as SIGTERM/SIGHUP do (kill, a scheduler's
                        # preemption): SIGTERM to the job, SIGKILL after its grace; its last
                        # output is still shown
                        client.cancel(job_id)
                        err.print(f"rtxops: cancelled job {job_id}")
                        stopped = signum
                    continue
                client.cancel(job_id)
            except DaemonUnreachable as gone:   # (while waiting for it to come back)
                err.print(f"rtxops: {gone}: job {job_id} runs on unsupervised; `rtxops cancel "
                          f"{job_id}` once a daemon serves this home again, or kill its processes",
                          markup=False)
                return 128 + signum
            err.print(f"rtxops: cancelled job {job_id}")
            return 128 + signum
    job = client.job(job_id)
    if follow and job["state"] != "succeeded" and job.get("reason"):
        _note(f"rtxops: job {job_id} {job['state']}: {job['reason']}")
    return 128 + stopped if stopped is not None else _exit_status(job)


def _reconnect_s() -> float:
    """How long ``rtxops run`` waits for its daemon to come back (``RTXOPS_RECONNECT_S``)."""
    from rtxops import settings

    try:
        return settings.seconds("RTXOPS_RECONNECT_S", 120.0, zero="giving up at once")
    except settings.SettingError as e:
        raise _fail(str(e)) from None


class _DaemonGone(Exception):
    """The daemon following a job went away and did not come back in time."""


class _Reconnecting:
    """A daemon client whose reads, when the daemon stops answering, wait up to
    ``RTXOPS_RECONNECT_S`` (120 s) for a daemon to serve the home again (a restarted daemon
    adopts the running job) and go on there; then :class:`_DaemonGone`. The job runs on
    meanwhile: it is in a session of its own."""

    RETRIED = ("logs", "job")  # reads: a repeated one does nothing twice (a signal would)

    def __init__(self, client, home, job_id: str) -> None:
        self.client, self.home, self.job_id = client, home, job_id
        self.reconnect_s = _reconnect_s()

    def __getattr__(self, name: str):
        method = getattr(self.client, name)
        if name not in self.RETRIED:
            return method

        def call(*args, **kwargs):
            from rtxops.daemon.client import DaemonClient, DaemonUnreachable

            try:
                return method(*args, **kwargs)
            except DaemonUnreachable as e:
                err.print(escape(f"rtxops: {e}; job {self.job_id} runs on, waiting up to "
                                 f"{self.reconnect_s:g} s for a daemon to serve {self.home.root} again"))
                deadline = time.monotonic() + self.reconnect_s
                while time.monotonic() < deadline:
                    time.sleep(1.0)
                    found = DaemonClient.find(self.home)
                    if found is not None:
                        self.client = found
                        err.print(f"rtxops: following job {self.job_id} at {found.url}")
                        return getattr(found, name)(*args, **kwargs)
                    ended = _EndedInStore.read(self.home, self.job_id)
                    if ended is not None:   # `rtxops daemon stop`: it stopped the job first
                        self.client = ended
                        return getattr(ended, name)(*args, **kwargs)
                raise _DaemonGone(f"no daemon came back for {self.home.root}: job {self.job_id} "
                                  "may still be running unsupervised; start `rtxops daemon` on "
                                  f"this home to adopt it, then `rtxops logs {self.job_id} -f`") from None

        return call


class _EndedInStore:
    """A job that ended before its daemon stopped, read from the store the daemon left: its last
    lines and its outcome, for a follower that would otherwise wait for a daemon to come back."""

    def __init__(self, job: dict, lines: list[dict], store_path=None, last_seq: int = 0) -> None:
        self._job, self._lines = job, lines
        self._store_path, self._last_seq = store_path, last_seq

    @classmethod
    def read(cls, home, job_id: str) -> Optional["_EndedInStore"]:
        """The job as stored, when the store can be read (no daemon holds it) and says it ended."""
        from rtxops.daemon.api_jobs import job_view
        from rtxops.daemon.jobs import Job
        from rtxops.telemetry import store_jobs
        from rtxops.telemetry.store import ReadOnlyStore, StoreError

        try:
            store = ReadOnlyStore(home.store)
        except (StoreError, OSError):
            return None
        try:
            rows = store.query("SELECT record FROM jobs WHERE job_id = ?", [job_id])
            job = Job.from_dict(json.loads(rows[0]["record"])) if rows else None
            if job is None or not job.state.terminal:
                return None
            lines = store_jobs.read_logs(store, job_id, limit=1_000_000)   # (at most 8 MiB)
            last_seq = store_jobs.last_log_seq(store, job_id)
        except Exception:   # (a store being written again: wait on)
            return None
        finally:
            store.close()
        return cls(job_view(job), lines, home.store, last_seq)

    def logs(self, job_id: str, after: int = 0, rank: Optional[int] = None, wait_s: float = 0) -> dict:
        lines = [ln for ln in self._lines if ln["seq"] > after and (rank is None or ln["rank"] == rank)]
        if not lines and after < self._last_seq and (not self._lines or self._lines[-1]["seq"] < self._last_seq):
            lines = self._read_on(job_id, after, rank)   # past what the first read held
        # done once nothing follows: the follower asks again after the last line it got
        return {"lines": lines, "done": not lines}

    def _read_on(self, job_id: str, after: int, rank: Optional[int]) -> list[dict]:
        from rtxops.telemetry import store_jobs
        from rtxops.telemetry.store import ReadOnlyStore, StoreError

        try:
            store = ReadOnlyStore(self._store_path)
        except (StoreError, OSError):   # (a daemon serves the store again: its lines are gone here)
            return []
        try:
            return store_jobs.read_logs(store, job_id, rank=rank, after_seq=after)
        finally:
            store.close()

    def job(self, job_id: str) -> dict:
        return self._job

    def cancel(self, job_id: str) -> dict:
        return self._job

    def signal(self, job_id: str, name: str = "SIGINT", stop: bool = False) -> dict:
        return {"pids": []}


class _Stopped(KeyboardInterrupt):
    """A stop signal other than SIGINT, handled as Ctrl-C is."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop_by_signal(signum, frame):
    raise _Stopped(signum)


def _same_process_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == os.getpgrp()
    except OSError:  # already gone
        return False


def _exit_status(job: dict) -> int:
    attempts = job.get("attempts") or []
    last = attempts[-1] if attempts else {}
    if last.get("exit_code") is not None:
        return last["exit_code"]
    if last.get("signal"):
        return 128 + _signal_number(last["signal"])
    return 0 if job["state"] == "succeeded" else 1


def _signal_number(name: str) -> int:
    """``SIGTERM`` → 15; an unnamed one as the daemon writes it (``SIG40``, a real-time signal)
    → 40; SIGKILL's for anything else."""
    number = getattr(signal, name, None)
    if number is None and name.startswith("SIG") and name[3:].isdigit():
        number = int(name[3:])
    return int(number) if number is not None else int(signal.SIGKILL)


def _print_summary(data: dict, ops: list[dict]) -> None:
    """The summary a job left, every value from it shown as text (it is the job's to write: a
    ``[/x]`` in an op's name was read as markup, an escape sequence acted on the terminal)."""
    if ops:
        _print_ops(data, ops)
    else:   # a script that never called a routed op: no table of nothing
        _note(f"{_headline(data)}; no routed op was called")
    for d in data["disabled"]:
        _note(f"disabled {d['op']}/{d['variant']} on {d['bucket']}: {d['reason']}", "yellow")
    for m in data["modules_on_own_forward"]:
        _note(f"{m['site']} kept its own forward: {m['reason']}", "yellow")
    for r in data["plan_rejections"]:
        _note(f"plan rejected: {r}", "yellow")


def _headline(data: dict) -> str:
    processes = data.get("processes", 1)
    across = f" across {processes} processes" if isinstance(processes, int) and processes > 1 else ""
    return f"rtxops: {data['steps']} optimizer steps{across}, plan v{data['plan_version']}"


def _at_terminal(text: str) -> None:
    """A note for someone watching: left out where stderr is a file or a pipe, as the job's
    own output merged with it (``2>&1 | head -1``) is what a script reads there."""
    if err.is_terminal:
        _note(text)


def _note(text: str, style: str | None = None) -> None:
    err.print(inert(text), style=style, markup=False, highlight=False)


def _print_ops(data: dict, ops: list[dict]) -> None:
    table = Table(title=plain(_headline(data)))
    for col in ("op", "calls", "time ms", "share", "bucket", "variant (calls)"):
        table.add_column(col, justify="right" if col in ("calls", "time ms", "share") else "left",
                         overflow="fold")
    for o in ops:
        for i, (bucket, variants) in enumerate(sorted(o["buckets"].items())):
            used = ", ".join(f"{v} ({n})" for v, n in sorted(variants.items()))
            head = (str(o["op"]), str(o["calls"]), f"{o['total_ns'] / 1e6:.1f}", f"{o['share']:.1%}")
            table.add_row(*map(plain, (*(head if i == 0 else ("",) * 4), str(bucket), used)))
    err.print(table)


# ---- daemon --------------------------------------------------------------------------------------
@daemon_app.callback(invoke_without_command=True)
def daemon(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1", help="address to bind"),
    port: int = typer.Option(8765, min=0, max=65535, help="port to bind (0: any free port)"),
    home: Optional[Path] = HomeOpt,
    detach: bool = typer.Option(False, help="run in the background (PID file in the home)"),
    retention: Optional[str] = typer.Option(
        None, help="delete telemetry older than this, hourly: 30d, 36h, off "
                   "(default $RTXOPS_RETENTION or 30d)"),
) -> None:
    """Run the daemon in the foreground (``--detach`` for the background)."""
    if ctx.invoked_subcommand is not None:
        # `rtxops daemon --home X stop`: the home given before the subcommand is its home
        ctx.obj = {"home": home}
        return
    from rtxops.daemon.client import DaemonClient
    from rtxops.daemon.server import Daemon, configure_logging

    from rtxops.daemon.retention import retention_from

    h = _home(home)
    running = DaemonClient.find(h)
    if running is not None:
        raise _fail(f"a daemon already serves {h.root} at {running.url}", 1)
    try:
        retention_from(retention)
    except ValueError as e:
        raise _fail(str(e)) from None
    if detach:
        try:   # a malformed setting is said here, not only in the detached daemon's log
            _check_plugins((os.getcwd(),))   # (the daemon below runs as python -m: cwd first)
        except ValueError as e:
            raise _fail(str(e)) from None
        h.ensure()
        log = open(h.root / "daemon.log", "ab")
        args = [sys.executable, "-m", "rtxops.cli", "daemon", "--host", host, "--port", str(port),
                "--home", str(h.root), *(["--retention", retention] if retention else [])]
        child = subprocess.Popen(args, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and child.poll() is None:
            client = DaemonClient.find(h)
            if client is not None:
                out.print(f"rtxops daemon serving {client.url} (home {h.root})")
                return
            time.sleep(0.1)
        raise _fail(f"the daemon did not come up; see {h.root / 'daemon.log'}", 1)
    configure_logging()
    import duckdb

    from rtxops.telemetry.store import StoreError

    try:
        _check_plugins()
        d = Daemon(h, host=host, port=port, retention=retention)
    except ValueError as e:  # a malformed RTXOPS_EVOLVE_* setting or retention
        raise _fail(str(e)) from None
    except (StoreError, duckdb.IOException) as e:  # another daemon on this home holds the store
        raise _fail(f"cannot open the store of {h.root} (another daemon starting or serving it?): "
                    f"{e}", 1) from None
    raise typer.Exit(d.serve_forever())


def _check_plugins(search_first: tuple[str, ...] = ()) -> None:
    """Raise ValueError for plugin modules the daemon could not import and for an evolve
    allow-list naming no variant (reads the registry, and so torch, only with an allow-list).
    `rtxops run`'s daemon leaves them to the job and to its loop, which say why."""
    from rtxops import settings
    from rtxops.evolve.config import LoopConfig
    from rtxops.evolve.scheduler import enabled as evolve_enabled

    settings.variant_modules(search_first)
    if evolve_enabled():
        with settings.searched_first(search_first):
            LoopConfig.from_env().check_variants()


DAEMON_COMING_UP_S = 60.0   # how long `rtxops run` waits for a daemon another process is starting


def _read_summary(path: Path) -> tuple[Optional[dict], str]:
    """The job's summary, or None and why it cannot be read ("" when there is none): the job's
    exit status is what `rtxops run` must pass on, whatever state the job left the file in."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError, RecursionError) as e:
        return None, f"{type(e).__name__}: {e}"[:200]
    return (data, "") if isinstance(data, dict) else (None, "not a JSON object")


def _wait_until_gone(h, url: str, check_stop: Callable[[], None]) -> None:
    """Wait for the daemon at ``url`` to finish shutting down: it takes its url file away last,
    after closing the store (DaemonError after :data:`DAEMON_COMING_UP_S`). ``check_stop`` raises
    a stop signal received meanwhile."""
    from rtxops.daemon.client import DaemonError

    deadline = time.monotonic() + DAEMON_COMING_UP_S
    while time.monotonic() < deadline:
        try:
            if h.url_file.read_text().strip() != url:
                return
        except OSError:
            return
        check_stop()
        time.sleep(0.1)
    raise DaemonError(f"the daemon at {url} is shutting down and did not finish within "
                      f"{DAEMON_COMING_UP_S:g} s")


def _daemon_coming_up(h, open_here: Callable, check_stop: Callable[[], None]):
    """``(client, None)`` for the daemon another process is starting on home ``h`` (its store is
    open, it does not answer yet), once it announces itself; ``(None, daemon)`` when the store
    comes free first (a daemon that was shutting down) and ``open_here()`` opens it; DaemonError
    after :data:`DAEMON_COMING_UP_S` (whatever holds the store is no daemon). ``check_stop``
    raises a stop signal received meanwhile."""
    from rtxops.daemon.client import DaemonClient, DaemonError

    err.print(f"rtxops: another process holds the store of {h.root}; waiting up to "
              f"{DAEMON_COMING_UP_S:g} s for its daemon", markup=False)
    deadline = time.monotonic() + DAEMON_COMING_UP_S
    while time.monotonic() < deadline:
        client = DaemonClient.find(h)
        if client is not None:
            return client, None
        local = open_here()
        if local is not None:
            return None, local
        check_stop()
        time.sleep(0.2)
    raise DaemonError(f"cannot open the store of {h.root}: another process holds it and no "
                      f"daemon answered within {DAEMON_COMING_UP_S:g} s")


def _silent_daemon(h) -> Optional[int]:
    """The pid of an `rtxops daemon` process for home ``h`` that does not answer: the one its pid
    file names, if that process is a daemon and holds the home's store open (a stale pid file
    may name a reused pid, even another home's daemon), or None."""
    try:
        pid = int(h.pid_file.read_text().split()[0])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        if "daemon" not in argv:
            return None
        store = str(h.store.resolve())
        fds = f"/proc/{pid}/fd"
        return pid if any(os.readlink(f"{fds}/{fd}") == store for fd in os.listdir(fds)) else None
    except (OSError, ValueError, IndexError):
        return None


def _daemon_home(ctx: typer.Context, home: Optional[Path]) -> Optional[Path]:
    """The subcommand's ``--home``, else the one given to ``rtxops daemon`` before it."""
    given = (ctx.obj or {}).get("home")
    if home is not None and given is not None and home.resolve() != given.resolve():
        raise _fail(f"two homes given: --home {given} and --home {home}")
    return home if home is not None else given


@daemon_app.command("status")
def daemon_status(ctx: typer.Context, home: Optional[Path] = HomeOpt) -> None:
    """Is a daemon serving this home? Exit 0 if so, 1 if not."""
    from rtxops.daemon.client import DaemonClient

    h = _home(_daemon_home(ctx, home))
    client = DaemonClient.find(h)
    if client is None:
        stuck = _silent_daemon(h)
        out.print(f"no daemon serving {h.root}" + (f"; process {stuck} holds it (its store) but does "
                                                    "not answer: stopped, or hung?" if stuck else ""))
        raise typer.Exit(1)
    out.print(f"daemon serving {client.url} (pid {client.pid}, home {h.root})")


@daemon_app.command("stop")
def daemon_stop(ctx: typer.Context, home: Optional[Path] = HomeOpt,
                timeout: float = typer.Option(60.0, min=0.1, help="seconds to wait for a clean stop")) -> None:
    """Stop the daemon (SIGTERM: jobs are stopped gracefully, the store flushed)."""
    from rtxops.daemon import proctree
    from rtxops.daemon.client import DaemonClient

    h = _home(_daemon_home(ctx, home))
    client = DaemonClient.find(h)
    if client is not None and isinstance(client.pid, int):
        pid = client.pid  # the daemon's own word: a stale pid file may name another process now
    else:
        pid = _silent_daemon(h)  # one that does not answer (stopped, hung) but holds the home
        if pid is None:
            raise _fail(f"no daemon serving {h.root}", 1)
        try:
            os.kill(pid, signal.SIGCONT)  # a stopped one cannot act on SIGTERM
        except ProcessLookupError:
            raise _fail(f"no daemon serving {h.root}", 1) from None
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        raise _fail(f"no daemon serving {h.root}", 1) from None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc = proctree.read_proc(pid)
        if proc is None or not proc.alive:  # gone, or exited and waiting for its parent to reap it
            out.print(f"stopped daemon {pid}")
            return
        time.sleep(0.1)
    raise _fail(f"daemon {pid} is still stopping after {timeout:g} s (SIGTERM sent)", 1)


# ---- jobs ----------------------------------------------------------------------------------------
@app.command(context_settings=PASSTHROUGH)
def submit(
    command: List[str] = typer.Argument(..., help="the command to run, after --"),
    name: str = typer.Option("", help="a name for the job"),
    restarts: int = typer.Option(0, help="restarts allowed after a crash"),
    hang_restarts: int = typer.Option(0, help="restarts allowed after a hang"),
    hang_timeout: Optional[float] = typer.Option(None, help="seconds without a step = hung"),
    first_step_timeout: Optional[float] = typer.Option(
        None, help="seconds an attempt may take to its first step (imports, data, compile); "
                   "default: --hang-timeout"),
    nproc_per_node: int = typer.Option(1, help="ranks, launched through torchrun (gloo on CPU)"),
    inherit_env: bool = typer.Option(False, help="start the job from this shell's environment "
                                                 "rather than the daemon's"),
    home: Optional[Path] = HomeOpt,
) -> None:
    """Submit a job to the daemon; prints its id."""
    from rtxops.daemon.client import DaemonError

    _refuse_unknown_option(command, "submit")

    for option, value in (("--hang-timeout", hang_timeout), ("--first-step-timeout", first_step_timeout)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise _fail(f"{option} {value}: give a number of seconds above 0")
    if inherit_env:   # the job reads this environment (without it, the daemon's, checked at its start)
        _check_job_environment(command)
    try:
        job = _client(home).submit(command=list(command), name=name, restarts=restarts,
                                   hang_restarts=hang_restarts, hang_timeout_s=hang_timeout,
                                   first_step_timeout_s=first_step_timeout,
                                   nproc_per_node=nproc_per_node, cwd=os.getcwd(),
                                   base_env=dict(os.environ) if inherit_env else None)
    except DaemonError as e:
        raise _fail(str(e)) from None
    out.print(job["id"])


@app.command()
def jobs(home: Optional[Path] = HomeOpt, limit: int = typer.Option(50, min=1, max=1000)) -> None:
    """List jobs, newest first."""
    listed = _client(home).jobs(limit)
    table = Table()
    # ids whole at any width (piped output is 80 columns): they are what logs and cancel take
    table.add_column("id", no_wrap=True, min_width=max((len(j["id"]) for j in listed), default=2))
    for col in ("name", "state", "attempts", "restarts", "exit", "step", "reason"):
        # state and figures whole (`rtxops jobs | grep succeeded`); name and reason fold
        table.add_column(col, no_wrap=col not in ("name", "reason"))

    def shown(v) -> str:
        return "" if v is None else str(v)

    for j in listed:
        table.add_row(*map(plain, (j["id"], j["name"], j["state"], str(len(j["attempts"])),
                                    str(j["crash_restarts"] + j["hang_restarts"]), shown(j["exit_code"]),
                                    shown(j["last_step"]), shown(j["reason"]))))  # user text, not markup
    out.print(table)


@app.command()
def logs(job: str, follow: bool = typer.Option(False, "--follow", "-f"),
         rank: Optional[int] = typer.Option(None), home: Optional[Path] = HomeOpt) -> None:
    """Print a job's output (``--follow`` until it ends)."""
    from rtxops.daemon.client import DaemonError

    try:
        _follow(_client(home), job, rank=rank, follow=follow)
    except DaemonError as e:
        raise _fail(str(e), 1) from None


@app.command()
def cancel(job: str, home: Optional[Path] = HomeOpt) -> None:
    """Cancel a job: SIGTERM to its process tree, SIGKILL after the grace period."""
    from rtxops.daemon.client import DaemonError

    try:
        j = _client(home).cancel(job)
    except DaemonError as e:
        raise _fail(str(e), 1) from None
    out.print(f"{j['id']} {j['state']}")


# ---- telemetry -----------------------------------------------------------------------------------
@telemetry_app.command("export")
def telemetry_export(
    format: str = typer.Option(..., "--format", help="chrome-trace | parquet | otlp-json"),
    job: Optional[str] = typer.Option(None, help="only this job"),
    output: Path = typer.Option(..., "--out", "-o", help="file to write"),
    home: Optional[Path] = HomeOpt,
) -> None:
    """Export stored spans: open chrome-trace in Perfetto, otlp-json in any OTel tool."""
    import duckdb

    from rtxops.daemon.client import DaemonClient, DaemonError
    from rtxops.telemetry import export, store_export, store_views

    if format not in ("chrome-trace", "parquet", "otlp-json"):
        raise _fail(f"--format {format!r}: expected chrome-trace, parquet or otlp-json")
    if job is not None and not job:
        raise _fail("--job: an empty job id")
    h = _home(home)
    if not output.resolve().parent.is_dir():
        raise _fail(f"cannot write {output}: its folder does not exist")
    store_file = Path(os.environ.get("RTXOPS_STORE") or h.store).resolve()
    target = output.resolve()
    if target.is_relative_to(h.root.resolve()) or (
            target.parent == store_file.parent and target.name.startswith(store_file.name)):
        # the export replaces the file it names: the store (or its WAL, the token, the ledger)
        raise _fail(f"--out {output}: a file of the rtxops home or its store; write elsewhere")
    client = DaemonClient.find(h)
    try:
        if client is not None:  # the daemon holds the store: ask it
            try:
                size = client.export(format, job, output)
            except DaemonError as e:
                raise _fail(str(e), 1) from None
            out.print(f"wrote {output} ({size} bytes)")
            return
        with _read_store(h) as s:
            if job and not store_views.job_known(s, job):
                raise _fail(f"no job {job!r} in the store", 1)
            part = output.with_name(output.name + ".part")  # the file appears whole or not at all
            try:
                if format == "parquet":
                    n = store_export.export_parquet(s, part, job)
                else:
                    document = export.JsonExport(s, format, job)
                    # closed here, while the store is open: its read transaction ends with it
                    with part.open("w") as f, contextlib.closing(iter(document)) as pieces:
                        for piece in pieces:
                            f.write(piece)
                    n = document.spans
                part.replace(output)
            finally:
                part.unlink(missing_ok=True)
    except OSError as e:
        raise _fail(f"cannot write {output}: {e.strerror or e}") from None
    except duckdb.OutOfMemoryException as e:
        raise _fail(f"the store ran out of memory reading the spans ({_first_line(e)}): raise "
                    "RTXOPS_STORE_MEMORY for this command", 1) from None
    except duckdb.Error as e:
        raise _fail(f"cannot read the spans from the store: {_first_line(e)}", 1) from None
    out.print(f"wrote {n} spans to {output}")


def _first_line(e: BaseException) -> str:
    """DuckDB's message up to its first blank line (then come hints), on one line."""
    return " ".join(str(e).strip().split("\n\n")[0].split()) or type(e).__name__


@telemetry_app.command("stats")
def telemetry_stats(home: Optional[Path] = HomeOpt,
                    as_json: bool = typer.Option(False, "--json")) -> None:
    """Ingest counts: spans stored by kind and batches; with a daemon running, also its refused
    and rejected requests and drops (a daemon counts those in memory, from its start)."""
    from rtxops.daemon.client import DaemonClient
    from rtxops.telemetry import store as store_mod

    h = _home(home)
    client = DaemonClient.find(h)
    if client is not None:
        stats = client.telemetry_stats()
    else:
        import duckdb

        with _read_store(h) as s:
            try:
                stats = store_mod.telemetry_summary(s)
            except duckdb.Error as e:   # a damaged file
                raise _fail(f"cannot read the store: {_first_line(e)}", 1) from None
    if as_json:
        out.print_json(data=stats)
        return
    table = Table(title="rtxops telemetry", caption=None if client is not None else
                  "no daemon is running: refused and rejected requests are counted by one")
    table.add_column("what")
    table.add_column("count", justify="right")
    for k, v in stats.items():
        table.add_row(*map(plain, (k, str(v))))  # span names any client sent: not markup
    out.print(table)


@telemetry_app.command("prune")
def telemetry_prune(
    older_than: str = typer.Option(..., "--older-than", help="an age: 30d, 36h, 2w (1d at least)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="count what would go, delete nothing"),
    home: Optional[Path] = HomeOpt,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Delete telemetry older than an age: spans, span events, kernel rollups, the ingest log and
    job log lines. Job records, evolve decisions and the ledger stay. A running daemon prunes by
    itself (``rtxops daemon --retention``, default 30d)."""
    from rtxops.daemon.client import DaemonClient
    from rtxops.telemetry import store_retention

    try:
        seconds = store_retention.check_age(store_retention.parse_age(older_than))
    except ValueError as e:
        raise _fail(f"--older-than: {e}") from None
    h = _home(home)
    client = DaemonClient.find(h)
    if client is not None:
        report = client.prune(older_than, dry_run)
    elif dry_run:   # read only: a dry run neither migrates the store nor writes to it
        import duckdb

        with _read_store(h) as s:
            try:
                report = store_retention.count(s, seconds).as_dict()
            except duckdb.Error as e:
                raise _fail(f"cannot read the store: {_first_line(e)}", 1) from None
    else:
        report = _prune_file(Path(os.environ.get("RTXOPS_STORE") or h.store), seconds)
    if as_json:
        out.print_json(data=report)
        return
    table = Table(title=f"rtxops telemetry prune{' (dry run)' if dry_run else ''}")
    table.add_column("rows")
    table.add_column("would go" if dry_run else "deleted", justify="right")
    for k, v in report["rows"].items():
        table.add_row(k, str(v))
    out.print(table)


def _prune_file(path: Path, seconds: float) -> dict:
    import duckdb

    from rtxops import settings
    from rtxops.telemetry import store_retention
    from rtxops.telemetry.store import Store, StoreError

    if not path.exists():
        raise _fail(f"no store at {path}", 2)
    try:
        store = Store(path)
    except settings.SettingError as e:
        raise _fail(str(e)) from None
    except StoreError as e:
        raise _fail(str(e), 1) from None
    except duckdb.IOException as e:
        held = "lock" in str(e).lower()
        raise _fail(f"cannot open {path} for writing{' (a job writing to it?)' if held else ''}: "
                    f"{_first_line(e)}", 1) from None
    except duckdb.Error as e:   # not a DuckDB file, a damaged one
        raise _fail(f"cannot open the store {path}: {_first_line(e)}", 1) from None
    with store:
        try:
            return store_retention.prune(store, seconds).as_dict()
        except duckdb.Error as e:   # a full disk: nothing was deleted (one transaction)
            raise _fail(f"the prune failed and deleted nothing: {_first_line(e)}", 1) from None


class _read_store:
    """Read-only access to the store file when no daemon holds it."""

    def __init__(self, home) -> None:
        self.path = Path(os.environ.get("RTXOPS_STORE") or home.store)

    def __enter__(self):
        from rtxops import settings
        from rtxops.telemetry.store import ReadOnlyStore, StoreError

        if not self.path.exists():
            raise _fail(f"no store at {self.path}", 2)
        try:
            self.store = ReadOnlyStore(self.path)
        except settings.SettingError as e:   # a malformed RTXOPS_STORE_* setting: usage
            raise _fail(str(e), 2) from None
        except (StoreError, ValueError) as e:
            raise _fail(str(e), 1) from None
        return self.store

    def __exit__(self, *exc) -> None:
        self.store.close()


def entrypoint() -> None:
    """The ``rtxops`` command: the app, with the errors a user can cause said in one line (exit 1
    for the daemon's refusals, 2 for files and folders) rather than as a traceback."""
    from rtxops.daemon.client import DaemonError

    try:
        app()
    except DaemonError as e:
        err.print(escape(f"rtxops: {e}"), style="red")
        sys.exit(1)
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        err.print(escape(f"rtxops: {e.strerror or e}{where}"), style="red")
        sys.exit(2)


if __name__ == "__main__":
    entrypoint()
