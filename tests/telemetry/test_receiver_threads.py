"""Decoding has threads of its own: on anyio's shared 40, a burst of slow synchronous endpoints
(publishes signing, submits waiting on the store) held every thread and ingest waited for them."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import uvicorn

from rtxops.telemetry import synthetic
from rtxops.telemetry.otlp import PROTOBUF
from rtxops.telemetry.receiver import make_app
from rtxops.telemetry.store import Store

from .._bounded import serving

SLOW_S = 12


def test_ingest_answers_while_slow_endpoints_hold_every_shared_thread(tmp_path):
    release = threading.Event()
    store = Store(tmp_path / "s.duckdb")
    app = make_app(store, token=None)

    @app.get("/slow")
    def slow() -> dict:  # a sync endpoint: it holds one of anyio's shared threads
        release.wait(SLOW_S)
        return {}

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           access_log=False, lifespan="off"))
    thread = serving(server, "receiver")
    base = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    body = synthetic.otlp_request(20, seed=1, job_id="job-t").SerializeToString()
    try:
        with ThreadPoolExecutor(48) as pool:
            slow_calls = [pool.submit(httpx.get, base + "/slow", timeout=60) for _ in range(45)]
            time.sleep(1.5)  # all 40 shared threads taken
            started = time.monotonic()
            r = httpx.post(base + "/v1/traces", content=body, timeout=60,
                           headers={"Content-Type": PROTOBUF})
            took = time.monotonic() - started
            release.set()
            assert all(c.result().status_code == 200 for c in slow_calls)
        assert r.status_code == 200, r.text
        assert took < SLOW_S / 2, f"ingest waited {took:.1f} s for the shared threads"
    finally:
        release.set()
        server.should_exit = True
        thread.join(10)
        store.close()
