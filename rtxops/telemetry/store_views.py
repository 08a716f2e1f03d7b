"""Read-only queries behind the dashboard: jobs, step-time series, swaps, kernels, evolve tables,
memory, caches, the governance ledger and windowed exports.

Every function takes ``q``, a :class:`~.store.Store` or :class:`~.store.ReadOnlyStore`, and runs
parameterized SQL only (user input never becomes SQL text). Tables that a later schema version
adds (the governance ledger) may be missing: callers check :func:`table_exists` and show nothing.
Windows are ``[since_ns, until_ns)`` in Unix nanoseconds.
"""
from __future__ import annotations

from typing import Any

from .store import MINUTE_NS

Row = dict[str, Any]


# ---- schema facts ------------------------------------------------------------------------------

def table_exists(q, name: str) -> bool:
    """Whether a table or view named ``name`` exists in the main schema."""
    return bool(q.query(
        "SELECT count(*) AS n FROM information_schema.tables WHERE table_name = $name",
        {"name": name})[0]["n"])


def table_columns(q, name: str) -> list[str]:
    """Column names of ``name`` in table order (empty when it does not exist)."""
    return [r["column_name"] for r in q.query(
        "SELECT column_name FROM information_schema.columns WHERE table_name = $name "
        "ORDER BY ordinal_position", {"name": name})]


# ---- jobs --------------------------------------------------------------------------------------

def jobs(q, *, state: str | None, search: str | None, limit: int, offset: int) -> tuple[int, list[Row]]:
    """Supervised jobs, newest first, plus the job ids only telemetry knows (``state`` NULL):
    ``(total, rows)`` with id, name, state, times and the supervisor's JSON record."""
    params = {"state": state, "search": search, "limit": limit, "offset": offset}
    base = """
        WITH known AS (
            SELECT job_id, name, state, created_ns, updated_ns, record FROM jobs
            UNION ALL
            SELECT job_id, job_id AS name, NULL AS state, min(first_seen_ns) AS created_ns,
                   min(first_seen_ns) AS updated_ns, NULL AS record
            FROM resources WHERE job_id IS NOT NULL AND job_id NOT IN (SELECT job_id FROM jobs)
            GROUP BY job_id
        )
        SELECT * FROM known
        WHERE ($state IS NULL OR state = $state)
          AND ($search IS NULL OR contains(lower(name), lower($search))
               OR contains(lower(job_id), lower($search)))"""
    total = q.query(f"SELECT count(*) AS n FROM ({base})",
                    {k: params[k] for k in ("state", "search")})[0]["n"]
    rows = q.query(base + " ORDER BY created_ns DESC NULLS LAST, job_id LIMIT $limit OFFSET $offset",
                   params)
    return total, rows


def job(q, job_id: str) -> Row | None:
    """One supervised job's row (with its JSON record), or None."""
    rows = q.query("SELECT job_id, name, state, created_ns, updated_ns, record FROM jobs "
                   "WHERE job_id = $job", {"job": job_id})
    return rows[0] if rows else None


def job_known(q, job_id: str) -> bool:
    """Whether the supervisor or telemetry knows ``job_id``."""
    return bool(q.query(
        "SELECT (EXISTS (SELECT 1 FROM jobs WHERE job_id = $job) OR "
        "EXISTS (SELECT 1 FROM resources WHERE job_id = $job)) AS known", {"job": job_id})[0]["known"])


def job_events(q, job_id: str, *, kind: str | None, limit: int, offset: int) -> tuple[int, list[Row]]:
    """The supervisor's events of one job in the order they happened."""
    params = {"job": job_id, "kind": kind}
    where = "WHERE job_id = $job AND ($kind IS NULL OR kind = $kind)"
    total = q.query(f"SELECT count(*) AS n FROM job_events {where}", params)[0]["n"]
    rows = q.query(f"SELECT ts_ns, kind, detail FROM job_events {where} ORDER BY ts_ns, rowid "
                   "LIMIT $limit OFFSET $offset", {**params, "limit": limit, "offset": offset})
    return total, rows


