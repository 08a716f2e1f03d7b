"""Jinja2 templates (autoescaped) and the filters they format numbers and times with."""
from __future__ import annotations

import datetime as dt
import json
import urllib.parse
from pathlib import Path

from fastapi.templating import Jinja2Templates

TEMPLATES = Path(__file__).parent / "templates"


def ms(ns: float | None) -> str:
    """Nanoseconds as milliseconds (or microseconds below 1 ms)."""
    if ns is None:
        return "–"
    return f"{ns / 1e6:.2f} ms" if ns >= 1e6 else f"{ns / 1e3:.1f} µs"


def when(ns: int | None) -> str:
    """Unix nanoseconds as UTC time of day (with the date when not today)."""
    if not ns:
        return "–"
    t = dt.datetime.fromtimestamp(ns / 1e9, tz=dt.timezone.utc)
    today = dt.datetime.now(tz=dt.timezone.utc).date()
    return t.strftime("%H:%M:%S" if t.date() == today else "%Y-%m-%d %H:%M:%S") + "Z"


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def size(n: int | None) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def num(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def pretty(value: object) -> str:
    """JSON text, indented (escaped by the template like any string)."""
    return json.dumps(value, indent=2, sort_keys=True, default=str)


def compact(value: object) -> str:
    """JSON text on one line, non-ASCII as is (escaped by the template like any string)."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def segment(value: object) -> str:
    """``value`` as one URL path segment: ``/`` and ``.`` escaped too, so a job id such as
    ``exp/../other`` links to itself (a browser resolves a literal ``..`` before asking)."""
    return urllib.parse.quote(str(value), safe="").replace(".", "%2E")


def given(params: dict) -> dict:
    """``params`` without its None values: a span with no bucket linked to ``bucket=None``,
    which filtered for the text "None" and found nothing."""
    return {k: v for k, v in params.items() if v is not None}


templates = Jinja2Templates(directory=str(TEMPLATES))
templates.env.filters.update(ms=ms, when=when, pct=pct, size=size, num=num, pretty=pretty,
                            compact=compact, segment=segment, given=given)
