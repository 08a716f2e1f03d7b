"""Errors raised by the daemon package."""
from __future__ import annotations


class DaemonError(Exception):
    """Base class of every error the daemon raises on purpose."""


class JobNotFound(DaemonError, LookupError):
    """No job has this id (the API maps it to 404)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job with id {job_id!r}; `rtxops jobs` lists the known ones")
        self.job_id = job_id


class JobSpecError(DaemonError, ValueError):
    """A job specification is invalid; the message names the field."""


class SupervisorClosed(DaemonError, RuntimeError):
    """The supervisor is shutting down and accepts no new jobs."""
