"""The plan board: the current plan per job (and a default for every job), persisted as files so
it survives daemon restarts. Versions only grow, per job; a job's first plan of its own is newer
than the default plan it ran until then.

With an :class:`~rtxops.governance.authority.Authority` every published plan becomes a signed
bundle first (policy-checked, recorded in the ledger); jobs fetch that bundle and verify it before
installing the plan. A manual publish (``POST /v1/plans`` with the token) is a ``manual`` decision,
which the default policy allows when the daemon's own key signs it."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

from rtxops.runtime.errors import PlanError, PlanNotIssued, PlanVersionConflict
from rtxops.runtime.plan import Plan

log = logging.getLogger("rtxops.daemon")

DEFAULT_KEY = "_default"  # governance.authority.EVERY_JOB: the scope its bundles are signed for
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class PlanBoard:
    def __init__(self, directory: Path, authority=None) -> None:
        self.directory = directory
        self.authority = authority
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()  # version check, signing and writing: one at a time
        self._plans: dict[str, Plan] = {}
        self.reports: list[dict] = []  # jobs telling us they refused a plan (the last 1000)
        self.refused_total = 0         # all of them, since this board started
        self._listeners: list[Callable[[], None]] = []
        self.waits_stopped = False     # the daemon is stopping: polls no longer wait for changes
        self._load_plans()  # the authority loads its policies itself, when first needed

    def reload(self) -> None:
        """Re-read the published plans (and the authority's policies) from disk (SIGHUP). Holds
        the publish lock, so a publish in flight is not overwritten with what was on disk before
        it. Raises when the policies cannot be loaded (the old ones stay)."""
        with self._publish_lock:
            self._load_plans()
            self._changed()
            if self.authority is not None:
                self.authority.reload()

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every change of the plans served (a publish, a reload) and
        when :meth:`stop_waits` is called; on the changing thread, so it must be quick."""
        self._listeners.append(listener)

    def stop_waits(self) -> None:
        """The daemon is stopping: plan polls waiting for a change answer now, and wait no more."""
        self.waits_stopped = True
        self._changed()

    def _changed(self) -> None:
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:  # noqa: BLE001 - a listener's failure is not the publisher's
                log.exception("rtxops: a plan-change listener failed")

    def _load_plans(self) -> None:
        with self._lock:
            before = dict(self._plans)
        plans = {}
        for path in sorted(self.directory.glob("*.json")):
            try:
                plans[path.stem] = Plan.from_json(path.read_text())
            except (OSError, PlanError):
                # a damaged file: the plan read before stays (a job runs it; versions only
                # grow), and the next publish rewrites the file
                if path.stem in before:
                    plans[path.stem] = before[path.stem]
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
        if plan.version < 1:   # every job starts on the built-in plan, version 0
            raise PlanError(f"plan version {plan.version}: a published plan's version is at least 1 "
                            "(jobs start on the built-in version 0 and take only newer ones)")
        from rtxops.runtime.registry import default_registry  # torch: only when publishing

        return plan.validate(default_registry())

    def publish(self, plan: Plan, job_id: str | None = None, *, decision: dict | None = None,
                evidence: dict | None = None) -> Plan:
        """Validate, sign (with an authority) and store ``plan`` for ``job_id`` (or as the
        default). ``decision`` defaults to a manual one. Raises PlanError (policy denials too)."""
        self.validate(plan, job_id)
        key = job_id or DEFAULT_KEY
        with self._publish_lock:
            with self._lock:
                running = self._plans.get(key)
                default = self._plans.get(DEFAULT_KEY)
            if running is not None and plan.version <= running.version:
                raise PlanVersionConflict(f"plan version {plan.version} is not newer than the published "
                                f"version {running.version} for {key}")
            if running is None and job_id and default is not None and plan.version <= default.version:
                # the job runs the default plan until it has its own, and refuses an older one
                raise PlanVersionConflict(f"plan version {plan.version} is not newer than the default plan's "
                                f"version {default.version}, which job {job_id} runs")
            if self.authority is not None:
                self._issue(plan, key, decision or {"kind": "manual"}, evidence)
            path = self.directory / f"{key}.json"
            tmp = path.with_suffix(".tmp")
            try:
                tmp.write_text(plan.to_json())
                tmp.replace(path)
            except OSError as e:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise PlanNotIssued(f"plan version {plan.version} could not be saved: {e}") from None
            with self._lock:
                self._plans[key] = plan
        self._changed()
        return plan

    def _issue(self, plan: Plan, key: str, decision: dict, evidence: dict | None) -> None:
        from rtxops.governance import GovernanceError
        from rtxops.runtime.registry import default_registry

        try:
            self.authority.issue_plan(plan, key, default_registry(), decision=decision,
                                      evidence=evidence)
        except Exception as e:  # a denial, or the ledger, the disk...: a PlanError, not an HTTP 500
            final = self.authority.bundle_dir(key, plan.version)
            shutil.rmtree(final.with_name(final.name + ".staging"), ignore_errors=True)
            if isinstance(e, GovernanceError):
                raise PlanError(f"plan version {plan.version} refused by governance: {e}") from None
            raise PlanNotIssued(f"plan version {plan.version} could not be issued: "
                                f"{type(e).__name__}: {e}") from None

    def bundle(self, job_id: str | None) -> tuple[Plan, dict[str, bytes]] | None:
        """The current plan for ``job_id`` with its signed bundle's files, or None."""
        plan = self.current(job_id)
        if plan is None or self.authority is None:
            return None
        from rtxops.governance.authority import bundle_files

        for key in (job_id or DEFAULT_KEY, DEFAULT_KEY):
            with self._lock:
                if self._plans.get(key) is not plan:
                    continue
            directory = self.authority.bundle_dir(key, plan.version)
            if directory.is_dir():
                return plan, bundle_files(directory)
        return None

    def promote(self, plan: Plan, job_id: str | None = None, *, decision: dict | None = None,
                evidence: dict | None = None) -> Plan:
        """Publish a plan the evolve loop decided on. ``decision`` (kind promote|rollback|explore, op,
        bucket, candidate, incumbent, gain, ci_low, ci_high, p_value, objective, deterministic)
        and ``evidence`` (trial_ids, windows, telemetry_digest) go into the bundle's provenance;
        the policy decides; the ledger records the outcome. Raises PlanError with the reason."""
        if not isinstance(decision, dict) or decision.get("kind") not in ("promote", "rollback",
                                                                           "explore"):
            raise PlanError("promote needs a decision of kind 'promote', 'rollback' or 'explore'")
        if plan.environment is None:  # tuned here: jobs elsewhere (other torch, device) skip it
            from rtxops.runtime.plan import current_environment

            plan = dataclasses.replace(plan, environment=current_environment(probe_cuda=True))
        return self.publish(plan, job_id, decision=decision, evidence=evidence)

    def report(self, job_id: str, version: int, reason: str) -> None:
        with self._lock:
            self.reports.append({"job_id": job_id, "version": version, "reason": reason,
                                 "at_ns": time.time_ns()})
            self.refused_total += 1
            del self.reports[:-1000]

    def snapshot(self) -> dict[str, dict]:
        with self._lock:
            return {k: json.loads(p.to_json()) for k, p in self._plans.items()}
