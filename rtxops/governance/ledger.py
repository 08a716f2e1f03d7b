"""The ledger: every promotion, rollback, manual publish and denial, hash-chained in the store.
A head file next to the store (last seq and hash, signed by the daemon's key) catches a deleted
tail, and a chain rewritten whole (every hash recomputed): only the key can sign its new head."""
from __future__ import annotations

import base64
import binascii
import json
import os
import threading
import time
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from rtxops.telemetry.store_ledger import (GENESIS, append_entry, count_entries, entry_hash,
                                          newest_version, read_entries)

from . import _keys
from ._errors import GovernanceError, UsageError, VerificationError
from ._layout import HEAD_KIND

__all__ = ["ChainCheck", "append", "append_problem", "check_chain", "count_entries", "export_jsonl",
           "head_signature_problem", "newest_version", "pending_head_file", "read_entries",
           "sign_head", "start", "unrecorded_bundles", "write_head"]

_HEAD_DOMAIN = b"rtxops ledger head v1\n"


def append(store, head_file: Path | None, head_key: ec.EllipticCurvePrivateKey | None = None,
           keyring=None, **entry) -> dict:
    """Append ``entry``; rewrite the head file (signed with ``head_key`` when given). With a key,
    the stored chain must end at a head a trusted key signed (:func:`append_problem`), else
    VerificationError: a daemon never signs over a chain it cannot vouch for."""
    announce = None
    if head_file is not None and head_key is not None:
        problem = append_problem(store, read_head(head_file), head_key, keyring,
                                 pending=read_head(pending_head_file(head_file)))
        if problem:
            raise VerificationError("ledger", problem + ": `rtxops ledger verify` says more")

        def announce(row: dict) -> None:
            # signed before the entry commits: a daemon killed between the commit and the head's
            # write leaves a head for it, which the next start takes (nobody without the key can
            # add an entry that way)
            write_head(pending_head_file(head_file), row["seq"], row["entry_hash"], head_key)

    row = append_entry(store, before_insert=announce, **entry)
    if head_file is not None:
        write_head(head_file, row["seq"], row["entry_hash"], head_key)
        pending_head_file(head_file).unlink(missing_ok=True)
    return row


def pending_head_file(head_file: Path) -> Path:
    """The signed head of the entry being appended (it may not have committed)."""
    return head_file.with_name(head_file.name + ".next")


def start(store, head_file: Path, key: ec.EllipticCurvePrivateKey, issued_before: bool,
          keyring=None) -> bool:
    """At a daemon's start: write the signed head of an empty ledger (seq 0) when there is no
    head file, no entry and ``issued_before`` is false (a daemon key made just now, no bundle
    issued); whether it wrote one. From then on a missing head means a removed one (emptying the
    ledger and deleting its head passed for a new ledger). Also takes the head a daemon killed
    between an entry's commit and its head's write had signed for that entry."""
    if not head_file.exists():
        if issued_before or count_entries(store):
            return False
        write_head(head_file, 0, GENESIS, key)
        return True
    pending_file = pending_head_file(head_file)
    pending, head = read_head(pending_file), read_head(head_file)
    if not pending or "invalid" in pending or "invalid" in head:
        return False   # (an unreadable head: `ledger verify` says so; the pending one is kept)
    rows = store.query("SELECT entry_hash FROM ledger WHERE seq = ?", [pending["seq"]])
    stored = bool(rows) and rows[0]["entry_hash"] == pending["entry_hash"]
    if pending["seq"] <= head["seq"] or not stored:
        pending_file.unlink(missing_ok=True)   # taken already, or its entry never committed
    elif (pending["seq"] == head["seq"] + 1
          and append_problem(store, head, key, keyring, pending=pending) is None):
        write_head(head_file, pending["seq"], pending["entry_hash"], key)
        pending_file.unlink(missing_ok=True)
    return False


