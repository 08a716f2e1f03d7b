"""An :class:`EvolveLoop` over recorded per-step kernel rows instead of a store, for tests of its
round and decision logic: the store functions it calls answer from ``rows``."""
from __future__ import annotations

import threading
from collections.abc import Callable

from rtxops.evolve import loop as L
from rtxops.evolve.config import LoopConfig
from rtxops.telemetry import store_evolve as se


class _Board:
    def current(self, job):
        return None

    def promote(self, plan, job, decision, evidence):
        return plan


class _Registry:
    def variant(self, op, v):
        return type("V", (), {"source_hash": "x", "deterministic": True})()


def loop_over_rows(monkeypatch, rows: list[dict], *, last: int, swapped: int = 9,
                   decisions: list | None = None,
                   save_trial: Callable | None = None, running: int | None = None) -> L.EvolveLoop:
    """A loop for job ``"job"`` whose plan swapped at ``swapped``, at step ``last``, running plan
    version ``running`` (None: it never swapped); decisions it records are appended to
    ``decisions``."""
    monkeypatch.setattr(se, "last_step", lambda q, job: last)
    monkeypatch.setattr(se, "swap_step", lambda q, job, v: swapped)
    monkeypatch.setattr(se, "running_plan_version", lambda q, job: running)
    monkeypatch.setattr(se, "last_swap_step", lambda q, job: None)
    monkeypatch.setattr(se, "arm_steps", lambda q, job, op, bucket, since, phase="fwd":
                        [r for r in rows if r["step"] >= since and r.get("phase", "fwd") == phase])
    monkeypatch.setattr(se, "step_durations", lambda *a, **k: [])
    monkeypatch.setattr(se, "job_resource", lambda q, job: {})
    monkeypatch.setattr(se, "disabled_arms", lambda q, job, op, bucket: set())
    monkeypatch.setattr(se, "save_trial", save_trial or (lambda store, row: None))
    sink = decisions if decisions is not None else []
    monkeypatch.setattr(se, "save_decision", lambda store, row: sink.append(row))
    monkeypatch.setattr(se, "upsert_tuning", lambda store, key, values: None)
    monkeypatch.setattr(se, "decisions", lambda q, job, limit=200, offset=0: [])
    loop = object.__new__(L.EvolveLoop)
    loop.store, loop.board, loop.registry = None, _Board(), _Registry()
    loop.running_jobs = lambda: ["job"]
    loop.unfinished_jobs = None
    loop.current_step = None
    loop.config = LoopConfig(window_steps=20, min_steps=5)
    loop.tuning = L.TuningDB(None, _Registry())
    loop.tuning.key = lambda *a: {}
    loop.tuning.gate = lambda op, bucket, arm: None   # no verdict stored
    loop.trial_spans = type("T", (), {"record": lambda self, t: None})()
    loop.jobs, loop._lock, loop._status = {}, threading.Lock(), {}
    loop._gate_slots = threading.Semaphore(loop.config.gates)
    return loop


def tick_one_arm(loop: L.EvolveLoop, op: str, incumbent, arm):
    """One tick of ``loop`` tuning ``op`` in bucket "b" with one explore arm, ``arm``, against
    ``incumbent`` (exhaustive search, its round under way); the bucket's tuning."""
    from rtxops.evolve.search import make_strategy

    bt = L.BucketTuning(op, "b", incumbent, strategy=make_strategy("exhaustive", [arm], budget=1),
                        round_arms=[arm], plan_version=5)
    bt.strategy.ask()
    loop.jobs["job"] = L.JobEvolution(active=bt)
    loop.tick()
    return bt
