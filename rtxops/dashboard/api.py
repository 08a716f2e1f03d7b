"""``/api/...``: the read-only, paginated JSON behind every dashboard page."""
from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Depends, Path, Query
from fastapi.responses import JSONResponse

from rtxops.telemetry import store_views as V

from . import data
from .params import (
    MAX_TEXT,
    Filter,
    Paging,
    Window,
    not_found,
    one_of,
    paging,
    text_filter,
    window,
)


def id_path():
    """A path parameter holding an id (1 to MAX_TEXT characters); one instance per route."""
    return Path(min_length=1, max_length=MAX_TEXT)


def points_query():
    return Query(200, ge=2, le=2000, description="at most this many time slices per series")


class Json(JSONResponse):
    """Strict JSON: NaN and infinities become null."""

    def render(self, content) -> bytes:
        return super().render(data.jsonable(content))


def make_router(store, *, problems: Callable[[], list[str]] | None = None,
                governance: data.GovernanceReports | None = None) -> APIRouter:
    """The API over ``store`` (a :class:`~rtxops.telemetry.store.Store`). ``problems()`` lists why
    the daemon is not ready; ``governance`` verifies ledger chains and bundles when it is wired in."""
    router = APIRouter(prefix="/api", tags=["dashboard"], default_response_class=Json)

    def known_job(job_id: str) -> str:
        if not V.job_known(store, job_id):
            raise not_found(f"job {job_id!r}")
        return job_id

    def whole_id_job(job_id: str, tail: str) -> dict | None:
        """The job whose id is ``job_id`` + ``tail`` ("/logs", "/events"), when ``job_id`` is
        no job: its page asks for /api/jobs/{its id}, which the route under a job took."""
        return None if V.job_known(store, job_id) else data.job_detail(store, job_id + tail)

    @router.get("/jobs")
    def jobs(state: Filter = one_of(data.JOB_STATES, "only jobs in this state"),
             search: Filter = text_filter("substring of the job's name or id"),
             page: Paging = Depends(paging)) -> dict:
        """Jobs (supervised and telemetry-only), newest first: state, steps, restarts, plan."""
        return data.jobs_page(store, state=state, search=search, paging=page)

    # job ids may hold "/" (any OpenTelemetry client names its own): the routes under a job come
    # before the job's own, whose path parameter would take them too
    @router.get("/jobs/{job_id:path}/events", responses={404: {"description": "unknown job"}})
    def events(job_id: str = id_path(), kind: Filter = text_filter("only this event kind"),
               page: Paging = Depends(paging)) -> dict:
        """The supervisor's events of one job, oldest first."""
        whole = whole_id_job(job_id, "/events")
        if whole is not None:
            return whole
        total, rows = V.job_events(store, known_job(job_id), kind=kind, limit=page.limit,
                                   offset=page.offset)
        return data.page(total, rows, page)

    @router.get("/jobs/{job_id:path}/logs", responses={404: {"description": "unknown job"}})
    def logs(job_id: str = id_path(), after: int = Query(0, ge=0, le=2**62, description="lines after this seq"),
             rank: int | None = Query(None, ge=-1, le=100_000),
             stream: Filter = one_of(("stdout", "stderr"), "only this stream"),
             search: Filter = text_filter("case-insensitive substring"),
             limit: int = Query(500, ge=1, le=5000)) -> dict:
        """Output lines after ``after`` (follow: pass the last ``seq`` back). A line longer than
        4000 bytes is stored in pieces, each a row here as in ``rtxops logs`` (``size``: its
        bytes; ``cut``: cut for display)."""
        whole = whole_id_job(job_id, "/logs")
        if whole is not None:
            return whole
        lines = V.job_logs(store, known_job(job_id), rank=rank, stream=stream, search=search,
                           after_seq=after, limit=limit)
        return {"job_id": job_id, "after": after, "lines": lines,
                "last_seq": lines[-1]["seq"] if lines else after}

    @router.get("/jobs/{job_id:path}", responses={404: {"description": "unknown job"}})
    def job(job_id: str = id_path()) -> dict:
        """One job: command, attempts with exit reasons, restarts, status history, stacks."""
        detail = data.job_detail(store, job_id)
        if detail is None:
            raise not_found(f"job {job_id!r}")
        return detail

    @router.get("/steps")
    def steps(job: Filter = text_filter("only this job id"), win: Window = Depends(window), points: int = points_query()) -> dict:
        """Step time p50/p95 per job over time, with swap and rollback markers."""
        return data.step_chart(store, job_id=job, window=win, points=points)

    @router.get("/speedups")
    def speedups(job: Filter = text_filter("only this job id"), win: Window = Depends(window)) -> dict:
        """Per job that swapped: median step time before the first swap vs since the last one."""
        return {"items": V.speedups(store, job_id=job, since_ns=win.since_ns, until_ns=win.until_ns)}

    @router.get("/ingest")
    def ingest(win: Window = Depends(window)) -> dict:
        """Ingest rate, drops reported by jobs, the daemon's counters and health."""
        return data.ingest(store, window=win, stats=store.stats() if hasattr(store, "stats") else None,
                           problems=problems() if problems else None)

    @router.get("/kernels")
    def kernels(job: Filter = text_filter("only this job id"), op: Filter = text_filter("only this op, e.g. rms_norm"),
                win: Window = Depends(window), page: Paging = Depends(paging)) -> dict:
        """Per op → bucket → variant and phase: calls, time, share of step time, p50/p95."""
        return data.kernels(store, job_id=job, op=op, window=win, paging=page)

    @router.get("/kernels/series")
    def kernel_series(job: Filter = text_filter("only this job id"), op: Filter = text_filter("only this op, e.g. rms_norm"),
                      bucket: Filter = text_filter("only this bucket id"),
                      win: Window = Depends(window), points: int = points_query()) -> dict:
        """Per-call time p50/p95 over time per (op, bucket, variant, phase)."""
        return data.kernel_series(store, job_id=job, op=op, bucket=bucket, window=win, points=points)

    @router.get("/kernels/breakdown", responses={404: {"description": "unknown job"}})
    def breakdown(job: str = Query(..., min_length=1, max_length=MAX_TEXT),
                  at_ns: int | None = Query(None, ge=0, le=2**62, description="the swap (default: the last)"),
                  span_s: int = Query(30, ge=1, le=3600, description="seconds on each side"),
                  win: Window = Depends(window)) -> dict:
        """Kernel time per step by op, before vs after a swap."""
        return data.breakdown(store, job_id=known_job(job), at_ns=at_ns, span_s=span_s, window=win)

    @router.get("/evolve")
    def evolve(job: Filter = text_filter("only this job id"), win: Window = Depends(window)) -> dict:
        """Hot spots, running explorations, canaries, rollbacks."""
        return data.evolve(store, job_id=job, window=win)

    @router.get("/evolve/trials")
    def trials(job: Filter = text_filter("only this job id"), op: Filter = text_filter("only this op, e.g. rms_norm"),
               bucket: Filter = text_filter("only this bucket id"),
               variant: Filter = text_filter("only this variant"),
               status: Filter = text_filter("only this status"),
               page: Paging = Depends(paging)) -> dict:
        """Trials, newest first."""
        total, rows = V.trials(store, job_id=job, op=op, bucket=bucket, variant=variant,
                               status=status, limit=page.limit, offset=page.offset)
        return data.page(total, rows, page)

    @router.get("/evolve/trials/{trial_id}", responses={404: {"description": "unknown trial"}})
    def trial(trial_id: str = id_path()) -> dict:
        """One trial."""
        row = V.trial(store, trial_id)
        if row is None:
            raise not_found(f"trial {trial_id!r}")
        return row

    @router.get("/evolve/decisions")
    def decisions(job: Filter = text_filter("only this job id"), op: Filter = text_filter("only this op, e.g. rms_norm"),
                  kind: Filter = text_filter("promote, reject, canary, rollback, …"),
                  page: Paging = Depends(paging)) -> dict:
        """Decisions with their statistics (gain, confidence interval, p-value), newest first."""
        total, rows = V.decisions(store, job_id=job, op=op, kind=kind, limit=page.limit,
                                  offset=page.offset)
        return data.page(total, rows, page)

    @router.get("/evolve/tuning")
    def tuning(op: Filter = text_filter("only this op, e.g. rms_norm"), variant: Filter = text_filter("only this variant"),
               status: Filter = text_filter("only this status"),
               device: Filter = text_filter("only this device"),
               page: Paging = Depends(paging)) -> dict:
        """The tuning database."""
        total, rows = V.tuning(store, op=op, variant=variant, status=status, device=device,
                               limit=page.limit, offset=page.offset)
        return data.page(total, rows, page)

    @router.get("/memory")
    def memory(job: Filter = text_filter("only this job id"), win: Window = Depends(window), points: int = points_query()) -> dict:
        """RSS and CUDA allocated/reserved/peak/fragmentation over time per job."""
        return {"series": V.memory_series(store, job_id=job, since_ns=win.since_ns,
                                          until_ns=win.until_ns, points=points)}

    @router.get("/caches")
    def caches(job: Filter = text_filter("only this job id"), win: Window = Depends(window)) -> dict:
        """Hit rates of the variant build cache, Inductor's FX graph cache, Triton autotuning."""
        return {"items": store.cache_hit_rates(job_id=job, since_ns=win.since_ns,
                                               until_ns=win.until_ns)}

    @router.get("/governance")
    def governance_(page: Paging = Depends(paging)) -> dict:
        """Ledger entries, chain verification, policies in force."""
        return data.governance(store, page, governance)

    @router.get("/governance/bundles/{digest}", responses={404: {"description": "unknown bundle"}})
    def bundle(digest: str = id_path()) -> dict:
        """One ledger entry and its bundle's verify report."""
        found = data.bundle(store, digest, governance)
        if found is None:
            raise not_found(f"bundle {digest!r} in the ledger")
        return found

    @router.get("/trace")
    def trace(job: Filter = text_filter("only this job id"), win: Window = Depends(window)) -> Json:
        """The window's spans (the first 50 000, sampled calls left out) as a Chrome trace, for
        ui.perfetto.dev or chrome://tracing."""
        return Json(data.chrome_trace(store, job_id=job, window=win),
                    headers={"Content-Disposition": 'attachment; filename="rtxops-trace.json"'})

    return router
