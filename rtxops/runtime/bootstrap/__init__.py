"""Start the runtime inside a job process from ``RTXOPS_*`` environment variables.

``RTXOPS_PLAN``     path of a plan JSON file (the user's own: trusted) or of a signed plan bundle
                   directory (verified first) to run with (default: every op on its reference)
``RTXOPS_KEYRING``  trusted keyring: plans from the daemon are installed only when their signed
                   bundle verifies against it (and the policies); without it none is installed
``RTXOPS_DETERMINISTIC``  ``1``: refuse plans that use a non-deterministic variant
``RTXOPS_SUMMARY``  path where the per-slot summary JSON is written when the process exits; the
                   processes of one job (same ``RTXOPS_JOB_ID``, or ``RTXOPS_RUN_ID`` without one)
                   add theirs up there
``RTXOPS_VERIFY_FIRST_CALL``  ``0`` turns off the first-call check of non-reference variants
``RTXOPS_DAEMON``, ``RTXOPS_JOB_ID``, ``RTXOPS_TOKEN``  poll the daemon for this job's plan
``RTXOPS_DAEMON_URL_FILE``  the daemon's URL file: followed when a restarted daemon listens elsewhere
``RTXOPS_PLAN_POLL_S``  seconds between polls (default 2; 0 turns polling off)
``RTXOPS_CALL_MEMORY``  ``1``: CUDA memory delta and peak per routed call (resets torch's peak
                   counter before each call: the job's own ``max_memory_allocated()`` then reports
                   per-call peaks)
``RTXOPS_READINGS_FACTORY``  ``module:function`` called with the dispatcher to attach more readings
                             (telemetry); the runtime never imports those packages itself
``RTXOPS_PLAN_VERIFIER``  ``module:function`` called as ``(keyring path, job facts callable)`` on
                   first use; returns the plan verifier (``(files, running version, directory=None)
                   -> plan.json bytes``, raising why a bundle is refused; ``.warm()`` optional).
                   Without it no signed plan is installed (fail closed)
``RTXOPS_COMPILE_MODEL``  ``1`` (or a torch.compile mode) compiles the model in the background and
                   keeps it when faster (regions.py); its calls are then recorded under op ``region``
``RTXOPS_FUSE_OPTIMIZER``  ``1`` tries torch's fused optimizer (optimizer_region.py); every
                   ``optimizer.step()`` is recorded under op ``region``
``RTXOPS_STEP_BASE``  the last step an earlier attempt of this job reported: steps count on from
                   it (the supervisor sets it on a restart)
"""
from __future__ import annotations

import atexit
import faulthandler
import fcntl
import importlib
import json
import os
import signal
import sys
from pathlib import Path

from rtxops import settings

DIRECTORY = str(Path(__file__).resolve().parent)
# the folder holding the rtxops package (see child_environment)
PACKAGE_ROOT = str(Path(DIRECTORY).parents[2])
PACKAGE_ROOT_VARIABLE = "RTXOPS_PACKAGE_ROOT"   # (sitecustomize.py reads it by this name)


_to_finish: list[tuple] = []   # (dispatcher, summary path, pid) of the runtime start() began


