"""What each page shows, as JSON-ready dicts: the API returns them as they are, the pages render
them. Reads go through :mod:`rtxops.telemetry.store_views` only."""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

from rtxops.telemetry import export
from rtxops.telemetry import store_views as V

from .params import Paging, Window

TRACE_ROW_LIMIT = 50_000
JOB_STATES = ("pending", "running", "hung", "restarting", "cancelling", "succeeded", "failed",
              "cancelled", "lost")


class GovernanceReports(Protocol):
    """What governance tells the dashboard (the daemon wires it in)."""

    def verify_chain(self) -> dict:
        """``{"ok": bool, "problems": [str]}`` for the whole ledger."""

    def verify_bundle(self, entry: dict) -> dict | None:
        """The verify report (as ``rtxops verify``), SBOM components and provenance of the
        bundle a ledger entry names; None when the bundle is not on disk."""

    def policies(self) -> list[dict]:
        """The policies in force: name and rules (name, CEL ``require``, reason)."""


def jsonable(value: Any) -> Any:
    """``value`` with NaN/inf floats as None and tuples as lists (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def page(total: int, rows: list[dict], paging: Paging) -> dict:
    return {"total": total, "limit": paging.limit, "offset": paging.offset, "items": rows}


def _record(row: dict | None) -> dict:
    try:
        return json.loads(row["record"]) if row and row.get("record") else {}
    except ValueError:
        return {}


# ---- overview ----------------------------------------------------------------------------------

def jobs_page(q, *, state: str | None, search: str | None, paging: Paging) -> dict:
    """Jobs with state, steps, restarts, current plan version."""
    total, rows = V.jobs(q, state=state, search=search, limit=paging.limit, offset=paging.offset)
    facts = V.job_facts(q, [r["job_id"] for r in rows]) if rows else {}
    items = []
    for row in rows:
        rec, fact = _record(row), facts.get(row["job_id"], {})
        items.append({
            "job_id": row["job_id"], "name": row["name"], "state": row["state"] or "telemetry only",
            "created_ns": row["created_ns"], "updated_ns": row["updated_ns"],
            "last_step": rec.get("last_step"), "ranks": fact.get("ranks", 0),
            "plan_version": fact.get("plan_version"),
            "crash_restarts": rec.get("crash_restarts", 0), "hang_restarts": rec.get("hang_restarts", 0),
            "reason": rec.get("reason", ""),
        })
    return page(total, items, paging)


def step_chart(q, *, job_id: str | None, window: Window, points: int) -> dict:
    """Step time p50/p95 per job over time, with swap and rollback markers."""
    series: dict[str, dict] = {}
    for r in V.step_series(q, job_id=job_id, since_ns=window.since_ns, until_ns=window.until_ns,
                           points=points):
        s = series.setdefault(r["job_id"], {"job_id": r["job_id"], "t_ns": [], "p50_ms": [],
                                            "p95_ms": [], "steps": []})
        s["t_ns"].append(r["t_ns"])
        s["p50_ms"].append(_scaled(r["p50_ns"], 1e6))
        s["p95_ms"].append(_scaled(r["p95_ns"], 1e6))
        s["steps"].append(r["steps"])
    markers = V.swap_markers(q, job_id=job_id, since_ns=window.since_ns, until_ns=window.until_ns,
                             limit=1000)
    return {"series": list(series.values()), "markers": markers}


DROPS_WINDOW_S = 900


def ingest(q, *, window: Window, stats: dict | None, problems: list[str] | None) -> dict:
    """Ingest rate (last minute), drops jobs reported in the window's last 15 minutes at most,
    the daemon's counters and readiness (``problems``: why it is not ready; None: unknown)."""
    now = time.time_ns()
    # counted back from now, not from the window's end, which runs a minute ahead of now for
    # clocks ahead of ours (the last 15 minutes were 14, and a 5-minute window said 6)
    end = min(window.until_ns, now)
    drops_since = max(window.since_ns, end - DROPS_WINDOW_S * 10**9)
    return {"rate": V.ingest_rate(q, now_ns=now),
            "drops_reported": V.reported_drops(q, since_ns=drops_since, until_ns=window.until_ns),
            "drops_window_s": max(0, min((end - drops_since) // 10**9, window.window_s)),
            "daemon": stats or {},
            "health": {"ready": None if problems is None else not problems, "problems": problems or []}}


# ---- kernels -----------------------------------------------------------------------------------

def kernels(q, *, job_id: str | None, op: str | None, window: Window, paging: Paging) -> dict:
    """Per job → op → bucket → variant and phase: calls, time, share of step time, p50/p95, and
    whether it is the variant the job ran last (``current``); one page of them."""
    total, rows = V.kernel_table(q, job_id=job_id, op=op, since_ns=window.since_ns,
                                 until_ns=window.until_ns, limit=paging.limit, offset=paging.offset)
    totals = V.step_totals(q, job_id=job_id, since_ns=window.since_ns, until_ns=window.until_ns)
    items = []
    for r in rows:
        step = totals.get(r["job_id"], {})
        share = r["total_ns"] / step["step_ns"] if step.get("step_ns") and r["total_ns"] is not None else None
        items.append({**r, "share": share,
                      "plan_version": step.get("plan_version")})
    return {**page(total, items, paging), "steps": list(totals.values())}


def kernel_series(q, *, job_id: str | None, op: str | None, bucket: str | None, window: Window,
                  points: int) -> dict:
    """p50/p95 of per-call mean time over time, one series per (job, op, bucket, variant,
    config, phase), for the keys with the most kernel time."""
    series: dict[tuple, dict] = {}
    for r in V.kernel_series(q, job_id=job_id, op=op, bucket=bucket, since_ns=window.since_ns,
                             until_ns=window.until_ns, points=points):
        key = (r["job_id"], r["op"], r["bucket"], r["variant"], r["config"], r["phase"])
        s = series.setdefault(key, {"job_id": r["job_id"], "op": r["op"], "bucket": r["bucket"],
                                    "variant": r["variant"], "config": r["config"],
                                    "phase": r["phase"], "t_ns": [], "p50_us": [], "p95_us": []})
        s["t_ns"].append(r["t_ns"])
        s["p50_us"].append(_scaled(r["p50_ns"], 1e3))
        s["p95_us"].append(_scaled(r["p95_ns"], 1e3))
    return {"series": list(series.values())}


def breakdown(q, *, job_id: str, at_ns: int | None, span_s: int, window: Window) -> dict:
    """Kernel time per step by op, ``span_s`` seconds before vs after a swap (default: the job's
    last swap in the window); empty when the job has no swap."""
    swaps = [m for m in V.swap_markers(q, job_id=job_id, since_ns=window.since_ns,
                                       until_ns=window.until_ns, limit=1000) if m["step"] is not None]
    chosen = next((m for m in swaps if m["at_ns"] == at_ns), None) if at_ns else (swaps[-1] if swaps else None)
    if chosen is None:
        return {"swap": None, "swaps": swaps, "before": [], "after": []}
    at, span = chosen["at_ns"], span_s * 10**9
    return {"swap": chosen, "swaps": swaps, "span_s": span_s,
            "before": V.op_breakdown(q, job_id=job_id, since_ns=at - span, until_ns=at),
            "after": V.op_breakdown(q, job_id=job_id, since_ns=at, until_ns=at + span)}


# ---- evolve ------------------------------------------------------------------------------------

def evolve(q, *, job_id: str | None, window: Window) -> dict:
    """Hot spots, the latest trials of running jobs, canaries (passed or rolled back) and
    rollbacks (first page of each)."""
    running = V.running_job_trials(q, job_id=job_id, limit=50)
    canaries = V.canaries(q, job_id=job_id, limit=50)
    _, rollbacks = V.decisions(q, job_id=job_id, op=None, kind="rollback", limit=50, offset=0)
    return {"hot_spots": V.hot_spots(q, job_id=job_id, since_ns=window.since_ns,
                                     until_ns=window.until_ns, limit=10),
            "running": running, "canaries": canaries, "rollbacks": rollbacks}


# ---- jobs --------------------------------------------------------------------------------------

EVENTS_SHOWN = 1000
STACKS_SHOWN = 20


def job_detail(q, job_id: str) -> dict | None:
    """One job: its record (spec, attempts with exit and restart reasons), status history,
    captured stacks and the variants its runtime disabled; None when neither the supervisor nor
    telemetry knows it."""
    row = V.job(q, job_id)
    if row is None and not V.job_known(q, job_id):
        return None
    rec = _record(row)
    rec.pop("token", None)
    # the newest events (a job restarting for hours has tens of thousands, and the newest say
    # where it stands), the stacks among them the newest few (each can be a screenful)
    total, _ = V.job_events(q, job_id, kind=None, limit=0, offset=0)
    _, events = V.job_events(q, job_id, kind=None, limit=EVENTS_SHOWN,
                             offset=max(0, total - EVENTS_SHOWN))
    history, stacks = [], []
    for e in events:
        try:
            detail = json.loads(e["detail"] or "{}")
        except ValueError:
            detail = {"raw": e["detail"]}
        (stacks if e["kind"] == "stacks" else history).append(
            {"ts_ns": e["ts_ns"], "kind": e["kind"], "detail": detail})
    return {"job_id": job_id, "name": (row or {}).get("name") or job_id,
            "state": (row or {}).get("state") or "telemetry only",
            "command": rec.get("spec", {}).get("command", []), "reason": rec.get("reason", ""),
            "last_step": rec.get("last_step"), "crash_restarts": rec.get("crash_restarts", 0),
            "hang_restarts": rec.get("hang_restarts", 0),
            "attempts": [{k: a.get(k) for k in ("number", "started_at_ns", "ended_at_ns", "pid",
                                                 "outcome", "exit_code", "signal", "detail")}
                         for a in rec.get("attempts", [])],
            "history": history, "stacks": stacks[-STACKS_SHOWN:],
            "events_left_out": total - len(events),
            "stacks_left_out": max(0, len(stacks) - STACKS_SHOWN),
            "ranks": V.job_facts(q, [job_id]).get(job_id, {}).get("ranks", 0),
            "disabled": V.disabled_variants(q, job_id)}


# ---- governance --------------------------------------------------------------------------------

def governance(q, paging: Paging, reports: GovernanceReports | None) -> dict:
    """Ledger entries (empty without a ledger table), chain status and policies when governance
    is wired in."""
    total, rows = V.ledger(q, limit=paging.limit, offset=paging.offset)
    return {"ledger_table": V.table_exists(q, V.LEDGER), "ledger": page(total, rows, paging),
            "chain": _call(reports, "verify_chain", None) if total else None,
            "policies": _call(reports, "policies", []) or [],
            "last_denial": V.last_denial(q)}   # of the whole ledger, not the page shown


def bundle(q, digest: str, reports: GovernanceReports | None) -> dict | None:
    entry = V.ledger_entry(q, digest)
    if entry is None:
        return None
    return {"entry": entry, "verify": _call(reports, "verify_bundle", None, entry)}


def _call(reports: Any, name: str, default: Any, *args: Any) -> Any:
    fn: Callable | None = getattr(reports, name, None)
    if fn is None:
        return default
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 (a governance failure is shown, not raised)
        return {"error": f"{type(e).__name__}: {e}"}


# ---- export ------------------------------------------------------------------------------------

def chrome_trace(q, *, job_id: str | None, window: Window) -> dict:
    """The window's first 50 000 spans (without sampled calls) as a Chrome trace;
    ``otherData.rtxops.truncated`` says when the window held more."""
    rows = V.window_rows(q, job_id=job_id, since_ns=window.since_ns, until_ns=window.until_ns,
                         limit=TRACE_ROW_LIMIT)
    doc = export.chrome_trace(rows)
    doc["otherData"].update({"rtxops.window": window.query(), "rtxops.job": job_id,
                             "rtxops.truncated": len(rows) >= TRACE_ROW_LIMIT})
    return doc


def _scaled(ns: float | None, per: float) -> float | None:
    """``ns`` in units of ``per`` ns; None where spans lacked the figure (any OTLP client may)."""
    return None if ns is None else ns / per
