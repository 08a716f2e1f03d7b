"""``/v1/plans``: the plan endpoint jobs poll, publishing, and jobs reporting refusals."""
from __future__ import annotations

import base64
import dataclasses

from fastapi import APIRouter, Body, Depends, HTTPException, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from rtxops.runtime.errors import PlanError, PlanNotIssued, PlanVersionConflict
from rtxops.runtime.plan import MAX_VERSION, Plan
from rtxops.telemetry.otlp import MAX_JOB_ID

from .plans import PlanBoard


class Refusal(BaseModel):
    model_config = ConfigDict(extra="forbid")
    job: str = Field(min_length=1, max_length=MAX_JOB_ID)
    version: int = Field(ge=-1, le=MAX_VERSION)   # (-1: a plan given at start, not published)
    reason: str = Field(max_length=10_000)


def make_router(board: PlanBoard, auth, step_of=lambda job: None, margin_steps: int = 5) -> APIRouter:
    """``step_of(job)`` is the last step the job reported (heartbeats); a plan published for a
    running job without an ``effective_step`` gets ``last step + margin_steps``, so that every rank
    polls it before that step and all of them swap at the same step."""
    router = APIRouter(prefix="/v1/plans", tags=["plans"])

    @router.get("/current", responses={304: {"description": "the plan has not changed"},
                                       404: {"description": "no plan published"}})
    async def current(request: Request, job: str | None = Query(None, max_length=MAX_JOB_ID)) -> Response:
        # on the event loop (the board answers from memory): every job asks every 2 s, and a
        # worker thread's hand-over cost the daemon a fifth more CPU per poll (2.0 ms, not 1.65)
        plan = board.current(job)
        if plan is None:
            raise HTTPException(404, "no plan published")
        etag = f'"{plan.digest}"'
        headers = {"ETag": etag, "X-Rtxops-Plan-Version": str(plan.version)}
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers=headers)
        return Response(plan.to_json(), media_type="application/json", headers=headers)

    @router.post("", status_code=201, dependencies=[Depends(auth)],
                 responses={409: {"description": "the version is not newer than the published one"},
                            503: {"description": "not issued now (the disk, the ledger): retry"}})
    def publish(plan: dict = Body(..., description="a plan (docs/plan.md)"),
                job: str | None = Query(None, max_length=MAX_JOB_ID)) -> dict:
        try:
            # validate first: the first validation takes seconds (torch), and the step read
            # after it must be current, or the job may be past the effective step already
            parsed = board.validate(Plan.from_dict(plan), job)
            last = step_of(job) if job else None
            if last is not None and parsed.effective_step is None:
                parsed = dataclasses.replace(parsed, effective_step=last + margin_steps)
            published = board.publish(parsed, job)
        except PlanNotIssued as e:   # not the plan's fault: the disk, the ledger
            raise HTTPException(503, str(e), {"Retry-After": "5"}) from None
        except PlanVersionConflict as e:   # a valid plan, not newer: publish a newer version
            raise HTTPException(409, str(e)) from None
        except PlanError as e:
            raise HTTPException(422, str(e)) from None
        return {"version": published.version, "digest": published.digest, "job": job,
                "effective_step": published.effective_step}

    @router.get("/bundle", responses={404: {"description": "no signed bundle for the plan"}})
    def bundle(job: str | None = Query(None, max_length=MAX_JOB_ID)) -> dict:
        """The current plan's signed bundle (files base64-encoded): jobs verify it offline
        (signature, trusted key, digests, policy) before installing the plan."""
        found = board.bundle(job)
        if found is None:
            raise HTTPException(404, "no signed bundle for the current plan")
        plan, files = found
        return {"version": plan.version, "digest": plan.digest,
                "files": {name: base64.b64encode(data).decode() for name, data in files.items()}}

    @router.get("/ledger")
    def ledger(limit: int = Query(1000, ge=1, le=1000),
               offset: int = Query(0, ge=0, le=10**9)) -> dict:  # DuckDB takes int64 offsets
        """A page of ledger entries in stored order (``total`` in all), and the head file
        (``rtxops ledger verify`` pages through it while the daemon holds the store)."""
        if board.authority is None or board.authority.store is None:
            raise HTTPException(404, "this daemon keeps no ledger")
        from rtxops.governance import ledger as gl

        store = board.authority.store
        with board.authority.ledger_lock:   # entries and head of one moment
            return {"entries": gl.read_entries(store, limit=limit, offset=offset),
                    "total": gl.count_entries(store), "limit": limit, "offset": offset,
                    "head": gl.read_head(board.authority.head_file)}

    @router.post("/report", status_code=204, dependencies=[Depends(auth)])
    def report(refusal: Refusal) -> Response:
        board.report(refusal.job, refusal.version, refusal.reason)
        return Response(status_code=204)

    @router.get("/reports")
    def reports() -> dict:
        return {"reports": list(board.reports)}

    return router
