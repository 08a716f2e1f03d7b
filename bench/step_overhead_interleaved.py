"""Step-time overhead of ``rtxops run``'s whole default path, in parts measured apart (issue #3).

Block alternation (``step_overhead_inprocess.py``) keeps the host's drift: on this VM a step's
time moves by 5-30 % from one ten-second stretch to the next, so that bench's interval stays as
wide as the 2 % target. Here one job runs the whole default path: the runtime with its default
plan, the telemetry recorder and export thread, OTLP/HTTP to a real ``rtxops daemon`` in its own
process (evolve loop off), exports at a settled job's cadence. Three parts, each measured where
the drift cannot reach it:

* ``routed``: the training thread's cost of routing, timing and recording a step's calls.
  The routing is suspended on every other two steps (:func:`rtxops.runtime.patching.suspended`:
  torch's functions and the classes' forwards put back between two steps), RRSS then SSRR; the
  figure is the median over pairs of routed step / suspended step - 1, two steps apart (a
  ratio: a slow spell slows both steps of a pair; ``routed_ms`` is the median difference).
  ``routed_first_steps`` takes the pairs of the blocks' first steps alone, each right after the
  switch, ``routed_second_steps`` those of their second steps, as in a run that never switches;
* ``boundary_ms``: the median wall time of the optimizer-step hook, which runs in both steps of
  a pair and so drops out of the difference;
* ``other_threads_fraction``: with every step routed (``--whole`` steps, their own telemetry,
  closed before the pairs), the export thread's CPU and the daemon's CPU above its idle, up to
  the closing export committed, over the same steps' wall time. Counted in full: the job's two
  threads keep both cores busy (a perf sample of this job shows each at ~100 % of the wall
  time), so a millisecond of another thread costs the step about a millisecond. A ratio of
  times taken together, so a slow spell moves both. ``observed`` checks that: each build and
  export of the export thread (the daemon's work within the export, which waits for its reply)
  timed and its CPU taken, and the steps it overlaps set against the untouched steps around
  them; ``excess_to_cpu`` is what those steps lost over the CPU the bursts took (under 1: the
  job's threads had idle moments to give; over 1: a burst costs more than its CPU, as the GIL
  it holds). ``overhead_observed`` weighs the other threads' CPU by it.

``overhead`` = routed + boundary / the median suspended step + other_threads_fraction;
``overhead_95ci`` moves only the routed part by its bootstrap interval. Left out, as once per
job: the first export (the OTLP exporter's imports, 0.25 s of the export thread's CPU on this
host, 0.1-0.2 ms a step when it fell within the 1500 steps; the job's first request to the
daemon) and the wait for the closing one; and the plan poller (a long poll a half minute).
JSON on stdout (``--out`` writes it too).
"""
from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _daemon import KeepOpen, cpu_s, running_daemon
from _gpt import median_interval, stepper
from _report import report

from rtxops import settings
from rtxops.runtime import dispatcher as D
from rtxops.runtime import patching
from rtxops.telemetry import exporters
from rtxops.telemetry.exporters import DeferredExporter, otlp_http_exporter
from rtxops.telemetry.job import start_job_telemetry


def _timed_boundary(dispatcher, times: list[int]) -> None:
    """Time the dispatcher's step hook (the hook looks ``on_step`` up at each call)."""
    on_step = dispatcher.on_step

    def timed(optimizer):
        t0 = time.perf_counter_ns()
        try:
            return on_step(optimizer)
        finally:
            times.append(time.perf_counter_ns() - t0)

    dispatcher.on_step = timed


def _watch_bursts(thread, proc) -> list[list[float]]:
    """``[wall start, wall end, export thread CPU, daemon CPU]`` of each build and export the
    export thread runs (an export waits for the daemon's reply, sent once it committed)."""
    bursts: list[list[float]] = []

    def watched(fn):
        def run(*args, **kwargs):
            t0, c0, d0 = time.perf_counter(), time.thread_time(), cpu_s(proc.pid)
            try:
                return fn(*args, **kwargs)
            finally:
                bursts.append([t0, time.perf_counter(), time.thread_time() - c0,
                               cpu_s(proc.pid) - d0])
        return run

    thread._build_some, thread._export = watched(thread._build_some), watched(thread._export)
    return bursts


