"""The offline tuner (``rtxops tune``): benchmark a bucket's candidates in worker processes on its
recorded shapes, with a search strategy on a trial budget.

Per bucket: candidates → correctness gate (stored) → a baseline trial of the reference → strategy
rounds, each one ``bench`` worker run of the arms it asked (a crash there fails those trials, not
the tuner) → ``trials`` rows and ``rtx.trial`` spans → tuning-database rows (source ``offline``) →
a decision (``offline_best``: the best arm against the reference, with its statistics, paired
repetition by repetition within the worker runs that measured both: runs differ by more than the
kernels do). A trial is one arm's repetitions in one worker run; the budget counts every trial
of the search, the baseline's included; a best arm never measured beside the reference gets one
more run with it. The thompson strategy starts from priors: the op's tuning rows on other buckets
(:func:`rtxops.evolve.priors.tuning_priors`).
"""
from __future__ import annotations

import json
import logging
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

from rtxops.runtime.bucket import Bucket
from rtxops.runtime.registry import Registry
from rtxops.runtime.spec import REFERENCE
from rtxops.telemetry import store_evolve
from rtxops.telemetry.store import Store

from . import stats
from .candidates import Arm, candidates
from .priors import tuning_priors
from .runner import WorkerError, run_isolating
from .screen import screen
from .search import STRATEGIES, make_strategy
from .trace import TrialSpans
from .tuning import TuningDB

log = logging.getLogger("rtxops.evolve")

BASELINE = Arm.of(REFERENCE)
BATCH = 4
MAX_DIM = 2**31 - 1   # a bucket's dim past it is no tensor anyone benchmarks (nor a C int)
SAVE_WAIT_S = 10.0  # how long a submit waits for its task record to be committed
Progress = Callable[[dict], None]


class TuneError(ValueError):
    """Bad tuning input (unknown op, variant or strategy, malformed bucket, nothing recorded)."""


def targets(store, registry: Registry, op: str | None, bucket: str | None,
            skipped: list[dict] | None = None) -> list[tuple[str, str]]:
    """The (op, bucket) pairs to tune: the given one, or every one recorded in telemetry that
    :func:`bucket_problem` passes (the others go to ``skipped``, with the reason)."""
    if bucket is not None and op is None:
        raise TuneError("--bucket needs --op (a bucket's form depends on its op)")
    if op is not None:
        _check(registry.op, op)
    if bucket is not None:
        return [(op, _check(lambda: registry.op(op).parse_bucket(bucket).id))]
    found = [(r["op"], r["bucket"]) for r in store_evolve.recorded_buckets(store, op)]
    known = {s.name for s in registry.ops()}
    found = [t for t in found if t[0] in known]
    if not found:
        raise TuneError(f"no recorded {op or 'op'} buckets in the telemetry store; run a job under "
                        "rtxops first, or give --op and --bucket")
    # telemetry is any OTLP client's, or an older rtxops's: what the tuner cannot take is skipped
    problems = {(o, b): bucket_problem(registry, o, b) for o, b in found}
    usable = [t for t, problem in problems.items() if problem is None]
    if not usable:
        raise TuneError(f"no recorded {op or 'op'} bucket is one the tuner can benchmark here: "
                        + "; ".join(f"{o} {b}: {p}" for (o, b), p in list(problems.items())[:3]))
    if skipped is not None:
        skipped += [{"op": o, "bucket": b, "reason": p} for (o, b), p in problems.items() if p]
    return usable


def bucket_problem(registry: Registry, op: str, bucket: str) -> str | None:
    """Why the tuner cannot benchmark ``bucket`` of ``op`` on this machine, or None."""
    try:
        parsed = registry.op(op).parse_bucket(bucket)
    except Exception as e:  # PlanError: the message names what is wrong
        return str(e)
    if parsed.device not in ("cpu", "cuda"):
        return (f"bucket {bucket!r}: device {parsed.device!r} is not one the tuner benchmarks on "
                "(cpu, cuda)")
    bad = [f"{k}={v}" for k, v in parsed.dims if not 0 <= v <= MAX_DIM]
    if bad:
        return f"bucket {bucket!r}: {', '.join(bad)} is no size"
    if parsed.device == "cuda" and not _cuda_here():
        return f"{bucket} is a CUDA bucket and this machine has no CUDA device"
    return None


