"""Screen candidate arms through the correctness gate (in a worker process), with every result
stored: an arm that failed is never retried for the same (variant, config, bucket, versions)."""
from __future__ import annotations

import logging

from .candidates import Arm
from .runner import WorkerError, run_worker
from .tuning import TuningDB

log = logging.getLogger("rtxops.evolve")


def screen(tuning: TuningDB, op: str, bucket: str, arms: list[Arm],
           timeout_s: float = 600.0) -> tuple[list[Arm], dict[Arm, str]]:
    """The arms that pass the gate, and the reason for each that does not."""
    passed, failed, unknown = [], {}, []
    for arm in arms:
        known = tuning.gate(op, bucket, arm)
        if known is None:
            unknown.append(arm)
        elif known["passed"]:
            passed.append(arm)
        else:
            failed[arm] = known["reason"]
    for arm, (ok, reason) in _gate(tuning, op, bucket, unknown, timeout_s).items():
        if ok:
            passed.append(arm)
        else:
            failed[arm] = reason
    return passed, failed


def _gate(tuning: TuningDB, op: str, bucket: str, arms: list[Arm],
          timeout_s: float) -> dict[Arm, tuple[bool, str]]:
    """Gate ``arms`` in one worker; when the worker dies, gate them one by one, so the arm that
    crashes the process is the one recorded as failed."""
    if not arms:
        return {}
    items = [{"op": op, "bucket": bucket, "variant": a.variant, "config": a.config} for a in arms]
    try:
        results = {r["index"]: r for r in run_worker({"command": "gate", "items": items}, timeout_s)}
    except WorkerError as e:
        if len(arms) > 1:
            out = {}
            for arm in arms:
                out.update(_gate(tuning, op, bucket, [arm], timeout_s))
            return out
        log.warning("gate worker failed on %s %s %s: %s", op, bucket, arms[0], e)
        results = {0: {"passed": False, "reason": f"the gate worker died: {e}"}}
    out = {}
    for i, arm in enumerate(arms):
        r = results.get(i, {"passed": False, "reason": "the gate worker gave no result"})
        if not r.get("setup_error"):  # e.g. a plugin module the worker cannot import: retried
            tuning.save_gate(op, bucket, arm, bool(r["passed"]), r["reason"], r.get("max_error"))
        out[arm] = (bool(r["passed"]), r["reason"])
    return out