def start() -> None:
    """Enable the runtime for this process as the environment asks; its exit work (see
    :func:`finish`) is registered with atexit. It runs before the exit handlers registered
    earlier: the libraries it exports through (OpenTelemetry, DuckDB) register theirs as it
    starts, and shut down in them."""
    if hasattr(signal, "SIGUSR1") and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
        # a supervisor that cannot attach py-spy asks for stacks with SIGUSR1
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    from ..dispatcher import Dispatcher
    from ..errors import PlanError
    from ..patching import enable
    from ..plan import Plan

    dispatcher: Dispatcher = enable(verify_first_call=_switch("RTXOPS_VERIFY_FIRST_CALL", default=True))
    base = os.environ.get("RTXOPS_STEP_BASE", "")
    if base.isdigit() and dispatcher.step == 0:
        dispatcher.step = dispatcher.steps_before = int(base)
    plan_path = os.environ.get("RTXOPS_PLAN")
    if plan_path:
        try:
            if Path(plan_path).is_dir():  # a signed bundle (`rtxops plan export`)
                plan = Plan.from_json(_plan_verifier(required=True)({}, -1, directory=plan_path))
            else:
                plan = Plan.from_json(Path(plan_path).read_text())
            problem = plan.environment_mismatch()
            if problem:
                raise PlanError(problem)
            dispatcher.install_plan(plan)
            dispatcher.apply_pending(at_once=True)
        except Exception as e:
            print(f"rtxops: plan {plan_path} not installed, running the reference plan: {e}",
                  file=sys.stderr)
            reason = f"{plan_path}: {e}"
            if str(e) not in dispatcher.plan_rejections:   # (install_plan put its own there)
                dispatcher.plan_rejections.append(reason)
    factory = os.environ.get("RTXOPS_READINGS_FACTORY")
    if factory:
        try:
            module, _, name = factory.partition(":")
            getattr(importlib.import_module(module), name)(dispatcher)
        except Exception as e:  # the job runs without telemetry rather than not at all
            print(f"rtxops: telemetry not started ({factory}): {type(e).__name__}: {e}", file=sys.stderr)
    daemon, job_id = os.environ.get("RTXOPS_DAEMON"), os.environ.get("RTXOPS_JOB_ID")
    dispatcher.call_memory = _switch("RTXOPS_CALL_MEMORY")
    try:
        dispatcher.cuda_time_every = settings.cuda_time_every()
    except settings.SettingError as e:   # (`rtxops run` refuses it before the job starts)
        print(f"rtxops: {e}; every CUDA call is timed", file=sys.stderr)
    dispatcher.set_reroute_partial(_switch("RTXOPS_REROUTE_MLP"))
    try:
        interval = settings.plan_poll_s()
    except settings.SettingError as e:
        print(f"rtxops: {e}; polling every 2 s", file=sys.stderr)
        interval = 2.0
    if daemon and job_id and interval > 0:
        from ..daemon_address import DaemonAddress
        from ..plan_client import PlanPoller

        address = DaemonAddress(daemon, os.environ.get("RTXOPS_DAEMON_URL_FILE"))
        PlanPoller(dispatcher, address, job_id, os.environ.get("RTXOPS_TOKEN"), interval,
                   verifier=_plan_verifier()).start()
    try:
        compile_model, mode = settings.compile_model()
    except settings.SettingError as e:   # (`rtxops run` refuses it before the job starts)
        print(f"rtxops: {e}; the model is not compiled", file=sys.stderr)
        compile_model, mode = False, None
    if compile_model:
        from ..regions import model_region

        dispatcher.regions = model_region(dispatcher, mode)
    if _switch("RTXOPS_FUSE_OPTIMIZER"):
        from ..optimizer_region import FusedOptimizer, step_clock
        from ..regions import SETTLED

        regions = dispatcher.regions

        def report_optimizer(step: int, outcome: str) -> None:
            v = dispatcher.plan.version
            dispatcher.readings.swap(step, v, v, f"region:optimizer:{outcome}")

        dispatcher.optimizer_region = FusedOptimizer(
            report_optimizer, ready=lambda: regions is None or regions.state in SETTLED,
            clock=step_clock(dispatcher))
    _to_finish.append((dispatcher, os.environ.get("RTXOPS_SUMMARY"), os.getpid()))
    atexit.register(finish)


def finish() -> None:
    """At exit: the runtime's last telemetry and its summary (once)."""
    while _to_finish:
        _at_exit(*_to_finish.pop())


def _switch(name: str, default: bool = False) -> bool:
    """An on/off setting; a malformed one is named and taken as ``default`` (``rtxops run``
    refuses it before the job starts)."""
    try:
        return settings.switch(name, default)
    except settings.SettingError as e:
        print(f"rtxops: {e}; taken as {'on' if default else 'off'}", file=sys.stderr)
        return default


