"""``/v1/telemetry``: read-only stats and exports of the store the daemon owns."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import anyio
from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import FileResponse, StreamingResponse
from starlette.background import BackgroundTask

from rtxops.telemetry import export, store as store_mod, store_views
from rtxops.telemetry.store import Store

FORMATS = ("chrome-trace", "otlp-json", "parquet")


def make_router(store: Store) -> APIRouter:
    router = APIRouter(prefix="/v1/telemetry", tags=["telemetry"])

    @router.get("/stats")
    def stats() -> dict:
        """Spans by kind, ingest batches, and the drops jobs reported."""
        return {**store_mod.telemetry_summary(store), **{f"daemon {k}": v for k, v in store.stats().items()}}

    @router.get("/export", responses={200: {"description": "the export file"}})
    async def export_spans(format: str = Query(..., pattern="^(chrome-trace|otlp-json|parquet)$"),
                           job: str | None = Query(None, max_length=200)):
        """Spans of one job (or all) as a Chrome trace (Perfetto), OTLP/JSON or Parquet; 404 for
        a job neither the supervisor nor telemetry knows."""
        if job and not await anyio.to_thread.run_sync(store_views.job_known, store, job):
            raise HTTPException(404, f"no job {job!r} in the store")
        if format == "parquet":
            fd, name = tempfile.mkstemp(suffix=".parquet")
            os.close(fd)
            tmp = Path(name)
            try:
                await anyio.to_thread.run_sync(store_mod.export_parquet, store, tmp, job)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            return FileResponse(tmp, media_type="application/vnd.apache.parquet",
                                filename="rtxops-spans.parquet",
                                background=BackgroundTask(tmp.unlink, missing_ok=True))
        def document():  # a sync iterator: Starlette steps it in a worker thread, off the loop
            for piece in export.JsonExport(store, format, job):
                yield piece.encode()

        return StreamingResponse(document(), media_type="application/json")

    return router