def _observed(starts: list[float], times: list[float], bursts: list[list[float]]) -> dict:
    """What the bursts cost the steps they overlap, against the CPU they took: each overlapped
    step's time over the median of the 50 untouched steps around it. A step counts as
    overlapped from a burst's start to 5 ms after its end."""
    touched = [any(b[0] < s + t and s < b[1] + 0.005 for b in bursts)
               for s, t in zip(starts, times)]
    excess = 0.0
    for i, hit in enumerate(touched):
        if hit:
            around = [times[j] for j in range(max(0, i - 25), min(len(times), i + 26))
                      if not touched[j]]
            excess += times[i] - statistics.median(around)
    inside = [b for b in bursts if starts[0] <= b[0] and b[1] <= starts[-1] + times[-1]]
    cpu = sum(b[2] + b[3] for b in inside)
    return {"bursts": len(inside), "steps_overlapped": sum(touched),
            "excess_ms": round(excess * 1e3, 2), "cpu_ms": round(cpu * 1e3, 2),
            "excess_to_cpu": round(excess / cpu, 3) if cpu > 0 else None}


def _other_threads(steps, d, exporter, proc, daemon_idle_per_s: float, n: int,
                   warm: int) -> dict:
    """Every step routed: the export thread's and the daemon's CPU over the steps' time; and,
    beside it, what the export thread's bursts (the daemon's work within them) cost the steps
    they overlap, against the CPU they took (``observed``: under 1 where the job's threads had
    idle time to give, over 1 where a burst costs the job more than its CPU, as GIL waits)."""
    telemetry = start_job_telemetry(d, exporter, quiet_interval_s=settings.EXPORT_QUIET_INTERVAL_S)
    try:
        steps(warm)
        while not telemetry.thread.spans_exported:   # the job's first export, once per job
            steps(10)
        bursts = _watch_bursts(telemetry.thread, proc)
        daemon_before, wall_before = cpu_s(proc.pid), time.monotonic()
        export_before = telemetry.thread.cpu_s
        begun = time.perf_counter()
        times = steps(n)
        step_s = sum(times)
    finally:
        telemetry.close()   # the last request, its spans among those counted
    time.sleep(2.0)         # the daemon commits what it acknowledged
    wall = time.monotonic() - wall_before
    daemon_cpu = max(cpu_s(proc.pid) - daemon_before - daemon_idle_per_s * wall, 0.0)
    export_cpu = telemetry.thread.cpu_s - export_before
    starts = list(itertools.accumulate(times[:-1], initial=begun))
    return {"fraction": (export_cpu + daemon_cpu) / step_s,
            "export_thread_cpu_ms_per_step": round(export_cpu / n * 1e3, 4),
            "daemon_cpu_ms_per_step": round(daemon_cpu / n * 1e3, 4),
            "mean_step_ms": round(step_s / n * 1e3, 3),
            "spans_exported": telemetry.thread.spans_exported,
            "spans_failed": telemetry.thread.spans_failed,
            "observed": _observed(starts, times, bursts)}


