"""The daemon's home directory: ``$RTXOPS_HOME`` (default ``./.rtxops``) with the store, the token,
the PID file, plans and job work files."""
from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("rtxops.daemon")
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765


@dataclass(frozen=True)
class Home:
    root: Path

    @classmethod
    def resolve(cls, root: str | os.PathLike[str] | None = None) -> Home:
        return cls(Path(root or os.environ.get("RTXOPS_HOME") or ".rtxops").resolve())

    @property
    def store(self) -> Path:
        return self.root / "rtxops.duckdb"

    @property
    def token_file(self) -> Path:
        return self.root / "token"

    @property
    def pid_file(self) -> Path:
        return self.root / "daemon.pid"

    @property
    def url_file(self) -> Path:
        return self.root / "daemon.url"

    @property
    def plans(self) -> Path:
        return self.root / "plans"

    @property
    def jobs(self) -> Path:
        return self.root / "jobs"

    def ensure(self) -> Home:
        """Create the home's folders. The home is private to its user (0700; one made open by
        another command or by hand is closed): its store holds the jobs' environments and
        output, and DuckDB writes the store's log there with the umask's mode."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        _make_private(self.root)
        for d in (self.root, self.plans, self.jobs):
            d.mkdir(parents=True, exist_ok=True)
        return self

    def token(self, create: bool = False) -> str | None:
        """The bearer token; with ``create`` a new one (mode 0600) when there is none, or when the
        file is empty (an empty token would check nothing)."""
        if self.token_file.exists():
            token = self.token_file.read_text().strip()
            if token or not create:
                return token or None
        elif not create:
            return None
        self.ensure()
        token = secrets.token_urlsafe(32)
        tmp = self.token_file.with_name(self.token_file.name + f".{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token + "\n")
            try:   # only where there is none: two daemons starting at once keep one token
                os.link(tmp, self.token_file)
            except FileExistsError:
                existing = self.token_file.read_text().strip()
                if existing:
                    return existing
                tmp.replace(self.token_file)   # an empty one would check nothing
        except OSError as e:   # a full disk: say which file, and leave no half-written one
            raise OSError(e.errno, f"cannot write the daemon's token: {e.strerror or e}",
                          str(self.token_file)) from None
        finally:
            tmp.unlink(missing_ok=True)
        return token

    def daemon_url(self) -> str | None:
        """The URL a running daemon wrote at start-up, if any."""
        try:
            return self.url_file.read_text().strip() or None
        except OSError:
            return None


def _make_private(folder: Path) -> None:
    """``chmod 700`` a folder of ours that others may enter (its files' modes do not protect
    the ones DuckDB makes)."""
    try:
        st = folder.stat()
        if st.st_mode & 0o077 and st.st_uid == os.getuid():
            os.chmod(folder, (st.st_mode & 0o7000) | 0o700)   # (setgid, sticky kept)
            log.warning("rtxops: made %s private (mode %o was %o): the store there holds the "
                        "jobs' environments", folder, (st.st_mode & 0o7000) | 0o700,
                        st.st_mode & 0o7777)
    except OSError:
        pass
