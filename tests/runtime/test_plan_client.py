"""The plan poller against a real local HTTP server: a bundle that cannot be fetched this time
(404 while it is staged, a 5xx, a dropped connection) is retried on the next poll, neither
reported as refused nor remembered by ETag; a definite refusal is remembered."""
from __future__ import annotations

import base64
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from rtxops.runtime.daemon_address import DaemonAddress
from rtxops.runtime.dispatcher import Dispatcher
from rtxops.runtime.errors import PlanError
from rtxops.runtime.plan_client import PlanPoller

from .helpers import plan_for


class Endpoint:
    def __init__(self, plan_json: bytes) -> None:
        self.plan_json = plan_json
        self.bundle_answers: list[int | str] = []  # HTTP codes or "drop", served in turn; then 200
        self.reports: list[dict] = []
        self.lock = threading.Lock()
        self.oversize: tuple[str, bool] | None = None   # (endpoint, send a Content-Length)
        self.token: str | None = None                   # wanted on every request when set
        self.streamed = 0                               # bytes of an oversize answer sent
        self.polls: list[tuple[str, str | None]] = []   # (path, If-None-Match) of each plan poll
        self.long_polls = False     # hold a poll naming the current answer for its wait_s
        self.release = threading.Event()                # ends the polls held now

    def _stream_oversize(self, handler, prefix: bytes, length_sent: bool) -> None:
        """An endless answer: sends until the client stops reading (its socket closed)."""
        handler.send_response(200)
        handler.send_header("ETag", '"v7"')
        if length_sent:
            handler.send_header("Content-Length", str(1 << 40))
        handler.end_headers()
        try:
            handler.wfile.write(prefix)
            while self.streamed < 64 << 20:
                handler.wfile.write(b"a" * 65536)
                self.streamed += 65536
        except OSError:
            pass

    def serve(self) -> ThreadingHTTPServer:
        ep = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, body=b"", headers=None):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                etag = '"v7"'
                if ep.token and self.headers.get("Authorization") != f"Bearer {ep.token}":
                    return self._send(401, b"{}")
                if ep.oversize and self.path.startswith(f"/v1/plans/{ep.oversize[0]}"):
                    return ep._stream_oversize(self, b'{"files": {"plan.json": "', ep.oversize[1])
                if self.path.startswith("/v1/plans/current"):
                    seen = self.headers.get("If-None-Match")
                    ep.polls.append((self.path, seen))
                    wait = parse_qs(urlsplit(self.path).query).get("wait_s")
                    if seen == etag and wait and ep.long_polls:
                        ep.release.wait(float(wait[0]))
                    if seen == etag:
                        return self._send(304)
                    return self._send(200, ep.plan_json, {"ETag": etag})
                if self.path.startswith("/v1/plans/bundle"):
                    with ep.lock:
                        answer = ep.bundle_answers.pop(0) if ep.bundle_answers else 200
                    if answer == "drop":
                        self.close_connection = True
                        self.wfile.flush()
                        self.connection.shutdown(2)
                        return
                    if answer != 200:
                        return self._send(answer, b"{}")
                    files = {"plan.json": base64.b64encode(ep.plan_json).decode()}
                    return self._send(200, json.dumps({"files": files}).encode())
                self._send(404)

            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                ep.reports.append(json.loads(self.rfile.read(n)))
                self._send(200, b"{}")

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.handle_error = lambda request, address: None   # a poll the client cut short
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


@pytest.fixture
def endpoint():
    ep = Endpoint(plan_for(7).to_json().encode())
    server = ep.serve()
    ep.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield ep
    server.shutdown()


def accept(files, running):
    return files["plan.json"]


def test_transient_bundle_failures_are_retried_not_refused(endpoint):
    endpoint.bundle_answers = [404, 503, "drop"]
    poller = PlanPoller(Dispatcher(), endpoint.url, "job-1", None, verifier=accept)
    assert [poller.poll_once() for _ in range(3)] == ["retry", "retry", "retry"]
    assert poller.etag is None and poller.refused == [] and endpoint.reports == []
    assert poller.poll_once() == "installed"
    assert poller.installed == [7] and poller.etag == '"v7"'
    assert poller.poll_once() == "unchanged"


