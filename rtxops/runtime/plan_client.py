"""The job's side of the plan endpoint: a background thread that polls for a newer plan, queues it
in the dispatcher (which swaps it in at a step boundary) and reports refusals back.

Plain HTTP with the standard library: the runtime depends on no web framework.
"""
from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.parse
import urllib.request

from .dispatcher import Dispatcher
from .errors import PlanError
from .plan import Plan

log = logging.getLogger("rtxops.runtime")


class PlanPoller:
    def __init__(self, dispatcher: Dispatcher, daemon_url: str, job_id: str, token: str | None,
                 interval_s: float = 2.0) -> None:
        self.dispatcher, self.job_id, self.token = dispatcher, job_id, token
        self.base = daemon_url.rstrip("/")
        self.interval_s = interval_s
        self.etag: str | None = None
        self.installed: list[int] = []
        self.refused: list[tuple[int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rtxops-plans", daemon=True)

    def start(self) -> PlanPoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll_once()
            except Exception as e:  # the daemon may be away for a while; the job goes on
                log.debug("rtxops: plan poll failed: %s", e)

    def poll_once(self) -> str:
        """One poll: ``"unchanged"``, ``"none"``, ``"installed"`` or ``"refused"``."""
        query = urllib.parse.urlencode({"job": self.job_id})
        req = urllib.request.Request(f"{self.base}/v1/plans/current?{query}")
        if self.etag:
            req.add_header("If-None-Match", self.etag)
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                body, etag = resp.read(), resp.headers.get("ETag")
        except urllib.error.HTTPError as e:
            if e.code == 304:
                return "unchanged"
            if e.code == 404:
                return "none"
            raise
        self.etag = etag
        try:
            plan = Plan.from_json(body)
            if plan.version <= self.dispatcher.plan.version and self.dispatcher.pending is None:
                return "unchanged"
            self.dispatcher.install_plan(plan)
        except PlanError as e:
            version = _version_of(body)
            self.refused.append((version, str(e)))
            self._report(version, str(e))
            return "refused"
        self.installed.append(plan.version)
        return "installed"

    def _report(self, version: int, reason: str) -> None:
        data = json.dumps({"job": self.job_id, "version": version, "reason": reason}).encode()
        req = urllib.request.Request(f"{self.base}/v1/plans/report", data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            urllib.request.urlopen(req, timeout=5).close()
        except OSError as e:
            log.warning("rtxops: could not report refused plan %s: %s", version, e)


def _version_of(body: bytes) -> int:
    try:
        v = json.loads(body).get("version", -1)
        return v if isinstance(v, int) else -1
    except (ValueError, AttributeError):
        return -1
