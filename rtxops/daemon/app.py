"""The daemon's FastAPI app: OTLP receiver, jobs, plans, operations (health, readiness, metrics) and
the dashboard, each a thin router over the daemon's parts."""
from __future__ import annotations

from fastapi import FastAPI, Response

from rtxops import __version__, dashboard
from rtxops.telemetry.receiver import make_router as receiver_router

from . import api_evolve, api_jobs, api_plans, api_telemetry
from .auth import require_token
from .metrics import registry_for, render


def create_app(daemon) -> FastAPI:
    app = FastAPI(title="rtxops daemon", version=__version__,
                  description="Supervises training jobs, ingests their telemetry, serves plans.")
    auth = require_token(daemon.token)
    app.include_router(receiver_router(daemon.store, token=daemon.token, on_batch=daemon.on_batch))
    app.include_router(api_jobs.make_router(daemon.supervisor, auth))
    app.include_router(api_plans.make_router(daemon.board, auth, daemon.last_step))
    app.include_router(api_telemetry.make_router(daemon.store))
    app.include_router(api_evolve.make_router(daemon, auth))
    metrics = registry_for(daemon)
    app.include_router(dashboard.make_router(daemon.store, problems=daemon.readiness_problems,
                                             governance=_GovernanceReports(daemon)))

    @app.get("/healthz", tags=["ops"])
    def healthz() -> dict:
        """The process is alive."""
        return {"status": "ok", "version": __version__}

    @app.get("/readyz", tags=["ops"], responses={503: {"description": "not ready"}})
    def readyz(response: Response) -> dict:
        """The store is writable and the receiver accepts spans."""
        problems = daemon.readiness_problems()
        if problems:
            response.status_code = 503
        return {"ready": not problems, "problems": problems}

    @app.get("/metrics", tags=["ops"], response_class=Response)
    def prometheus() -> Response:
        return Response(render(metrics), media_type="text/plain; version=0.0.4")

    return app


class _GovernanceReports:
    """Governance facts for the dashboard (:class:`rtxops.dashboard.GovernanceReports`)."""

    def __init__(self, daemon) -> None:
        self.daemon = daemon
        self._chain = None

    def verify_chain(self) -> dict:
        """The chain's status; entries verified once are not verified again (the daemon is the
        store's only writer)."""
        from rtxops.governance import ledger

        if self._chain is None:
            self._chain = ledger.ChainCheck()
        problems = self._chain.problems(self.daemon.store,
                                        ledger.read_head(self.daemon.authority.head_file))
        return {"ok": not problems, "problems": problems}

    def verify_bundle(self, entry: dict) -> dict | None:
        import json

        from rtxops.governance._layout import PROVENANCE, SBOM
        from rtxops.governance.keyring import Keyring
        from rtxops.governance.verify import Trust, verify

        authority = self.daemon.authority
        directory = authority.bundle_dir(entry["scope"], entry["version"])
        if not directory.is_dir():
            return None
        report = verify(directory, Trust(keyring=Keyring.load(authority.keyring_file)),
                        policies=authority.policies).to_dict()

        def read(name: str) -> dict:
            try:
                return json.loads((directory / name).read_text())
            except (OSError, ValueError):
                return {}
        return {**report, "sbom": read(SBOM).get("components", []),
                "provenance": read(PROVENANCE).get("predicate")}

    def policies(self) -> list[dict]:
        return [{"name": p.name, "rules": [{"name": r.name, "require": r.require, "reason": r.reason}
                                           for r in p.rules]} for p in self.daemon.authority.policies]

