"""Where the converged GPT step's time goes (issue #5): the example GPT compiled with
``torch.compile`` and torch's fused AdamW (what rtxops converges to), its FLOPs per step
(``torch.utils.flop_counter``) and the share of its CPU time in matrix products (torch profiler),
against eager's step time. Matrix products near the CPU's peak bound what any variant of the other
ops can still gain. JSON on stdout (``--out`` writes it too).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics

import torch
from _gpt import Trainer
from _report import report
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from rtxops.runtime.optimizer_region import _switch_to_fused
from rtxops.runtime.regions import compile_kwargs

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out")
    a = p.parse_args()
    t = Trainer()
    t.steps(5)
    with FlopCounterMode(display=False) as fc:
        t.steps(1)
    flops = fc.get_total_flops()
    by_op = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    eager_s = statistics.median(t.steps(a.steps))
    t.forward = torch.compile(t.model, **compile_kwargs(None, t.model))  # as the region compiles it
    _switch_to_fused(t.opt)
    t.steps(10)  # compiles
    converged_s = statistics.median(t.steps(a.steps))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t.steps(a.steps)
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    mm_us = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
    mm_s_per_step = mm_us / 1e6 / a.steps
    report({
        "bench": "converged_profile", "python": platform.python_version(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "steps": a.steps,
        "gflop_per_step": round(flops / 1e9, 3),
        "gflop_per_step_by_op": {k: round(v / 1e9, 3) for k, v in by_op.items()},
        "eager_step_ms": round(eager_s * 1e3, 2), "converged_step_ms": round(converged_s * 1e3, 2),
        "converged_speedup": round(eager_s / converged_s, 3),
        "profiled_cpu_ms_per_step": round(total_us / 1e3 / a.steps, 2),
        "matmul_cpu_ms_per_step": round(mm_s_per_step * 1e3, 2),
        "matmul_share_of_profiled": round(mm_us / total_us, 3),
        "matmul_gflop_per_s": round(by_op.get("aten.mm", flops) / 1e9 / mm_s_per_step, 1),
    }, a.out)


if __name__ == "__main__":
    main()
