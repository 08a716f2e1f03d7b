"""The governance ledger's table: append-only and hash-chained. Each entry's hash covers its
fields and the previous entry's hash, so an edited, deleted or reordered row breaks the chain.
Appends go through the store's writer thread, which serialises them."""
from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Callable

from .store import Store

GENESIS = "sha256:" + "0" * 64
FIELDS = ("seq", "at_ns", "kind", "scope", "version", "subject_digest", "decision", "signer",
          "reason", "prev_hash")


def entry_hash(row: dict[str, Any]) -> str:
    """sha256 over the canonical JSON of the entry's fields (all but its own hash)."""
    body = json.dumps({k: row.get(k) for k in FIELDS}, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(body.encode()).hexdigest()


def append_entry(store: Store, *, kind: str, scope: str, version: int, subject_digest: str,
                 decision: dict | None, signer: str, reason: str = "",
                 timeout_s: float = 30.0, before_insert: Callable[[dict], None] | None = None) -> dict:
    """Append one entry after the current last one; returns it (with seq and hashes).
    ``before_insert(row)`` runs once the row is known and before it is written (raising, it
    writes nothing)."""

    def append(cur) -> dict:
        last = cur.execute("SELECT seq, entry_hash FROM ledger ORDER BY seq DESC LIMIT 1").fetchone()
        row = {"seq": (last[0] + 1) if last else 1, "at_ns": time.time_ns(), "kind": kind,
               "scope": scope, "version": version, "subject_digest": subject_digest,
               "decision": json.dumps(decision or {}, sort_keys=True, separators=(",", ":")),
               "signer": signer, "reason": reason, "prev_hash": last[1] if last else GENESIS}
        row["entry_hash"] = entry_hash(row)
        if before_insert is not None:
            before_insert(row)
        cur.execute(f"INSERT INTO ledger ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                    list(row.values()))
        return row

    return store.call(append, timeout_s)


def read_entries(q, *, after_seq: int = 0, limit: int | None = None, offset: int = 0) -> list[dict]:
    """The entries in stored order (``q``: a Store or ReadOnlyStore): every one by default; those
    after ``after_seq``; a page of ``limit`` from ``offset``."""
    page = "" if limit is None else f" LIMIT {int(limit)} OFFSET {int(offset)}"
    where = " WHERE seq > $after" if after_seq else ""
    return q.query(f"SELECT {', '.join(FIELDS)}, entry_hash FROM ledger{where} ORDER BY seq{page}",
                   {"after": after_seq} if after_seq else None)


def count_entries(q) -> int:
    return q.query("SELECT count(*) AS n FROM ledger")[0]["n"]


def newest_version(q, scope: str, kinds: tuple[str, ...] = ("promote", "rollback", "explore", "manual")) -> int | None:
    """The highest plan version the ledger accepted for ``scope``, or None."""
    rows = q.query("SELECT max(version) AS v FROM ledger WHERE scope = $scope AND list_contains($kinds, kind)",
                   {"scope": scope, "kinds": list(kinds)})
    return rows[0]["v"] if rows else None


def accepted_digest(q, scope: str, version: int) -> str | None:
    """The subject digest of the bundle the ledger accepted for ``scope`` at ``version``."""
    rows = q.query("SELECT subject_digest FROM ledger WHERE scope = $scope AND version = $version "
                   "AND kind != 'deny' ORDER BY seq DESC LIMIT 1", {"scope": scope, "version": version})
    return rows[0]["subject_digest"] if rows else None
