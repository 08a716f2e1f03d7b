"""Retention: delete telemetry older than an age, so a long-running daemon's store stops growing.

What goes: span rows (but plan swaps: the evolve loop finds a swap's step by them, and they are
few), span events, the per-minute kernel rollups, the ingest log (its last 15 minutes recognise
a client's retry: far younger than any cutoff) and job log lines, each by its own timestamp; then span keys and resources no span refers to. What stays: job records and
events, the evolve loop's tables (tuning, trials, gate results, decisions) and the governance
ledger — the evidence behind signed decisions is never pruned. The shortest age is a day: the
loop's windows count steps, which can be minutes each. DuckDB reuses the freed space for new
rows; the file itself does not shrink.
"""
from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import duckdb

from .store import MINUTE_NS, Store

CHECKPOINT_SPARE_BYTES = 64 << 20
MAX_AGE_S = 50 * 365 * 86400
MIN_AGE_S = 86400                    # younger data may feed the evolve loop's windows and canaries
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_AGE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*")

_SPANS_GONE = "start_ns < $1 AND key_id NOT IN (SELECT key_id FROM span_keys WHERE name = 'rtx.swap')"
# (table, what its rows are called in a report, which rows go: older than the cutoff ($1))
_BY_TIME = (
    ("span_rows", "spans", _SPANS_GONE),
    ("span_events", "span events", "time_ns < $1"),
    ("job_logs", "job log lines", "ts_ns < $1"),
    ("kernel_minutes", "kernel minutes", f"minute < $1 // {MINUTE_NS}"),
    ("ingest_batches", "ingest batches", "received_ns < $1"),
)
# what no span left refers to (a dry run has deleted nothing: the spans that go count as gone)
_ORPHANS = tuple(
    (table, label, f"NOT EXISTS (SELECT 1 FROM span_rows r WHERE r.{column} = {table}.{column} "
                   f"AND NOT ({_SPANS_GONE}))")
    for table, label, column in (("span_keys", "span keys", "key_id"),
                                 ("resources", "resources", "resource_id")))


def parse_age(text: str) -> float:
    """Seconds in an age like ``30d``, ``12h``, ``90m``, ``2w`` (ValueError otherwise)."""
    match = _AGE.fullmatch(text or "")
    if not match:
        raise ValueError(f"not an age: {text!r} (a number and a unit, s m h d or w: 30d, 12h)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def check_age(seconds: float) -> float:
    """``seconds`` if it is a retention this store allows (at least :data:`MIN_AGE_S`)."""
    if not seconds >= MIN_AGE_S:
        raise ValueError("a retention under a day may delete what the evolve loop is still "
                         "reading; give 1d or more")
    if not seconds <= MAX_AGE_S:   # (nanoseconds before now past this are before 1970)
        raise ValueError("an age over 50 years: nothing in the store is that old")
    return seconds


@dataclass(frozen=True)
class PruneReport:
    """What a prune deleted (or, for a dry run, would delete), per kind of row."""

    before_ns: int
    dry_run: bool
    rows: dict[str, int]
    seconds: float

    @property
    def total(self) -> int:
        return sum(self.rows.values())

    def as_dict(self) -> dict:
        return {"before_ns": self.before_ns, "dry_run": self.dry_run, "rows": self.rows,
                "total": self.total, "seconds": round(self.seconds, 3)}


def prune(store: Store, older_than_s: float, *, dry_run: bool = False,
          timeout_s: float | None = 600.0) -> PruneReport:
    """Delete the store's telemetry older than ``older_than_s`` seconds in one transaction on
    the writer thread (ingest waits meanwhile; a failure leaves everything in place)."""
    check_age(older_than_s)
    before_ns = _cutoff(older_than_s)
    started = time.perf_counter()

    def run(cur: duckdb.DuckDBPyConnection) -> dict[str, int]:
        counted = _rows(cur, before_ns, delete=not dry_run)
        if not dry_run:
            store.forget_stored_ids()   # keys and resources it deleted must be written again
        return counted

    rows = store.call(run, timeout_s)
    if not dry_run:
        store.note_pruned(sum(rows.values()))
    if not dry_run and any(rows.values()) and _room_to_checkpoint(store.path):
        # after the commit: DuckDB marks the deleted rows' blocks free at a checkpoint
        store.call(lambda cur: cur.execute("CHECKPOINT"), timeout_s, transaction=False)
    return PruneReport(before_ns, dry_run, rows, time.perf_counter() - started)


def count(q, older_than_s: float) -> PruneReport:
    """What :func:`prune` would delete, counted through ``q``'s reader (a
    :class:`~rtxops.telemetry.store.ReadOnlyStore` too: nothing is written)."""
    check_age(older_than_s)
    before_ns = _cutoff(older_than_s)
    started = time.perf_counter()
    with q.reader() as cur:
        rows = _rows(cur, before_ns, delete=False)
    return PruneReport(before_ns, True, rows, time.perf_counter() - started)


def _cutoff(older_than_s: float) -> int:
    """Now less ``older_than_s``, down to a whole minute: the kernel rollup keeps minutes, and
    a cutoff inside one deleted its spans before the cutoff but kept their rollup row."""
    before_ns = time.time_ns() - int(older_than_s * 1e9)
    return before_ns - before_ns % MINUTE_NS


def _room_to_checkpoint(path: Path) -> bool:
    """Whether the disk has room for a checkpoint (its WAL's size, and some): one that fails
    invalidates the database until it is reopened. Without room, DuckDB's own checkpoint comes
    later."""
    try:
        wal = os.path.getsize(f"{path}.wal")
    except OSError:
        wal = 0
    try:
        return shutil.disk_usage(path.parent).free > 2 * wal + CHECKPOINT_SPARE_BYTES
    except OSError:
        return False


def _rows(cur: duckdb.DuckDBPyConnection, before_ns: int, delete: bool) -> dict[str, int]:
    """Delete (or count) what goes, table by table; then the keys and resources no span left
    refers to (each of those scans every span row left: only after spans went)."""
    verb = "DELETE FROM" if delete else "SELECT count(*) FROM"
    rows = {label: _scalar(cur, f"{verb} {table} WHERE {which}", before_ns)
            for table, label, which in _BY_TIME}
    for table, label, which in _ORPHANS:
        rows[label] = _scalar(cur, f"{verb} {table} WHERE {which}", before_ns) if rows["spans"] else 0
    return rows


def _scalar(cur: duckdb.DuckDBPyConnection, sql: str, *params: int) -> int:
    return int(cur.execute(sql, list(params)).fetchone()[0])
