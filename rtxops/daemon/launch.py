"""The command line and environment of one attempt of a job, and starting it under its waiter."""
from __future__ import annotations

import errno
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from .. import settings
from .errors import JobSpecError
from .jobs import JobSpec
from .proctree import TOKEN_VARIABLE

_PYTHON = re.compile(r"^python(\d+(\.\d+)*)?$")
TORCHRUN_ROLE = "rank"
"""torchrun's role name; it prefixes each worker line with ``[rank<local rank>]:``."""


def is_python(executable: str) -> bool:
    """Whether ``executable`` names a Python interpreter (``python``, ``python3.11``, a venv's ``python``)."""
    return bool(_PYTHON.match(Path(executable).name))


def command_line(spec: JobSpec, torchrun_log_dir: str | os.PathLike[str]) -> list[str]:
    """What to execute. Raises :class:`JobSpecError` for a job the OS cannot start as given (see
    :func:`check_launchable`) or a command torchrun cannot wrap."""
    check_launchable(spec)
    command = list(spec.command)
    if spec.nproc_per_node == 1:
        return command
    options = ["--standalone", "--nnodes", "1", "--nproc-per-node", str(spec.nproc_per_node),
               "--max-restarts", "0", "--role", TORCHRUN_ROLE, "--tee", "3",
               "--log-dir", str(torchrun_log_dir)]
    if not is_python(command[0]):
        return [sys.executable, "-m", "torch.distributed.run", *options, "--no-python", *command]
    python, rest = command[0], command[1:]
    while rest and rest[0] == "-u":
        rest = rest[1:]
    if rest[:1] == ["-m"] and len(rest) >= 2:
        return [python, "-m", "torch.distributed.run", *options, "-m", *rest[1:]]
    if not rest or rest[0].startswith("-"):
        raise JobSpecError(
            "command: with nproc_per_node > 1 a Python command must be `python SCRIPT ARGS` or "
            "`python -m MODULE ARGS` (set interpreter options through PYTHON* variables in env)")
    return [python, "-m", "torch.distributed.run", *options, *rest]


def check_launchable(spec: JobSpec) -> None:
    """Raise :class:`JobSpecError` for strings ``exec`` cannot take (they would otherwise fail only
    at launch, as a supervisor error): NUL characters, environment names that are empty or hold
    ``=``, and text that is not UTF-8 (a lone surrogate from a JSON escape such as ``\\ud800``)."""
    base_env = spec.base_env or {}
    for what, text in (("command", spec.command), ("env", [*spec.env, *spec.env.values()]),
                       ("base_env", [*base_env, *base_env.values()]),
                       ("cwd", [spec.cwd or ""]), ("name", [spec.name or ""])):
        for t in text:
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                raise JobSpecError(f"{what}: {t.encode('utf-8', 'backslashreplace').decode()!r} "
                                   "is not valid Unicode text (a lone surrogate)") from None
    if any("\0" in a for a in spec.command):
        raise JobSpecError("command: an argument contains a NUL character")
    for what, values in (("env", spec.env), ("base_env", base_env)):
        for k, v in values.items():
            if not k or "=" in k or "\0" in k or "\0" in v:
                raise JobSpecError(f"{what}: {k!r} cannot be passed to a process (an empty name, "
                                   "'=' or NUL in the name, or NUL in the value)")
    if spec.cwd is not None and "\0" in spec.cwd:
        raise JobSpecError("cwd: contains a NUL character")


def _quiet_interval(env: Mapping[str, str], hang_timeout_s: float) -> float | None:
    """The job's quiet export interval as its environment asks (the job's own rule:
    ``RTXOPS_EXPORT_QUIET_INTERVAL_S``, else ``RTXOPS_EXPORT_INTERVAL_S``, else 10 s), at most a
    tenth of its hang timeout; None for a malformed setting (the job refuses it itself)."""
    asked = settings.EXPORT_QUIET_INTERVAL_S
    for name in ("RTXOPS_EXPORT_QUIET_INTERVAL_S", "RTXOPS_EXPORT_INTERVAL_S"):
        if env.get(name):
            try:
                asked = float(env[name])
            except ValueError:
                return None
            break
    if not (asked > 0 and math.isfinite(asked)):
        return None
    return min(asked, hang_timeout_s / 10)


