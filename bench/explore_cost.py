"""Cost of exploring on the example GPT, measured inside one process (issue #5: ≤ 5 %).

The runtime routes the GPT's ops (no telemetry, like ``evolve_gpt.py``'s exploration runs); every
``--block`` steps a new plan is installed at the step boundary, alternating between the reference
on every recorded bucket and the same plan with explore arms (10 % of each bucket's calls, over up
to 3 of its candidates; torch.compile variants left out, as the loop's online trials would stall
on them). The first ``--skip`` steps of a block (route rebuilds, first-call checks) are dropped.
Adjacent blocks run a second apart, so the host's slow spells, which move whole runs by +25 % on
this VM, hit both sides alike; the figure is the median over blocks of explore ÷ the mean of the
reference blocks on either side. JSON on stdout (``--out`` writes it too).
"""
from __future__ import annotations

import statistics

from _gpt import block_options, emit, paired_ratios, stepper

from rtxops.evolve.candidates import candidates
from rtxops.runtime import patching
from rtxops.runtime.bucket import Bucket
from rtxops.runtime.plan import ExploreArm, Plan, PlanEntry
from rtxops.runtime.spec import REFERENCE

SHARE = 0.10


def main() -> None:
    a = block_options(__doc__, block=50, skip=10)
    steps = stepper()
    d = patching.enable()
    try:
        steps(20)  # the buckets the GPT calls
        buckets = sorted({(s.op, s.bucket) for s in d.slots})
        base, explore = [], []
        for op, bucket in buckets:
            arms = [x for x in candidates(d.registry, op, Bucket.parse(op, bucket))
                    if x.variant not in (REFERENCE, "compiled")][:3]
            base.append(PlanEntry(op, bucket, REFERENCE))
            explore.append(PlanEntry(op, bucket, REFERENCE, {}, tuple(
                ExploreArm(x.variant, x.config, SHARE / len(arms)) for x in arms)))
        version = 0
        blocks: dict[str, list[float]] = {"reference": [], "explore": []}
        explored_calls = total_calls = 0
        for i in range(2 * a.pairs + 1):  # reference first and last: each explore block has both sides
            name, entries = ("reference", base) if i % 2 == 0 else ("explore", explore)
            version += 1
            d.install_plan(Plan(version=version, entries=tuple(entries)))
            before = list(d.readings.calls)
            blocks[name].append(statistics.median(steps(a.block)[a.skip:]))
            if name == "explore":
                calls = [c - (before[j] if j < len(before) else 0) for j, c in enumerate(d.readings.calls)]
                explored_calls += sum(c for s, c in zip(d.slots, calls) if s.variant != REFERENCE)
                total_calls += sum(calls)
    finally:
        patching.disable()

    ref, exp = blocks["reference"], blocks["explore"]
    ratios = paired_ratios(blocks, "reference", "explore")
    emit("explore_cost", "one process, plans alternated every block at a step boundary", a, {
        "buckets": len(buckets), "explored_buckets": sum(1 for e in explore if e.explore),
        "explored_share_of_calls": round(explored_calls / max(total_calls, 1), 4),
        "step_ms": {"reference": round(statistics.median(ref) * 1e3, 3),
                    "explore": round(statistics.median(exp) * 1e3, 3)},
        "block_ms": {k: [round(v * 1e3, 2) for v in vs] for k, vs in blocks.items()},
        "block_ratios": [round(r, 4) for r in ratios],
        "overhead": round(statistics.median(ratios) - 1, 4),
        "target_overhead_max": 0.05,
    })

if __name__ == "__main__":
    main()
