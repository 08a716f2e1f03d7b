"""Step time of examples/train_gpt.py: plain eager vs ``rtxops run`` with the default plan.

Runs the two alternately in fresh processes (pairs), drops warm-up steps, and compares the median
step time. Also reports the CPU time of the job's telemetry export thread per step, as a share of
the eager step (also without the exporter's one-time imports): on a small shared machine the step-time pairs move with everyone else's load, the
export thread's CPU (what it takes from the job's OpenMP threads on 2 cores) much less. Prints JSON
(and writes it with ``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _report import report

ROOT = Path(__file__).resolve().parents[1]


def step_times(cmd: list[str], extra_env: dict | None = None) -> list[float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTXOPS_")} | (extra_env or {})
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return [json.loads(line)["step_s"] for line in out.splitlines() if line.startswith("{")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out")
    p.add_argument("--run-args", default="", help="extra `rtxops run` arguments, e.g. '--direct'")
    p.add_argument("--model", default="", help="extra train_gpt.py arguments, e.g. '--dim 256 --layers 4'")
    a = p.parse_args()
    job = [sys.executable, str(ROOT / "examples/train_gpt.py"), "--json", "--steps", str(a.steps),
           *a.model.split()]
    runs = {"eager": [], "rtxops": []}
    export = []
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "telemetry.json"
        for _ in range(a.pairs):
            for name, cmd in (("eager", job),
                              ("rtxops", [sys.executable, "-m", "rtxops.cli", "run", "--no-summary",
                                         *a.run_args.split(), "--", *job])):
                # the evolve loop off: this measures the runtime and its telemetry, not exploring
                # and a home of its own: ./.rtxops, or a daemon serving it, would take the job
                extra = ({"RTXOPS_TELEMETRY_STATS": str(stats), "RTXOPS_EVOLVE": "0",
                          "RTXOPS_HOME": tempfile.mkdtemp(prefix="home-", dir=tmp)}
                         if name == "rtxops" else None)
                runs[name].append(step_times(cmd, extra)[a.warmup:])
                if extra and stats.exists():
                    export.append(json.loads(stats.read_text()))
                    stats.unlink()
    med = {k: statistics.median(t for r in v for t in r) for k, v in runs.items()}
    pair_ratios = [statistics.median(r) / statistics.median(e) for e, r in zip(runs["eager"], runs["rtxops"])]
    out = {
        "bench": "step_overhead",
        "steps": a.steps, "warmup": a.warmup, "pairs": a.pairs, "model_args": a.model,
        "run_args": a.run_args,
        "method": "alternating fresh processes; rtxops = `rtxops run` (in-process daemon, telemetry "
                  "over OTLP, default plan, evolve loop off)",
        "median_step_s": med,
        "overhead": med["rtxops"] / med["eager"] - 1,   # of the medians of all steps pooled
        "pair_overheads": [r - 1 for r in pair_ratios],
        "median_pair_overhead": statistics.median(pair_ratios) - 1,
        "export_thread": {
            "cpu_ms_per_step": statistics.median(
                e["export_thread_cpu_s"] / e["steps"] * 1e3 for e in export if e["steps"]) if export else None,
            "cpu_ms_per_step_after_setup": statistics.median(
                (e["export_thread_cpu_s"] - e.get("exporter_setup_cpu_s", 0.0)) / e["steps"] * 1e3
                for e in export if e["steps"]) if export else None,
            "share_of_eager_step": statistics.median(
                e["export_thread_cpu_s"] / e["steps"] / med["eager"] for e in export if e["steps"])
            if export else None,
            "runs": export,
        },
        "target_overhead_max": 0.02,
    }
    report(out, a.out)


if __name__ == "__main__":
    main()
