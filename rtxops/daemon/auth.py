"""Bearer-token check for mutating endpoints (the token lives in ``$RTXOPS_HOME/token``)."""
from __future__ import annotations

from fastapi import Header, HTTPException

from rtxops.bearer import carries_token


def require_token(token: str | None):
    """A FastAPI dependency that answers 401 unless the request carries ``Bearer <token>``
    (``None``: no check, for tests and embedded apps; an empty token is refused)."""
    if token is not None and not token.strip():
        raise ValueError("an empty bearer token would let every request through")
    expected = None if token is None else token.encode()

    def check(authorization: str | None = Header(default=None)) -> None:
        if expected is None:
            return
        if not carries_token(authorization, expected):
            raise HTTPException(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})

    return check
