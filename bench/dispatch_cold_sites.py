"""What each routed site of the example GPT adds to its call with the caches cold (issue #3).

``dispatch_cold.py`` takes one op (``F.linear`` on tiny tensors) apart. This times every kind of
routed call a step of ``examples/train_gpt.py`` makes, at its own sizes, through the site rtxops
put there (the ``RMSNorm`` class's forward, ``nn.Linear``'s, the job's ``apply_rotary_pos_emb``,
``F.scaled_dot_product_attention``, ``F.silu``, ``F.cross_entropy``), paired against what runs
there without rtxops (the class's own forward, torch's functions), each timed call after a 24 MB
write, with autograd on as in training. ``per_step_us`` weighs each site by its calls in one step
of the example's defaults (2 layers): what the routing costs a step, to set beside
``step_overhead_interleaved.py``'s ``routed_ms``. ``RTXOPS_DISPATCH_CORE=0`` measures the routing
in Python instead of the C++ core (``dispatch_core`` in the JSON). Medians of per-pair
differences, µs. JSON on stdout (``--out`` writes it too).
"""
from __future__ import annotations

import os
import platform
import statistics

import torch
import torch.nn.functional as F
from _gpt import train_gpt
from _report import report
from dispatch_cold import _Nowhere, arguments, paired

from rtxops.runtime import dispatcher, originals, patching
from rtxops.telemetry.job import start_job_telemetry

# routed calls of each kind in one step of the example GPT (2 layers): per layer two RMSNorms,
# seven linears, one rope, one attention, one SiLU; then the last norm, the head, the loss
CALLS_PER_STEP = {"rms_norm_class": 5, "linear_module": 15, "rope_function": 2, "attention": 2,
                  "silu": 2, "cross_entropy": 1}


def sites(d, model) -> dict:
    """(routed call, what runs there without rtxops) for each kind of site, at the GPT's sizes."""
    g = train_gpt
    x = torch.randn(8, 64, 128, requires_grad=True)
    hidden = torch.randn(8, 64, 340, requires_grad=True)
    q, k, v = (torch.randn(8, 4, 64, 32, requires_grad=True) for _ in range(3))
    cos, sin = model.cos[:, :64], model.sin[:, :64]
    logits = torch.randn(512, 2048, requires_grad=True)
    targets = torch.randint(0, 2048, (512,))
    norm, linear = model.norm, model.layers[0].self_attn.q_proj
    norm_site = next(s for s in d.sites if getattr(s, "cls", None) is g.RMSNorm)
    rope_site = next(s for s in d.sites if s.name.endswith("apply_rotary_pos_emb"))
    own = {name: originals.original(name)
           for name in ("linear", "silu", "scaled_dot_product_attention", "cross_entropy")}
    own_norm, own_rope = norm_site.original_forward, rope_site.reference

    def own_linear_forward(module, input):   # nn.Linear.forward as torch writes it
        return own["linear"](input, module.weight, module.bias)

    return {
        "rms_norm_class": (lambda: g.RMSNorm.forward(norm, x), lambda: own_norm(norm, x)),
        "linear_module": (lambda: torch.nn.Linear.forward(linear, x),
                          lambda: own_linear_forward(linear, x)),
        "rope_function": (lambda: g.apply_rotary_pos_emb(q, k, cos, sin),
                          lambda: own_rope(q, k, cos, sin)),
        "attention": (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                      lambda: own["scaled_dot_product_attention"](q, k, v, is_causal=True)),
        "silu": (lambda: F.silu(hidden), lambda: own["silu"](hidden)),
        "cross_entropy": (lambda: F.cross_entropy(logits, targets),
                          lambda: own["cross_entropy"](logits, targets)),
    }


def main() -> None:
    a = arguments(__doc__, 1000)
    torch.manual_seed(0)
    model = train_gpt.GPT(2048, 128, 2, 4, 64)
    junk = torch.empty(24 * 2**20 // 4)
    d = patching.enable()
    telemetry = start_job_telemetry(d, _Nowhere())
    try:
        candidates = sites(d, model)
        for routed, own in candidates.values():
            for _ in range(20):   # each route found, checked, its slot made
                routed()
                own()
        rounds = [{name: paired(routed, own, (), a.pairs, junk)
                   for name, (routed, own) in candidates.items()} for _ in range(a.rounds)]
    finally:
        telemetry.close()
        patching.disable()
    median = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    per_step = sum(median[name] * n for name, n in CALLS_PER_STEP.items())
    report({"bench": "dispatch_cold_sites", "python": platform.python_version(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "pairs": a.pairs,
            "dispatch_core": dispatcher._Core is not None,
            "method": "each timed call after a 24 MB write, autograd on; median of per-pair "
                      "differences, routed call minus the call without rtxops, µs",
            "calls_per_step": CALLS_PER_STEP, "median_of_rounds_us": median,
            "per_step_us": round(per_step, 1), "rounds": rounds}, a.out)


if __name__ == "__main__":
    main()
