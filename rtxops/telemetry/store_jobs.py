"""The supervisor's tables in the store: jobs, their log lines and events (so they survive daemon
restarts). Writes go through the store's writer thread; the daemon adapts these rows to its types."""
from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from .store import Store, execute_on


def save_job(store: Store, job_id: str, name: str, state: str, created_ns: int, updated_ns: int,
             record_json: str, timeout_s: float = 30.0) -> None:
    row = [job_id, name, state, created_ns, updated_ns, record_json]
    store.call(lambda cur: cur.execute(
        "INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?, ?)", row), timeout_s)


def append_logs(store: Store, job_id: str, attempt: int, rank: int, stream: str,
                lines: Sequence[tuple[int, int, str]], timeout_s: float = 30.0) -> None:
    """Append ``(ts_ns, seq, text)`` lines as one Arrow batch."""
    if not lines:
        return
    n = len(lines)
    table = pa.table({
        "job_id": [job_id] * n, "seq": [seq for _, seq, _ in lines], "ts_ns": [ts for ts, _, _ in lines],
        "attempt": [attempt] * n, "rank": [rank] * n, "stream": [stream] * n,
        "text": [text for _, _, text in lines],
    })

    store.call(lambda cur: execute_on(cur, "INSERT INTO job_logs SELECT * FROM _rtx_rows", table),
               timeout_s)


def append_event(store: Store, job_id: str, ts_ns: int, kind: str, detail_json: str,
                 timeout_s: float = 30.0) -> None:
    store.call(lambda cur: cur.execute(
        "INSERT INTO job_events VALUES (?, ?, ?, ?)", [job_id, ts_ns, kind, detail_json]), timeout_s)


MAX_PAGE_BYTES = 8 << 20   # text one read returns at most (and at least its first line)


def read_logs(store: Store, job_id: str, *, rank: int | None = None, after_seq: int = 0,
              limit: int = 1000, search: str | None = None) -> list[dict]:
    """Up to ``limit`` lines after ``after_seq``, fewer where their text passes
    :data:`MAX_PAGE_BYTES` (a line may be a mebibyte): the sizes are summed before any text is
    read out."""
    return store.query(
        """WITH page AS (
               SELECT seq, strlen(text) AS size FROM job_logs
               WHERE job_id = $job AND seq > $after AND ($rank IS NULL OR rank = $rank)
                 AND ($search IS NULL OR contains(text, $search))
               ORDER BY seq LIMIT $limit
           ), kept AS (
               SELECT seq FROM (SELECT seq, sum(size) OVER (ORDER BY seq) - size AS before FROM page)
               WHERE before < $bytes
           )
           SELECT job_id, seq, ts_ns, attempt, rank, stream, text FROM job_logs
           WHERE job_id = $job AND seq > $after AND seq IN (SELECT seq FROM kept) ORDER BY seq""",
        {"job": job_id, "after": after_seq, "rank": rank, "limit": limit, "search": search,
         "bytes": MAX_PAGE_BYTES})


def read_events(store: Store, job_id: str, *, offset: int = 0, limit: int | None = None) -> list[dict]:
    return store.query("SELECT job_id, ts_ns, kind, detail FROM job_events WHERE job_id = $job "
                       "ORDER BY ts_ns, rowid LIMIT $limit OFFSET $offset",
                       {"job": job_id, "limit": limit, "offset": offset})


def last_log_seq(store: Store, job_id: str) -> int:
    return store.query("SELECT coalesce(max(seq), 0) AS n FROM job_logs WHERE job_id = $job",
                       {"job": job_id})[0]["n"]


def saved_job_records(store: Store) -> list[str]:
    """The JSON record of every saved job, oldest first."""
    return [r["record"] for r in store.query("SELECT record FROM jobs ORDER BY created_ns")]
