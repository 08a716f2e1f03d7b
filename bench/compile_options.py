"""Which ``torch.compile`` options the whole-model region uses on the CPU (issue #5).

One GPT trains on while every ``--block`` steps it switches between four configurations, in an
order that turns round every round, so that each round's blocks share the host's state: plain
eager with AdamW; the model compiled with torch's defaults and fused AdamW; the model compiled
with Inductor's C++ wrapper (``cpp_wrapper``, what the region compiles a CPU model with) and fused
AdamW; the same with SDPA's math backend traced into the graph (the region's
``compiled_math_attention`` candidate) and fused AdamW. A block's figure is its median step; each
round gives the ratios of its blocks, and the figures are the medians of those over the rounds.
JSON on stdout (``--out`` writes it too).
"""
from __future__ import annotations

import statistics

import torch
from _gpt import Trainer, block_options, emit

from rtxops.runtime.optimizer_region import _switch_back, _switch_to_fused
from rtxops.runtime.regions import MATH_ATTENTION, candidate_forward, compile_kwargs

CONFIGS = ("eager", "compiled", "compiled_cpp_wrapper", "compiled_math_attention")


def main() -> None:
    a = block_options(__doc__, block=40, skip=5)
    t = Trainer()
    math = torch.compile(candidate_forward(type(t.model).forward, MATH_ATTENTION),
                         **compile_kwargs(None, t.model))
    forwards = {"eager": t.model, "compiled": torch.compile(t.model),
                "compiled_cpp_wrapper": torch.compile(t.model, **compile_kwargs(None, t.model)),
                "compiled_math_attention": lambda *args: math(t.model, *args)}
    assert compile_kwargs(None, t.model) == {"options": {"cpp_wrapper": True}}
    fused = [None]

    def use(config: str) -> None:
        t.forward = forwards[config]
        if config == "eager" and fused[0] is not None:
            _switch_back(t.opt, fused[0])
            fused[0] = None
        elif config != "eager" and fused[0] is None:
            fused[0] = _switch_to_fused(t.opt)

    for config in CONFIGS:   # compiles
        use(config)
        t.steps(a.skip + 5)
    blocks: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for r in range(a.pairs):
        for config in CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]:
            use(config)
            blocks[config].append(statistics.median(t.steps(a.block)[a.skip:]))

    def ratio(num: str, den: str) -> float:
        return round(statistics.median(x / y for x, y in zip(blocks[num], blocks[den])), 4)

    emit("compile_options", "one process: eager, torch.compile defaults, cpp_wrapper and "
         "cpp_wrapper with SDPA's math backend, alternated every block in turning order", a, {
             "block_ms": {k: [round(v * 1e3, 2) for v in vs] for k, vs in blocks.items()},
             "speedup_compiled": ratio("eager", "compiled"),
             "speedup_compiled_cpp_wrapper": ratio("eager", "compiled_cpp_wrapper"),
             "speedup_compiled_math_attention": ratio("eager", "compiled_math_attention"),
             "cpp_wrapper_over_defaults": ratio("compiled", "compiled_cpp_wrapper"),
             "math_attention_over_cpp_wrapper": ratio("compiled_cpp_wrapper",
                                                      "compiled_math_attention")})


if __name__ == "__main__":
    main()
