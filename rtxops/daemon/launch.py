"""The command line and environment of one attempt of a job."""
from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

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


def environment(spec: JobSpec, *, job_id: str, token: str, attempt: int,
                base: Mapping[str, str], extra_env: Mapping[str, str],
                step_base: int | None = None) -> dict[str, str]:
    """``base`` (the daemon's environment; the job's ``base_env`` instead when it has one), then
    ``extra_env``, then the job's own ``env``; with the runtime enabled as ``rtxops run`` enables
    it, and the job's identity set last. ``step_base``: the last step an earlier attempt
    reported, from which a restarted job counts on."""
    env = {**(base if spec.base_env is None else spec.base_env), **extra_env, **spec.env}
    if spec.runtime:
        from rtxops.runtime.bootstrap import child_environment

        env = child_environment(env, plan=spec.plan)
    else:
        env.pop("RTXOPS_ENABLE", None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["RTXOPS_JOB_ID"] = job_id
    env["RTXOPS_JOB_ATTEMPT"] = str(attempt)
    env.pop("RTXOPS_STEP_BASE", None)
    if step_base:
        env["RTXOPS_STEP_BASE"] = str(step_base)
    env[TOKEN_VARIABLE] = token
    if spec.nproc_per_node > 1:
        env["RTXOPS_LAUNCHER"] = "torchrun"
    return env
