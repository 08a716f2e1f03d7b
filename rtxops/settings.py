"""``RTXOPS_*`` environment settings read with their checks.

A malformed value is a :class:`SettingError` that names the variable and what it takes, raised
where the setting is read at start-up: never a bare ``int()`` message, a DuckDB parser error
from a thread, or a value that quietly breaks something (a negative export interval spun the
export thread). Every variable is listed in ``docs/settings.md``.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import sys


class SettingError(ValueError):
    """An ``RTXOPS_*`` variable holds a value its setting cannot take."""


def _raw(name: str) -> str | None:
    raw = os.environ.get(name)
    return None if raw is None or not raw.strip() else raw


def whole_number(name: str, default: int, minimum: int = 0) -> int:
    """An integer of at least ``minimum``; ``default`` when unset or empty."""
    raw = _raw(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not a whole number") from None
    if value < minimum:
        raise SettingError(f"{name}={raw!r}: it must be at least {minimum}")
    return value


def seconds(name: str, default: float, *, zero: str | None = None) -> float:
    """A finite duration above zero, in seconds, or 0 too where ``zero`` says what 0 means;
    ``default`` when unset or empty."""
    raw = _raw(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and zero is None):
        raise SettingError(f"{name}={raw!r}: " + (f"give a number of seconds, or 0 for {zero}" if zero
                                                  else "it must be a number of seconds above 0"))
    return value


_SIZE = re.compile(r"\d+(\.\d+)?\s*([kmgt]i?)?b", re.IGNORECASE)


def memory_size(name: str, default: str) -> str:
    """A size as DuckDB reads it (``96MB``, ``1GiB``, ``512KB``); ``default`` when unset or empty."""
    raw = _raw(name)
    if raw is None:
        return default
    if not _SIZE.fullmatch(raw.strip()):
        raise SettingError(f"{name}={raw!r} is not a size such as 96MB or 1GiB")
    return raw.strip()


def call_samples(name: str) -> tuple[int, int] | None:
    """``PER/STEPS`` (calls sampled per slot every STEPS steps; ``PER`` alone: every 100 steps;
    ``0``: none), or None when unset."""
    raw = _raw(name)
    if raw is None:
        return None
    per, slash, window = raw.partition("/")
    try:
        value = int(per), int(window) if slash else 100
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not PER/STEPS (for example 2/100, or 0 for none)") from None
    if value[0] < 0 or value[1] < 1:
        raise SettingError(f"{name}={raw!r}: PER must be 0 or more and STEPS at least 1")
    return value


# ---- the settings read in more than one place ----------------------------------------------

EXPORT_INTERVAL_S = 2.0
EXPORT_QUIET_INTERVAL_S = 10.0
RECORDER_CAPACITY = 1 << 16


def export_interval_s() -> float:
    """Seconds between a job's span exports (``RTXOPS_EXPORT_INTERVAL_S``) while something in it
    changes: its first half minute, the half minute after a plan or region swap, a plan that
    explores."""
    return seconds("RTXOPS_EXPORT_INTERVAL_S", EXPORT_INTERVAL_S)


def export_quiet_interval_s() -> float:
    """Seconds between a job's span exports the rest of the time
    (``RTXOPS_EXPORT_QUIET_INTERVAL_S``; by default 10, or ``RTXOPS_EXPORT_INTERVAL_S`` where
    only that is set); never less than :func:`export_interval_s`."""
    active = export_interval_s()
    default = EXPORT_QUIET_INTERVAL_S if _raw("RTXOPS_EXPORT_INTERVAL_S") is None else active
    return max(active, seconds("RTXOPS_EXPORT_QUIET_INTERVAL_S", default))


def recorder_capacity() -> int:
    """Call records a job's recorder holds between steps (``RTXOPS_RECORDER_CAPACITY``)."""
    return whole_number("RTXOPS_RECORDER_CAPACITY", RECORDER_CAPACITY, minimum=1)


def store_connection() -> dict:
    """The store's DuckDB settings (``RTXOPS_STORE_THREADS``, ``RTXOPS_STORE_MEMORY``): DuckDB's
    worker threads would compete with the training jobs on a small machine."""
    return {"threads": whole_number("RTXOPS_STORE_THREADS", 1, minimum=1),
            "memory_limit": memory_size("RTXOPS_STORE_MEMORY", "96MB")}


def store_wal() -> str:
    """The WAL size at which the store checkpoints (``RTXOPS_STORE_WAL``)."""
    return memory_size("RTXOPS_STORE_WAL", "256MB")


_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def switch(name: str, default: bool = False) -> bool:
    """An on/off setting: 1/0, true/false, yes/no, on/off; ``default`` when unset or empty
    (``false`` once read as on: anything but ``0`` was)."""
    raw = _raw(name)
    if raw is None:
        return default
    word = raw.strip().lower()
    if word not in _ON + _OFF:
        raise SettingError(f"{name}={raw!r}: give 1 or 0 (true/false, yes/no, on/off)")
    return word in _ON


