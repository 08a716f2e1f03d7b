"""What rtxops converges to on the example GPT, against eager, inside one process (issue #5).

``rtxops run --compile-model --fuse-optimizer`` ends, when both regions win, on the model compiled
with ``torch.compile`` and torch's fused AdamW. Here one GPT trains on while every ``--block``
steps it switches between that configuration and plain eager (default AdamW), at a step boundary,
so adjacent blocks share the host's slow spells. It measures the end state only, not the road to
it (``evolve_gpt.py`` runs the whole thing, process against process). The figure is the median
over blocks of the eager block ÷ the mean of the converged blocks on either side. JSON on stdout
(``--out`` writes it too).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch
from _gpt import Trainer, paired_ratios


def set_fused(opt: torch.optim.Optimizer, fused: bool) -> None:
    for g in opt.param_groups:
        g["fused"], g["foreach"] = (True, False) if fused else (None, None)
        for p in g["params"]:  # fused kernels keep the step counter with the parameter
            state = opt.state.get(p)
            if state and isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].to(p.device if fused else "cpu", torch.float32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("--block", type=int, default=45, help="steps per block")
    p.add_argument("--skip", type=int, default=5, help="steps dropped at the start of a block")
    p.add_argument("--out")
    a = p.parse_args()
    t = Trainer()
    compiled = torch.compile(t.model)
    t.steps(5)
    t.forward = compiled
    set_fused(t.opt, True)
    t.steps(10)  # compiles
    blocks: dict[str, list[float]] = {"converged": [], "eager": []}
    for i in range(2 * a.pairs + 1):  # converged first and last
        name = "eager" if i % 2 else "converged"
        t.forward = t.model if name == "eager" else compiled
        set_fused(t.opt, name == "converged")
        blocks[name].append(statistics.median(t.steps(a.block)[a.skip:]))
    ratios = paired_ratios(blocks, "converged", "eager")  # eager ÷ converged: the speed-up
    out = {"bench": "converged_inprocess", "python": platform.python_version(),
           "cpus": os.cpu_count(), "torch": torch.__version__,
           "method": ("one process: eager + AdamW vs torch.compile(model) + fused AdamW, "
                      "alternated every block"),
           "pairs": a.pairs, "block_steps": a.block, "skipped_steps": a.skip,
           "block_ms": {k: [round(v * 1e3, 2) for v in vs] for k, vs in blocks.items()},
           "speedup_per_block": [round(r, 4) for r in ratios],
           "speedup": round(statistics.median(ratios), 4), "target_speedup_min": 1.25}
    text = json.dumps(out, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
