"""The plan board: the current plan per job (and a default for every job), persisted as files so
it survives daemon restarts. Versions only grow, per job."""
from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

from rtxops.runtime.errors import PlanError
from rtxops.runtime.plan import Plan

DEFAULT_KEY = "_default"
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class PlanBoard:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._plans: dict[str, Plan] = {}
        self.reports: list[dict] = []  # jobs telling us they refused a plan
        self.reload()

    def reload(self) -> None:
        """Re-read the published plans from disk (SIGHUP)."""
        plans = {}
        for path in sorted(self.directory.glob("*.json")):
            try:
                plans[path.stem] = Plan.from_json(path.read_text())
            except (OSError, PlanError):
                continue  # a damaged file is ignored; the next publish rewrites it
        with self._lock:
            self._plans = plans

    def current(self, job_id: str | None) -> Plan | None:
        """The plan for ``job_id``: its own, else the default; None when there is neither."""
        with self._lock:
            return self._plans.get(job_id or DEFAULT_KEY) or self._plans.get(DEFAULT_KEY)

    def validate(self, plan: Plan, job_id: str | None = None) -> Plan:
        """Check ``plan`` (and the job id) as :meth:`publish` does; return it. Raises PlanError.
        The first call loads the op registry, which imports torch: seconds."""
        if job_id is not None and not _JOB_ID.fullmatch(job_id):
            raise PlanError(f"job id {job_id!r} is not a valid job id")
        from rtxops.runtime.registry import default_registry  # torch: only when publishing

        return plan.validate(default_registry())

    def publish(self, plan: Plan, job_id: str | None = None) -> Plan:
        """Validate and store ``plan`` for ``job_id`` (or as the default). Raises PlanError."""
        self.validate(plan, job_id)
        key = job_id or DEFAULT_KEY
        with self._lock:
            running = self._plans.get(key)
            if running is not None and plan.version <= running.version:
                raise PlanError(f"plan version {plan.version} is not newer than the published "
                                f"version {running.version} for {key}")
            path = self.directory / f"{key}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(plan.to_json())
            tmp.replace(path)
            self._plans[key] = plan
        return plan

    def promote(self, plan: Plan, job_id: str | None = None, *, decision: dict | None = None,
                evidence: dict | None = None) -> Plan:
        """Publish a plan the evolve loop decided on. ``decision`` (what changed and the statistics)
        and ``evidence`` (trial ids, telemetry windows) travel with it; governance (#6) turns them
        into a signed bundle before the plan is published. Raises PlanError."""
        return self.publish(plan, job_id)

    def report(self, job_id: str, version: int, reason: str) -> None:
        with self._lock:
            self.reports.append({"job_id": job_id, "version": version, "reason": reason,
                                 "at_ns": time.time_ns()})
            del self.reports[:-1000]

    def snapshot(self) -> dict[str, dict]:
        with self._lock:
            return {k: json.loads(p.to_json()) for k, p in self._plans.items()}