def _routed(steps, d, exporter, pairs: int, warm: int) -> dict:
    """Routing suspended every other two steps (RRSS, then SSRR): each pair's difference and
    ratio, and the step hook's own time. A pair is a block's first steps (each right after the
    routing was put back or taken down: the classes' forwards replaced, torch's caches of their
    attributes dropped) or its second steps (neither right after a change, as every step of a
    real run): the two halves show what the switching itself adds."""
    telemetry = start_job_telemetry(d, exporter, quiet_interval_s=settings.EXPORT_QUIET_INTERVAL_S)
    boundary: list[int] = []
    routed: list[list[float]] = [[], []]      # [block's first steps, second steps]
    suspended: list[list[float]] = [[], []]
    try:
        steps(warm)
        _timed_boundary(d, boundary)
        for i in range((pairs + 1) // 2):
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                if on:
                    got = steps(2)
                else:
                    with patching.suspended():
                        got = steps(2)
                for side, t in zip(routed if on else suspended, got):
                    side.append(t)
    finally:
        telemetry.close()
    halves = [([r / s for r, s in zip(rs, ss)], [r - s for r, s in zip(rs, ss)])
              for rs, ss in zip(routed, suspended)]
    return {"diffs": halves[0][1] + halves[1][1],
            "ratios": halves[0][0] + halves[1][0],
            "ratios_first": halves[0][0], "ratios_second": halves[1][0],
            "base": statistics.median(suspended[0] + suspended[1]),
            "boundary": statistics.median(boundary) / 1e9,
            "spread": (min(suspended[0] + suspended[1]), max(suspended[0] + suspended[1]))}


def measure(steps, daemon, pairs: int, whole: int, warm: int) -> dict:
    proc, url, token = daemon
    idle_s = 10.0
    idle_before = cpu_s(proc.pid)
    time.sleep(idle_s)
    daemon_idle_per_s = (cpu_s(proc.pid) - idle_before) / idle_s

    exporters.ACTIVE_S = 0.0   # a settled job: exports every quiet interval
    exporter = DeferredExporter(lambda: otlp_http_exporter(url, token))
    try:
        d = patching.enable()
        try:
            other = _other_threads(steps, d, KeepOpen(exporter), proc, daemon_idle_per_s,
                                   whole, warm)
        finally:
            patching.disable()
        d = patching.enable()
        try:
            paired = _routed(steps, d, KeepOpen(exporter), pairs, warm)
        finally:
            patching.disable()
    finally:
        exporter.shutdown()

    base, boundary_s = paired["base"], paired["boundary"]
    routed = statistics.median(paired["ratios"]) - 1
    first, second = (statistics.median(paired[k]) - 1 for k in ("ratios_first", "ratios_second"))
    low, high = (x - 1 for x in median_interval(paired["ratios"]))
    fraction = other.pop("fraction")
    rest = boundary_s / base + fraction
    ratio = other["observed"]["excess_to_cpu"]
    return {
        "overhead": round(routed + rest, 4),
        "overhead_95ci": [round(low + rest, 4), round(high + rest, 4)],
        "routed": round(routed, 4),
        "routed_95ci": [round(low, 4), round(high, 4)],
        "routed_first_steps": round(first, 4),    # right after the routing was switched
        "routed_second_steps": round(second, 4),  # a step later
        "suspended_step_ms": round(base * 1e3, 3),
        "routed_ms": round(statistics.median(paired["diffs"]) * 1e3, 4),
        "boundary_ms": round(boundary_s * 1e3, 4),
        "other_threads_fraction": round(fraction, 4),
        # the other threads' CPU weighed by what their bursts were seen to cost the steps
        "overhead_observed": None if ratio is None else round(
            routed + boundary_s / base + fraction * ratio, 4),
        "other_threads": other,
        "daemon_idle_cpu_ms_per_s": round(daemon_idle_per_s * 1e3, 3),
        "step_ms_spread": [round(x * 1e3, 2) for x in paired["spread"]],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=1500, help="routed/suspended step pairs")
    p.add_argument("--whole", type=int, default=1500,
                   help="steps all routed, for the other threads' CPU")
    p.add_argument("--warm", type=int, default=30, help="routed steps before each part")
    p.add_argument("--out")
    a = p.parse_args()
    steps = stepper()
    steps(30)
    with tempfile.TemporaryDirectory(prefix="rtxops-overhead-") as tmp, \
            running_daemon(Path(tmp) / "home", env={"RTXOPS_EVOLVE": "0"}) as daemon:
        figures = measure(steps, daemon, a.pairs, a.whole, a.warm)
    report({"bench": "step_overhead_interleaved", "python": platform.python_version(),
            "cpus": os.cpu_count(), "torch": torch.__version__,
            "dispatch_core": D._Core is not None,   # RTXOPS_DISPATCH_CORE=0: off
            "method": "one job on the whole default path, routing suspended every other two steps "
                      "(RRSS, SSRR); other threads' CPU charged in full",
            "pairs": a.pairs, "whole_steps": a.whole, **figures, "target_overhead_max": 0.02}, a.out)


if __name__ == "__main__":
    main()
