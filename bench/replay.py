"""Search efficiency on real sweeps: record one exhaustive sweep of every candidate of each op at
two (or more) bucket sizes on this machine (one ``bench`` run of the evolve worker per sweep: every
arm warmed up, then repetitions interleaved across arms), keep the sweeps as JSON, then replay each
search strategy against each sweep and count the trials it needs to come within 5 % of the best arm.

Thompson sampling is replayed twice: without priors, and with priors from the OTHER sweeps of the
same op (leave-one-out: a sweep's own values never inform its prior). Sweeps already in
``--sweeps-dir`` are reused (``--rerecord`` measures them again). Prints the summary; ``--out``
writes the full JSON.

The issue's target: the bandit (thompson) or successive halving reaches within 5 % of the best
with ≤ 25 % of the exhaustive sweep's trials (median over the sweeps).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

SWEEPS_DIR = Path(__file__).parent / "results" / "sweeps"
# Small-to-medium float32 CPU buckets, two sizes per op.
TARGETS = [
    ("rms_norm", "float32/cpu/hidden=512,rows=256"),
    ("rms_norm", "float32/cpu/hidden=1024,rows=1024"),
    ("layer_norm", "float32/cpu/hidden=512,rows=256"),
    ("layer_norm", "float32/cpu/hidden=1024,rows=1024"),
    ("softmax", "float32/cpu/cols=512,rows=256"),
    ("softmax", "float32/cpu/cols=1024,rows=1024"),
    ("gelu", "float32/cpu/tanh=0,hidden=512,rows=256"),
    ("gelu", "float32/cpu/tanh=0,hidden=1024,rows=1024"),
    ("silu", "float32/cpu/hidden=512,rows=256"),
    ("silu", "float32/cpu/hidden=1024,rows=1024"),
    ("swiglu", "float32/cpu/hidden=512,rows=256"),
    ("swiglu", "float32/cpu/hidden=1024,rows=1024"),
    ("cross_entropy", "float32/cpu/vocab=1024,rows=256,reduction=1,smoothing=0"),
    ("cross_entropy", "float32/cpu/vocab=4096,rows=512,reduction=1,smoothing=0"),
    ("rope", "float32/cpu/head_dim=64,seq=128,rows=8,unsqueeze_dim=1,same_qk=1"),
    ("rope", "float32/cpu/head_dim=64,seq=256,rows=16,unsqueeze_dim=1,same_qk=1"),
    ("attention", "float32/cpu/head_dim=64,seq_q=128,seq_kv=128,rows=4,causal=1,mask=0"),
    ("attention", "float32/cpu/head_dim=64,seq_q=256,seq_kv=256,rows=8,causal=1,mask=0"),
    ("linear", "float32/cpu/in_features=512,out_features=512,rows=256,bias=1"),
    ("linear", "float32/cpu/in_features=1024,out_features=1024,rows=512,bias=1"),
]
COMPARED = ("thompson", "thompson+priors", "successive_halving", "random", "exhaustive")


def sweep_path(sweeps_dir: Path, op: str, bucket: str) -> Path:
    safe = bucket.replace("/", "_").replace(",", "_").replace("=", "")
    return sweeps_dir / f"{op}__{safe}.json"


def record(op: str, bucket: str, reps: int, warmup: int, timeout_s: float) -> dict:
    """One exhaustive sweep: every candidate arm of (op, bucket), one worker run."""
    import torch

    from rtxops.evolve.candidates import candidates
    from rtxops.evolve.runner import run_worker
    from rtxops.runtime.bucket import Bucket
    from rtxops.runtime.registry import default_registry

    arms = candidates(default_registry(), op, Bucket.parse(op, bucket))
    t0 = time.monotonic()
    results = run_worker({"command": "bench", "op": op, "bucket": bucket, "warmup": warmup,
                          "reps": reps, "arms": [{"variant": a.variant, "config": a.config}
                                                 for a in arms]}, timeout_s)
    ok = [r for r in results if r.get("status") == "ok" and r.get("values")]
    return {"op": op, "bucket": bucket, "reps": reps, "warmup": warmup,
            "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
            "record_s": round(time.monotonic() - t0, 1),
            "failed": {f'{r["variant"]} {json.dumps(r.get("config", {}), sort_keys=True)}':
                       r.get("reason", "") for r in results if r not in ok},
            "arms": [{"variant": r["variant"], "config": r.get("config", {}), "values": r["values"]}
                     for r in ok]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seeds", type=int, default=50)
    p.add_argument("--sweeps-dir", type=Path, default=SWEEPS_DIR)
    p.add_argument("--rerecord", action="store_true", help="measure sweeps already on disk again")
    p.add_argument("--only", help="comma-separated ops to record (default: all)")
    p.add_argument("--no-replay", action="store_true", help="record only")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out")
    p.add_argument("--compare-with", type=Path, metavar="DIR",
                   help="only compare the sweeps in --sweeps-dir with a second recording in DIR "
                        "(is each bucket's best arm the same, and by how much does it differ?)")
    a = p.parse_args()
    if a.compare_with:
        text = json.dumps(compare_recordings(a.sweeps_dir, a.compare_with), indent=1)
        if a.out:
            Path(a.out).write_text(text)
        print(text)
        return

    started = time.monotonic()
    a.sweeps_dir.mkdir(parents=True, exist_ok=True)
    only = set(a.only.split(",")) if a.only else None
    for op, bucket in TARGETS:
        path = sweep_path(a.sweeps_dir, op, bucket)
        if (only and op not in only) or (path.exists() and not a.rerecord):
            continue
        sweep = record(op, bucket, a.reps, a.warmup, a.timeout)
        path.write_text(json.dumps(sweep, indent=1))
        print(f"recorded {op} {bucket}: {len(sweep['arms'])} arms in {sweep['record_s']} s"
              f"{' (failed: ' + ', '.join(sweep['failed']) + ')' if sweep['failed'] else ''}",
              file=sys.stderr)
    if a.no_replay:
        return
    out = replay_dir(a.sweeps_dir, a.seeds)
    out["seconds"] = round(time.monotonic() - started, 1)
    text = json.dumps(out, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(json.dumps(out["summary"], indent=1))


def replay_dir(sweeps_dir: Path, seeds: int) -> dict:
    """Replay every sweep in ``sweeps_dir`` (Thompson with and without leave-one-out priors). A
    trial is one benchmark of R repetitions (R = the sweep's reps): the median of R of the arm's
    recorded values drawn with replacement; the one-repetition trial is reported alongside."""
    from rtxops.evolve.replay import load_sweep_data, replay_many

    files = sorted(sweeps_dir.glob("*.json"))
    raw = [json.loads(f.read_text()) for f in files]
    sweeps = [load_sweep_data(d, f) for d, f in zip(raw, files)]
    reps = min(int(d.get("reps") or 1) for d in raw)
    per_sweep = []
    for f, data, sweep in zip(files, raw, sweeps):
        medians = {k: statistics.median(v) for k, v in sweep.arms.items()}
        fastest = min(medians, key=medians.get)
        per_sweep.append({
            "file": f.name, "op": sweep.op, "bucket": sweep.bucket, "arms": len(sweep.arms),
            "reps": data.get("reps"), "record_s": data.get("record_s"), "best": fastest,
            "best_median_ns": medians[fastest], "reference_median_ns": medians.get("reference {}"),
            "within_5pct_arms": sum(m <= medians[fastest] * 1.05 for m in medians.values())})
    out_summary, replays = {}, {}
    headline = f"trial={reps}_reps,shuffled"
    for label, tr, shuffle in ((headline, reps, True), (f"trial={reps}_reps,file_order", reps, False),
                               ("trial=1_rep,shuffled", None, True)):
        results = replay_many(sweeps, seeds=seeds, trial_reps=tr, shuffle=shuffle)
        replays[label] = results
        out_summary[label] = summarize(per_sweep, results)
    for i, s in enumerate(per_sweep):
        s["prior_best"] = replays[headline][i]["prior_best"]
        s["replay"] = {label: r[i]["strategies"] for label, r in replays.items()}
    import torch

    return {"bench": "replay", "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__, "seeds": seeds, "within": 0.05, "trial_reps": reps,
            "order": "each seed hands the strategy the arms in its own random order (the sweep's "
                     "order puts the reference first, which on CPU is often within 5 % of the best)",
            "summary": out_summary[headline],
            "summary_file_order": out_summary[f"trial={reps}_reps,file_order"],
            "summary_one_rep_trials": out_summary["trial=1_rep,shuffled"], "sweeps": per_sweep}


def compare_recordings(first: Path, second: Path) -> dict:
    """Two recordings of the same buckets: whether each names the same best arm, and how far each
    recording's best is from the best in the other (the replay's 5 % target is only meaningful
    where these stay well under 5 %)."""
    from rtxops.evolve.replay import load_sweep_file

    rows = []
    for f in sorted(second.glob("*.json")):
        if not (first / f.name).exists():
            continue
        a, b = (load_sweep_file(p).arms for p in (first / f.name, f))
        both = a.keys() & b.keys()  # an arm that failed in one recording has no values there
        if not both:
            continue
        ma = {k: statistics.median(v) for k, v in a.items() if k in both}
        mb = {k: statistics.median(v) for k, v in b.items() if k in both}
        best_a, best_b = min(ma, key=ma.get), min(mb, key=mb.get)
        rows.append({"file": f.name, "best_first": best_a, "best_second": best_b,
                     "same_best": best_a == best_b,
                     "first_best_in_second": round(mb[best_a] / mb[best_b], 3),
                     "second_best_in_first": round(ma[best_b] / ma[best_a], 3)})
    return {"bench": "replay_repeat", "first": os.path.relpath(first), "second": os.path.relpath(second),
            "sweeps": len(rows), "same_best": sum(r["same_best"] for r in rows),
            "best_off_by_more_than_5pct": sum(max(r["first_best_in_second"],
                                                   r["second_best_in_first"]) > 1.05 for r in rows),
            "per_sweep": rows}


def summarize(per_sweep: list[dict], results: list[dict]) -> dict:
    """Per strategy: median over sweeps of (median trials to within 5 %) / arms, a sweep where it
    never got there counting as 1.0; and the share of seeds that got there."""
    summary: dict = {"strategies": {}, "target_fraction": 0.25, "sweeps": len(per_sweep),
                     "ops": sorted({s["op"] for s in per_sweep})}
    for name in COMPARED:
        per, reached = [], []
        for s, r in zip(per_sweep, results):
            st = r["strategies"].get(name)
            if st is None:
                continue
            per.append(st["median_trials"] / s["arms"] if st["median_trials"] is not None else None)
            reached.append(st["reached"])
        done = [x for x in per if x is not None]
        summary["strategies"][name] = {
            "median_fraction_of_arms": statistics.median(x if x is not None else 1.0 for x in per)
            if per else None,
            "median_fraction_where_reached": statistics.median(done) if done else None,
            "median_reached_share": statistics.median(reached) if reached else None,
            "sweeps_at_or_under_25pct": sum(x is not None and x <= 0.25 for x in per),
            "per_sweep": per, "reached": reached}
    best = {n: summary["strategies"][n]["median_fraction_of_arms"]
            for n in ("thompson", "thompson+priors", "successive_halving")}
    pick = min((k for k in best if best[k] is not None), key=best.get, default=None)
    summary["best_bandit_or_halving"] = pick
    summary["bandit_or_halving_fraction"] = best.get(pick)
    summary["met"] = pick is not None and best[pick] <= 0.25
    return summary


if __name__ == "__main__":
    main()
