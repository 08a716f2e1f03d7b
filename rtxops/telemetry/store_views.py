"""Read-only queries behind the dashboard: jobs, step-time series, swaps, kernels, evolve tables,
memory, caches, the governance ledger and windowed exports.

Every function takes ``q``, a :class:`~.store.Store` or :class:`~.store.ReadOnlyStore`, and runs
parameterized SQL only (user input never becomes SQL text). Tables that a later schema version
adds (the governance ledger) may be missing: callers check :func:`table_exists` and show nothing.
Windows are ``[since_ns, until_ns)`` in Unix nanoseconds.
"""
from __future__ import annotations

from typing import Any

from .store import HIST_BINS_PER_OCTAVE, KERNEL_TOTALS_CTE, MINUTE_NS, QUANTILE_CTES

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


LINE_SHOWN_CHARS = 4096   # characters of one output line the dashboard shows (a line may be a MiB)


def job_logs(q, job_id: str, *, rank: int | None, stream: str | None, search: str | None,
             after_seq: int, limit: int) -> list[Row]:
    """Stored output lines of one job after ``after_seq`` (``search``: a case-insensitive
    substring, matched literally), each cut to :data:`LINE_SHOWN_CHARS` (``size``: its bytes)."""
    return _shown_lines(q, """
        SELECT seq FROM job_logs
        WHERE job_id = $job AND seq > $after AND ($rank IS NULL OR rank = $rank)
          AND ($stream IS NULL OR stream = $stream)
          AND ($search IS NULL OR contains(lower(text), lower($search)))
        ORDER BY seq LIMIT $limit""",
                        {"job": job_id, "after": after_seq, "rank": rank, "stream": stream,
                         "search": search, "limit": limit})


def _shown_lines(q, seqs_sql: str, params: dict) -> list[Row]:
    """The lines whose seqs ``seqs_sql`` picks, oldest first, their text cut for display. The
    seqs are picked first, without the text: sorting whole lines of a mebibyte each ran the
    store out of memory (a 500 on every view of the job)."""
    return q.query(f"""
        WITH picked AS ({seqs_sql})
        SELECT seq, ts_ns, attempt, rank, stream, left(text, {LINE_SHOWN_CHARS}) AS text,
               strlen(text) AS size, length(text) > {LINE_SHOWN_CHARS} AS cut
        FROM job_logs WHERE job_id = $job AND seq IN (SELECT seq FROM picked) ORDER BY seq""",
                   params)


def job_facts(q, job_ids: list[str]) -> dict[str, Row]:
    """Per job id of ``job_ids``: ranks seen (resources) and the plan version it swapped to last
    (swaps; None before the first swap). Cheap: neither scans the step spans."""
    rows = q.query("""
        SELECT r.job_id, count(DISTINCT r.rank) AS ranks,
               (SELECT max(plan_to) FROM swaps w WHERE w.job_id = r.job_id) AS plan_version
        FROM resources r WHERE r.job_id IN (SELECT unnest($ids)) GROUP BY r.job_id""",
                   {"ids": job_ids})
    return {r["job_id"]: r for r in rows}


DISABLED_SHOWN = 200   # a job's disabled variants a page lists (each (op, variant, config, bucket) once)
_STEP_SLACK_NS = 60 * 10**9   # an event's time against its step span's, either side
# how long before the store first heard of a job its events may be from (spans a job held
# while its daemon was away)
_HELD_NS = 3600 * 10**9


