"""A small HTTP client for the daemon's API (used by the CLI)."""
from __future__ import annotations

import urllib.parse
from pathlib import Path

import httpx

from .home import Home


class DaemonError(Exception):
    """The daemon answered with an error (message from its response) or could not be reached;
    ``status`` is the HTTP status it answered with, if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class DaemonUnreachable(DaemonError):
    """Nothing answered at the daemon's address (it is down, or restarting)."""


class DaemonClosing(DaemonError):
    """The daemon takes no new jobs: it is shutting down."""


def _segment(text: str) -> str:
    """``text`` as one URL path segment: a job id is never read as a path (``j-a/../j-b``)."""
    return urllib.parse.quote(text, safe="").replace(".", "%2E")


class DaemonClient:
    def __init__(self, url: str, token: str | None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.pid: int | None = None  # the daemon's process, once find() has asked it
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # trust_env=False: the daemon is local; HTTP(S)_PROXY set for the internet must not apply
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, trust_env=False)

    @classmethod
    def find(cls, home: Home) -> DaemonClient | None:
        """A client for the daemon serving ``home``, or None when none does. The daemon at the
        home's recorded URL must say it serves this home: a daemon killed without cleaning up
        leaves a URL whose port another home's daemon may have taken since."""
        url = home.daemon_url()
        if not url:
            return None
        client = cls(url, home.token())
        health = client.health()
        if health is None or health.get("home") != str(home.root.resolve()):
            return None
        client.pid = health.get("pid")
        return client

    def health(self) -> dict | None:
        """What ``/healthz`` says, or None when nothing answers it."""
        try:
            r = self.http.get("/healthz", timeout=2)
            health = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return health if isinstance(health, dict) else None   # (another server at a stale URL)

    def healthy(self) -> bool:
        return self.health() is not None

    def _call(self, method: str, path: str, **kw) -> dict:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise DaemonUnreachable(f"cannot reach the daemon at {self.url}: {e}") from None
        if r.status_code >= 400:
            raise _error(r)
        return r.json() if r.content else {}

    def submit(self, **spec) -> dict:
        _check_text(spec)
        try:
            return self._call("POST", "/v1/jobs", json=spec)
        except DaemonError as e:
            if e.status == 503:   # (the supervisor's SupervisorClosed)
                raise DaemonClosing(str(e), status=503) from None
            raise

    def jobs(self, limit: int = 100) -> list[dict]:
        return self._call("GET", "/v1/jobs", params={"limit": limit})["jobs"]

    def job(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/jobs/{_segment(job_id)}")

    def logs(self, job_id: str, after: int = 0, rank: int | None = None, wait_s: float = 0) -> dict:
        params = {"after": after, "wait_s": wait_s}
        if rank is not None:
            params["rank"] = rank
        return self._call("GET", f"/v1/jobs/{_segment(job_id)}/logs", params=params, timeout=wait_s + 30)

    def cancel(self, job_id: str) -> dict:
        return self._call("POST", f"/v1/jobs/{_segment(job_id)}/cancel")

    def signal(self, job_id: str, name: str = "SIGINT", stop: bool = False) -> dict:
        return self._call("POST", f"/v1/jobs/{_segment(job_id)}/signal", json={"signal": name, "stop": stop})

    def telemetry_stats(self) -> dict:
        return self._call("GET", "/v1/telemetry/stats")

    def prune(self, older_than: str, dry_run: bool = False) -> dict:
        return self._call("POST", "/v1/telemetry/prune", json={"older_than": older_than,
                                                               "dry_run": dry_run},
                          timeout=httpx.Timeout(660, connect=10))

    def export(self, format: str, job: str | None, path: Path) -> int:
        """Stream the export into ``path`` (written whole or not at all); returns its bytes."""
        params = {"format": format, **({"job": job} if job else {})}
        part = path.with_name(path.name + ".part")
        size = 0
        try:
            # a Parquet file is written whole before its first byte comes: minutes for a long job
            with self.http.stream("GET", "/v1/telemetry/export", params=params,
                                  timeout=httpx.Timeout(3600, connect=10)) as r:
                if r.status_code >= 400:
                    r.read()
                    raise _error(r)
                with part.open("wb") as f:
                    for chunk in r.iter_bytes():
                        f.write(chunk)
                        size += len(chunk)
            part.replace(path)
        except httpx.RemoteProtocolError:   # the answer was cut short: the export failed there
            raise DaemonError(f"the daemon at {self.url} stopped the export midway "
                              "(its log says why)") from None
        except httpx.HTTPError as e:
            raise DaemonError(f"the export from the daemon at {self.url} failed: {e}") from None
        finally:
            part.unlink(missing_ok=True)
        return size


def _check_text(spec: dict) -> None:
    """Raise :class:`DaemonError` naming the first string of ``spec`` that holds bytes that are not
    UTF-8 (Python keeps them as surrogate escapes): JSON, and the daemon, take text only."""
    for field, value in spec.items():
        if field == "base_env" and value:
            items = [(f"environment variable {k}", t) for k, v in value.items() for t in (k, v)]
        elif isinstance(value, dict):
            items = [(f"{field} variable {k}", t) for k, v in value.items() for t in (k, v)]
        elif isinstance(value, list):
            items = [(f"{field} argument {i}", t) for i, t in enumerate(value)]
        else:
            items = [("working folder" if field == "cwd" else field, value)]
        for where, text in items:
            if not isinstance(text, str):
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                shown = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                hint = ": unset it, or run with --direct" if field == "base_env" else " (run with --direct)"
                raise DaemonError(f"the {where} holds bytes that are not UTF-8 ('{shown}'); the daemon "
                                  f"takes text{hint}") from None


def _error(r: httpx.Response) -> DaemonError:
    """The daemon's answer ``r`` (4xx, 5xx) as an error saying its ``detail``."""
    try:
        detail = _readable(r.json().get("detail", r.text))
    except (ValueError, AttributeError):
        detail = r.text
    return DaemonError(f"{r.status_code}: {detail}", status=r.status_code)


def _readable(detail) -> str:
    """A validation error list (``[{"loc": [...], "msg": ...}]``) as ``field: message; ...``."""
    if isinstance(detail, list) and all(isinstance(d, dict) and "msg" in d for d in detail):
        return "; ".join(f"{'.'.join(str(x) for x in d.get('loc', ())[1:]) or 'request'}: {d['msg']}"
                         for d in detail)
    return str(detail)