def test_daemon_away_on_the_bundle_fetch_is_retried(endpoint):
    poller = PlanPoller(Dispatcher(), endpoint.url, "job-1", None, verifier=accept)
    real = poller._verified

    def away(plan):  # the daemon goes away between /current and /bundle
        poller.address, address = DaemonAddress("http://127.0.0.1:9"), poller.address
        try:
            return real(plan)
        finally:
            poller.address = address

    poller._verified = away
    assert poller.poll_once() == "retry"
    assert poller.etag is None and poller.refused == []
    poller._verified = real
    assert poller.poll_once() == "installed"


def test_a_definite_refusal_is_reported_once_and_remembered(endpoint):
    def refuse(files, running):
        raise PlanError("signature does not verify")

    poller = PlanPoller(Dispatcher(), endpoint.url, "job-1", None, verifier=refuse)
    assert poller.poll_once() == "refused"
    assert poller.etag == '"v7"' and len(endpoint.reports) == 1
    assert poller.poll_once() == "unchanged" and len(endpoint.reports) == 1


def test_a_forbidden_bundle_is_a_refusal(endpoint):
    endpoint.bundle_answers = [403]
    poller = PlanPoller(Dispatcher(), endpoint.url, "job-1", None, verifier=accept)
    assert poller.poll_once() == "refused"
    assert "HTTP 403" in poller.refused[0][1]


def test_a_plan_met_while_the_job_exits_gets_no_verdict(endpoint, monkeypatch):
    def shutting_down(files, running):    # what the verifier's thread pool raises at exit
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    ended = threading.Thread(target=lambda: None)
    ended.start()
    ended.join()
    monkeypatch.setattr(threading, "main_thread", lambda: ended)   # as during interpreter exit
    poller = PlanPoller(Dispatcher(), endpoint.url, "job-1", None, verifier=shutting_down)
    assert poller.poll_once() == "retry"
    assert poller.refused == [] and endpoint.reports == [] and poller.etag is None
    monkeypatch.undo()
    assert poller.poll_once() == "refused"       # the same failure in a running job is one


def test_a_jobs_proxy_settings_do_not_reach_the_daemon(endpoint, monkeypatch):
    """A job often has HTTP(S)_PROXY set to reach the internet: the plan polls to the local
    daemon went to the proxy instead (and never arrived)."""
    import urllib.request

    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")      # nothing listens there
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(urllib.request, "_opener", None)    # urlopen's opener reads them anew

    def refuse(files, running):
        raise PlanError("refused in a test")

    poller = PlanPoller(Dispatcher(), endpoint.url, "job-1", None, verifier=refuse)
    assert poller.poll_once() == "refused"
    assert [r["reason"] for r in endpoint.reports] == ["refused in a test"]


def test_a_plan_published_between_the_poll_and_the_bundle_fetch_is_no_refusal(endpoint):
    """The daemon published v8 after serving v7 as current and before the job fetched the
    bundle: v7 was refused and reported (which ends that plan's tuning in the evolve loop)."""
    newer = plan_for(8).to_json()
    poller = PlanPoller(Dispatcher(), endpoint.url, "job-1", None,
                        verifier=lambda files, running: newer.encode())
    assert poller.poll_once() == "retry"
    assert poller.refused == [] and endpoint.reports == [] and poller.etag is None


def test_a_served_plan_of_the_running_version_with_other_entries_is_refused_not_skipped(endpoint):
    """The poller took "same version" for "same plan": a job started with its own version 7 that
    was served another version 7 kept its own silently, with no refusal reported."""
    own = plan_for(7, ("gelu", "float32/cpu/tanh=0,hidden=64,rows=16", "algebraic"))
    d = Dispatcher()
    d.plan = own
    poller = PlanPoller(d, endpoint.url, "job-1", None, verifier=accept)
    assert poller.poll_once() == "refused"
    assert len(endpoint.reports) == 1 and "differs from the running plan" in str(endpoint.reports[0])
    assert d.plan is own