def disabled_events(q, job_id: str, *, op: str | None = None,
                    bucket: str | None = None) -> list[Row]:
    """The job's ``rtx.variant.disabled`` events (a first call that differed from the reference,
    a build that failed, a variant it cannot run): time, op, variant, config, bucket, reason.
    The events are few (those since the job began); the step spans they hang on are found by
    integer id within the events' time range (joining every span on its hex id read the whole
    span table)."""
    events = q.query("""
        SELECT time_ns, span_id, attributes->>'rtx.op' AS op,
               attributes->>'rtx.variant' AS variant, attributes->>'rtx.config' AS config,
               attributes->>'rtx.bucket' AS bucket, attributes->>'rtx.reason' AS reason
        FROM span_events WHERE name = 'rtx.variant.disabled'
          AND time_ns >= (SELECT min(first_seen_ns) FROM resources WHERE job_id = $job) - $held
          AND ($op IS NULL OR attributes->>'rtx.op' = $op)
          AND ($bucket IS NULL OR attributes->>'rtx.bucket' = $bucket)
        ORDER BY time_ns""", {"job": job_id, "held": _HELD_NS, "op": op, "bucket": bucket})
    ids = {e["span_id"]: _span_int(e["span_id"]) for e in events}
    if not any(v is not None for v in ids.values()):
        return []
    times = [e["time_ns"] for e in events]
    mine = {r["span_id"] for r in q.query("""
        SELECT DISTINCT r.span_id FROM span_rows r JOIN span_keys k USING (key_id)
        WHERE k.job_id = $job AND r.span_id IN (SELECT unnest($ids::UBIGINT[]))
          AND r.start_ns <= $hi AND r.end_ns >= $lo""",
        {"job": job_id, "ids": [v for v in ids.values() if v is not None],
         "lo": min(times) - _STEP_SLACK_NS, "hi": max(times) + _STEP_SLACK_NS})}
    return [e for e in events if ids[e["span_id"]] in mine]


def _span_int(span_id: str | None) -> int | None:
    try:
        return int(span_id, 16)
    except (TypeError, ValueError):
        return None


def disabled_variants(q, job_id: str) -> list[Row]:
    """What the job's runtime disabled, each (op, variant, config, bucket) once: when first,
    why, and how many times it was reported (by its ranks and attempts)."""
    seen: dict[tuple, Row] = {}
    for e in disabled_events(q, job_id):
        key = (e["op"], e["variant"], e["config"], e["bucket"])
        if key in seen:
            seen[key]["reports"] += 1
        elif len(seen) < DISABLED_SHOWN:
            seen[key] = {**{k: e[k] for k in ("op", "variant", "config", "bucket", "reason")},
                         "first_ns": e["time_ns"], "reports": 1}
    return list(seen.values())


# ---- steps, swaps and speed-up -----------------------------------------------------------------

_SLICED = """
    WITH picked AS MATERIALIZED (
        SELECT * FROM {source}
        WHERE start_ns >= $since AND start_ns < $until AND ($job IS NULL OR job_id = $job)
    ), bounds AS (
        SELECT min(start_ns) AS lo, greatest((max(start_ns) - min(start_ns)) // ($points - 1) + 1, 1)
               AS width FROM picked
    )
    SELECT job_id, lo + (start_ns - lo) // width * width AS t_ns, {aggregates}
    FROM picked, bounds GROUP BY ALL ORDER BY job_id, t_ns"""


def step_series(q, *, job_id: str | None, since_ns: int, until_ns: int,
                points: int) -> list[Row]:
    """Step time p50/p95 per job in at most ``points`` time slices of the window's data (one
    scan of the step spans)."""
    return q.query(_SLICED.format(source="step_times", aggregates="""
        count(*) AS steps, quantile_cont(duration_ns, 0.5) AS p50_ns,
        quantile_cont(duration_ns, 0.95) AS p95_ns, max(plan_version) AS plan_version,
        max(step) AS last_step"""),
                   {"since": since_ns, "until": until_ns, "job": job_id, "points": max(2, points)})


