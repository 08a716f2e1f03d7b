"""The evolve loop's SQL: kernel timings per step and arm, hot spots, and its own tables (tuning
database, trials, gate results, decisions; schema v5). Reads take anything with ``query(sql,
params)`` (a :class:`Store` or :class:`ReadOnlyStore` adapter); writes go through the store's
writer thread."""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from . import store_views
from .store import Store

log = logging.getLogger("rtxops.evolve")

TUNING_KEY = ("op", "bucket", "variant", "config", "device", "torch_version", "triton_version",
              "source_hash")


def arm_steps(q, job_id: str, op: str, bucket: str, since_step: int,
              phase: str = "fwd") -> list[dict]:
    """Per step and (variant, config) of one bucket: calls and total ns, over every rank and site.
    The evolve loop pairs arms by step: they ran in the same steps, on the same data."""
    return q.query(
        """SELECT step, variant, config, sum(count) AS calls, sum(total_ns) AS total_ns
           FROM kernel_spans
           WHERE job_id = ? AND op = ? AND bucket = ? AND phase = ? AND step >= ? AND count > 0
             AND total_ns IS NOT NULL
           GROUP BY step, variant, config ORDER BY step""",
        [job_id, op, bucket, phase, since_step])


def disabled_arms(q, job_id: str, op: str, bucket: str) -> set[tuple[str, str]]:
    """(variant, config) of the bucket the job reported disabled (``rtx.variant.disabled``: a
    first call that differed from the reference, a build that failed, a variant the job cannot
    run): they get no more calls there."""
    return {(e["variant"], e["config"] or "{}")
            for e in store_views.disabled_events(q, job_id, op=op, bucket=bucket)}


def job_resource(q, job_id: str) -> dict:
    """The resource attributes a job's telemetry carries (its lowest rank's newest process):
    its torch and triton versions and device models. Empty when it sent none."""
    rows = q.query("""SELECT attributes FROM resources WHERE job_id = ?
                      ORDER BY rank NULLS LAST, first_seen_ns DESC LIMIT 1""", [job_id])
    if not rows or not rows[0]["attributes"]:
        return {}
    try:
        attrs = json.loads(rows[0]["attributes"])
    except ValueError:
        return {}
    return attrs if isinstance(attrs, dict) else {}


def step_durations(q, job_id: str, since_step: int, until_step: int | None = None) -> list[dict]:
    """Step durations of a job (rank 0, or the lowest rank reporting) in a step window, and
    how many ranks reported each step."""
    return q.query(
        """SELECT step, min(duration_ns) AS duration_ns, count(DISTINCT rank) AS ranks
           FROM step_times
           WHERE job_id = ? AND step >= ? AND step <= ? GROUP BY step ORDER BY step""",
        [job_id, since_step, until_step if until_step is not None else 2**62])


def last_swap_step(q, job_id: str) -> int | None:
    """The step of the job's latest plan swap (its first rank to make it); None before any."""
    rows = q.query("SELECT max(step) AS step FROM swaps WHERE job_id = ?", [job_id])
    return rows[0]["step"] if rows else None


def running_plan_version(q, job_id: str) -> int | None:
    """The newest plan version the job swapped to (versions only grow in a job); None before
    its first swap."""
    rows = q.query("SELECT max(plan_to) AS v FROM swaps WHERE job_id = ?", [job_id])
    return rows[0]["v"] if rows else None


def last_step(q, job_id: str) -> int | None:
    rows = q.query("SELECT max(step) AS step FROM step_times WHERE job_id = ?", [job_id])
    return rows[0]["step"] if rows else None


def swap_step(q, job_id: str, plan_version: int) -> int | None:
    """The step at which the job (its first rank to do so) swapped to ``plan_version``."""
    rows = q.query("SELECT min(step) AS step FROM swaps WHERE job_id = ? AND plan_to = ?",
                   [job_id, plan_version])
    return rows[0]["step"] if rows else None