def test_the_served_plan_the_job_runs_is_unchanged(endpoint):
    d = Dispatcher()
    d.plan = plan_for(7)
    poller = PlanPoller(d, endpoint.url, "job-1", None, verifier=accept)
    assert poller.poll_once() == "unchanged" and endpoint.reports == []


@pytest.mark.parametrize("where", ["current", "bundle"])
@pytest.mark.parametrize("length_sent", [True, False])
def test_an_answer_over_the_limit_is_refused_unread(endpoint, monkeypatch, where, length_sent):
    """Whatever answers on the daemon's port (another process once the daemon is gone) could send
    gigabytes: the job read the answer whole before any check. With or without a Content-Length,
    it reads no further than the limit, and refuses the plan."""
    from rtxops.runtime import plan_client

    monkeypatch.setattr(plan_client, "MAX_PLAN_BYTES" if where == "current" else
                        "MAX_BUNDLE_RESPONSE_BYTES", 4096)
    endpoint.oversize = (where, length_sent)
    poller = PlanPoller(Dispatcher(), endpoint.url, "job-1", None, verifier=accept)
    assert poller.poll_once() == "refused"
    assert "MiB: not read" in poller.refused[0][1] and poller.installed == []
    assert endpoint.streamed < 16 << 20   # it stopped reading (what the sockets buffer aside)


def test_the_job_sends_its_token_on_its_plan_reads_too(endpoint):
    """A daemon bound to a non-loopback address wants the token on reads: the job sent it only
    with its refusal reports, and never got a plan."""
    endpoint.token = "t0k"
    poller = PlanPoller(Dispatcher(), endpoint.url, "job-1", "t0k", verifier=accept)
    assert poller.poll_once() == "installed" and poller.installed == [7]


def test_a_poll_names_the_answer_it_has_and_waits_for_a_change_only_then(endpoint):
    endpoint.long_polls = True
    d = Dispatcher()
    poller = PlanPoller(d, endpoint.url, "job-1", None, verifier=accept, wait_s=0.3)
    assert poller.poll_once() == "installed"
    started = time.monotonic()
    assert poller.poll_once() == "unchanged"
    assert time.monotonic() - started >= 0.25          # held at the endpoint for its wait_s
    (first, none), (second, seen) = endpoint.polls
    assert none is None and "wait_s" not in first       # nothing to name: no long poll
    assert seen == '"v7"' and "wait_s=0.3" in second


def test_stopping_the_poller_ends_the_poll_it_has_in_flight(endpoint):
    """At the job's exit the poller is stopped and joined: a long poll held 30 s at the daemon
    would hold the exit for the join's 5 s."""
    endpoint.long_polls = True
    d = Dispatcher()
    poller = PlanPoller(d, endpoint.url, "job-1", None, verifier=accept, interval_s=0.05)
    poller.start()
    try:
        deadline = time.monotonic() + 10
        while not (poller.installed and len(endpoint.polls) >= 2) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert poller.installed == [7] and len(endpoint.polls) == 2    # the second one is held
        time.sleep(0.2)
        started = time.monotonic()
        poller.stop(join_s=5.0)
        assert not poller._thread.is_alive() and time.monotonic() - started < 2
    finally:
        endpoint.release.set()


def test_polls_a_daemon_answers_at_once_go_out_no_more_often_than_the_interval(endpoint):
    """An older daemon does not hold a poll: the job must not ask it in a loop."""
    poller = PlanPoller(Dispatcher(), endpoint.url, "job-1", None, verifier=accept, interval_s=0.25)
    poller.start()
    time.sleep(1.2)
    poller.stop(join_s=5.0)
    assert 3 <= len(endpoint.polls) <= 7 and poller.installed == [7]