def validate(registry: Registry, op: str | None, bucket: str | None, strategy: str,
             budget: int, variants: Sequence[str] | None) -> None:
    """Raise :class:`TuneError` for input :func:`tune` would refuse (before any work starts)."""
    if strategy not in STRATEGIES:
        raise TuneError(f"unknown strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
    if budget < 1:
        raise TuneError("the trial budget must be at least 1")
    if bucket is not None and op is None:
        raise TuneError("--bucket needs --op (a bucket's form depends on its op)")
    if op is not None:
        _check(registry.op, op)
        if bucket is not None and (problem := bucket_problem(registry, op, bucket)) is not None:
            raise TuneError(problem)
        for v in variants or ():
            _check(registry.variant, op, v)
    else:
        names = {v.name for o in registry.ops() for v in registry.variants(o.name)}
        for v in variants or ():
            if v not in names:
                raise TuneError(f"unknown variant {v!r}: no op has one of that name "
                                f"(known: {', '.join(sorted(names))})")


def tune(store: Store, registry: Registry, *, op: str | None = None, bucket: str | None = None,
         strategy: str = "successive_halving", budget: int = 12, reps: int = 20, warmup: int = 3,
         variants: Sequence[str] | None = None, seed: int = 0, timeout_s: float = 600.0,
         on_progress: Progress | None = None, sweep_out: str | Path | None = None,
         stop: threading.Event | None = None) -> dict:
    """Tune each target bucket; the report (per bucket: best arm, decision, trials, gate failures,
    the sweep of every measured arm's values). ``variants`` limits the candidates to those names."""
    validate(registry, op, bucket, strategy, budget, variants)
    skipped: list[dict] = []
    todo = targets(store, registry, op, bucket, skipped)
    for s in skipped:
        log.warning("rtxops tune: skipping %s %s: %s", s["op"], s["bucket"], s["reason"])
    tuner = _Tuner(store, registry, strategy, budget, reps, warmup, variants, seed, timeout_s,
                   on_progress or (lambda _: None), stop or threading.Event())
    report = {"strategy": strategy, "budget": budget, "reps": reps, "warmup": warmup,
              "seed": seed, "buckets": [], "skipped": skipped}
    for i, (o, b) in enumerate(todo):
        if tuner.stopped():
            break
        tuner.where = {"op": o, "bucket": b, "index": i, "buckets": len(todo)}
        report["buckets"].append(tuner.bucket(o, b))
    if sweep_out is not None:
        report["sweep_files"] = write_sweeps(report, sweep_out)
    return report


def write_sweeps(report: dict, path: str | Path) -> list[str]:
    """Write each tuned bucket's sweep (``{"op", "bucket", "arms": [...]}``, the format
    :func:`rtxops.evolve.replay.load_sweep` reads) to ``path``; with several buckets, to
    ``<stem>-<n><suffix>`` next to it. A bucket none of whose arms was measured has no sweep
    (replay could not read one). The paths written."""
    path = Path(path)
    sweeps = [b["sweep"] for b in report["buckets"] if b.get("sweep", {}).get("arms")]
    paths = [path] if len(sweeps) == 1 else [
        path.with_name(f"{path.stem}-{n}{path.suffix}") for n in range(len(sweeps))]
    for p, sweep in zip(paths, sweeps):
        p.write_text(json.dumps(sweep, indent=1))
    return [str(p) for p in paths]


class _Tuner:
    def __init__(self, store, registry, strategy, budget, reps, warmup, variants, seed, timeout_s,
                 on_progress, stop) -> None:
        self.store, self.registry = store, registry
        self.strategy, self.budget, self.reps, self.warmup = strategy, budget, reps, warmup
        self.variants = set(variants) if variants else None
        self.seed, self.timeout_s = seed, timeout_s
        self.on_progress, self.stop = on_progress, stop
        self.tuning = TuningDB(store, registry)
        self.spans = TrialSpans(store)
        self.where: dict = {}

    def stopped(self) -> bool:
        return self.stop.is_set() or bool(getattr(self.store, "closed", False))

    def progress(self, stage: str, **kw) -> None:
        self.on_progress({**self.where, "stage": stage, "budget": self.budget, **kw})

    def bucket(self, op: str, bucket: str) -> dict:
        arms = [a for a in candidates(self.registry, op, Bucket.parse(op, bucket))
                if a != BASELINE and (self.variants is None or a.variant in self.variants)]
        self.progress("gate", trials=0, arms=len(arms))
        passed, failed = screen(self.tuning, op, bucket, arms, self.timeout_s)
        values: dict[Arm, list[float]] = {}
        trials: list[dict] = []
        # the bandit starts from what this op measured on other buckets (same device, versions)
        prior = tuning_priors(self.store, self.registry, op, bucket, sorted(passed)) \
            if self.strategy == "thompson" and passed else {}
        s = make_strategy(self.strategy, sorted(passed), max(1, self.budget - 1), seed=self.seed,
                          batch=BATCH, prior=prior or None) if passed and self.budget > 1 else None
        asked = s.ask() if s else []
        first = True
        runs: list[dict[Arm, list[float]]] = []   # each worker run's values per arm
        while (first or asked) and not self.stopped():
            run = ([BASELINE] if first else []) + asked
            for arm, trial in self._run(op, bucket, run, len(trials), runs):
                trials.append(trial)
                values.setdefault(arm, []).extend(trial["values"])
                if s and arm in asked:
                    s.tell(arm, trial["median_ns"] if trial["status"] == "ok" else float("inf"))
            # after every run, not once at the end: a task stopped or killed midway keeps what
            # it measured (its message says so)
            self._record_tuning(op, bucket, trials)
            first, asked = False, (s.ask() if s else [])
        best = self._best(s, values)
        if best not in (None, BASELINE) and not _paired(runs, best)[0] and not self.stopped():
            # the verdict compares the two within one worker run: runs differ by more than the
            # kernels do (a run's offset hits every arm in it alike)
            trials += [t for _, t in self._run(op, bucket, [BASELINE, best], len(trials), runs)]
            self._record_tuning(op, bucket, trials)
        decision = self._decide(op, bucket, best, values, trials, failed, _paired(runs, best))
        self.progress("done", trials=len(trials))
        return {"op": op, "bucket": bucket, "candidates": len(arms), "gate_passed": len(passed),
                "prior_arms": len(prior),
                "gate_failures": {str(a): r for a, r in failed.items()},
                "trials": len(trials), "best": _arm_dict(best) if best else None,
                "decision": decision,
                "arms": [{**_arm_dict(a), "trials": sum(t["arm"] == a for t in trials),
                          "median_ns": statistics.median(v) if v else None}
                         for a, v in sorted(values.items())],
                "sweep": {"op": op, "bucket": bucket, "reps": self.reps, "warmup": self.warmup,
                          "arms": [{**_arm_dict(a), "values": v}
                                   for a, v in sorted(values.items()) if v]}}

    # ---- trials --------------------------------------------------------------------------------
    def _run(self, op: str, bucket: str, arms: list[Arm], done: int,
             runs: list[dict[Arm, list[float]]]) -> list[tuple[Arm, dict]]:
        """Worker runs of ``arms`` (see :func:`run_isolating`: only an arm that kills the worker
        fails); each worker process's values per arm are appended to ``runs`` (after a crash,
        the arms re-run one per process: no two of those are paired)."""
        request = {"command": "bench", "op": op, "bucket": bucket, "warmup": self.warmup,
                   "reps": self.reps, "arms": [{"variant": a.variant, "config": a.config} for a in arms]}
        started = time.time_ns()

        def on_worker(d: int, total: int) -> None:
            self.progress("bench", trials=done, running=[str(a) for a in arms], run_done=d,
                          run_total=total)

        on_worker(0, self.reps * len(arms))
        results = run_isolating(request, "arms", self.timeout_s, on_worker)
        ended = time.time_ns()
        out = []
        by_worker: dict[int, dict[Arm, list[float]]] = {}
        for arm, r in zip(arms, results):
            if isinstance(r, WorkerError):
                r = {"status": "failed", "reason": str(r)[:2000], "values": []}
            trial = self._trial(op, bucket, arm, r, started, ended)
            by_worker.setdefault(r.get("worker", -1), {})[arm] = trial["values"]
            out.append((arm, trial))
        runs.extend(by_worker.values())
        self.progress("bench", trials=done + len(out))
        return out

    def _trial(self, op, bucket, arm: Arm, r: dict, started: int, ended: int) -> dict:
        ok = r.get("status") == "ok" and bool(r.get("values"))
        row = {"trial_id": uuid.uuid4().hex, "job_id": None, "op": op, "bucket": bucket,
               "variant": arm.variant, "config": arm.config_json, "mode": "offline",
               "strategy": "baseline" if arm == BASELINE else self.strategy,
               "started_ns": started, "ended_ns": ended, "samples": len(r.get("values") or []),
               "median_ns": r.get("median_ns") if ok else None,
               "p95_ns": r.get("p95_ns") if ok else None,
               "spread": r.get("spread") if ok else None, "peak_bytes": r.get("peak_bytes"),
               "status": "ok" if ok else "failed",
               "detail": {"reps": self.reps, "warmup": self.warmup,
                          **({"calls_per_rep": r["calls_per_rep"]} if "calls_per_rep" in r else {}),
                          **({"reason": r.get("reason", "no values")} if not ok else {})}}
        store_evolve.save_trial(self.store, row)
        self.spans.record(row)
        return {**row, "arm": arm, "values": list(r.get("values") or []) if ok else []}

    def _record_tuning(self, op: str, bucket: str, trials: list[dict]) -> None:
        by_arm: dict[Arm, list[dict]] = {}
        for t in trials:
            by_arm.setdefault(t["arm"], []).append(t)
        for arm, ts in by_arm.items():
            v = [x for t in ts for x in t["values"]]
            failed = [t for t in ts if t["status"] != "ok"]
            peaks = [t["peak_bytes"] for t in ts if t["peak_bytes"] is not None]
            self.tuning.record(
                op, bucket, arm, source="offline", trials=len(ts),
                median_ns=statistics.median(v) if v else None,
                spread=statistics.pstdev(v) / statistics.fmean(v) if len(v) > 1 else None,
                peak_bytes=max(peaks) if peaks else None,
                status="ok" if v else "failed",
                reason=failed[-1]["detail"].get("reason", "") if failed else "")

    # ---- decision ------------------------------------------------------------------------------
    @staticmethod
    def _best(s, values: dict[Arm, list[float]]) -> Arm | None:
        pick = s.best() if s else None
        if pick is not None and not values.get(pick):
            pick = None
        if pick is None or (values.get(BASELINE) and statistics.median(values[BASELINE])
                            <= statistics.median(values[pick])):
            return BASELINE if values.get(BASELINE) else pick
        return pick

    def _decide(self, op, bucket, best: Arm | None, values, trials, failed,
                pairs: tuple[list[float], list[float]]) -> dict:
        if best is None or best == BASELINE:
            others = any(v for a, v in values.items() if a != BASELINE)
            cmp, reason = None, ("nothing was measured" if best is None else
                                 "the reference is the fastest arm measured" if others else
                                 "only the reference was measured (the budget held no candidate)")
        elif not pairs[0]:
            cmp, reason = None, "the best arm and the reference were never measured in one run"
        else:   # repetitions interleave the arms of a run: pairs by position
            cmp = stats.compare_paired(*pairs, seed=self.seed)
            reason = cmp.reason
        finite = stats.finite
        row = {"decision_id": uuid.uuid4().hex, "job_id": None, "op": op, "bucket": bucket,
               "kind": "offline_best",
               "candidate_variant": best.variant if best else None,
               "candidate_config": best.config_json if best else None,
               "incumbent_variant": BASELINE.variant, "incumbent_config": BASELINE.config_json,
               "gain": finite(cmp.gain) if cmp else None,
               "ci_low": finite(cmp.ci_low) if cmp else None,
               "ci_high": finite(cmp.ci_high) if cmp else None,
               "p_value": cmp.p_value if cmp else None, "reason": reason,
               "evidence": {"trial_ids": [t["trial_id"] for t in trials], "strategy": self.strategy,
                            "budget": self.budget, "reps": self.reps, "warmup": self.warmup,
                            "better": bool(cmp and cmp.promote), "samples": cmp.samples if cmp else 0,
                            "gate_failures": {str(a): r for a, r in failed.items()}},
               "at_ns": time.time_ns()}
        store_evolve.save_decision(self.store, row)
        return {k: row[k] for k in ("decision_id", "kind", "gain", "ci_low", "ci_high", "p_value",
                                    "reason")} | {"better": row["evidence"]["better"]}


class TuneTasks:
    """Tuning tasks of the daemon (the only store writer), run one at a time on a background
    thread. Progress is kept in memory; each task's record is saved at every change of state
    (``tune_tasks``), so a later daemon still answers for it (see
    :func:`store_evolve.saved_tune_tasks`)."""

    def __init__(self, store: Store, registry: Callable[[], Registry], keep: int = 50) -> None:
        self.store, self.registry, self.keep = store, registry, keep
        self.tasks: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._queue: list[tuple[str, dict]] = []
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stops: dict[str, threading.Event] = {}  # the running task's

    def submit(self, params: dict) -> dict:
        """Validate ``params`` (``tune``'s keyword arguments; :class:`TuneError` when bad) and
        queue a task; its state."""
        registry = self.registry()
        validate(registry, params.get("op"), params.get("bucket"),
                 params.get("strategy", "successive_halving"), params.get("budget", 12),
                 params.get("variants"))
        targets(self.store, registry, params.get("op"), params.get("bucket"))
        task_id = uuid.uuid4().hex[:16]
        with self._lock:
            self.tasks[task_id] = {"id": task_id, "state": "queued", "params": params,
                                   "progress": {}, "report": None, "error": None,
                                   "submitted_ns": time.time_ns(), "ended_ns": None}
            for old in list(self.tasks)[: max(0, len(self.tasks) - self.keep)]:
                if self.tasks[old]["state"] in ("done", "failed", "cancelled"):
                    del self.tasks[old]
            self._queue.append((task_id, params))
            saved = self._save(task_id)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rtxops-tune", daemon=True)
                self._thread.start()
            self._wake.notify()
            state = dict(self.tasks[task_id])
        # a task the caller was told about is on disk: a later daemon answers for it, even when
        # this one dies before the task's next save (waited for outside the lock)
        if saved is not None:
            try:
                saved.result(SAVE_WAIT_S)
            except Exception as e:
                log.warning("rtxops tune: task %s not saved yet: %s", task_id, e)
        return state

    def get(self, task_id: str) -> dict | None:
        with self._lock:
            task = self.tasks.get(task_id)
            return dict(task) if task else None

    def cancel(self, task_id: str) -> dict | None:
        """Cancel a task: a queued one at once, the running one once the benchmark in flight
        ends (its trials so far are kept). Its state; None for an unknown task."""
        with self._lock:
            task = self.tasks.get(task_id)
            if task is None:
                return None
            if task["state"] == "queued":
                self._queue = [(t, p) for t, p in self._queue if t != task_id]
                task.update(state="cancelled", ended_ns=time.time_ns())
                self._save(task_id)
            elif task["state"] == "running":
                task["cancelling"] = True
                self._stops[task_id].set()
            return dict(task)

    def summary(self) -> list[dict]:
        with self._lock:
            return [{k: t[k] for k in store_evolve.SUMMARY} for t in self.tasks.values()]

    def _update(self, task_id: str, **fields) -> None:
        with self._lock:
            self.tasks[task_id].update(fields)
            if "state" in fields:
                self._save(task_id)

    def _save(self, task_id: str) -> Future | None:
        """Queue the task's record for the store's writer (under the lock, so the saves of a task
        keep their order; nobody waits for the write under it); the write's future."""
        def saved(future) -> None:
            if future.exception() is not None:
                log.warning("rtxops tune: task %s not saved: %s", task_id, future.exception())

        try:
            future = store_evolve.save_tune_task(self.store, dict(self.tasks[task_id]))
        except Exception as e:  # the task goes on; only a later daemon would miss it
            log.warning("rtxops tune: task %s not saved: %s", task_id, e)
            return None
        future.add_done_callback(saved)
        return future

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._wake.wait()
                task_id, params = self._queue.pop(0)
                self.tasks[task_id]["state"] = "running"
                stop = self._stops[task_id] = threading.Event()
                self._save(task_id)
            try:
                report = tune(self.store, self.registry(), **params, stop=stop,
                              on_progress=lambda p, t=task_id: self._update(t, progress=p))
                self._update(task_id, state="cancelled" if stop.is_set() else "done", report=report,
                             ended_ns=time.time_ns())
            except Exception as e:  # the task fails with its reason; the daemon keeps serving
                self._update(task_id, state="failed", error=f"{type(e).__name__}: {e}",
                             ended_ns=time.time_ns())
            finally:
                with self._lock:
                    self._stops.pop(task_id, None)


def _arm_dict(arm: Arm) -> dict:
    return {"variant": arm.variant, "config": arm.config}


def _paired(runs: list[dict[Arm, list[float]]], arm: Arm | None) -> tuple[list[float], list[float]]:
    """The reference's and ``arm``'s values from the runs that measured both in full."""
    base, other = [], []
    for run in runs:
        b, a = run.get(BASELINE), run.get(arm)
        if b and a and len(b) == len(a):
            base += b
            other += a
    return base, other


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def _check(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # RegistryError, PlanError: the message names what is wrong
        raise TuneError(str(e)) from None