def compile_model() -> tuple[bool, str | None]:
    """``RTXOPS_COMPILE_MODEL``: (on, torch.compile mode); on with no mode for 1/true/yes/on,
    a mode by its name."""
    raw = _raw("RTXOPS_COMPILE_MODEL")
    if raw is None:
        return False, None
    word = raw.strip().lower()
    if word in _ON + _OFF:
        return word in _ON, None
    if word not in COMPILE_MODES:
        raise SettingError(f"RTXOPS_COMPILE_MODEL={raw!r}: give 1 or 0, or a torch.compile mode "
                           f"({', '.join(COMPILE_MODES)})")
    return True, word


JOB_SWITCHES = ("RTXOPS_CALL_MEMORY", "RTXOPS_REROUTE_MLP", "RTXOPS_FUSE_OPTIMIZER",
                "RTXOPS_DETERMINISTIC", "RTXOPS_VERIFY_FIRST_CALL", "RTXOPS_DISPATCH_CORE")


CUDA_TIME_EVERY = 1


def cuda_time_every() -> int:
    """``RTXOPS_CUDA_TIME_EVERY``: a CUDA route times its first call and then one in N with
    events; the calls between take the last timed figure (1: every call is timed)."""
    return whole_number("RTXOPS_CUDA_TIME_EVERY", CUDA_TIME_EVERY, minimum=1)


def plan_poll_s() -> float:
    """``RTXOPS_PLAN_POLL_S``: the least time between a job's polls for a new plan (each waits
    up to 30 s at the daemon for one); 0 turns polling off."""
    return seconds("RTXOPS_PLAN_POLL_S", 2.0, zero="no polling")


@contextlib.contextmanager
def searched_first(folders: tuple[str, ...]):
    """Imports inside look in ``folders`` before this process's own path."""
    saved = sys.path[:]
    sys.path[:0] = [f for f in folders if f not in sys.path]
    try:
        yield
    finally:
        sys.path[:] = saved


def variant_modules(search_first: tuple[str, ...] = (), python: str | None = None) -> None:
    """Raise :class:`SettingError` unless every module ``RTXOPS_VARIANT_MODULES`` names can be
    found: in ``search_first`` (where the job's interpreter looks before its own path: the
    script's folder, the working directory), then on this process's path or, given ``python``
    (the job's interpreter, another environment's), on that one's. A dotted name's package is
    imported to find it; the module itself, which imports torch, is not."""
    from rtxops import _find_modules

    names = [m.strip() for m in (os.environ.get("RTXOPS_VARIANT_MODULES") or "").split(",") if m.strip()]
    if not names:
        return
    if python is None:
        found = _find_modules.problems(names, list(search_first))
    else:
        found = _problems_in(python, names, search_first)
    if found:
        name, problem = found[0]
        by = f" (by {python})" if python else ""
        if problem == "missing":
            raise SettingError(f"RTXOPS_VARIANT_MODULES: no module {name!r} can be imported{by} "
                               "(give comma-separated module names, each with a VARIANTS list)")
        if problem == "folder":
            raise SettingError(f"RTXOPS_VARIANT_MODULES: {name!r} is a folder, not a module with "
                               f"a VARIANTS list{by}")
        raise SettingError(f"RTXOPS_VARIANT_MODULES: {name!r} {problem}{by}")


def _problems_in(python: str, names: list[str], search_first: tuple[str, ...]) -> list:
    """:func:`rtxops._find_modules.problems` run by the interpreter ``python``, with rtxops's
    own package root after its path as a job's runtime adds it; nothing when it cannot tell (it
    does not start, or answers otherwise: the job itself will say)."""
    import json
    import subprocess

    from rtxops import _find_modules
    from rtxops.runtime.bootstrap import PACKAGE_ROOT

    request = {"names": names, "search_first": list(search_first), "package_root": PACKAGE_ROOT}
    try:
        r = subprocess.run([python, _find_modules.__file__, json.dumps(request)],
                           capture_output=True, text=True, timeout=60)
        # the last line: a sitecustomize or .pth file of that environment may print before it
        lines = r.stdout.strip().splitlines()
        return [tuple(p) for p in json.loads(lines[-1])] if r.returncode == 0 and lines else []
    except (OSError, subprocess.SubprocessError, ValueError, TypeError):
        return []


def check_runtime() -> None:
    """Raise :class:`SettingError` for a malformed switch of the job's runtime (the job would take
    it as off, saying so only in its output)."""
    for name in JOB_SWITCHES:
        switch(name)
    compile_model()
    plan_poll_s()
    cuda_time_every()


def check_job(direct: bool) -> None:
    """Raise :class:`SettingError` for a malformed setting a job's telemetry would read (``rtxops
    run`` checks before it submits; the job would train on without telemetry); ``direct``: the
    job also opens the store."""
    call_samples("RTXOPS_CALL_SAMPLES")
    export_quiet_interval_s()
    recorder_capacity()
    if direct:
        store_connection()
        store_wal()
