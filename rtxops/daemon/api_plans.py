"""``/v1/plans``: the plan endpoint jobs poll, publishing, and jobs reporting refusals."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import threading
from typing import Callable

from fastapi import APIRouter, Body, Depends, HTTPException, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from rtxops.runtime.errors import PlanError, PlanNotIssued, PlanVersionConflict
from rtxops.runtime.plan import MAX_VERSION, Plan
from rtxops.telemetry.otlp import MAX_JOB_ID

from .plans import PlanBoard

MAX_WAIT_S = 60.0
NO_PLAN_ETAG = '"none"'   # the "no plan published" answer's ETag: a poll waits on that too


class _Waits:
    """Plan polls waiting for a change of the board (long polls), woken from any thread."""

    def __init__(self, board: PlanBoard) -> None:
        self._board = board
        self._waiting: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()
        self._lock = threading.Lock()
        board.on_change(self.wake)

    async def wait(self, timeout_s: float, unchanged: Callable[[], bool]) -> None:
        """Until the board changes, the daemon stops, or ``timeout_s`` passes; at once where
        ``unchanged()`` says the change came already (asked once this wait is registered: a
        publish between the caller's look and then would wake no one)."""
        loop = asyncio.get_running_loop()
        entry = (loop, loop.create_future())
        with self._lock:
            if self._board.waits_stopped:
                return
            self._waiting.add(entry)
        try:
            if not unchanged():
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(entry[1], timeout_s)
        finally:
            with self._lock:
                self._waiting.discard(entry)

    def wake(self) -> None:
        with self._lock:
            waiting = list(self._waiting)
        for loop, future in waiting:
            with contextlib.suppress(RuntimeError):   # its loop has closed
                loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _etag(plan: Plan | None) -> str:
    return NO_PLAN_ETAG if plan is None else f'"{plan.digest}"'


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

    waits = _Waits(board)

    @router.get("/current", responses={304: {"description": "the plan has not changed"},
                                       404: {"description": "no plan published"}})
    async def current(request: Request, job: str | None = Query(None, max_length=MAX_JOB_ID),
                      wait_s: float = Query(0.0, ge=0.0, le=MAX_WAIT_S, description=(
                          "long poll: while the answer is the one named in If-None-Match, wait "
                          "up to this long for a publish"))) -> Response:
        """The job's current plan (its own, else the default). With ``If-None-Match`` (the
        ``ETag`` of the last answer, ``"none"`` for no plan) and ``wait_s``, the answer waits
        until the plan changes or ``wait_s`` passes (then 304): a job hears of a new plan at
        once, and asks a few times a minute instead of every 2 s."""
        # on the event loop (the board answers from memory): a worker thread's hand-over cost
        # the daemon a fifth more CPU per poll (2.0 ms, not 1.65)
        seen = request.headers.get("if-none-match")
        plan = board.current(job)
        if wait_s and seen == _etag(plan):
            deadline = asyncio.get_running_loop().time() + wait_s
            while seen == _etag(plan) and not board.waits_stopped:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                await waits.wait(left, lambda: seen == _etag(board.current(job)))
                plan = board.current(job)
        etag = _etag(plan)
        headers = {"ETag": etag}
        if plan is not None:
            headers["X-Rtxops-Plan-Version"] = str(plan.version)
        if seen == etag:
            return Response(status_code=304, headers=headers)
        if plan is None:
            raise HTTPException(404, "no plan published", headers=headers)
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
