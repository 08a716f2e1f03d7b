"""The job's side of the plan endpoint: a background thread that polls for a newer plan, fetches
its signed bundle, has it verified, queues it in the dispatcher (which swaps it in at a step
boundary) and reports refusals back.

A poll is a long poll: it names the answer it has (``If-None-Match``) and the daemon holds it up
to :data:`LONG_POLL_S` until that changes, so a published plan reaches the job at once (every
rank of a job at the same moment) and an unchanged one costs a request a half minute, not one
every 2 s on both sides. Polls that come back sooner (a daemon that does not wait: an older one,
or one stopping) go out no more often than ``interval_s``.

The runtime knows nothing of signatures: the bootstrap injects ``verifier``, a callable
``(bundle files, running version) -> plan.json bytes`` that raises with the reason a bundle is
refused. Without a verifier every plan is refused (fail closed).

Plain HTTP with the standard library: the runtime depends on no web framework.
"""
from __future__ import annotations

import atexit
import base64
import contextlib
import http.client
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable

from .daemon_address import DaemonAddress
from .dispatcher import Dispatcher
from .errors import PlanError
from .plan import Plan

PlanVerifier = Callable[[dict[str, bytes], int], bytes]
log = logging.getLogger("rtxops.runtime")


MISSING_BUNDLE_POLLS = 5  # a plan served with no bundle this many polls in a row has none
LONG_POLL_S = 30.0        # how long the daemon may hold a poll whose answer has not changed
# what the job reads of an answer, at most: a plan's JSON (the verifier's own limit), and a
# bundle's files (128 MiB in all, the verifier's limit) base64-encoded in JSON
MAX_PLAN_BYTES = 16 << 20
MAX_BUNDLE_RESPONSE_BYTES = 176 << 20

# the daemon is on this machine: a job's HTTP(S)_PROXY (set to reach the internet) must not
# route the plan requests away from it
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class _Retry(Exception):
    """The signed bundle could not be fetched this time (network, timeout, not staged yet)."""

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = int(missing)  # the daemon said there is no bundle (vs. could not answer)


