"""What rtxops converges to on the example GPT, against eager, inside one process (issue #5).

``rtxops run --compile-model --fuse-optimizer`` ends, when both regions win, on the model compiled
with ``torch.compile`` and torch's fused AdamW; on this model the region keeps its candidate
compiled with SDPA's math backend (``--candidate``, default ``compiled_math_attention``; the
plain compile is ``compiled``). Here one GPT trains on while every ``--block``
steps it switches between that configuration and plain eager (default AdamW), at a step boundary,
so adjacent blocks share the host's slow spells. It measures the end state only, not the road to
it (``evolve_gpt.py`` runs the whole thing, process against process). The figure is the median
over blocks of the eager block ÷ the mean of the converged blocks on either side. JSON on stdout
(``--out`` writes it too).
"""
from __future__ import annotations

import statistics

import torch
from _gpt import Trainer, block_options, emit, paired_ratios

from rtxops.runtime.optimizer_region import _switch_back, _switch_to_fused
from rtxops.runtime.regions import MATH_ATTENTION, candidate_forward, compile_kwargs


def main() -> None:
    a = block_options(__doc__, block=45, skip=5, extra=lambda p: p.add_argument(
        "--candidate", choices=("compiled", MATH_ATTENTION), default=MATH_ATTENTION))
    t = Trainer()
    # as the region compiles it
    run = torch.compile(candidate_forward(type(t.model).forward, a.candidate),
                        **compile_kwargs(None, t.model))

    def compiled(*args):
        return run(t.model, *args)

    t.steps(5)
    # the job's own settings, kept once: switching to fused again returns fused's
    t.forward, own = compiled, _switch_to_fused(t.opt)
    t.steps(10)  # compiles
    blocks: dict[str, list[float]] = {"converged": [], "eager": []}
    for i in range(2 * a.pairs + 1):  # converged first and last
        if i % 2:
            t.forward = t.model
            _switch_back(t.opt, own)
        else:
            t.forward = compiled
            _switch_to_fused(t.opt)
        blocks["eager" if i % 2 else "converged"].append(statistics.median(t.steps(a.block)[a.skip:]))
    ratios = paired_ratios(blocks, "converged", "eager")  # eager ÷ converged: the speed-up
    emit("converged_inprocess", "one process: eager + AdamW vs torch.compile(model) + fused AdamW, "
         "alternated every block", a, {
             "candidate": a.candidate,
             "block_ms": {k: [round(v * 1e3, 2) for v in vs] for k, vs in blocks.items()},
             "speedup_per_block": [round(r, 4) for r in ratios],
             "speedup": round(statistics.median(ratios), 4), "target_speedup_min": 1.25})


if __name__ == "__main__":
    main()
