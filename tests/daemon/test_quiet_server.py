"""The daemon's uvicorn server: idle, it wakes once a second, not ten times; told to exit, at once."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn

from rtxops.daemon.quiet_server import IDLE_TICK_S, QuietServer


async def _app(scope, receive, send):
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def served():
    server = QuietServer(uvicorn.Config(_app, host="127.0.0.1", port=0, log_level="warning",
                                       lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield server, thread, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_an_idle_server_wakes_about_once_a_second(served):
    server, _, _ = served
    before = server.ticks
    time.sleep(3 * IDLE_TICK_S + 0.2)
    assert 2 <= server.ticks - before <= 4   # uvicorn's own loop: 30


def test_should_exit_from_another_thread_stops_it_without_waiting_for_the_tick(served):
    server, thread, _ = served
    ticks = server.ticks
    while server.ticks == ticks:   # just past a tick: the next is a second away
        time.sleep(0.005)
    t0 = time.monotonic()
    server.should_exit = True
    thread.join(5)
    assert not thread.is_alive()
    assert time.monotonic() - t0 < 0.75 * IDLE_TICK_S   # waiting for the tick: ~1 s


def test_the_date_header_still_moves_on(served):
    _, _, url = served
    first = httpx.get(url, trust_env=False).headers["date"]
    time.sleep(2 * IDLE_TICK_S + 0.1)
    assert httpx.get(url, trust_env=False).headers["date"] != first


def test_the_daemon_parses_http_with_httptools():
    """uvicorn picks its C parser where httptools is installed (a dependency): the job's span
    requests cost the daemon a quarter less CPU per span than with h11 (bench/daemon_request_cost.py)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    assert AutoHTTPProtocol.__name__ == "HttpToolsProtocol"   # what the daemon's "auto" resolves to
