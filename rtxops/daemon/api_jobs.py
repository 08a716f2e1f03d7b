"""``/v1/jobs``: submit, list, inspect, follow logs, signal, cancel."""
from __future__ import annotations

import signal
from typing import Literal

import anyio
from fastapi import APIRouter, Depends, HTTPException, Query
from pydantic import BaseModel, ConfigDict, Field

from .errors import JobNotFound, JobSpecError, SupervisorClosed
from .jobs import MAX_NAME, Job, JobSpec
from .supervisor import Supervisor

# log long-polls hold a worker thread each: they get at most this many of anyio's 40, so the
# other endpoints (health, submit, cancel, the dashboard) never wait behind them
MAX_LONG_POLLS = 16


class SubmitRequest(BaseModel):
    """A job to run under rtxops."""

    model_config = ConfigDict(extra="forbid")
    command: list[str] = Field(min_length=1, description="argv, e.g. ['python', 'train.py']")
    name: str = Field("", max_length=MAX_NAME)
    env: dict[str, str] = {}
    base_env: dict[str, str] | None = Field(
        None, description="the environment to start from instead of the daemon's (`rtxops run` "
                          "sends its caller's); `env` still goes on top")
    cwd: str | None = None
    restarts: int = Field(0, ge=0, le=1000, description="crash restart budget")
    hang_restarts: int = Field(0, ge=0, le=1000)
    hang_timeout_s: float | None = Field(None, gt=0, le=86400)
    first_step_timeout_s: float | None = Field(
        None, gt=0, le=86400, description="how long an attempt may take to its first step "
                                          "(default: hang_timeout_s)")
    backoff_s: float = Field(1.0, ge=0, le=3600)
    nproc_per_node: int = Field(1, ge=1, le=64)
    grace_s: float = Field(10.0, ge=0, le=3600)


class SignalRequest(BaseModel):
    """A signal for a job's processes."""

    model_config = ConfigDict(extra="forbid")
    signal: Literal["SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2"] = "SIGINT"
    stop: bool = Field(False, description="a request to stop (Ctrl-C at `rtxops run`): if the "
                                          "attempt then fails it is cancelled, not restarted")


def job_view(job: Job) -> dict:
    """A job as the API shows it: without the internal process-tracking token, and with the
    values of its environment hidden (reads need no token; a job's env may hold credentials)."""
    d = job.to_dict()
    d.pop("token", None)
    spec = d.get("spec")
    if isinstance(spec, dict):
        if spec.get("env"):
            spec["env"] = {k: "***" for k in spec["env"]}
        if spec.get("base_env") is not None:   # not even the names of a shell's variables
            spec["base_env"] = f"{len(spec['base_env'])} variables of the submitting shell"
    d["name"] = job.name
    d["exit_code"] = job.exit_code
    return d


def make_router(supervisor: Supervisor, auth) -> APIRouter:
    router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

    def get(job_id: str) -> Job:
        try:
            return supervisor.job(job_id)
        except JobNotFound:
            raise HTTPException(404, f"no job {job_id!r}") from None

    @router.post("", status_code=201, dependencies=[Depends(auth)])
    def submit(req: SubmitRequest) -> dict:
        try:
            spec = JobSpec(command=req.command, name=req.name, env=req.env, cwd=req.cwd,
                           max_crash_restarts=req.restarts, max_hang_restarts=req.hang_restarts,
                           hang_timeout_s=req.hang_timeout_s,
                           first_step_timeout_s=req.first_step_timeout_s, backoff_s=req.backoff_s,
                           nproc_per_node=req.nproc_per_node, grace_s=req.grace_s,
                           base_env=req.base_env)
            return job_view(supervisor.submit(spec))
        except JobSpecError as e:
            raise HTTPException(422, str(e)) from None
        except SupervisorClosed as e:
            raise HTTPException(503, str(e)) from None

    @router.get("")
    def jobs(limit: int = Query(100, ge=1, le=1000), offset: int = Query(0, ge=0, le=10**9)) -> dict:
        total, page = supervisor.page(offset, limit)
        return {"total": total, "jobs": [job_view(j) for j in page]}

    @router.get("/{job_id}")
    def job(job_id: str) -> dict:
        return job_view(get(job_id))

    long_polls: list[anyio.CapacityLimiter] = []
    polling = [0]   # long-polls waiting now (counted on the event loop: no await between check and count)

    @router.get("/{job_id}/logs")
    async def logs(job_id: str, after: int = Query(0, ge=0, le=2**62), rank: int | None = Query(None, ge=-1),
                   limit: int = Query(1000, ge=1, le=10000),
                   wait_s: float = Query(0, ge=0, le=30, description="long-poll for new lines")) -> dict:
        before = get(job_id)
        # "done" is the state from before the lines were read: a job that ended meanwhile may
        # have stored its last lines after the read, and a follower stops at done with no lines
        ended = before.state.terminal
        ranks = before.spec.nproc_per_node
        if rank is not None and rank >= ranks:  # -1: the launcher's own lines (torchrun)
            raise HTTPException(404, f"job {job_id!r} has no rank {rank}: it runs "
                                     + ("rank 0" if ranks == 1 else f"ranks 0-{ranks - 1}"))
        if not long_polls:  # made on the event loop (anyio's limiters need one)
            long_polls.append(anyio.CapacityLimiter(MAX_LONG_POLLS))
        if wait_s and polling[0] < MAX_LONG_POLLS:
            # (the limiter's own count is taken only after a checkpoint: polls arriving together
            # all saw a free slot, and those past it queued for a slot instead of answering)
            polling[0] += 1
            try:
                lines = await anyio.to_thread.run_sync(
                    lambda: supervisor.wait_for_logs(job_id, after_seq=after, rank=rank,
                                                     timeout=wait_s, limit=limit), limiter=long_polls[0])
            finally:
                polling[0] -= 1
        else:  # no wait asked, or every long-poll slot taken: answer now, off the event loop
            lines = await anyio.to_thread.run_sync(
                lambda: supervisor.logs(job_id, rank=rank, after_seq=after, limit=limit))
            if wait_s and not lines and not get(job_id).state.terminal:
                # a follower past the long-poll slots polls again at once on an empty answer:
                # pace it, or a few of them spin on the store
                await anyio.sleep(min(wait_s, 1.0))
        state = before.state if ended else get(job_id).state
        return {"job": job_id, "state": state.value, "done": ended,
                "lines": [line._asdict() for line in lines]}

    @router.get("/{job_id}/events")
    def events(job_id: str, offset: int = Query(0, ge=0, le=2**62),
               limit: int = Query(1000, ge=1, le=10000)) -> dict:
        """The job's events, oldest first, ``limit`` of them from ``offset`` (a job's hang
        restarts each store the stacks of every rank: all of them at once could be gigabytes)."""
        get(job_id)
        events = supervisor.events(job_id, offset=offset, limit=limit)
        return {"job": job_id, "events": [e._asdict() for e in events],
                "next_offset": offset + len(events) if len(events) == limit else None}

    @router.post("/{job_id}/cancel", dependencies=[Depends(auth)])
    def cancel(job_id: str) -> dict:
        get(job_id)
        return job_view(supervisor.cancel(job_id))

    @router.post("/{job_id}/signal", dependencies=[Depends(auth)])
    def send_signal(job_id: str, req: SignalRequest) -> dict:
        """Send a signal to the job's processes (``rtxops run`` forwards Ctrl-C so); the job
        stays supervised and exits as it chooses."""
        get(job_id)
        return {"job": job_id, "signal": req.signal,
                "pids": supervisor.signal(job_id, getattr(signal, req.signal), stop=req.stop)}

    return router