def write_head(head_file: Path, seq: int, entry_hash: str,
               key: ec.EllipticCurvePrivateKey | None = None) -> None:
    """Replace the head file (atomically), signed with ``key`` when given."""
    head: dict = {"seq": seq, "entry_hash": entry_hash}
    if key is not None:
        head["signed_at"] = time.time()
        signature = key.sign(_head_payload(head), ec.ECDSA(hashes.SHA256()))
        head.update(key_id=_keys.key_id(key.public_key()),
                    signature=base64.b64encode(signature).decode())
    tmp = head_file.with_name(head_file.name + ".tmp")
    with open(tmp, "w") as f:   # on disk before the entry commits (DuckDB's commit is)
        f.write(json.dumps(head) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(head_file)


def sign_head(rows: list[dict], head: dict, head_file: Path,
              key: ec.EllipticCurvePrivateKey) -> list[str]:
    """Sign ``head`` (a head written before heads were signed) after checking that the chain
    ``rows`` it closes is intact; the problems that kept it unsigned, else []. Someone's explicit
    act (``rtxops ledger sign-head``): a daemon never signs a head it did not write."""
    problems = check_chain(rows, head)
    if not problems and not rows and not head:
        # an empty ledger without a head (a home whose store was deleted on purpose): its
        # first head, by the key holder's explicit act; a daemon never starts one by itself
        write_head(head_file, 0, GENESIS, key)
        return []
    if not problems and (not head or "invalid" in head):
        problems = ["there is no head to sign"]
    if not problems:
        write_head(head_file, head["seq"], head["entry_hash"], key)
    return problems


def append_problem(store, head: dict, key: ec.EllipticCurvePrivateKey, keyring=None,
                   pending: dict | None = None) -> str | None:
    """Why a daemon holding ``key`` must not chain onto the stored ledger and sign its new head,
    or None. The head must be readable, signed by ``key`` (or by a key ``keyring`` trusts for
    the head), name a stored entry with its hash (seq 0: the empty ledger), and have no entry
    after it but the one ``pending`` names, signed by ``key`` (a daemon killed between committing
    an entry and writing the head leaves it). Anything else is a chain the daemon cannot vouch
    for: signing over it would bless it (one entry appended by whoever can write the store)."""
    if "invalid" in head:
        return f"the ledger's head file is unreadable ({head['invalid']})"
    if not head:
        return ("the ledger's head file is missing (a daemon writes it at its first start and "
                "with every entry; on an empty ledger, `rtxops ledger sign-head` with the "
                "daemon's key starts it)")
    if "signature" not in head:
        return ("the ledger's head file is not signed (if `rtxops ledger verify` finds the chain "
                "intact, `rtxops ledger sign-head` signs it)")
    if head["key_id"] == _keys.key_id(key.public_key()):
        if not _signed_by(head, key.public_key()):
            return "the ledger's head file carries this daemon's key id but not its signature"
    else:
        problem = (head_signature_problem(head, keyring) if keyring is not None
                   else "the ledger's head file is signed by another key")
        if problem:
            return problem
    seq = head["seq"]
    rows = [{"entry_hash": GENESIS}] if seq == 0 else store.query(
        "SELECT entry_hash FROM ledger WHERE seq = ?", [seq])
    if not rows or rows[0]["entry_hash"] != head["entry_hash"]:
        return (f"the ledger's entry {seq} is not the one its signed head names (the chain was "
                "rewritten)")
    last = store.query("SELECT coalesce(max(seq), 0) AS n FROM ledger")[0]["n"]
    if last > seq + 1:
        return (f"the ledger holds {last - seq} entries after entry {seq}, which its signed head "
                "names (added without the head)")
    if last == seq + 1:
        (row,) = store.query("SELECT entry_hash FROM ledger WHERE seq = ?", [last])
        announced = (pending and "signature" in pending and pending["seq"] == last
                     and pending["entry_hash"] == row["entry_hash"]
                     and ((pending["key_id"] == _keys.key_id(key.public_key())
                           and _signed_by(pending, key.public_key()))
                          # signed by the daemon's key before a rotation: one trusted for heads
                          or (keyring is not None
                              and head_signature_problem(pending, keyring) is None)))
        if not announced:
            return (f"the ledger holds entry {last} after entry {seq}, which its signed head "
                    "names, and this daemon never signed a head for it (added without the head)")
    return None


def _signed_by(head: dict, key: ec.EllipticCurvePublicKey) -> bool:
    """Whether ``head``'s signature is ``key``'s, over its seq, entry hash and signing time."""
    try:
        key.verify(base64.b64decode(head["signature"], validate=True), _head_payload(head),
                   ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, binascii.Error, ValueError):
        return False
    return True


def _head_payload(head: dict) -> bytes:
    fields = {k: head[k] for k in ("seq", "entry_hash", "signed_at")}
    return _HEAD_DOMAIN + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def head_signature_problem(head: dict | None, keyring) -> str | None:
    """Why the head file's signature does not vouch for it (unsigned, an untrusted or revoked
    key, a signature over another seq or hash), or None. An empty or unreadable head is
    :func:`check_chain`'s to report."""
    if not head or "invalid" in head:
        return None
    if "signature" not in head:
        return ("the head file is not signed (replaced, or written by an rtxops before signed "
                "heads: `rtxops ledger sign-head` signs it once the chain checks intact): the "
                "ledger's end cannot be trusted")
    try:
        entry = keyring.check(head["key_id"], HEAD_KIND)
        key = _keys.load_public(entry.pem.encode(), "the head signer's key")
    except VerificationError as e:
        return f"the head file's signer: {e.message}"
    except UsageError:  # a keyring entry that holds no usable key
        key = None
    if key is None or not _signed_by(head, key):
        return ("the head file's signature does not match its sequence number and hash (the "
                "ledger rewritten, or the head replaced)")
    return None


def check_chain(rows: list[dict], head: dict | None = None, *,
                after: tuple[int, str] = (0, GENESIS), head_expected: bool = False) -> list[str]:
    """Every problem in ``rows`` (stored order): an edited entry (hash), a deleted or reordered
    one (sequence, previous hash), a deleted tail (``head``, as :func:`read_head` gives it; None
    skips that check). Empty when intact. ``after``: the (seq, entry hash) of the verified entry
    ``rows`` follow (the genesis by default). ``head_expected``: a daemon served this ledger (it
    wrote a head at its start), so even an empty ledger without one was tampered with."""
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
        if rows or after[0] or head_expected:
            problems.append("the head file is missing (a daemon writes it at its first start and "
                            "with every entry): entries may have been deleted")
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
            problems = check_chain(rows, head, after=self.verified, head_expected=True)
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
    out = {"seq": head["seq"], "entry_hash": head["entry_hash"]}
    if "signature" in head:
        if (not isinstance(head.get("signature"), str) or not isinstance(head.get("key_id"), str)
                or type(head.get("signed_at")) not in (int, float)):
            return {"invalid": "a signature without a string key_id and a numeric signed_at"}
        out.update({k: head[k] for k in ("signed_at", "key_id", "signature")})
    return out


ISSUED_KINDS = ("promote", "rollback", "explore", "manual")   # entries whose bundle the daemon keeps


def unrecorded_bundles(bundles: Path, rows: list[dict], keyring) -> list[str]:
    """The plan bundles under ``bundles`` (``<scope>/v<version>``) that this home's daemon
    issued (they verify against ``keyring``, built by the daemon) and no entry of ``rows``
    records. The daemon records an entry before it moves a bundle into place, so such a bundle
    means entries were deleted: a tail cut and an older signed head put back passes the chain
    and head checks, not this one."""
    from .verify import Trust, verify

    recorded = {(r["scope"], r["version"], r["subject_digest"]) for r in rows
                if r.get("kind") in ISSUED_KINDS}
    problems = []
    for directory in sorted(bundles.glob("*/v*")) if bundles.is_dir() else ():
        if directory.is_symlink() or not directory.is_dir() or not directory.name[1:].isdigit():
            continue   # (a staging folder, say; the daemon moves real folders into place)
        try:
            report = verify(directory, Trust(keyring=keyring), expected_kind="plan")
        except GovernanceError:   # not a bundle at all: not this daemon's word either
            continue
        facts = report.facts
        if not report.ok or not str(facts.get("builder", {}).get("id", "")).startswith("rtxops-daemon"):
            continue   # not this daemon's word: it proves nothing about the ledger
        if (facts["scope"], facts["version"], facts["digest"]) not in recorded:
            problems.append(f"{directory.parent.name}/{directory.name}: this home's daemon issued "
                            "it, and no ledger entry records it (entries deleted at the end, and "
                            "an older head put back?)")
    return problems


def export_jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in rows)
