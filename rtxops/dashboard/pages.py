"""The dashboard's server-rendered pages (tables readable without JavaScript; charts and live
updates in ``static/dashboard.js`` over the same ``/api`` the pages link to)."""
from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import HTMLResponse

from rtxops.evolve.stats import CONFIDENCE  # the level of the decisions' intervals
from rtxops.telemetry import store_views as V

from . import data
from .params import (
    MAX_TEXT,
    WINDOWS,
    Filter,
    Paging,
    Window,
    not_found,
    one_of,
    paging,
    text_filter,
    window,
)
from .render import templates


def make_router(store, *, problems: Callable[[], list[str]] | None = None,
                governance: data.GovernanceReports | None = None) -> APIRouter:
    router = APIRouter(include_in_schema=False, default_response_class=HTMLResponse)

    def render(request: Request, name: str, win: Window | None, job: str | None = None,
               **context) -> HTMLResponse:
        trace = None
        if win is not None:
            trace = "/api/trace?" + urlencode({**win.query(), **({"job": job} if job else {})})
        response = templates.TemplateResponse(request, name, {
            "win": win, "windows": WINDOWS, "job": job, "trace_url": trace,
            "query": dict(request.query_params), **context})
        response.headers["Cache-Control"] = "no-store"
        return response

    @router.get("/")
    def overview(request: Request, job: Filter = text_filter("only this job id"), win: Window = Depends(window)):
        jobs = data.jobs_page(store, state=None, search=None, paging=Paging(20, 0))
        ingest = data.ingest(store, window=win, stats=store.stats() if hasattr(store, "stats") else None,
                             problems=problems() if problems else None)
        return render(request, "overview.html", win, job, jobs=jobs, ingest=ingest,
                      speedups=V.speedups(store, job_id=job, since_ns=win.since_ns,
                                                  until_ns=win.until_ns))

    @router.get("/kernels")
    def kernels(request: Request, job: Filter = text_filter("only this job id"), op: Filter = text_filter("only this op"),
                bucket: Filter = text_filter("only this bucket"),
                at_ns: int | None = Query(None, ge=0, le=2**62), win: Window = Depends(window),
                page: Paging = Depends(paging)):
        table = data.kernels(store, job_id=job, op=op, window=win, paging=page)
        swaps = V.swap_markers(store, job_id=job, since_ns=win.since_ns, until_ns=win.until_ns,
                               limit=1000) if job else []
        return render(request, "kernels.html", win, job, op=op, bucket=bucket, at_ns=at_ns,
                      table=table, swaps=[s for s in swaps if s["step"] is not None],
                      job_ids=[s["job_id"] for s in table["steps"]])

    @router.get("/evolve")
    def evolve(request: Request, job: Filter = text_filter("only this job id"), op: Filter = text_filter("only this op"),
               bucket: Filter = text_filter("only this bucket"),
               variant: Filter = text_filter("only this variant"),
               status: Filter = text_filter("only this status"),
               win: Window = Depends(window), page: Paging = Depends(paging)):
        total, trials = V.trials(store, job_id=job, op=op, bucket=bucket, variant=variant,
                                 status=status, limit=page.limit, offset=page.offset)
        _, decisions = V.decisions(store, job_id=job, op=op, kind=None, limit=50, offset=0)
        _, tuning = V.tuning(store, op=op, variant=variant, status=None, device=None, limit=50, offset=0)
        return render(request, "evolve.html", win, job, op=op, bucket=bucket,
                      summary=data.evolve(store, job_id=job, window=win),
                      trials=data.page(total, trials, page), decisions=decisions, tuning=tuning,
                      ci_percent=round(100 * CONFIDENCE))

    @router.get("/memory")
    def memory(request: Request, job: Filter = text_filter("only this job id"), win: Window = Depends(window)):
        caches = store.cache_hit_rates(job_id=job, since_ns=win.since_ns, until_ns=win.until_ns)
        return render(request, "memory.html", win, job, caches=caches)

    @router.get("/governance")
    def governance_(request: Request, page: Paging = Depends(paging)):
        return render(request, "governance.html", None, gov=data.governance(store, page, governance))

    @router.get("/governance/bundles/{digest}")
    def bundle(request: Request, digest: str = Path(min_length=1, max_length=200)):
        found = data.bundle(store, digest, governance)
        if found is None:
            raise not_found(f"bundle {digest!r} in the ledger")
        return render(request, "bundle.html", None, digest=digest, bundle=found)

    @router.get("/jobs")
    def jobs(request: Request, state: Filter = one_of(data.JOB_STATES, "only jobs in this state"),
             search: Filter = text_filter("substring of name or id"), page: Paging = Depends(paging)):
        return render(request, "jobs.html", None, states=data.JOB_STATES, state=state, search=search,
                      jobs=data.jobs_page(store, state=state, search=search, paging=page))

    @router.get("/jobs/{job_id:path}")  # ids may hold "/"
    def job(request: Request, job_id: str = Path(min_length=1, max_length=MAX_TEXT),
            search: Filter = text_filter("case-insensitive substring"),
            win: Window = Depends(window)):
        detail = data.job_detail(store, job_id)
        if detail is None:
            raise not_found(f"job {job_id!r}")
        lines = V.job_logs_tail(store, job_id, search=search, limit=500)
        return render(request, "job.html", win, job_id, detail=detail, lines=lines, search=search)

    return router
