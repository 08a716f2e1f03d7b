"""The web dashboard: server-rendered pages at ``/``, their JSON at ``/api/...``, static assets at
``/static/...``. Read-only; reads the store through :mod:`rtxops.telemetry.store_views`."""
from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter

from . import api, pages, static
from .data import GovernanceReports


def make_router(store, *, problems: Callable[[], list[str]] | None = None,
                governance: GovernanceReports | None = None) -> APIRouter:
    """Pages, API and static files over ``store`` (a :class:`~rtxops.telemetry.store.Store`)."""
    router = APIRouter()
    router.include_router(api.make_router(store, problems=problems, governance=governance))
    router.include_router(static.make_router())
    router.include_router(pages.make_router(store, problems=problems, governance=governance))
    return router


__all__ = ["GovernanceReports", "make_router"]
