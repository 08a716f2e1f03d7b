"""The bearer-token check every rtxops endpoint shares (RFC 6750 credentials in RFC 7235's form)."""
from __future__ import annotations

import hmac


def carries_token(authorization: str | bytes | None, token: bytes) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <token>``: the scheme in any case
    (RFC 7235 makes it case-insensitive), spaces after it; the token compared in constant time."""
    if not authorization:
        return False
    if isinstance(authorization, str):   # as ASGI servers decode header values
        authorization = authorization.encode("latin-1", "replace")
    scheme, _, credentials = authorization.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.lstrip(b" "), token)