def region_swap_step(q, job_id: str) -> int | None:
    """The step of the job's latest whole-model region swap (to its compiled forward or back),
    or None: the ops inside a compiled region no longer reach the dispatcher, so what was
    measured before it says nothing about the job now."""
    rows = q.query("SELECT max(step) AS step FROM swaps WHERE job_id = ? "
                   "AND plan_digest LIKE 'region:%'", [job_id])
    return rows[0]["step"] if rows else None


def hotspots(q, job_id: str, since_step: int) -> list[dict]:
    """Every (op, bucket) of a job since ``since_step``: its kernel time (forward + sampled
    backward, scaled to every call of every step, per rank), calls per step, the (variant, config) with most
    calls, and the CV of its per-step forward mean; ranked by share of step time."""
    return q.query(
        """WITH k AS (
             SELECT op, bucket, variant, config, phase, step, sum(count) AS calls,
                    sum(total_ns) AS total_ns
             FROM kernel_spans WHERE job_id = ? AND step >= ? AND count > 0
               AND total_ns IS NOT NULL
             GROUP BY ALL),
           s AS (SELECT count(DISTINCT step) AS steps, sum(d) AS step_ns,
                        greatest(max(ranks), 1) AS ranks FROM
                 (SELECT step, min(duration_ns) AS d, count(DISTINCT rank) AS ranks
                  FROM step_times WHERE job_id = ? AND step >= ? GROUP BY step)),
           -- forward time is over every step of the window (a bucket called in few steps has a
           -- small share); backward is timed on one call a route in sampled steps only: its
           -- time per call, times the forward calls a step (each call has its backward)
           per_phase AS (
             SELECT op, bucket, phase,
                    sum(total_ns) / nullif(greatest(max(s.steps), count(DISTINCT step)), 0)
                        AS ns_per_step,
                    sum(total_ns) / nullif(sum(calls), 0) AS ns_per_call,
                    sum(calls) / nullif(greatest(max(s.steps), count(DISTINCT step)), 0) AS calls_per_step
             FROM k, s GROUP BY op, bucket, phase),
           scaled AS (
             SELECT p.op, p.bucket, p.phase, p.calls_per_step,
                    CASE WHEN p.phase = 'bwd' THEN p.ns_per_call * f.calls_per_step
                         ELSE p.ns_per_step END AS ns_per_step
             FROM per_phase p LEFT JOIN per_phase f
               ON f.op = p.op AND f.bucket = p.bucket AND f.phase = 'fwd'),
           fwd_means AS (
             SELECT op, bucket, variant, config, stddev_samp(total_ns / calls)
                        / nullif(avg(total_ns / calls), 0) AS cv, sum(calls) AS calls
             FROM k WHERE phase = 'fwd' GROUP BY ALL),
           top AS (SELECT op, bucket, t.v.variant AS variant, t.v.config AS config, t.v.cv AS cv
                   FROM (SELECT op, bucket,
                                arg_max(struct_pack(variant := variant, config := config, cv := cv),
                                        calls) AS v
                         FROM fwd_means GROUP BY ALL) t)
           SELECT p.op, p.bucket, t.variant, t.config, t.cv,
                  sum(p.ns_per_step) AS ns_per_step,
                  sum(p.calls_per_step) FILTER (WHERE p.phase = 'fwd') AS calls_per_step,
                  -- kernel time is summed over ranks; a step's time is one rank's
                  sum(p.ns_per_step) / max(s.ranks) / nullif(max(s.step_ns) / max(s.steps), 0)
                      AS share,
                  max(s.steps) AS steps
           FROM scaled p JOIN top t USING (op, bucket), s
           GROUP BY p.op, p.bucket, t.variant, t.config, t.cv
           ORDER BY share DESC NULLS LAST""",
        [job_id, since_step, job_id, since_step])


