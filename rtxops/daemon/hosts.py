"""Who may read: the Host check of a daemon that listens on a loopback address, and the token
check of every request to one that does not.

Reads (the dashboard, job logs, span exports) need no token on the daemon's own machine. A page
on any site could still read them through the user's browser by pointing its own name at
127.0.0.1 (DNS rebinding): its requests then carry that name as their Host. So a loopback
daemon answers only requests addressed to a loopback name or address. A daemon bound to
another address (``--host 0.0.0.0``) is reachable from other machines: there every request
needs the token but the health probes (the dashboard then is for a loopback daemon, or through
an SSH tunnel to one).
"""
from __future__ import annotations

import ipaddress

from starlette.responses import JSONResponse, PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from rtxops.bearer import carries_token

LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is this machine's
    loopback."""
    host = host.strip().lower().removeprefix("[").removesuffix("]")
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_of(header: str) -> str:
    """The host part of a Host header (``[::1]:8765`` → ``::1``, ``127.0.0.1:8765`` → ``127.0.0.1``)."""
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class LoopbackHostOnly:
    """ASGI middleware: a request whose Host is not a loopback name gets 421 (a request without
    a Host header, HTTP/1.0, comes from no browser and is let through)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            header = dict(scope.get("headers") or ()).get(b"host")
            if header is not None and not is_loopback(_host_of(header.decode("latin-1"))):
                response = PlainTextResponse(
                    "this rtxops daemon listens on a loopback address and answers requests "
                    "addressed to it only (Host: 127.0.0.1, localhost or [::1])", status_code=421)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


OPEN_PATHS = frozenset({"/healthz", "/readyz"})   # a load balancer's or systemd's probes


class TokenOnEveryRequest:
    """ASGI middleware for a daemon bound to a non-loopback address: a request without
    ``Authorization: Bearer <token>`` gets 401, reads included (but :data:`OPEN_PATHS`)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and scope.get("path") not in OPEN_PATHS:
            given = dict(scope.get("headers") or ()).get(b"authorization")
            if not carries_token(given, self.token):
                response = JSONResponse(
                    {"detail": "this rtxops daemon listens on a non-loopback address: every "
                               "request needs its bearer token"},
                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
