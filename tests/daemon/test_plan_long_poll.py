"""Plan polls are long polls: a poll naming the answer it has waits at the daemon until a plan is
published (and gets it at once) or its ``wait_s`` passes (304); a stopping daemon answers the
polls it holds instead of letting its server's grace period cancel them."""
from __future__ import annotations

import threading
import time

import httpx

PLAN = {"version": 1, "defaults": {"gelu": "algebraic"}}


def _poll_in_thread(url: str, seen: str, wait_s: float) -> dict:
    """A poll of ``/v1/plans/current`` naming ``seen``, on a thread; its answer (status, ETag,
    when) lands in the returned dict."""
    out: dict = {}

    def poll() -> None:
        try:
            r = httpx.get(f"{url}/v1/plans/current", params={"job": "job-1", "wait_s": wait_s},
                          headers={"If-None-Match": seen}, timeout=wait_s + 30)
            out.update(status=r.status_code, etag=r.headers.get("etag"), at=time.monotonic(),
                       body=r.text)
        except httpx.HTTPError as e:   # a poll the server cancelled
            out.update(error=repr(e), at=time.monotonic())

    out["thread"] = threading.Thread(target=poll, daemon=True)
    out["thread"].start()
    return out


def test_a_poll_waits_for_a_publish_and_gets_the_plan_at_once(daemon):
    c = daemon.client()
    none = c.get("/v1/plans/current", params={"job": "job-1"})
    assert none.status_code == 404 and none.headers["etag"] == '"none"'
    # naming the answer it has, without waiting: not modified
    assert c.get("/v1/plans/current", params={"job": "job-1"},
                 headers={"If-None-Match": '"none"'}).status_code == 304

    held = _poll_in_thread(daemon.url, '"none"', wait_s=50)
    time.sleep(1.0)
    assert "status" not in held and "error" not in held       # still held: nothing changed
    published = c.post("/v1/plans", json=PLAN)
    assert published.status_code == 201, published.text
    answered_by = time.monotonic()
    held["thread"].join(40)
    assert held.get("status") == 200, held
    assert held["at"] - answered_by < 10      # at the publish, not at the end of its 50 s
    etag = held["etag"]
    assert etag == f'"{published.json()["digest"]}"' and '"algebraic"' in held["body"]

    # nothing published while it waits: a 304 once its wait_s has passed
    started = time.monotonic()
    r = c.get("/v1/plans/current", params={"job": "job-1", "wait_s": 1.0},
              headers={"If-None-Match": etag})
    assert r.status_code == 304 and time.monotonic() - started >= 0.9
    # a poll naming an older answer is answered at once
    assert c.get("/v1/plans/current", params={"job": "job-1", "wait_s": 50},
                 headers={"If-None-Match": '"none"'}).status_code == 200


def test_a_stopping_daemon_answers_the_polls_it_holds(daemon):
    """Held polls would keep the server's stop waiting for its grace period, then be cancelled
    (an error at the job); they are answered as the daemon begins to stop."""
    held = _poll_in_thread(daemon.url, '"none"', wait_s=50)
    time.sleep(1.5)
    assert "status" not in held and "error" not in held       # held
    assert daemon.terminate(60) == 0
    held["thread"].join(10)
    assert held.get("status") == 304, held
