"""``/v1/evolve``: offline tuning tasks (``rtxops tune``) and read-only views of the evolve loop's
state, decisions, trials, tuning database and hot spots."""
from __future__ import annotations

import dataclasses
import json
import random
import threading

from fastapi import APIRouter, Depends, HTTPException, Query
from pydantic import BaseModel, ConfigDict, Field

from rtxops.evolve.search import STRATEGIES
from rtxops.telemetry import store_evolve
from rtxops.telemetry.otlp import MAX_JOB_ID

MAX_LIMIT = 1000
MAX_OFFSET = 10**9
_STRATEGY = "^(" + "|".join(STRATEGIES) + ")$"


class TuneRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    op: str | None = Field(None, min_length=1, max_length=100)
    bucket: str | None = Field(None, min_length=1, max_length=500)
    strategy: str = Field("successive_halving", pattern=_STRATEGY)
    budget: int = Field(12, ge=1, le=10_000)
    reps: int = Field(20, ge=1, le=100_000)
    warmup: int = Field(3, ge=0, le=10_000)
    variants: list[str] | None = Field(None, max_length=100)
    # none given: a fresh one (a fixed default tried the same few arms of a small budget on
    # every task); the report gives the one used
    seed: int | None = Field(None, ge=0, le=2**31)


def _limit(default: int = 100):
    return Query(default, ge=1, le=MAX_LIMIT)


def _offset():
    return Query(0, ge=0, le=MAX_OFFSET)


def make_router(daemon, auth) -> APIRouter:
    router = APIRouter(prefix="/v1/evolve", tags=["evolve"])

    made: list = []  # the one TuneTasks (one task at a time), once the first task comes
    making = threading.Lock()

    def tasks():  # imports torch (the registry): only when the first task comes
        with making:  # two first submits at once made two, each running its tasks
            if not made:
                from rtxops.evolve.offline import TuneTasks
                from rtxops.runtime.registry import default_registry

                made.append(TuneTasks(daemon.store, default_registry))
            return made[0]

    @router.post("/tune", status_code=202, dependencies=[Depends(auth)],
                 responses={422: {"description": "bad op, bucket, variant or strategy"}})
    def submit(request: TuneRequest) -> dict:
        """Start an offline tuning task (worker processes, one task at a time); its id."""
        from rtxops.evolve.offline import TuneError

        try:
            params = request.model_dump()
            if params["seed"] is None:
                params["seed"] = random.randrange(2**31)
            return tasks().submit(params)
        except TuneError as e:
            raise HTTPException(422, str(e)) from None

    @router.post("/tune/{task_id}/cancel", dependencies=[Depends(auth)],
                 responses={404: {"description": "no such task of this daemon"}})
    def cancel_task(task_id: str) -> dict:
        """Cancel a tuning task: a queued one at once, the running one once the benchmark in
        flight ends (its trials so far are kept)."""
        found = made[0].cancel(task_id) if made else None
        if found is None:
            raise HTTPException(404, f"no tuning task {task_id!r} in this daemon")
        return found

    @router.get("/tune/{task_id}", responses={404: {"description": "no such task"}})
    def task(task_id: str) -> dict:
        """A tuning task: state (queued, running, done, failed), progress, report or error."""
        found = made[0].get(task_id) if made else None
        if found is None:  # an earlier daemon's
            found = next(iter(store_evolve.saved_tune_tasks(daemon.store, task_id)), None)
        if found is None:
            raise HTTPException(404, f"no tuning task {task_id!r}")
        return found

    @router.get("/status")
    def status() -> dict:
        """The evolve loop's state per job (``enabled: false`` when the loop is off) and the
        offline tuning tasks (this daemon's, then the saved ones of earlier daemons)."""
        tune = made[0].summary() if made else []
        here = {t["id"] for t in tune}
        tune += [t for t in store_evolve.saved_tune_tasks(daemon.store, summary=True)
                 if t["id"] not in here]
        scheduler = daemon.evolve
        if scheduler is None:
            return {"enabled": False, "tune_tasks": tune}
        loop = scheduler.loop
        return {"enabled": True, "ready": loop is not None, "error": scheduler.error,
                "min_steps": daemon.evolve_config.min_steps,
                "config": dataclasses.asdict(loop.config) if loop is not None else None,
                "jobs": loop.status() if loop is not None else {}, "tune_tasks": tune}

    @router.get("/decisions")
    def decisions(job: str | None = Query(None, max_length=MAX_JOB_ID), limit: int = _limit(),
                  offset: int = _offset()) -> dict:
        rows = store_evolve.decisions(daemon.store, job, limit=limit, offset=offset)
        return {"decisions": [_parsed(r, "evidence") for r in rows], "limit": limit, "offset": offset}

    @router.get("/trials")
    def trials(job: str | None = Query(None, max_length=MAX_JOB_ID),
               op: str | None = Query(None, max_length=100), limit: int = _limit(),
               offset: int = _offset()) -> dict:
        rows = store_evolve.trials(daemon.store, job, op, limit=limit, offset=offset)
        return {"trials": [_parsed(r, "detail") for r in rows], "limit": limit, "offset": offset}

    @router.get("/tuning")
    def tuning(op: str | None = Query(None, max_length=100),
               bucket: str | None = Query(None, max_length=500), limit: int = _limit(),
               offset: int = _offset()) -> dict:
        """The tuning database (every key part, the result and where it came from)."""
        rows = store_evolve.tuning_rows(daemon.store, {"bucket": bucket} if bucket else None,
                                        op=op, limit=limit, offset=offset)
        return {"tuning": rows, "limit": limit, "offset": offset}

    @router.get("/hotspots")
    def hotspots(job: str = Query(..., min_length=1, max_length=MAX_JOB_ID),
                 since_step: int = Query(0, ge=0, le=2**62), limit: int = _limit(),
                 offset: int = _offset()) -> dict:
        """A job's (op, bucket) pairs ranked by share of step time since ``since_step``."""
        rows = store_evolve.hotspots(daemon.store, job, since_step)
        return {"hotspots": rows[offset:offset + limit], "total": len(rows), "limit": limit,
                "offset": offset}

    return router


def _parsed(row: dict, column: str) -> dict:
    try:
        return {**row, column: json.loads(row[column]) if row.get(column) else {}}
    except ValueError:
        return row