def job_logs(q, job_id: str, *, rank: int | None, stream: str | None, search: str | None,
             after_seq: int, limit: int) -> list[Row]:
    """Stored output lines of one job after ``after_seq`` (``search``: a case-insensitive
    substring, matched literally)."""
    return q.query("""
        SELECT seq, ts_ns, attempt, rank, stream, text FROM job_logs
        WHERE job_id = $job AND seq > $after AND ($rank IS NULL OR rank = $rank)
          AND ($stream IS NULL OR stream = $stream)
          AND ($search IS NULL OR contains(lower(text), lower($search)))
        ORDER BY seq LIMIT $limit""",
                   {"job": job_id, "after": after_seq, "rank": rank, "stream": stream,
                    "search": search, "limit": limit})


def job_step_summary(q) -> dict[str, Row]:
    """Per job id: steps stored, last step, ranks, current plan version."""
    rows = q.query("""
        SELECT job_id, count(*) AS steps, max(step) AS last_step, count(DISTINCT rank) AS ranks,
               arg_max(plan_version, start_ns) AS plan_version, max(end_ns) AS last_ns
        FROM step_times WHERE job_id IS NOT NULL GROUP BY job_id""")
    return {r["job_id"]: r for r in rows}


# ---- steps, swaps and speed-up -----------------------------------------------------------------

def data_range(q, *, job_id: str | None, since_ns: int, until_ns: int) -> tuple[int, int] | None:
    """The first and last step start inside the window, or None when there is none."""
    row = q.query("""
        SELECT min(start_ns) AS lo, max(start_ns) AS hi FROM step_times
        WHERE start_ns >= $since AND start_ns < $until AND ($job IS NULL OR job_id = $job)""",
                  {"since": since_ns, "until": until_ns, "job": job_id})[0]
    return None if row["lo"] is None else (row["lo"], row["hi"])


