"""The daemon's FastAPI app: OTLP receiver, jobs, plans, operations (health, readiness, metrics) and
the dashboard, each a thin router over the daemon's parts."""
from __future__ import annotations

import json
import math
import os
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException

from rtxops import __version__, dashboard
from rtxops.telemetry.receiver import make_router as receiver_router

from . import api_evolve, api_jobs, api_plans, api_telemetry
from .auth import require_token
from .docs import api_page
from .hosts import LoopbackHostOnly, TokenOnEveryRequest, is_loopback
from .metrics import registry_for, render


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped. A client may send text that is not UTF-8 (a
    lone surrogate, through a JSON escape such as ``\\ud800``); echoed in an error, or stored in
    a job's name, it would otherwise fail the response (a 500) every time it is shown."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


API_MAX_BODY = 4 << 20   # bytes of a JSON request (a job with its shell's environment: ~10 kB)


def _finite(value: Any) -> Any:
    """``value`` with non-finite floats as text: a validation error echoes the input it refused
    (``1e400``, ``NaN``), which JSON cannot carry."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def create_app(daemon) -> FastAPI:
    app = FastAPI(title="rtxops daemon", version=__version__, default_response_class=AsciiJSONResponse,
                  description="Supervises training jobs, ingests their telemetry, serves plans.",
                  docs_url=None, redoc_url=None)  # their pages load scripts from a CDN

    @app.get("/docs", include_in_schema=False)
    def docs() -> Response:
        return HTMLResponse(api_page(app.openapi()))

    @app.exception_handler(HTTPException)
    def http_error(request: Request, exc: HTTPException) -> Response:
        return AsciiJSONResponse({"detail": exc.detail}, status_code=exc.status_code,
                                 headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    def invalid_request(request: Request, exc: RequestValidationError) -> Response:
        return AsciiJSONResponse({"detail": _finite(jsonable_encoder(exc.errors()))}, status_code=422)

    if is_loopback(daemon.host):
        app.add_middleware(LoopbackHostOnly)   # see hosts.py: DNS rebinding
    elif daemon.token:   # reachable from other machines: reads need the token too
        app.add_middleware(TokenOnEveryRequest, token=daemon.token)
    auth = require_token(daemon.token)
    app.include_router(receiver_router(daemon.store, token=daemon.token, on_batch=daemon.on_batch))
    # FastAPI reads and parses a body before the token is checked: the JSON API takes at most
    # API_MAX_BODY (the receiver has its own limit and answers in OTLP's terms)
    for router in (api_jobs.make_router(daemon.supervisor, auth),
                   api_plans.make_router(daemon.board, auth, daemon.last_step),
                   api_telemetry.make_router(daemon.store, auth), api_evolve.make_router(daemon, auth),
                   dashboard.make_router(daemon.store, problems=daemon.readiness_problems,
                                         governance=_GovernanceReports(daemon))):
        app.include_router(router, max_body_size=API_MAX_BODY)
    metrics = registry_for(daemon)

    home, pid = str(daemon.home.root.resolve()), os.getpid()

    @app.get("/healthz", tags=["ops"])
    def healthz() -> dict:
        """The process is alive; which home it serves, as which process (a client checks both:
        another home's daemon may answer at a port a dead one left in this home's files)."""
        return {"status": "ok", "version": __version__, "home": home, "pid": pid}

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
        authority = self.daemon.authority
        with authority.ledger_lock:   # entries and head of one moment
            problems = self._chain.problems(self.daemon.store, ledger.read_head(authority.head_file))
        return {"ok": not problems, "problems": problems}

    def verify_bundle(self, entry: dict) -> dict | None:
        import json

        from rtxops.governance._layout import PROVENANCE, SBOM
        from rtxops.governance.keyring import Keyring
        from rtxops.governance.verify import Trust, verify

        authority = self.daemon.authority
        directory = authority.bundle_dir(entry["scope"], entry["version"])
        if entry.get("kind") == "deny" or not directory.is_dir():
            return None   # a denied bundle is never kept: the folder is another entry's
        report = verify(directory, Trust(keyring=Keyring.load(authority.keyring_file)),
                        policies=authority.policies).to_dict()
        if report["ok"] and (report.get("facts") or {}).get("digest") != entry.get("subject_digest"):
            return None   # the scope's version was issued again since: not this entry's bundle
        # a folder that fails has no facts to tell whose it is: shown failed, never hidden (a
        # tampered bundle read "not on this daemon's disk")

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