def environment(spec: JobSpec, *, job_id: str, token: str, attempt: int,
                base: Mapping[str, str], extra_env: Mapping[str, str],
                step_base: int | None = None) -> dict[str, str]:
    """``base`` (the daemon's environment; the job's ``base_env`` instead when it has one), then
    ``extra_env`` (whose ``PATH`` goes in front of the base's: the caller's own programs stay
    found), then the job's own ``env``; with the runtime enabled as ``rtxops run`` enables it,
    and the job's identity set last. ``step_base``: the last step an earlier attempt reported,
    from which a restarted job counts on."""
    own = base if spec.base_env is None else spec.base_env
    env = {**own, **extra_env, **spec.env}
    if own.get("RTXOPS_TELEMETRY") == "off" and "RTXOPS_TELEMETRY" not in spec.env:
        env["RTXOPS_TELEMETRY"] = "off"   # the caller's (or the daemon's) "no telemetry" stands
    if extra_env.get("PATH") and "PATH" not in spec.env:
        # (an environment without PATH: a shell's own default path stands for it)
        env["PATH"] = os.pathsep.join(p for p in (extra_env["PATH"], own.get("PATH") or os.defpath) if p)
    if spec.runtime:
        from rtxops.runtime.bootstrap import child_environment

        env = child_environment(env, plan=spec.plan)
    else:
        env.pop("RTXOPS_ENABLE", None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    quiet = None if spec.hang_timeout_s is None else _quiet_interval(env, spec.hang_timeout_s)
    if quiet is not None:
        # the job's exports are its heartbeats: a settled job is heard several times within its
        # hang timeout (a refused export is sent again only with the next)
        env["RTXOPS_EXPORT_QUIET_INTERVAL_S"] = repr(quiet)
    if spec.cwd and "PWD" not in spec.env:   # a shell's $PWD names the folder the job runs in
        env["PWD"] = spec.cwd
    env["RTXOPS_JOB_ID"] = job_id
    env["RTXOPS_JOB_ATTEMPT"] = str(attempt)
    env.pop("RTXOPS_STEP_BASE", None)
    if step_base:
        env["RTXOPS_STEP_BASE"] = str(step_base)
    env[TOKEN_VARIABLE] = token
    if spec.nproc_per_node > 1:
        env["RTXOPS_LAUNCHER"] = "torchrun"
    return env


WAITER = Path(__file__).with_name("_waiter.py")
CARRIED_TOKEN = "RTXOPS_WAITER_JOB_TOKEN"   # (the name _waiter.py gives the token back under TOKEN)


class StartFailed(Exception):
    """The attempt's command could not be started; ``exit_code`` as a shell would say it."""

    def __init__(self, detail: str, exit_code: int) -> None:
        super().__init__(detail)
        self.detail, self.exit_code = detail, exit_code


def spawn(argv: list[str], *, env: Mapping[str, str], cwd: str | None, stdout: IO, stderr: IO,
          status_file: Path) -> tuple[subprocess.Popen, int]:
    """Start ``argv`` under a waiter (see ``_waiter.py``): the job leads a session of its own and
    its exit status lands in ``status_file`` even if this process is gone by then. Returns the
    waiter's Popen and the job's pid; raises :class:`StartFailed`."""
    waiter_env = dict(env)
    token = waiter_env.pop(TOKEN_VARIABLE, None)
    if token is not None:
        waiter_env[CARRIED_TOKEN] = token
    fd = stdout.fileno()
    try:
        waiter = subprocess.Popen(
            [sys.executable, "-I", "-S", str(WAITER), str(status_file), str(fd), "--", *argv],
            cwd=cwd, env=waiter_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=stderr, pass_fds=(fd,), start_new_session=True)
    except (OSError, ValueError) as e:   # the cwd is gone; ValueError: what exec cannot take
        raise StartFailed(_cannot_start(argv[0], getattr(e, "strerror", None) or str(e),
                                        getattr(e, "filename", None)),
                          127 if isinstance(e, FileNotFoundError) else 126) from None
    with waiter.stdout:
        line = waiter.stdout.readline()
    try:
        report = json.loads(line)
    except ValueError:
        report = {}
    if isinstance(report, dict) and isinstance(report.get("pid"), int):
        return waiter, report["pid"]
    waiter.wait()
    if isinstance(report, dict) and "error" in report:
        raise StartFailed(_cannot_start(argv[0], str(report["error"]), report.get("filename")),
                          127 if report.get("errno") == errno.ENOENT else 126)
    raise StartFailed(f"the rtxops waiter ended (exit {waiter.returncode}) before it started "
                      f"{argv[0]!r}; see the attempt's stderr", 126)


def read_status(status_file: Path) -> int | None:
    """The exit status the waiter wrote (negative: killed by that signal), or None."""
    try:
        value = json.loads(status_file.read_text()).get("returncode")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def _cannot_start(program: str, why: str, filename: str | None) -> str:
    return f"cannot start {program!r}: {why}" + (f" ({filename})" if filename else "")
