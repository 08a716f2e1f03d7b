"""The tuning database: what each (variant, config) measured on each bucket, keyed by everything
that would change the answer (torch and triton versions, device model, kernel source hash), so
results carry across jobs and daemon restarts and go stale by themselves when any part changes."""
from __future__ import annotations

import time

from rtxops.runtime.bucket import Bucket
from rtxops.runtime.registry import Registry
from rtxops.runtime.spec import REFERENCE
from rtxops.telemetry import store_evolve
from rtxops.telemetry.store import Store

from .candidates import Arm
from .environment import environment, job_environment


class TuningDB:
    def __init__(self, store: Store, registry: Registry) -> None:
        self.store, self.registry = store, registry

    def key(self, op: str, bucket: str, arm: Arm, resource: dict | None = None) -> dict:
        """The full key of an arm's result: on the machine of the job whose ``resource``
        attributes are given (a live result), else on this one, now."""
        device = Bucket.parse(op, bucket).device
        env = (job_environment(resource, device) if resource else None) or environment(device)
        return {"op": op, "bucket": bucket, "variant": arm.variant, "config": arm.config_json,
                "source_hash": self.registry.variant(op, arm.variant).source_hash, **env}

    def record(self, op: str, bucket: str, arm: Arm, *, source: str, trials: int, median_ns: float | None,
               spread: float | None = None, peak_bytes: int | None = None, status: str = "ok",
               reason: str = "", resource: dict | None = None) -> None:
        store_evolve.upsert_tuning(self.store, self.key(op, bucket, arm, resource), {
            "source": source, "trials": trials, "median_ns": median_ns, "spread": spread,
            "peak_bytes": peak_bytes, "status": status, "reason": reason,
            "updated_ns": time.time_ns()})

    def lookup(self, op: str, bucket: str, arm: Arm, resource: dict | None = None) -> dict | None:
        """The current result for ``arm`` (on the job's machine, given its ``resource``), or
        None (never measured there, or stale)."""
        rows = store_evolve.tuning_rows(self.store, self.key(op, bucket, arm, resource), limit=1)
        return rows[0] if rows else None

    def gate(self, op: str, bucket: str, arm: Arm) -> dict | None:
        """A stored gate result for ``arm`` under the current versions and gate rules, or None."""
        return store_evolve.gate_result(self.store, self._gate_key(op, bucket, arm))

    def save_gate(self, op: str, bucket: str, arm: Arm, passed: bool, reason: str,
                  max_error: float | None) -> None:
        store_evolve.save_gate_result(self.store, self._gate_key(op, bucket, arm), passed, reason,
                                      max_error, time.time_ns())

    def _gate_key(self, op: str, bucket: str, arm: Arm) -> dict:
        from .gate import RULES   # (torch there)

        key = self.key(op, bucket, arm)
        # the verdict compares the arm with the reference: a changed reference asks again
        reference = self.registry.variant(op, REFERENCE).source_hash
        return {**key, "source_hash": f"{key['source_hash']}/ref{reference}/gate{RULES}"}
