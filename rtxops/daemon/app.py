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
    app.include_router(dashboard.make_router(daemon.store, problems=daemon.readiness_problems))

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
