"""``/v1/telemetry``: stats and exports of the store the daemon owns, and pruning it."""
from __future__ import annotations

import functools
import math
import os
import tempfile
from pathlib import Path

import anyio
from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from rtxops.telemetry import export, store as store_mod, store_export, store_retention, store_views
from rtxops.telemetry.otlp import MAX_JOB_ID
from rtxops.telemetry.store import Store

FORMATS = ("chrome-trace", "otlp-json", "parquet")


class PruneRequest(BaseModel):
    """Delete telemetry older than an age (see ``rtxops telemetry prune``)."""

    model_config = ConfigDict(extra="forbid")
    older_than: str = Field(max_length=32, description="an age: 30d, 36h, 2w (1d at least)")
    dry_run: bool = Field(False, description="count what would go, delete nothing")


def make_router(store: Store, auth) -> APIRouter:
    router = APIRouter(prefix="/v1/telemetry", tags=["telemetry"])

    @router.get("/stats")
    def stats() -> dict:
        """Spans by kind, ingest batches, the drops jobs reported, and the daemon's counters."""
        return {**store_mod.telemetry_summary(store), **{f"daemon {k}": v for k, v in store.stats().items()}}

    @router.post("/prune", dependencies=[Depends(auth)],
                 responses={422: {"description": "not an age, or under 1d"},
                            503: {"description": "the store is closing"}})
    async def prune(request: PruneRequest) -> dict:
        """Delete spans, span events, kernel rollups, the ingest log and job log lines older
        than ``older_than`` (job records, evolve decisions and the ledger stay)."""
        try:
            seconds = store_retention.check_age(store_retention.parse_age(request.older_than))
        except ValueError as e:
            raise HTTPException(422, str(e)) from None
        try:
            report = await anyio.to_thread.run_sync(functools.partial(
                store_retention.prune, store, seconds, dry_run=request.dry_run))
        except store_mod.StoreClosed as e:
            raise HTTPException(503, str(e)) from None
        except store_mod.StoreBusy as e:   # being reopened: the same prune may go again soon
            raise HTTPException(503, str(e), headers={
                "Retry-After": str(max(1, math.ceil(e.retry_after)))}) from None
        return report.as_dict()

    @router.get("/export", responses={200: {"description": "the export file"}})
    async def export_spans(format: str = Query(..., pattern="^(chrome-trace|otlp-json|parquet)$"),
                           job: str | None = Query(None, max_length=MAX_JOB_ID)):
        """Spans of one job (or all) as a Chrome trace (Perfetto), OTLP/JSON or Parquet; 404 for
        a job neither the supervisor nor telemetry knows."""
        if job and not await anyio.to_thread.run_sync(store_views.job_known, store, job):
            raise HTTPException(404, f"no job {job!r} in the store")
        if format == "parquet":
            # beside the store, on its disk: /tmp is often memory, and a long job's file is large
            fd, name = tempfile.mkstemp(suffix=".parquet", prefix=".export-", dir=store.path.parent)
            os.close(fd)
            tmp = Path(name)
            try:
                await anyio.to_thread.run_sync(store_export.export_parquet, store, tmp, job)
                # open, then unlinked at once: the file goes with the response whatever ends it
                # (a FileResponse answering a bad Range header ran no cleanup: a file left for
                # good per request)
                f = open(tmp, "rb")
            finally:
                tmp.unlink(missing_ok=True)
            size = os.fstat(f.fileno()).st_size

            def chunks():
                with f:
                    while piece := f.read(1 << 20):
                        yield piece

            return StreamingResponse(chunks(), media_type="application/vnd.apache.parquet", headers={
                "Content-Length": str(size),
                "Content-Disposition": 'attachment; filename="rtxops-spans.parquet"'})
        def document():  # a sync iterator: Starlette steps it in a worker thread, off the loop
            for piece in export.JsonExport(store, format, job):
                yield piece.encode()

        return StreamingResponse(document(), media_type="application/json")

    return router
