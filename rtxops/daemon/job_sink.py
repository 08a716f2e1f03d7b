"""The supervisor's :class:`~rtxops.daemon.jobs.JobSink` on the DuckDB store."""
from __future__ import annotations

import json
from collections.abc import Sequence

from rtxops.telemetry import store_jobs
from rtxops.telemetry.store import Store

from .jobs import Job, JobEvent, LogLine


class DuckDBJobSink:
    def __init__(self, store: Store) -> None:
        self.store = store

    def job_saved(self, job: Job) -> None:
        store_jobs.save_job(self.store, job.id, job.name, job.state.value, job.created_at_ns,
                            job.updated_at_ns, json.dumps(job.to_dict()))

    def log_lines(self, job_id: str, attempt: int, rank: int, stream: str,
                  lines: Sequence[tuple[int, int, str]]) -> None:
        store_jobs.append_logs(self.store, job_id, attempt, rank, stream, lines)

    def event(self, job_id: str, ts_ns: int, kind: str, detail_json: str) -> None:
        store_jobs.append_event(self.store, job_id, ts_ns, kind, detail_json)

    def read_logs(self, job_id: str, *, rank: int | None = None, after_seq: int = 0,
                  limit: int = 1000) -> list[LogLine]:
        return [LogLine(**r) for r in store_jobs.read_logs(self.store, job_id, rank=rank,
                                                           after_seq=after_seq, limit=limit)]

    def read_events(self, job_id: str, *, offset: int = 0, limit: int | None = None) -> list[JobEvent]:
        return [JobEvent(**r) for r in store_jobs.read_events(self.store, job_id, offset=offset,
                                                               limit=limit)]

    def last_log_seq(self, job_id: str) -> int:
        return store_jobs.last_log_seq(self.store, job_id)

    def last_step(self, job_id: str) -> int | None:
        """The job's last step in the telemetry, once every batch received before this call is
        committed (it runs on the store's writer, after them)."""
        return self.store.call(lambda cur: cur.execute(
            "SELECT max(step) FROM step_times WHERE job_id = ?", [job_id]).fetchone()[0], 10.0)

    def saved_jobs(self) -> list[Job]:
        return [Job.from_dict(json.loads(r)) for r in store_jobs.saved_job_records(self.store)]