def recorded_buckets(q, op: str | None = None, job_id: str | None = None) -> list[dict]:
    """The (op, bucket) pairs seen in telemetry (the shapes ``rtxops tune`` benchmarks)."""
    return q.query(
        """SELECT op, bucket, sum(calls) AS calls, sum(total_ns) AS total_ns FROM kernel_minutes
           WHERE (? IS NULL OR op = ?) AND (? IS NULL OR job_id = ?) AND phase = 'fwd'
           GROUP BY op, bucket ORDER BY total_ns DESC""",
        [op, op, job_id, job_id])


# ---- the evolve tables --------------------------------------------------------------------

def _write(store: Store, sql: str, params: Sequence[Any], timeout_s: float = 30.0) -> None:
    store.call(lambda cur: cur.execute(sql, list(params)), timeout_s)


def save_trial(store: Store, row: dict) -> None:
    row = {**row, "detail": json.dumps(row.get("detail") or {}, sort_keys=True)}
    cols = ("trial_id", "job_id", "op", "bucket", "variant", "config", "mode", "strategy",
            "started_ns", "ended_ns", "samples", "median_ns", "p95_ns", "spread", "peak_bytes",
            "status", "detail")
    _write(store, f"INSERT OR REPLACE INTO trials ({', '.join(cols)}) VALUES "
                  f"({', '.join('?' * len(cols))})", [row.get(c) for c in cols])


def save_decision(store: Store, row: dict) -> None:
    row = {**row, "evidence": json.dumps(row.get("evidence") or {}, sort_keys=True)}
    cols = ("decision_id", "job_id", "op", "bucket", "kind", "candidate_variant",
            "candidate_config", "incumbent_variant", "incumbent_config", "plan_version", "gain",
            "ci_low", "ci_high", "p_value", "reason", "evidence", "bundle_digest", "at_ns")
    _write(store, f"INSERT OR REPLACE INTO decisions ({', '.join(cols)}) VALUES "
                  f"({', '.join('?' * len(cols))})", [row.get(c) for c in cols])


def save_gate_result(store: Store, key: dict, passed: bool, reason: str, max_error: float | None,
                     checked_ns: int) -> None:
    cols = TUNING_KEY + ("passed", "reason", "max_error", "checked_ns")
    _write(store, f"INSERT OR REPLACE INTO gate_results ({', '.join(cols)}) VALUES "
                  f"({', '.join('?' * len(cols))})",
           [key[c] for c in TUNING_KEY] + [passed, reason, max_error, checked_ns])


def gate_result(q, key: dict) -> dict | None:
    rows = q.query("SELECT * FROM gate_results WHERE "
                   + " AND ".join(f"{c} = ?" for c in TUNING_KEY), [key[c] for c in TUNING_KEY])
    return rows[0] if rows else None


def upsert_tuning(store: Store, key: dict, values: dict) -> None:
    """Insert or update one tuning-database row (the key is every part that invalidates it). A
    row marked ``regressed`` (a canary rolled it back) stays so, with its reason, whatever is
    measured later under the same key: only a new key (versions, source) clears it. A live figure
    (online or canary: forward calls inside a job's steps) never replaces an offline one
    (forward and backward, benchmarked): they measure different things; a canary's verdict
    still marks the row. A run that measured nothing (``failed``: a worker timed out or was
    killed) leaves a row that holds a measurement as it was, the failure noted in its reason: the
    same key is the same code, so the failure was the run's, not the kernel's."""
    measured = ("source", "trials", "median_ns", "spread", "peak_bytes", "updated_ns")
    cols = TUNING_KEY + measured + ("status", "reason")
    row = {**key, **values}
    # (every SET expression reads the row as it was)
    kept = "(status = 'ok' AND median_ns IS NOT NULL AND excluded.status = 'failed')"
    keep = f"(source = 'offline' AND excluded.source IN ('online', 'canary')) OR {kept}"
    figure = f"CASE WHEN {keep} THEN {{0}} ELSE excluded.{{0}} END"
    status = ("CASE WHEN status = 'regressed' OR (source = 'offline' AND excluded.source = "
              f"'online') OR {kept} THEN status ELSE excluded.status END")
    reason = (f"CASE WHEN {kept} THEN 'a later run measured nothing: ' || excluded.reason "
              "WHEN status = 'regressed' OR (source = 'offline' AND excluded.source = 'online') "
              "THEN reason ELSE excluded.reason END")
    _write(store, f"INSERT INTO tuning ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
                  "ON CONFLICT DO UPDATE SET "
                  + ", ".join([f"{c} = {figure.format(c)}" for c in measured]
                              + [f"status = {status}", f"reason = {reason}"]),
           [row.get(c) for c in cols])