def swap_markers(q, *, job_id: str | None, since_ns: int, until_ns: int, limit: int) -> list[Row]:
    """Plan swaps (one per job and step, over ranks) and evolve rollbacks in the window, oldest
    first: the newest ``limit`` of them (the last swap is the one a page defaults to). A
    rollback decision is marked when it was made (its ``at_ns``, the plan version it published);
    the plan's digest comes from the job's swap to that version, once it swapped."""
    return q.query("""
        SELECT * FROM (SELECT * FROM (
            SELECT job_id, min(at_ns) AS at_ns, step, min(plan_from) AS plan_from,
                   max(plan_to) AS plan_to, any_value(plan_digest) AS plan_digest,
                   CASE WHEN max(plan_to) < min(plan_from) THEN 'rollback' ELSE 'swap' END AS kind
            FROM swaps WHERE at_ns >= $since AND at_ns < $until AND ($job IS NULL OR job_id = $job)
            GROUP BY job_id, step
            UNION ALL
            SELECT d.job_id, d.at_ns, NULL AS step, NULL AS plan_from, d.plan_version AS plan_to,
                   (SELECT any_value(s.plan_digest) FROM swaps s
                    WHERE s.job_id = d.job_id AND s.plan_to = d.plan_version) AS plan_digest,
                   'rollback' AS kind
            FROM decisions d WHERE d.kind = 'rollback' AND d.at_ns >= $since AND d.at_ns < $until
              AND ($job IS NULL OR d.job_id = $job))
        ORDER BY at_ns DESC LIMIT $limit) ORDER BY at_ns""",
                   {"since": since_ns, "until": until_ns, "job": job_id, "limit": limit})