def step_series(q, *, job_id: str | None, since_ns: int, until_ns: int,
                points: int) -> list[Row]:
    """Step time p50/p95 per job in at most ``points`` time slices of the window's data."""
    span = data_range(q, job_id=job_id, since_ns=since_ns, until_ns=until_ns)
    if span is None:
        return []
    lo, hi = span
    width = max(1, (hi - lo) // max(1, points - 1) + 1)
    return q.query("""
        SELECT job_id, $lo + (start_ns - $lo) // $width * $width AS t_ns, count(*) AS steps,
               quantile_cont(duration_ns, 0.5) AS p50_ns, quantile_cont(duration_ns, 0.95) AS p95_ns,
               max(plan_version) AS plan_version, max(step) AS last_step
        FROM step_times
        WHERE start_ns >= $lo AND start_ns <= $hi AND ($job IS NULL OR job_id = $job)
        GROUP BY ALL ORDER BY job_id, t_ns""",
                   {"lo": lo, "hi": hi, "width": width, "job": job_id})


def swap_markers(q, *, job_id: str | None, since_ns: int, until_ns: int, limit: int) -> list[Row]:
    """Plan swaps (one per job and step, over ranks) and evolve rollbacks in the window."""
    return q.query("""
        SELECT * FROM (
            SELECT job_id, min(at_ns) AS at_ns, step, min(plan_from) AS plan_from,
                   max(plan_to) AS plan_to, any_value(plan_digest) AS plan_digest,
                   CASE WHEN max(plan_to) < min(plan_from) THEN 'rollback' ELSE 'swap' END AS kind
            FROM swaps WHERE at_ns >= $since AND at_ns < $until AND ($job IS NULL OR job_id = $job)
            GROUP BY job_id, step
            UNION ALL
            SELECT job_id, at_ns, NULL AS step, NULL AS plan_from, plan_version AS plan_to,
                   bundle_digest AS plan_digest, 'rollback' AS kind
            FROM decisions WHERE kind = 'rollback' AND at_ns >= $since AND at_ns < $until
              AND ($job IS NULL OR job_id = $job))
        ORDER BY at_ns LIMIT $limit""",
                   {"since": since_ns, "until": until_ns, "job": job_id, "limit": limit})


def speedups(q, *, job_id: str | None) -> list[Row]:
    """Per job that swapped: median step time before its first swap and since its last one
    (steps 0-2 left out as warm-up), and the speed-up ``before / after``."""
    return q.query("""
        WITH sw AS (
            SELECT job_id, min(at_ns) AS first_ns, max(at_ns) AS last_ns,
                   count(DISTINCT step) AS swaps
            FROM swaps WHERE ($job IS NULL OR job_id = $job) GROUP BY job_id
        ), med AS (
            SELECT s.job_id, any_value(sw.swaps) AS swaps,
                   median(s.duration_ns) FILTER (WHERE s.start_ns < sw.first_ns) AS before_ns,
                   median(s.duration_ns) FILTER (WHERE s.start_ns >= sw.last_ns) AS after_ns
            FROM step_times s JOIN sw USING (job_id)
            WHERE s.step >= 3 GROUP BY s.job_id
        )
        SELECT *, before_ns / nullif(after_ns, 0) AS speedup FROM med ORDER BY job_id""",
                   {"job": job_id})


# ---- ingest ------------------------------------------------------------------------------------

def ingest_rate(q, *, now_ns: int, window_s: int = 60) -> Row:
    """Spans and batches committed in the last ``window_s`` seconds, and per second."""
    row = q.query("""
        SELECT count(*) AS batches, coalesce(sum(spans), 0) AS spans,
               max(committed_ns) AS last_commit_ns
        FROM ingest_batches WHERE committed_ns >= $since""",
                  {"since": now_ns - window_s * 10**9})[0]
    row["spans_per_s"] = row["spans"] / window_s
    row["window_s"] = window_s
    return row


def reported_drops(q, *, since_ns: int, until_ns: int) -> Row:
    """Drops jobs reported on their step spans in the window: call records (per step, summed),
    steps and spans (cumulative per process: the last value per job and rank, summed)."""
    row = q.query("""
        WITH per_process AS (
            SELECT job_id, rank,
                   sum(coalesce(TRY_CAST(attributes->>'rtx.dropped.records' AS BIGINT), 0)) AS records,
                   max(coalesce(TRY_CAST(attributes->>'rtx.dropped.steps' AS BIGINT), 0)) AS steps,
                   max(coalesce(TRY_CAST(attributes->>'rtx.dropped.spans' AS BIGINT), 0)) AS spans
            FROM spans WHERE name = 'rtx.step' AND start_ns >= $since AND start_ns < $until
            GROUP BY job_id, rank)
        SELECT coalesce(sum(records), 0) AS records, coalesce(sum(steps), 0) AS steps,
               coalesce(sum(spans), 0) AS spans FROM per_process""",
                  {"since": since_ns, "until": until_ns})[0]
    return {k: int(v) for k, v in row.items()}


# ---- kernels -----------------------------------------------------------------------------------

def step_totals(q, *, job_id: str | None, since_ns: int, until_ns: int) -> dict[str, Row]:
    """Per job: steps and summed step time in the window (the denominator of kernel shares)."""
    rows = q.query("""
        SELECT job_id, count(*) AS steps, sum(duration_ns) AS step_ns,
               arg_max(plan_version, start_ns) AS plan_version
        FROM step_times WHERE start_ns >= $since AND start_ns < $until
          AND ($job IS NULL OR job_id = $job) GROUP BY job_id""",
                   {"since": since_ns, "until": until_ns, "job": job_id})
    return {r["job_id"]: r for r in rows}


def kernel_series(q, *, job_id: str | None, op: str | None, bucket: str | None, since_ns: int,
                  until_ns: int, points: int) -> list[Row]:
    """Per-call mean time over time per (op, bucket, variant, phase): p50/p95 of the kernel
    spans' per-step means in at most ``points`` time slices of the window's data."""
    params = {"job": job_id, "op": op, "bucket": bucket, "since": since_ns, "until": until_ns}
    where = """name = 'rtx.kernel' AND start_ns >= $since AND start_ns < $until
               AND ($job IS NULL OR job_id = $job) AND ($op IS NULL OR op = $op)
               AND ($bucket IS NULL OR bucket = $bucket) AND count > 0"""
    span = q.query(f"SELECT min(start_ns) AS lo, max(start_ns) AS hi FROM spans WHERE {where}",
                   params)[0]
    if span["lo"] is None:
        return []
    width = max(1, (span["hi"] - span["lo"]) // max(1, points - 1) + 1)
    return q.query(f"""
        SELECT op, bucket, variant, phase,
               $lo + (start_ns - $lo) // $width * $width AS t_ns, sum(count) AS calls,
               quantile_cont(total_ns / count, 0.5) AS p50_ns,
               quantile_cont(total_ns / count, 0.95) AS p95_ns
        FROM spans WHERE {where}
        GROUP BY ALL ORDER BY op, bucket, variant, phase, t_ns""",
                   {**params, "lo": span["lo"], "width": width})


def op_breakdown(q, *, job_id: str, since_ns: int, until_ns: int) -> list[Row]:
    """Kernel time per op and phase in the window, and per step (over the window's steps)."""
    return q.query("""
        WITH k AS (
            SELECT op, phase, sum(total_ns) AS total_ns, sum(count) AS calls FROM spans
            WHERE name = 'rtx.kernel' AND job_id = $job AND start_ns >= $since
              AND start_ns < $until GROUP BY ALL
        ), s AS (
            SELECT count(DISTINCT (rank, step)) AS steps FROM step_times
            WHERE job_id = $job AND start_ns >= $since AND start_ns < $until
        )
        SELECT k.*, s.steps, k.total_ns / nullif(s.steps, 0) AS per_step_ns FROM k, s
        ORDER BY op, phase""",
                   {"job": job_id, "since": since_ns, "until": until_ns})


# ---- evolve ------------------------------------------------------------------------------------

TRIAL_COLUMNS = ("trial_id", "job_id", "op", "bucket", "variant", "config", "mode", "strategy",
                 "started_ns", "ended_ns", "samples", "median_ns", "p95_ns", "spread",
                 "peak_bytes", "status", "detail")


def trials(q, *, job_id: str | None, op: str | None, bucket: str | None, variant: str | None,
           status: str | None, limit: int, offset: int) -> tuple[int, list[Row]]:
    """Evolve trials, newest first, with exact-match filters."""
    params = {"job": job_id, "op": op, "bucket": bucket, "variant": variant, "status": status}
    where = """WHERE ($job IS NULL OR job_id = $job) AND ($op IS NULL OR op = $op)
               AND ($bucket IS NULL OR bucket = $bucket) AND ($variant IS NULL OR variant = $variant)
               AND ($status IS NULL OR status = $status)"""
    total = q.query(f"SELECT count(*) AS n FROM trials {where}", params)[0]["n"]
    rows = q.query(f"SELECT * FROM trials {where} ORDER BY started_ns DESC NULLS LAST, trial_id "
                   "LIMIT $limit OFFSET $offset", {**params, "limit": limit, "offset": offset})
    return total, rows


def trial(q, trial_id: str) -> Row | None:
    rows = q.query("SELECT * FROM trials WHERE trial_id = $id", {"id": trial_id})
    return rows[0] if rows else None


def decisions(q, *, job_id: str | None, op: str | None, kind: str | None, limit: int,
              offset: int) -> tuple[int, list[Row]]:
    """Evolve decisions (promotions, rejections, canaries, rollbacks) with their statistics."""
    params = {"job": job_id, "op": op, "kind": kind}
    where = """WHERE ($job IS NULL OR job_id = $job) AND ($op IS NULL OR op = $op)
               AND ($kind IS NULL OR kind = $kind)"""
    total = q.query(f"SELECT count(*) AS n FROM decisions {where}", params)[0]["n"]
    rows = q.query(f"SELECT * FROM decisions {where} ORDER BY at_ns DESC NULLS LAST, decision_id "
                   "LIMIT $limit OFFSET $offset", {**params, "limit": limit, "offset": offset})
    return total, rows


def tuning(q, *, op: str | None, variant: str | None, status: str | None, device: str | None,
           limit: int, offset: int) -> tuple[int, list[Row]]:
    """The tuning database (no kernel sources: ``source`` is left out), fastest first per op."""
    params = {"op": op, "variant": variant, "status": status, "device": device}
    where = """WHERE ($op IS NULL OR op = $op) AND ($variant IS NULL OR variant = $variant)
               AND ($status IS NULL OR status = $status) AND ($device IS NULL OR device = $device)"""
    total = q.query(f"SELECT count(*) AS n FROM tuning {where}", params)[0]["n"]
    rows = q.query(f"SELECT * EXCLUDE (source) FROM tuning {where} "
                   "ORDER BY op, bucket, median_ns NULLS LAST LIMIT $limit OFFSET $offset",
                   {**params, "limit": limit, "offset": offset})
    return total, rows


def hot_spots(q, *, job_id: str | None, since_ns: int, until_ns: int, limit: int) -> list[Row]:
    """(op, bucket) pairs by kernel time in the window's whole minutes (from the rollup)."""
    return q.query(f"""
        SELECT op, bucket, sum(total_ns) AS total_ns, sum(calls) AS calls,
               count(DISTINCT variant) AS variants, arg_max(variant, last_ns) AS current_variant
        FROM kernel_minutes
        WHERE minute >= $since // {MINUTE_NS} AND minute <= ($until - 1) // {MINUTE_NS}
          AND ($job IS NULL OR job_id = $job)
        GROUP BY op, bucket ORDER BY total_ns DESC NULLS LAST LIMIT $limit""",
                   {"job": job_id, "since": since_ns, "until": until_ns, "limit": limit})


# ---- memory ------------------------------------------------------------------------------------

def memory_series(q, *, job_id: str | None, since_ns: int, until_ns: int, points: int) -> list[Row]:
    """RSS and CUDA allocator figures per job, the maximum in each of at most ``points`` slices."""
    span = data_range(q, job_id=job_id, since_ns=since_ns, until_ns=until_ns)
    if span is None:
        return []
    lo, hi = span
    width = max(1, (hi - lo) // max(1, points - 1) + 1)
    return q.query("""
        SELECT job_id, $lo + (start_ns - $lo) // $width * $width AS t_ns,
               max(rss_bytes) AS rss_bytes, max(cuda_allocated_bytes) AS cuda_allocated_bytes,
               max(cuda_reserved_bytes) AS cuda_reserved_bytes, max(cuda_peak_bytes) AS cuda_peak_bytes,
               max(cuda_fragmentation) AS cuda_fragmentation, max(cuda_ooms) AS cuda_ooms
        FROM memory_timeline
        WHERE start_ns >= $lo AND start_ns <= $hi AND ($job IS NULL OR job_id = $job)
        GROUP BY ALL ORDER BY job_id, t_ns""",
                   {"lo": lo, "hi": hi, "width": width, "job": job_id})


# ---- governance ledger (schema v6; may be missing) ----------------------------------------------

LEDGER = "ledger"


def ledger(q, *, limit: int, offset: int) -> tuple[int, list[Row]]:
    """Ledger entries in append order, newest first; ``(0, [])`` when there is no ledger table."""
    if not table_exists(q, LEDGER):
        return 0, []
    total = q.query(f"SELECT count(*) AS n FROM {LEDGER}")[0]["n"]
    rows = q.query(f"SELECT * FROM {LEDGER} ORDER BY rowid DESC LIMIT $limit OFFSET $offset",
                   {"limit": limit, "offset": offset})
    return total, rows


def ledger_entry(q, digest: str) -> Row | None:
    """The ledger entry whose bundle digest column (the first of ``bundle_digest``, ``digest``,
    ``entry_digest``) equals ``digest``."""
    if not table_exists(q, LEDGER):
        return None
    cols = table_columns(q, LEDGER)
    key = next((c for c in ("bundle_digest", "digest", "entry_digest") if c in cols), None)
    if key is None:
        return None
    rows = q.query(f'SELECT * FROM {LEDGER} WHERE "{key}" = $d LIMIT 1', {"d": digest})
    return rows[0] if rows else None


# ---- export ------------------------------------------------------------------------------------

def window_rows(q, *, job_id: str | None, since_ns: int, until_ns: int, limit: int) -> list[Row]:
    """Spans (with resource attributes) of the window for a Chrome trace, oldest first;
    sampled calls are left out, at most ``limit``."""
    return q.query("""
        SELECT s.*, r.attributes AS resource_attributes
        FROM spans s LEFT JOIN resources r USING (resource_id)
        WHERE s.start_ns >= $since AND s.start_ns < $until AND s.name <> 'rtx.call'
          AND ($job IS NULL OR s.job_id = $job)
        ORDER BY s.start_ns LIMIT $limit""",
                   {"job": job_id, "since": since_ns, "until": until_ns, "limit": limit})



def job_logs_tail(q, job_id: str, *, search: str | None, limit: int) -> list[Row]:
    """The last ``limit`` stored lines of one job (matching ``search``), oldest first."""
    rows = q.query("""
        SELECT seq, ts_ns, attempt, rank, stream, text FROM job_logs
        WHERE job_id = $job AND ($search IS NULL OR contains(lower(text), lower($search)))
        ORDER BY seq DESC LIMIT $limit""", {"job": job_id, "search": search, "limit": limit})
    return rows[::-1]