class PlanPoller:
    def __init__(self, dispatcher: Dispatcher, daemon: str | DaemonAddress, job_id: str,
                 token: str | None, interval_s: float = 2.0,
                 verifier: PlanVerifier | None = None, wait_s: float = LONG_POLL_S) -> None:
        self.dispatcher, self.job_id, self.token = dispatcher, job_id, token
        self.verifier = verifier
        self.address = daemon if isinstance(daemon, DaemonAddress) else DaemonAddress(daemon)
        self.interval_s = interval_s
        self.wait_s = wait_s
        self.etag: str | None = None
        self._none_etag: str | None = None   # the "no plan" answer's ETag, while that is the answer
        self._conn: http.client.HTTPConnection | None = None   # the poll in flight (stop ends it)
        self._conn_lock = threading.Lock()
        self.installed: list[int] = []
        self.refused: list[tuple[int, str]] = []
        self._missing: dict[str | None, int] = {}  # ETag → polls that found no bundle
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rtxops-plans", daemon=True)

    def start(self) -> PlanPoller:
        self._thread.start()
        # at exit, let a warm-up import or a poll in flight finish first: a thread still
        # importing C extensions while the interpreter finalizes can abort the process
        atexit.register(self.stop, join_s=5.0)
        return self

    def stop(self, join_s: float = 0.0) -> None:
        self._stop.set()
        with self._conn_lock:   # a long poll in flight ends now, not when the daemon answers
            conn = self._conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        if join_s and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(join_s)

    @property
    def base(self) -> str:
        """The daemon's URL now (it follows a daemon restarted on another port)."""
        return self.address.current()

    def _run(self) -> None:
        warm = getattr(self.verifier, "warm", None)
        while True:
            started = time.monotonic()
            try:
                self.poll_once()
            except Exception as e:  # the daemon may be away for a while; the job goes on
                log.debug("rtxops: plan poll failed: %s", e)
            # load the verifier's code ahead of the next plan, once the job's first steps ran
            # (so they do not share the CPU with it)
            if warm is not None and self.dispatcher.step - self.dispatcher.steps_before >= 2:
                try:
                    warm()
                except Exception as e:
                    log.warning("rtxops: plan verifier warm-up failed: %s", e)
                warm = None
            # a long poll has waited at the daemon; an answer that came sooner waits here
            if self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started))):
                return

    def poll_once(self) -> str:
        """One poll: ``"unchanged"``, ``"none"``, ``"installed"``, ``"refused"`` or ``"retry"``
        (the bundle could not be fetched; the ETag is kept unrecorded so the next poll tries the
        same version again). The ETag is recorded only once a version is installed or refused.
        A plan still served without any bundle after MISSING_BUNDLE_POLLS polls is refused."""
        status, body, etag = self._current()
        if status == 304:
            return "unchanged"
        if status == 404:
            self._none_etag = etag
            return "none"
        self._none_etag = None
        try:
            if body is None:
                raise PlanError(f"the served plan is over {MAX_PLAN_BYTES >> 20} MiB: not read")
            plan = Plan.from_json(body)
            running = self.dispatcher.plan.version
            if plan.version == running and self.dispatcher.pending is None:
                if plan.digest != self.dispatcher.plan.digest:
                    raise PlanError(f"plan version {plan.version} differs from the running plan of "
                                    f"that version (one given to the job, say); keeping it: "
                                    "publish a newer version")
                self.etag = etag
                return "unchanged"
            if plan.version < running:
                raise PlanError(f"plan version {plan.version} is not newer than the running version "
                                f"{running} (an older plan replayed); keeping version {running}")
            try:
                plan = self._verified(plan)
            except _Retry as e:  # no verdict this time, unless the bundle stays missing
                self._missing[etag] = self._missing.get(etag, 0) + e.missing
                if self._missing[etag] < MISSING_BUNDLE_POLLS:
                    log.info("rtxops: %s; will retry", e)
                    return "retry"
                raise PlanError(f"{e}; still none after {MISSING_BUNDLE_POLLS} polls") from None
            problem = plan.environment_mismatch()
            if problem:
                raise PlanError(problem)
            self.dispatcher.install_plan(plan)
        except Exception as e:  # a refused plan, whatever the reason: the job keeps its plan
            if not threading.main_thread().is_alive():
                # the job is exiting: what failed may be the interpreter shutting down (its
                # thread pools take no more work), not the plan; no verdict
                log.debug("rtxops: plan not checked, the job is exiting: %s", e)
                return "retry"
            version = _version_of(body)
            reason = str(e) if isinstance(e, PlanError) else f"{type(e).__name__}: {e}"
            if not isinstance(e, PlanError) or reason not in self.dispatcher.plan_rejections:
                self.dispatcher.plan_rejections.append(reason)
            self.refused.append((version, reason))
            self.etag = etag  # a definite verdict: this version is not offered again
            self._report(version, reason)
            return "refused"
        self.etag = etag
        self.installed.append(plan.version)
        return "installed"

    def _current(self) -> tuple[int, bytes | None, str | None]:
        """GET the current plan: (status, body of a 200 or None past MAX_PLAN_BYTES, ETag).
        A long poll where the job has an answer to name; plain HTTP, no proxy (the daemon is
        local), on a connection :meth:`stop` can end."""
        seen = self.etag or self._none_etag
        wait_s = self.wait_s if seen else 0.0
        query = {"job": self.job_id, **({"wait_s": f"{wait_s:g}"} if wait_s else {})}
        url = urllib.parse.urlsplit(self.base)
        cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        conn = cls(url.hostname, url.port, timeout=wait_s + 5)
        try:
            conn.connect()
            with self._conn_lock:
                if self._stop.is_set():
                    raise ConnectionAbortedError("the plan poller is stopping")
                self._conn = conn
            conn.request("GET", f"{url.path.rstrip('/')}/v1/plans/current?{urllib.parse.urlencode(query)}",
                         headers={**self._auth(), **({"If-None-Match": seen} if seen else {})})
            resp = conn.getresponse()
            etag = resp.headers.get("ETag")
            if resp.status == 200:
                return 200, _read_at_most(resp, MAX_PLAN_BYTES), etag
            if resp.status in (304, 404):
                return resp.status, None, etag
            raise http.client.HTTPException(f"the daemon answered the plan poll with HTTP {resp.status}")
        finally:
            with self._conn_lock:
                self._conn = None
            conn.close()

    def _verified(self, served: Plan) -> Plan:
        """The plan inside the served plan's signed bundle, once the verifier accepts it."""
        if self.verifier is None:
            raise PlanError(f"plan version {served.version} refused: this job has no plan verifier")
        query = urllib.parse.urlencode({"job": self.job_id})
        try:
            bundle = urllib.request.Request(f"{self.base}/v1/plans/bundle?{query}", headers=self._auth())
            with _DIRECT.open(bundle, timeout=10) as resp:
                raw = _read_at_most(resp, MAX_BUNDLE_RESPONSE_BYTES)
        except urllib.error.HTTPError as e:
            if e.code == 404 or e.code >= 500:  # not staged yet, or the daemon's trouble: retry
                raise _Retry(f"plan version {served.version}: no signed bundle yet "
                             f"(HTTP {e.code})", missing=e.code == 404) from None
            raise PlanError(f"plan version {served.version} refused: no signed bundle "
                            f"(HTTP {e.code})") from None
        except (OSError, http.client.HTTPException) as e:  # URLError, timeout, reset, cut short
            raise _Retry(f"plan version {served.version}: could not fetch its signed bundle "
                         f"({type(e).__name__}: {e})") from None
        if raw is None:
            raise PlanError(f"plan version {served.version} refused: its bundle is over "
                            f"{MAX_BUNDLE_RESPONSE_BYTES >> 20} MiB: not read")
        data = json.loads(raw)
        files = {name: base64.b64decode(text) for name, text in data.get("files", {}).items()}
        plan = Plan.from_json(self.verifier(files, self.dispatcher.plan.version))
        if plan.version > served.version:
            # the daemon published a newer plan between this poll's two requests: no verdict on
            # the served one (a refusal would end that plan's tuning); the next poll gets both
            raise _Retry(f"plan version {served.version}: the daemon now serves version "
                         f"{plan.version}")
        if plan.digest != served.digest:
            raise PlanError(f"plan version {served.version} refused: the signed bundle holds "
                            f"version {plan.version} with another digest")
        return plan

    def _auth(self) -> dict[str, str]:
        """The token on every request (a daemon bound to a non-loopback address wants it on
        reads too)."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _report(self, version: int, reason: str) -> None:
        data = json.dumps({"job": self.job_id, "version": version, "reason": reason}).encode()
        req = urllib.request.Request(f"{self.base}/v1/plans/report", data=data, method="POST",
                                     headers={"Content-Type": "application/json", **self._auth()})
        try:
            _DIRECT.open(req, timeout=5).close()
        except OSError as e:
            log.warning("rtxops: could not report refused plan %s: %s", version, e)


def _read_at_most(resp, limit: int) -> bytes | None:
    """The answer's body, or None when it is longer than ``limit`` (read no further than that)."""
    length = resp.headers.get("Content-Length")
    if length is not None and length.isdigit() and int(length) > limit:
        return None
    data = resp.read(limit + 1)
    return None if len(data) > limit else data


def _version_of(body: bytes | None) -> int:
    if body is None:
        return -1
    try:
        v = json.loads(body).get("version", -1)
        return v if isinstance(v, int) else -1
    except (ValueError, AttributeError, RecursionError):   # ([[[[… nests past the parser)
        return -1
