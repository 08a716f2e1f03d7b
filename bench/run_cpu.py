"""CPU that ``rtxops run`` (its in-process daemon: receiver, store writer, evolve loop, log
following) and the job's own rtxops threads take per training step, once the example GPT has
converged.

``rtxops run --compile-model --fuse-optimizer`` (evolve loop on) runs the GPT, which prints a JSON
line a step (``--default-plan``: issue #3's setting instead, the default plan with the evolve loop
off; ``--every-10``: the GPT's own output, a line every 10 steps); from step ``--at`` on, every thread's CPU time (``/proc/PID/task``) is read over
``--window`` seconds, and named through ``py-spy dump``. On a 2-core machine any of it is taken
from the job. JSON on stdout (``--out`` writes it too).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import report

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
STEP = re.compile(r'(?:\{"step": |step +)(\d+)')   # a JSON line, or one of every 10 steps


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid``, by thread id."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[tid] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def thread_names(pid: int) -> dict[str, str]:
    py_spy = Path(sys.executable).parent / "py-spy"
    dump = subprocess.run([str(py_spy), "dump", "--pid", str(pid)], capture_output=True,
                          text=True).stdout
    return {m.group(1): m.group(2) for m in re.finditer(r'Thread (\d+) \([^)]*\): "([^"]+)"', dump)}


def per_step(pid: int, before: dict, after: dict, steps: int) -> dict:
    names = thread_names(pid)
    ms: collections.Counter = collections.Counter()
    for tid, cpu in after.items():
        ms[names.get(tid, "other")] += (cpu - before.get(tid, cpu)) / steps * 1e3
    return {"total_ms_per_step": round(sum(ms.values()), 3),
            "threads_ms_per_step": {k: round(v, 3) for k, v in ms.most_common() if v > 0}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--at", type=int, default=1200, help="step the window starts at")
    p.add_argument("--window", type=float, default=10.0, help="seconds")
    p.add_argument("--default-plan", action="store_true",
                   help="issue #3's setting: the default plan, evolve loop off, nothing compiled")
    p.add_argument("--every-10", action="store_true",
                   help="the job prints a line every 10 steps (its default), not a JSON line a step")
    p.add_argument("--out")
    a = p.parse_args()
    tuned = [] if a.default_plan else ["--compile-model", "--fuse-optimizer"]
    with tempfile.TemporaryDirectory(prefix="rtxops-runcpu-") as home:
        env = {**os.environ, "RTXOPS_HOME": home, "RTXOPS_EVOLVE": "0" if a.default_plan else "1",
               "OMP_NUM_THREADS": "2"}
        output = [] if a.every_10 else ["--json"]
        run = subprocess.Popen(
            [sys.executable, "-m", "rtxops.cli", "run", *tuned,
             "--name", "bench", "--no-summary", "--", sys.executable,
             str(ROOT / "examples" / "train_gpt.py"), *output, "--steps", str(a.steps)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
        steps, window, out = 0, None, None
        for line in run.stdout:
            if not (step := STEP.match(line)):
                continue
            steps = int(step.group(1))
            if steps >= a.at and window is None:
                job = _job_pid(home, run.pid)
                window = (time.monotonic(), steps, thread_cpu(run.pid), thread_cpu(job))
            if window and out is None and time.monotonic() - window[0] >= a.window:
                t0, s0, run0, job0 = window
                n, seconds = steps - s0, time.monotonic() - t0
                out = {"bench": "run_cpu", "cpus": os.cpu_count(),
                       "setting": "default plan, evolve off" if a.default_plan
                       else "evolve on, --compile-model --fuse-optimizer",
                       "job_prints": "a line every 10 steps" if a.every_10 else "a line a step",
                       "window_s": round(seconds, 1),
                       "steps": n, "step_ms": round(seconds / n * 1e3, 2),
                       "rtxops_run": per_step(run.pid, run0, thread_cpu(run.pid), n),
                       "job": per_step(job, job0, thread_cpu(job), n)}
        run.wait()
    if out is None:
        raise SystemExit("the job ended before the window did")
    report(out, a.out)


def _job_pid(home: str, run_pid: int) -> int:
    """The job's process: the example's Python whose environment has this run's home (not its
    waiter, whose command line names it too)."""
    needle = f"RTXOPS_HOME={home}".encode()
    for line in subprocess.check_output(["pgrep", "-f", "train_gpt.py"], text=True).split():
        pid = int(line)
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if (pid != run_pid and not any(arg.endswith(b"_waiter.py") for arg in argv)
                    and needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")):
                return pid
        except OSError:
            continue
    raise SystemExit("the job's process was not found")


if __name__ == "__main__":
    main()
