"""Search efficiency on real sweeps: record one exhaustive sweep of every candidate of a few
(op, bucket) pairs on this machine (``rtxops tune --strategy exhaustive`` in worker processes, the
correctness gate first), then replay each search strategy against it and count the trials each
needs to come within 5 % of the best arm. Prints JSON (``--out`` writes it).

The issue's target: the bandit (thompson) or successive halving reaches within 5 % of the best
with ≤ 25 % of the exhaustive sweep's trials (median over the sweeps).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

TARGETS = [
    ("rms_norm", "float32/cpu/hidden=512,rows=256"),
    ("rms_norm", "float32/cpu/hidden=1024,rows=1024"),
    ("layer_norm", "float32/cpu/hidden=512,rows=256"),
    ("layer_norm", "float32/cpu/hidden=1024,rows=1024"),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seeds", type=int, default=50)
    p.add_argument("--no-compiled", action="store_true", help="leave torch.compile variants out")
    p.add_argument("--out")
    a = p.parse_args()

    import torch

    from rtxops.evolve.candidates import candidates
    from rtxops.evolve.offline import tune
    from rtxops.evolve.replay import load_sweep, replay
    from rtxops.runtime.bucket import Bucket
    from rtxops.runtime.registry import default_registry
    from rtxops.telemetry.store import Store

    registry = default_registry()
    results = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "rtxops.duckdb")
        try:
            for op, bucket in TARGETS:
                arms = candidates(registry, op, Bucket.parse(op, bucket))
                variants = sorted({x.variant for x in arms if not (a.no_compiled and x.variant == "compiled")})
                t0 = time.monotonic()
                sweep_file = Path(tmp) / f"{op}-{len(results)}.json"
                report = tune(store, registry, op=op, bucket=bucket, strategy="exhaustive",
                              budget=len(arms) + 1, reps=a.reps, warmup=a.warmup, variants=variants,
                              sweep_out=sweep_file)
                (b,) = report["buckets"]
                sweep = load_sweep(sweep_file)
                replayed = replay(sweep, None, None, a.seeds)
                medians = {k: statistics.median(v) for k, v in sweep.items()}
                fastest = min(medians, key=medians.get)
                results.append({
                    "op": op, "bucket": bucket, "arms": len(sweep), "record_s": round(time.monotonic() - t0, 1),
                    "gate_failures": b["gate_failures"], "best": fastest,
                    "best_median_ns": medians[fastest], "reference_median_ns": medians.get("reference {}"),
                    "within_5pct_arms": sum(m <= medians[fastest] * 1.05 for m in medians.values()),
                    "replay": replayed, "sweep": json.loads(sweep_file.read_text()),
                })
                print(f"{op} {bucket}: {len(sweep)} arms, best {fastest}", file=sys.stderr)
        finally:
            store.close()

    fractions = {}
    for name in ("thompson", "successive_halving", "random", "exhaustive"):
        per = [r["replay"]["strategies"][name]["median_trials"] / r["arms"]
               if r["replay"]["strategies"][name]["median_trials"] is not None else None
               for r in results]
        fractions[name] = {"median_fraction_of_arms": statistics.median(x for x in per if x is not None)
                           if any(x is not None for x in per) else None,
                           "per_sweep": per,
                           "reached": [r["replay"]["strategies"][name]["reached"] for r in results]}
    best_of = min((fractions[n]["median_fraction_of_arms"] for n in ("thompson", "successive_halving")
                   if fractions[n]["median_fraction_of_arms"] is not None), default=None)
    out = {
        "bench": "replay", "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__, "reps": a.reps, "warmup": a.warmup, "seeds": a.seeds,
        "compiled_variants": not a.no_compiled, "seconds": round(time.monotonic() - started, 1),
        "summary": {"strategies": fractions, "target_fraction": 0.25,
                    "bandit_or_halving_fraction": best_of,
                    "met": best_of is not None and best_of <= 0.25},
        "sweeps": results,
    }
    text = json.dumps(out, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(json.dumps(out["summary"], indent=1))


if __name__ == "__main__":
    main()