def tuning_rows(q, key: dict | None = None, *, op: str | None = None, limit: int = 1000,
                offset: int = 0) -> list[dict]:
    """Tuning rows matching ``key``'s parts (any subset of :data:`TUNING_KEY`), or every row."""
    key = {k: v for k, v in (key or {}).items() if k in TUNING_KEY}
    if op is not None:
        key["op"] = op
    where = " AND ".join(f"{c} = ?" for c in key) or "true"
    # every key column: rows of one arm under other versions tie on the rest, and pages cut
    # between ties repeated some rows and left out others
    return q.query(f"SELECT * FROM tuning WHERE {where} ORDER BY op, bucket, median_ns, variant, "
                   "config, device, torch_version, triton_version, source_hash LIMIT ? OFFSET ?",
                   [*key.values(), limit, offset])


def decisions(q, job_id: str | None = None, limit: int = 200, offset: int = 0) -> list[dict]:
    return q.query("SELECT * FROM decisions WHERE (? IS NULL OR job_id = ?) "
                   "ORDER BY at_ns DESC, decision_id LIMIT ? OFFSET ?", [job_id, job_id, limit, offset])


def trials(q, job_id: str | None = None, op: str | None = None, limit: int = 500,
           offset: int = 0) -> list[dict]:
    return q.query("SELECT * FROM trials WHERE (? IS NULL OR job_id = ?) AND (? IS NULL OR op = ?) "
                   "ORDER BY started_ns DESC, trial_id LIMIT ? OFFSET ?",
                   [job_id, job_id, op, op, limit, offset])


# ---- offline tuning tasks --------------------------------------------------------------------

SUMMARY = ("id", "state", "params", "progress", "error")  # what /v1/evolve/status lists
INTERRUPTED = ("interrupted: the daemon stopped before the task finished; the trials it measured "
               "are in the tuning database; submit it again to finish")


def save_tune_task(store: Store, task: dict) -> Future:
    """Queue ``task``'s record (TuneTasks': id, state, params, progress, report, error, times) for
    the writer, which keeps the order of the queue; the future resolves once it is committed."""
    summary = {k: task.get(k) for k in SUMMARY}
    row = [task["id"], task["state"], task["submitted_ns"], task["ended_ns"],
           json.dumps(summary, sort_keys=True, default=str),
           json.dumps(task, sort_keys=True, default=str)]
    return store.run_write(lambda cur: cur.execute(
        "INSERT OR REPLACE INTO tune_tasks VALUES (?, ?, ?, ?, ?, ?)", row))


def saved_tune_tasks(q, task_id: str | None = None, limit: int = 50,
                     summary: bool = False) -> list[dict]:
    """Saved tasks, newest first (only the :data:`SUMMARY` fields with ``summary``), as a daemon
    that did not run them sees them: one left queued or running when its daemon stopped has
    failed, with :data:`INTERRUPTED` as the error."""
    column = "summary" if summary else "record"
    rows = q.query(f"SELECT {column} AS t FROM tune_tasks WHERE ? IS NULL OR task_id = ? "
                   "ORDER BY submitted_ns DESC LIMIT ?", [task_id, task_id, limit])
    tasks = []
    for r in rows:
        try:
            task = json.loads(r["t"])
            if task.get("state") in ("queued", "running"):
                task["state"], task["error"] = "failed", INTERRUPTED
            tasks.append(task)
        except (TypeError, ValueError, AttributeError):  # another version's row: left out
            log.warning("rtxops: an unreadable tuning-task record was left out")
    return tasks
