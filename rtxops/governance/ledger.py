"""The ledger: every promotion, rollback, manual publish and denial, hash-chained in the store.
A head file next to the store (last seq and hash) catches a deleted tail."""
from __future__ import annotations

import json
from pathlib import Path

import threading

from rtxops.telemetry.store_ledger import (GENESIS, append_entry, count_entries, entry_hash,
                                          newest_version, read_entries)

__all__ = ["ChainCheck", "append", "check_chain", "count_entries", "export_jsonl",
           "newest_version", "read_entries"]


def append(store, head_file: Path | None, **entry) -> dict:
    row = append_entry(store, **entry)
    if head_file is not None:
        tmp = head_file.with_name(head_file.name + ".tmp")
        tmp.write_text(json.dumps({"seq": row["seq"], "entry_hash": row["entry_hash"]}) + "\n")
        tmp.replace(head_file)
    return row


def check_chain(rows: list[dict], head: dict | None = None, *,
                after: tuple[int, str] = (0, GENESIS)) -> list[str]:
    """Every problem in ``rows`` (stored order): an edited entry (hash), a deleted or reordered
    one (sequence, previous hash), a deleted tail (``head``, as :func:`read_head` gives it; None
    skips that check). Empty when intact. ``after``: the (seq, entry hash) of the verified entry
    ``rows`` follow (the genesis by default)."""
    problems = []
    expected_seq, prev = after[0] + 1, after[1]
    for row in rows:
        seq = row.get("seq")
        if seq != expected_seq:
            problems.append(f"entry {seq}: expected sequence number {expected_seq} (deleted or reordered entry)")
        if row.get("prev_hash") != prev:
            problems.append(f"entry {seq}: previous hash does not match entry {expected_seq - 1} "
                            "(deleted or reordered entry)")
        if entry_hash(row) != row.get("entry_hash"):
            problems.append(f"entry {seq}: its hash does not match its contents (edited entry)")
        prev, expected_seq = row.get("entry_hash"), expected_seq + 1
    if head is not None and "invalid" in head:
        problems.append(f"the head file is unreadable ({head['invalid']}): the tail cannot be checked")
    elif head is not None and not head:
        if rows or after[0]:
            problems.append("the head file is missing (every append writes it): entries at the end "
                            "may have been deleted")
    elif head is not None:
        last = rows[-1] if rows else {"seq": after[0], "entry_hash": after[1]}
        if (last["seq"], last["entry_hash"]) != (head.get("seq"), head.get("entry_hash")):
            problems.append(f"the last entry is {last['seq']}, the head file says {head.get('seq')} "
                            "(entries deleted at the end, or the head replaced)")
    return problems


class ChainCheck:
    """:func:`check_chain` over a ledger that only grows, verifying only the entries after the
    last verified one. For the daemon, the store's only writer: nothing else can edit the verified
    prefix while it holds the store (``rtxops ledger verify`` checks the whole chain offline)."""

    def __init__(self) -> None:
        self.verified: tuple[int, str] = (0, GENESIS)
        self._lock = threading.Lock()

    def problems(self, store, head: dict | None) -> list[str]:
        with self._lock:
            rows = read_entries(store, after_seq=self.verified[0])
            problems = check_chain(rows, head, after=self.verified)
            if not problems and rows:
                self.verified = (rows[-1]["seq"], rows[-1]["entry_hash"])
            return problems


def read_head(head_file: Path) -> dict:
    """The head file's ``{seq, entry_hash}``; ``{}`` when there is none yet, ``{"invalid": why}``
    when it cannot be read or is not of that form (so a removed or broken head never turns the
    tail check off)."""
    try:
        text = head_file.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        return {"invalid": f"{type(e).__name__}: {e}"}
    try:
        head = json.loads(text)
    except (ValueError, RecursionError) as e:
        return {"invalid": f"not JSON: {type(e).__name__}"}
    if (not isinstance(head, dict) or type(head.get("seq")) is not int
            or not isinstance(head.get("entry_hash"), str)):
        return {"invalid": "not an object with an integer seq and a string entry_hash"}
    return {"seq": head["seq"], "entry_hash": head["entry_hash"]}


def export_jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in rows)
