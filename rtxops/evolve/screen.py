"""Screen candidate arms through the correctness gate (in a worker process), with every verdict
stored: an arm that failed is never retried for the same (variant, config, bucket, versions).
A gate that could not run (a worker that timed out, a module it cannot import) is no verdict."""
from __future__ import annotations

import contextlib
import logging
from typing import ContextManager

from .candidates import Arm
from .runner import WorkerError, run_isolating
from .tuning import TuningDB

log = logging.getLogger("rtxops.evolve")


def screen(tuning: TuningDB, op: str, bucket: str, arms: list[Arm], timeout_s: float = 600.0,
           worker_slot: ContextManager = contextlib.nullcontext()) -> tuple[list[Arm], dict[Arm, str]]:
    """The arms that pass the gate, and the reason for each that does not. A worker runs only
    for arms with no stored verdict, inside ``worker_slot`` (the loop's bound on gates at once)."""
    passed: list[Arm] = []
    failed: dict[Arm, str] = {}

    def unknown_of(candidates: list[Arm]) -> list[Arm]:
        left = []
        for arm in candidates:
            known = tuning.gate(op, bucket, arm)
            if known is None:
                left.append(arm)
            elif known["passed"]:
                passed.append(arm)
            else:
                failed[arm] = known["reason"]
        return left

    unknown = unknown_of(arms)
    gated = {}
    if unknown:
        with worker_slot:
            # once more, in the slot: a job tuning the same bucket may have gated them meanwhile
            unknown = unknown_of(unknown)
            gated = _gate(tuning, op, bucket, unknown, timeout_s)
    for arm, (ok, reason) in gated.items():
        if ok:
            passed.append(arm)
        else:
            failed[arm] = reason
    return passed, failed


def _gate(tuning: TuningDB, op: str, bucket: str, arms: list[Arm],
          timeout_s: float) -> dict[Arm, tuple[bool, str]]:
    """Gate ``arms`` in worker processes (see :func:`run_isolating`: the arm that crashes the
    process is the one recorded as failed)."""
    if not arms:
        return {}
    items = [{"op": op, "bucket": bucket, "variant": a.variant, "config": a.config} for a in arms]
    out = {}
    for arm, r in zip(arms, run_isolating({"command": "gate", "items": items}, "items", timeout_s)):
        if isinstance(r, WorkerError):
            log.warning("gate worker failed on %s %s %s: %s", op, bucket, arm, r)
            # a timeout says nothing of the arm's values (a busy machine, a slow compile): it
            # fails this screening, and a later one gates it again
            r = {"passed": False, "reason": f"the gate worker died: {r}", "setup_error": r.timed_out}
        if not r.get("setup_error"):  # e.g. a plugin module the worker cannot import: retried
            tuning.save_gate(op, bucket, arm, bool(r["passed"]), r["reason"], r.get("max_error"))
        out[arm] = (bool(r["passed"]), r["reason"])
    return out
