"""Static files: the dashboard's own JS/CSS and plotly.js from the installed ``plotly`` package
(served from its install location, never copied into this repository)."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, Response

OWN = Path(__file__).parent / "static"


def plotly_js() -> Path | None:
    """plotly.min.js inside the installed plotly package, if there is one."""
    try:
        import plotly
    except ImportError:
        return None
    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    return path if path.is_file() else None


FILES = {
    "dashboard.js": (lambda: OWN / "dashboard.js", "text/javascript"),
    "dashboard.css": (lambda: OWN / "dashboard.css", "text/css"),
    "vendor/plotly.min.js": (plotly_js, "text/javascript"),
}


def make_router() -> APIRouter:
    router = APIRouter(prefix="/static", include_in_schema=False)

    @router.get("/{name:path}")
    def static(name: str) -> Response:
        entry = FILES.get(name)
        path = entry[0]() if entry else None
        if path is None:
            return Response(f"no static file {name!r}", status_code=404, media_type="text/plain")
        return FileResponse(path, media_type=entry[1],
                            headers={"Cache-Control": "public, max-age=3600"})

    return router