def speedups(q, *, job_id: str | None, since_ns: int, until_ns: int) -> list[Row]:
    """Per job that swapped in the window: median step time in the window before its first swap
    and since its last one, and the speed-up ``before / after``. Each process's first three
    steps are left out as warm-up (a restarted attempt's too: its steps count on); they are
    looked for as far back as the window is long (not through the job's whole history, which
    made this grow with the store)."""
    swapped = [r["job_id"] for r in q.query(
        "SELECT DISTINCT job_id FROM swaps WHERE ($job IS NULL OR job_id = $job) "
        "AND at_ns >= $since AND at_ns < $until", {"job": job_id, "since": since_ns, "until": until_ns})]
    if not swapped:
        return []
    return q.query("""
        WITH sw AS (
            SELECT job_id, min(at_ns) AS first_ns, max(at_ns) AS last_ns,
                   count(DISTINCT step) AS swaps
            FROM swaps WHERE ($job IS NULL OR job_id = $job) AND at_ns >= $since AND at_ns < $until
            GROUP BY job_id
        ), steps AS (
            SELECT job_id, duration_ns, start_ns,
                   row_number() OVER (PARTITION BY job_id, resource_id ORDER BY step) AS nth
            FROM spans WHERE name = 'rtx.step' AND step >= 0 AND job_id IN (SELECT job_id FROM sw)
              AND start_ns >= $before AND start_ns < $until
        ), med AS (
            SELECT s.job_id, any_value(sw.swaps) AS swaps,
                   median(s.duration_ns) FILTER (WHERE s.start_ns < sw.first_ns) AS before_ns,
                   median(s.duration_ns) FILTER (WHERE s.start_ns >= sw.last_ns) AS after_ns
            FROM steps s JOIN sw USING (job_id)
            WHERE s.nth > 3 AND s.start_ns >= $since AND s.start_ns < $until GROUP BY s.job_id
        )
        SELECT *, before_ns / nullif(after_ns, 0) AS speedup FROM med ORDER BY job_id""",
                   {"job": job_id, "since": since_ns, "until": until_ns,
                    "before": since_ns - max(0, until_ns - since_ns)})


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
    steps and spans (counted by each process since it started: per process, the last value in
    the window less the last one before it, looked for as far back as the window is long;
    summed over processes, a restarted job's old and new ones apart)."""
    row = q.query("""
        WITH picked AS (
            SELECT resource_id, start_ns, start_ns >= $since AS inside,
                   json_extract_string(attributes, ['$."rtx.dropped.records"',
                       '$."rtx.dropped.steps"', '$."rtx.dropped.spans"']) AS v
            FROM spans WHERE name = 'rtx.step' AND start_ns >= $before AND start_ns < $until
        ), per_process AS (
            SELECT resource_id,
                   sum(coalesce(TRY_CAST(v[1] AS BIGINT), 0)) FILTER (WHERE inside) AS records,
                   max(coalesce(TRY_CAST(v[2] AS BIGINT), 0)) FILTER (WHERE inside) AS steps,
                   max(coalesce(TRY_CAST(v[3] AS BIGINT), 0)) FILTER (WHERE inside) AS spans,
                   max(coalesce(TRY_CAST(v[2] AS BIGINT), 0)) FILTER (WHERE NOT inside) AS steps_before,
                   max(coalesce(TRY_CAST(v[3] AS BIGINT), 0)) FILTER (WHERE NOT inside) AS spans_before
            FROM picked GROUP BY resource_id)
        SELECT coalesce(sum(records), 0) AS records,
               coalesce(sum(greatest(steps - coalesce(steps_before, 0), 0)), 0) AS steps,
               coalesce(sum(greatest(spans - coalesce(spans_before, 0), 0)), 0) AS spans
        FROM per_process""",
                  {"before": since_ns - max(0, until_ns - since_ns), "since": since_ns,
                   "until": until_ns})[0]
    return {k: int(v) for k, v in row.items()}


# ---- kernels -----------------------------------------------------------------------------------

_KERNEL_TABLE = f"""
WITH window_rows AS MATERIALIZED (
    SELECT * FROM kernel_minutes
    WHERE minute >= $since // {MINUTE_NS} AND minute <= ($until - 1) // {MINUTE_NS}
      AND ($job IS NULL OR job_id = $job) AND ($op IS NULL OR op = $op)
), {KERNEL_TOTALS_CTE}, ranked AS (
    SELECT *, count(*) OVER () AS total_rows,
           max(last_ns) OVER (PARTITION BY job_id, op, bucket, phase) = last_ns AS current
    FROM totals
), paged AS (
    SELECT * FROM ranked ORDER BY job_id, op, bucket, phase, mean_ns, key_id
    LIMIT $limit OFFSET $offset
), bins AS (
    SELECT w.key_id, e.key AS bin, sum(e.value) AS n
    FROM window_rows w, unnest(map_entries(w.mean_hist)) AS t(e)
    WHERE w.key_id IN (SELECT key_id FROM paged) GROUP BY ALL
), {QUANTILE_CTES}
SELECT p.* EXCLUDE (key_id), q.p50_step_mean_ns, q.p95_step_mean_ns
FROM paged p LEFT JOIN quantiles q USING (key_id)
ORDER BY job_id, op, bucket, phase, mean_ns
"""


def kernel_table(q, *, job_id: str | None, op: str | None, since_ns: int, until_ns: int,
                 limit: int, offset: int) -> tuple[int, list[Row]]:
    """One page of per (job, op, bucket, variant, config, phase) kernel figures over the whole
    minutes of the window, as ``Store.kernel_stats`` computes them (p50/p95 of the per-step
    mean from the rollup's histograms, only for the page's rows), plus ``current``: the key ran
    last in its (job, op, bucket, phase). ``(total rows, page)``."""
    rows = q.query(_KERNEL_TABLE, {"since": since_ns, "until": until_ns, "job": job_id, "op": op,
                                   "limit": limit, "offset": offset})
    if not rows and offset:
        total = q.query(f"""SELECT count(DISTINCT key_id) AS n FROM kernel_minutes
            WHERE minute >= $since // {MINUTE_NS} AND minute <= ($until - 1) // {MINUTE_NS}
              AND ($job IS NULL OR job_id = $job) AND ($op IS NULL OR op = $op)""",
                        {"since": since_ns, "until": until_ns, "job": job_id, "op": op})[0]["n"]
        return total, []
    total = rows[0]["total_rows"] if rows else 0
    return total, [{k: v for k, v in r.items() if k != "total_rows"} for r in rows]


def step_totals(q, *, job_id: str | None, since_ns: int, until_ns: int) -> dict[str, Row]:
    """Per job: steps and summed step time in the window's whole minutes, the minutes the kernel
    rows cover (the denominator of kernel shares: over the window alone, a share read up to
    59 s of kernel time more than its steps, and passed 100 %)."""
    rows = q.query(f"""
        SELECT job_id, count(*) AS steps, sum(duration_ns) AS step_ns,
               arg_max(plan_version, start_ns) AS plan_version
        FROM step_times
        WHERE start_ns >= $since // {MINUTE_NS} * {MINUTE_NS}
          AND start_ns < (($until - 1) // {MINUTE_NS} + 1) * {MINUTE_NS}
          AND ($job IS NULL OR job_id = $job) GROUP BY job_id""",
                   {"since": since_ns, "until": until_ns, "job": job_id})
    return {r["job_id"]: r for r in rows}


RAW_SERIES_MAX_NS = 5 * MINUTE_NS
_SERIES_KEY = ("job_id", "op", "bucket", "variant", "config", "phase")

_TOP_KEYS = f"""
    SELECT key_id, any_value(job_id) AS job_id, any_value(op) AS op, any_value(bucket) AS bucket,
           any_value(variant) AS variant,
           any_value(config) AS config, any_value(phase) AS phase, sum(total_ns) AS total_ns, min(first_ns) AS first_ns,
           max(last_ns) AS last_ns
    FROM kernel_minutes
    WHERE minute >= $since // {MINUTE_NS} AND minute <= ($until - 1) // {MINUTE_NS}
      AND ($job IS NULL OR job_id = $job) AND ($op IS NULL OR op = $op)
      AND ($bucket IS NULL OR bucket = $bucket)
    GROUP BY key_id ORDER BY total_ns DESC LIMIT $series"""

# the rollup's key_id (rollup.INSERT_SQL) of each span: a key whose attributes are missing
# (nulls) is matched as the rollup keyed it, where comparing the values matched nothing
_SERIES_FROM_SPANS = """
    WITH picked AS MATERIALIZED (
        SELECT hash(job_id, op, bucket, variant, config, phase) AS key_id, start_ns, count,
               total_ns FROM spans
        WHERE name = 'rtx.kernel' AND start_ns >= $lo AND start_ns <= $hi AND count > 0
          AND ($job IS NULL OR job_id = $job) AND ($op IS NULL OR op = $op)
          AND ($bucket IS NULL OR bucket = $bucket)
    )
    SELECT key_id, $lo + (start_ns - $lo) // $width * $width AS t_ns,
           sum(count) AS calls, quantile_cont(total_ns / count, 0.5) AS p50_ns,
           quantile_cont(total_ns / count, 0.95) AS p95_ns
    FROM picked WHERE list_contains($ids, key_id) GROUP BY ALL ORDER BY key_id, t_ns"""

_SERIES_FROM_MINUTES = f"""
    WITH picked AS (
        SELECT k.key_id, k.minute // $per AS slice, k.calls, k.mean_hist FROM kernel_minutes k
        WHERE k.key_id IN (SELECT unnest($ids))
          AND k.minute >= $since // {MINUTE_NS} AND k.minute <= ($until - 1) // {MINUTE_NS}
    ), calls AS (
        SELECT key_id, slice, sum(calls) AS calls FROM picked GROUP BY ALL
    ), bins AS (
        SELECT key_id, slice, e.key AS bin, sum(e.value) AS n
        FROM picked, unnest(map_entries(mean_hist)) AS t(e) GROUP BY ALL
    ), cumulative AS (
        SELECT key_id, slice, bin,
               sum(n) OVER (PARTITION BY key_id, slice ORDER BY bin) AS upto,
               sum(n) OVER (PARTITION BY key_id, slice) AS all_n
        FROM bins
    )
    SELECT c.key_id, c.slice * $per * {MINUTE_NS} AS t_ns, any_value(calls.calls) AS calls,
           pow(2, (min(bin) FILTER (WHERE upto >= 0.5 * all_n) + 0.5) / {HIST_BINS_PER_OCTAVE})
               AS p50_ns,
           pow(2, (min(bin) FILTER (WHERE upto >= 0.95 * all_n) + 0.5) / {HIST_BINS_PER_OCTAVE})
               AS p95_ns
    FROM cumulative c JOIN calls USING (key_id, slice)
    GROUP BY c.key_id, c.slice ORDER BY c.key_id, t_ns"""


def kernel_series(q, *, job_id: str | None, op: str | None, bucket: str | None, since_ns: int,
                  until_ns: int, points: int, series: int = 12) -> list[Row]:
    """Per-call time over time for the ``series`` (job, op, bucket, variant, config, phase) keys
    with the most kernel time in the window: p50/p95 of the kernel spans' per-step means in at
    most ``points`` time slices. When the keys' data spans at most 5 minutes the slices come
    from the spans themselves; otherwise from the per-minute rollup (whole minutes, bins within
    2 %). Each job's figures are their own series (two jobs' one key zig-zagged between them)."""
    params = {"job": job_id, "op": op, "bucket": bucket, "since": since_ns, "until": until_ns}
    keys = q.query(_TOP_KEYS, {**params, "series": series})
    if not keys:
        return []
    lo, hi = min(k["first_ns"] for k in keys), max(k["last_ns"] for k in keys)
    points = max(2, points)
    by_id = {k["key_id"]: k for k in keys}
    if hi - lo <= RAW_SERIES_MAX_NS:
        rows = q.query(_SERIES_FROM_SPANS, {
            **{k: v for k, v in params.items() if k not in ("since", "until")},
            "lo": lo, "hi": hi, "width": max(1, (hi - lo) // (points - 1) + 1), "ids": list(by_id)})
    else:
        minutes = (hi - lo) // MINUTE_NS + 1
        rows = q.query(_SERIES_FROM_MINUTES, {"ids": list(by_id), "since": since_ns,
                                              "until": until_ns, "per": max(1, -(-minutes // points))})
    out = [{**{f: by_id[r["key_id"]][f] for f in _SERIES_KEY},
            "t_ns": r["t_ns"], "calls": r["calls"], "p50_ns": r["p50_ns"], "p95_ns": r["p95_ns"]}
           for r in rows]
    return sorted(out, key=lambda r: (*(_nulls_last(r[f]) for f in _SERIES_KEY), r["t_ns"]))


def _nulls_last(value) -> tuple:
    """A sort key that orders None (a span without that attribute) after every value."""
    return (value is None, value if value is not None else 0)


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


def canaries(q, *, job_id: str | None, limit: int) -> list[Row]:
    """Canary outcomes: a canary that held (``canary_pass``) or was rolled back, newest first."""
    return q.query("""SELECT * FROM decisions WHERE kind IN ('canary_pass', 'rollback')
                      AND ($job IS NULL OR job_id = $job) ORDER BY at_ns DESC NULLS LAST
                      LIMIT $limit""", {"job": job_id, "limit": limit})


def running_job_trials(q, *, job_id: str | None, limit: int) -> list[Row]:
    """The latest trials of jobs still running (a trial row is written when the trial ends, so
    this is what the jobs being explored measured last), newest first."""
    return q.query("""SELECT t.* FROM trials t JOIN jobs j ON j.job_id = t.job_id
                      WHERE j.state = 'running' AND ($job IS NULL OR t.job_id = $job)
                      ORDER BY t.ended_ns DESC NULLS LAST, t.trial_id LIMIT $limit""",
                   {"job": job_id, "limit": limit})


def tuning(q, *, op: str | None, variant: str | None, status: str | None, device: str | None,
           limit: int, offset: int) -> tuple[int, list[Row]]:
    """The tuning database (no kernel sources: ``source`` is left out), fastest first per op."""
    params = {"op": op, "variant": variant, "status": status, "device": device}
    where = """WHERE ($op IS NULL OR op = $op) AND ($variant IS NULL OR variant = $variant)
               AND ($status IS NULL OR status = $status) AND ($device IS NULL OR device = $device)"""
    total = q.query(f"SELECT count(*) AS n FROM tuning {where}", params)[0]["n"]
    rows = q.query(f"SELECT * EXCLUDE (source) FROM tuning {where} "
                   "ORDER BY op, bucket, median_ns NULLS LAST, variant, config, device, torch_version, "
                   "triton_version, source_hash LIMIT $limit OFFSET $offset",
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

_MEMORY = """
    WITH picked AS MATERIALIZED (
        SELECT job_id, start_ns, json_extract_string(attributes, [
                   '$."rtx.mem.rss_bytes"', '$."rtx.cuda.allocated_bytes"',
                   '$."rtx.cuda.reserved_bytes"', '$."rtx.cuda.peak_bytes"',
                   '$."rtx.cuda.fragmentation"', '$."rtx.cuda.ooms"']) AS v
        FROM spans WHERE name = 'rtx.step' AND start_ns >= $since AND start_ns < $until
          AND ($job IS NULL OR job_id = $job)
    ), bounds AS (
        SELECT min(start_ns) AS lo, greatest((max(start_ns) - min(start_ns)) // ($points - 1) + 1, 1)
               AS width FROM picked
    )
    SELECT job_id, lo + (start_ns - lo) // width * width AS t_ns,
           max(TRY_CAST(v[1] AS BIGINT)) AS rss_bytes, max(TRY_CAST(v[2] AS BIGINT)) AS cuda_allocated_bytes,
           max(TRY_CAST(v[3] AS BIGINT)) AS cuda_reserved_bytes, max(TRY_CAST(v[4] AS BIGINT)) AS cuda_peak_bytes,
           max(TRY_CAST(v[5] AS DOUBLE)) AS cuda_fragmentation, max(TRY_CAST(v[6] AS BIGINT)) AS cuda_ooms
    FROM picked, bounds GROUP BY ALL ORDER BY job_id, t_ns"""


def memory_series(q, *, job_id: str | None, since_ns: int, until_ns: int, points: int) -> list[Row]:
    """RSS and CUDA allocator figures per job (the step spans' attributes, as the
    ``memory_timeline`` view reads them, parsed once per span), the maximum in each of at most
    ``points`` time slices."""
    return q.query(_MEMORY, {"since": since_ns, "until": until_ns, "job": job_id,
                             "points": max(2, points)})


# ---- governance ledger (schema v6; may be missing) ----------------------------------------------

LEDGER = "ledger"


def ledger(q, *, limit: int, offset: int) -> tuple[int, list[Row]]:
    """Ledger entries, newest first; ``(0, [])`` when there is no ledger table."""
    if not table_exists(q, LEDGER):
        return 0, []
    total = q.query(f"SELECT count(*) AS n FROM {LEDGER}")[0]["n"]
    rows = q.query(f"SELECT * FROM {LEDGER} ORDER BY seq DESC LIMIT $limit OFFSET $offset",
                   {"limit": limit, "offset": offset})
    return total, rows


def last_denial(q) -> Row | None:
    """The newest ``deny`` entry of the whole ledger, or None."""
    if not table_exists(q, LEDGER):
        return None
    rows = q.query(f"SELECT * FROM {LEDGER} WHERE kind = 'deny' ORDER BY seq DESC LIMIT 1")
    return rows[0] if rows else None


def ledger_entry(q, digest: str) -> Row | None:
    """The newest ledger entry about the bundle whose digest is ``digest``, or None."""
    if not table_exists(q, LEDGER):
        return None
    rows = q.query(f"SELECT * FROM {LEDGER} WHERE subject_digest = $d ORDER BY seq DESC LIMIT 1",
                   {"d": digest})
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
    """The last ``limit`` stored lines of one job (matching ``search``), oldest first, cut as
    :func:`job_logs` cuts them."""
    return _shown_lines(q, """
        SELECT seq FROM job_logs
        WHERE job_id = $job AND ($search IS NULL OR contains(lower(text), lower($search)))
        ORDER BY seq DESC LIMIT $limit""", {"job": job_id, "search": search, "limit": limit})
