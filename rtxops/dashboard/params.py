"""Query parameters shared by the dashboard's pages and API: the time window and paging."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import HTTPException, Query
from pydantic import AfterValidator

MAX_WINDOW_S = 30 * 86400
MAX_NS = 2**62
WINDOWS = (("5 min", 300), ("15 min", 900), ("1 hour", 3600), ("6 hours", 21600),
           ("1 day", 86400), ("7 days", 604800))


SLACK_NS = 60 * 10**9


@dataclass(frozen=True)
class Window:
    """``[since_ns, until_ns)``: the last ``window_s`` seconds before ``until_ns``; by default
    before now, and then ``until_ns`` also takes a minute's slack for clocks ahead of ours."""

    window_s: int
    since_ns: int
    until_ns: int
    pinned: bool

    def query(self) -> dict[str, int]:
        """The parameters that reproduce this window in a link."""
        return {"window_s": self.window_s, **({"until_ns": self.until_ns} if self.pinned else {})}


def window(window_s: int = Query(900, ge=10, le=MAX_WINDOW_S,
                                 description="length of the time window, seconds"),
           until_ns: int | None = Query(None, ge=10**18, le=MAX_NS,
                                        description="end of the window, Unix ns (default: now)")
           ) -> Window:
    if until_ns is None:
        now = time.time_ns()
        return Window(window_s, now - window_s * 10**9, now + SLACK_NS, pinned=False)
    return Window(window_s, until_ns - window_s * 10**9, until_ns, pinned=True)


@dataclass(frozen=True)
class Paging:
    limit: int
    offset: int


def paging(limit: int = Query(50, ge=1, le=500, description="rows per page"),
           offset: int = Query(0, ge=0, le=10**9, description="rows to skip")) -> Paging:
    return Paging(limit, offset)


def _blank_is_none(value: str | None) -> str | None:
    return value or None


Filter = Annotated[str | None, AfterValidator(_blank_is_none)]
"""An optional text filter; an empty value (a blank form field) means no filter."""


MAX_TEXT = 1024
"""The longest id or filter value taken: any OpenTelemetry client names its own job ids, and the
store keeps them whole (a 228-character one was listed, then a 422 on its own page)."""


def text_filter(description: str):
    """An optional filter on a text column (at most :data:`MAX_TEXT` characters; blank: none)."""
    return Query(None, max_length=MAX_TEXT, description=description)


def one_of(values: tuple[str, ...], description: str):
    """An optional filter that must be one of ``values`` (blank: none)."""
    return Query(None, pattern="^(|" + "|".join(values) + ")$", description=description)


def not_found(what: str) -> HTTPException:
    return HTTPException(404, f"no {what}")
