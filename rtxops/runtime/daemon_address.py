"""Where the job's daemon listens: the URL it was launched with, followed through the daemon's
URL file (``$RTXOPS_HOME/daemon.url``, named in ``RTXOPS_DAEMON_URL_FILE``).

A daemon that was killed and started again adopts its running jobs, but it may listen on another
port (``rtxops run`` starts its daemon on a free one). A job that kept the address it was launched
with would send its steps and poll for plans where no one answers: its telemetry lost, its plans
never delivered. Reading the file costs a ``stat`` per request; it is read again only when it
changed.
"""
from __future__ import annotations

import os
import threading


class DaemonAddress:
    """The daemon's base URL as of now (``current()``), for the job's exporter and plan poller."""

    def __init__(self, url: str, url_file: str | os.PathLike[str] | None = None) -> None:
        self._url = url.rstrip("/")
        self._file = os.fspath(url_file) if url_file else None
        self._seen: tuple[int, int] | None = None   # (mtime_ns, size) of the file last read
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, default: str) -> DaemonAddress:
        return cls(os.environ.get("RTXOPS_DAEMON") or default, os.environ.get("RTXOPS_DAEMON_URL_FILE"))

    def current(self) -> str:
        """The URL the daemon last announced; the one known before while the file is missing (a
        daemon that stopped removes it) or holds no URL."""
        if self._file is None:
            return self._url
        try:
            st = os.stat(self._file)
        except OSError:
            return self._url
        with self._lock:
            if (st.st_mtime_ns, st.st_size) != self._seen:
                try:
                    with open(self._file, encoding="utf-8") as f:
                        text = f.read().strip()
                except (OSError, UnicodeDecodeError):
                    return self._url
                self._seen = (st.st_mtime_ns, st.st_size)
                if text.startswith(("http://", "https://")) and not any(c.isspace() for c in text):
                    self._url = text.rstrip("/")
            return self._url