def _plan_verifier(required: bool = False):
    """The verifier the plan client gets: the factory named in ``RTXOPS_PLAN_VERIFIER`` (set by
    whoever launches the job; imported on first use, so a job that never receives a plan never
    loads it) with the trusted keyring from ``RTXOPS_KEYRING``."""
    keyring = os.environ.get("RTXOPS_KEYRING")
    if not keyring:
        if not required:
            return None
        keyring = str(Path(os.environ.get("RTXOPS_HOME") or ".rtxops") / "keyring.json")
    factory = os.environ.get("RTXOPS_PLAN_VERIFIER", "")
    made: list = []

    def verifier():
        if not made:
            from ..errors import PlanError

            module, _, name = factory.partition(":")
            if not module or not name:
                raise PlanError("no plan verifier: RTXOPS_PLAN_VERIFIER is not set (module:function)")
            made.append(getattr(importlib.import_module(module), name)(keyring, _job_facts))
        return made[0]

    def verify(files: dict, running_version: int, directory: str | None = None) -> bytes:
        return verifier()(files, running_version, directory=directory)

    def warm() -> None:
        w = getattr(verifier(), "warm", None)
        if w is not None:
            w()

    verify.warm = warm  # type: ignore[attr-defined]
    return verify


def _job_facts() -> dict:
    """What the policies know of this job (read at each verification)."""
    return {"id": os.environ.get("RTXOPS_JOB_ID", ""), "deterministic": _wants_determinism()}


def _wants_determinism() -> bool:
    if _switch("RTXOPS_DETERMINISTIC"):
        return True
    import torch

    return bool(torch.are_deterministic_algorithms_enabled())


def _at_exit(dispatcher, summary_path: str | None, pid: int) -> None:
    """Flush the readings (telemetry exports the last partial step), then write the summary.
    Not in a child the job forked: the telemetry (its threads, a store connection) is the
    parent's, and a forked copy of it must not be closed or written from there."""
    from ..summary import summarize

    if os.getpid() != pid:
        return
    try:
        dispatcher.drain_timers()   # the last step's CUDA-timed calls, into the readings
        dispatcher.readings.close()
        if summary_path:
            _add_summary(Path(summary_path), summarize(dispatcher))
    except Exception as e:  # the job's own exit status matters more than our summary
        print(f"rtxops: could not finish telemetry or the summary: {e}", file=sys.stderr)


def _add_summary(path: Path, summary: dict) -> None:
    """Write ``summary`` to ``path``, or add it to the summary another process of the same job
    wrote there (ranks started by torchrun or torch.multiprocessing, spawned DataLoader workers).
    Under a lock on the folder; the file is replaced whole (a process killed mid-write, a full
    disk)."""
    from ..summary import did_anything, merged

    folder = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        earlier = _read_summary(path)
        if earlier is not None and did_anything(earlier) and not did_anything(summary):
            return   # a process that trained nothing (a spawned worker) never replaces one that did
        if earlier is not None and summary["job_id"] and earlier.get("job_id") == summary["job_id"]:
            # (no id: a file a run before this one may have left, not added to)
            if did_anything(earlier):
                summary = merged(earlier, summary)
        part = Path(f"{path}.{os.getpid()}.part")
        try:
            part.write_text(json.dumps(summary))
            os.replace(part, path)
        finally:
            part.unlink(missing_ok=True)
    finally:
        os.close(folder)   # (and its lock)


def _read_summary(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def child_environment(env: dict[str, str], *, plan: str | None = None,
                      summary: str | None = None, readings_factory: str | None = None,
                      plan_verifier: str | None = None) -> dict[str, str]:
    """``env`` plus what a child process needs to start with the runtime enabled."""
    out = dict(env)
    out["RTXOPS_ENABLE"] = "1"
    # the folder holding the rtxops package, for a Python that cannot import it otherwise: the
    # bootstrap appends it to sys.path there. Not on PYTHONPATH: for an installed rtxops it is a
    # whole site-packages, whose torch would stand before the job's own (PYTHONPATH precedes
    # the interpreter's stdlib and site-packages)
    out[PACKAGE_ROOT_VARIABLE] = PACKAGE_ROOT
    # the job's own entries exactly as given (an empty one is the working directory)
    own = out["PYTHONPATH"].split(os.pathsep) if out.get("PYTHONPATH") else []
    own = [p for p in own if p != DIRECTORY]
    out["PYTHONPATH"] = os.pathsep.join([DIRECTORY, *own])
    if plan:
        out["RTXOPS_PLAN"] = str(Path(plan).resolve())
    if summary:
        out["RTXOPS_SUMMARY"] = summary
    if readings_factory:
        out["RTXOPS_READINGS_FACTORY"] = readings_factory
    if plan_verifier:
        out["RTXOPS_PLAN_VERIFIER"] = plan_verifier
    return out
