"""What the runtime did in a process: per op, bucket and variant, calls and time."""
from __future__ import annotations

import json
import os
from collections import defaultdict

from .dispatcher import Dispatcher, ModuleSite
from .readings import CallStats


def summarize(dispatcher: Dispatcher) -> dict:
    """A JSON-ready summary of what ``dispatcher`` did (calls and time need readings that keep
    :class:`CallStats`)."""
    stats = _call_stats(dispatcher)
    rows = []
    if stats is not None:
        for slot in stats.slots:
            if stats.calls[slot.id] or stats.build_misses[slot.id]:
                rows.append({
                    "op": slot.op, "bucket": slot.bucket, "variant": slot.variant,
                    "config": slot.config, "site": slot.site, "calls": stats.calls[slot.id],
                    "total_ns": stats.total_ns[slot.id], "builds": stats.build_misses[slot.id],
                })
    return {
        # the processes of one job: its daemon job id, or the run `rtxops run --direct` made
        "job_id": os.environ.get("RTXOPS_JOB_ID") or os.environ.get("RTXOPS_RUN_ID", ""),
        "processes": 1,
        "first_step": dispatcher.steps_before,
        "steps": dispatcher.step - dispatcher.steps_before,
        "plan_version": dispatcher.plan.version,
        "plan_digest": dispatcher.plan.digest,
        "peak_rss_bytes": stats.peak_rss if stats else 0,
        "slots": rows,
        "disabled": [
            {"op": k[0], "variant": k[1], "config": k[2], "bucket": k[3],
             "reason": reason + (f" (under autocast {_autocast_text(k[4])})" if k[4] else "")}
            for k, reason in dispatcher.disabled.items()
        ],
        "modules_on_own_forward": [
            *({"site": s.name, "reason": s.failed}
              for s in dispatcher.sites if isinstance(s, ModuleSite) and s.failed),
            *({"site": f"{s.name} subclass {sub.__module__}.{sub.__qualname__}", "reason": why}
              for s in dispatcher.sites if isinstance(s, ModuleSite)
              for sub, why in s.subclasses_back.items()),
        ],
        "plan_rejections": list(dispatcher.plan_rejections),
    }


def did_anything(summary: dict) -> bool:
    """Whether the process stepped or routed a call (a spawned DataLoader worker does neither)."""
    return bool(summary.get("steps") or summary.get("slots"))


def merged(a: dict, b: dict) -> dict:
    """The summary of two processes of one job: calls and time added up per slot, the steps
    from the first either started at to the last either reached (ranks step side by side, a
    restarted attempt goes on from the step its predecessor reported), the larger peak RSS, the
    newer plan, and every disabled variant, module and rejection either saw."""
    slots: dict[tuple, dict] = {}
    for row in [*a.get("slots", []), *b.get("slots", [])]:
        key = tuple(row.get(k) for k in ("op", "bucket", "variant", "config", "site"))
        if key in slots:
            mine = slots[key]
            slots[key] = {**mine, **{k: mine.get(k, 0) + row.get(k, 0)
                                     for k in ("calls", "total_ns", "builds")}}
        else:
            slots[key] = dict(row)
    newer = max((a, b), key=lambda s: (s.get("plan_version") or 0, s.get("steps") or 0))
    first = min(s.get("first_step", 0) for s in (a, b))
    last = max(s.get("first_step", 0) + s.get("steps", 0) for s in (a, b))
    return {
        "job_id": a.get("job_id", ""),
        "processes": a.get("processes", 1) + b.get("processes", 1),
        "first_step": first,
        "steps": last - first,
        "plan_version": newer.get("plan_version"),
        "plan_digest": newer.get("plan_digest"),
        "peak_rss_bytes": max(a.get("peak_rss_bytes", 0), b.get("peak_rss_bytes", 0)),
        "slots": list(slots.values()),
        **{k: _union(a.get(k, []), b.get(k, []))
           for k in ("disabled", "modules_on_own_forward", "plan_rejections")},
    }


def _union(a: list, b: list) -> list:
    seen = {json.dumps(x, sort_keys=True) for x in a}
    return [*a, *(x for x in b if json.dumps(x, sort_keys=True) not in seen)]


def per_op(summary: dict) -> list[dict]:
    """Rows per op: calls, time, share of routed time, and the variant each bucket ran."""
    total = sum(r["total_ns"] for r in summary["slots"]) or 1
    ops: dict[str, dict] = defaultdict(lambda: {"calls": 0, "total_ns": 0, "buckets": {}})
    for r in summary["slots"]:
        o = ops[r["op"]]
        o["calls"] += r["calls"]
        o["total_ns"] += r["total_ns"]
        b = o["buckets"].setdefault(r["bucket"], {})
        b[r["variant"]] = b.get(r["variant"], 0) + r["calls"]
    out = []
    for op, o in sorted(ops.items(), key=lambda kv: -kv[1]["total_ns"]):
        out.append({"op": op, "calls": o["calls"], "total_ns": o["total_ns"],
                    "share": o["total_ns"] / total, "buckets": o["buckets"]})
    return out


def _call_stats(dispatcher: Dispatcher) -> CallStats | None:
    """The CallStats the readings keep: the readings themselves, or the ``totals`` a telemetry
    recorder accumulates off the hot path."""
    r = dispatcher.readings
    for candidate in (r, getattr(r, "totals", None)):
        if isinstance(candidate, CallStats):
            return candidate
    return None


def _autocast_text(scope: tuple) -> str:
    return ", ".join(f"{device} {str(dtype).removeprefix('torch.')}" for device, dtype in scope)
