"""The trusted keyring: a JSON file mapping key id → public key PEM, validity window, the artifact
kinds the key may sign, and revocation. Only keys here are trusted (besides ``--key``)."""
from __future__ import annotations

import fcntl
import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from . import _keys
from ._errors import UsageError, VerificationError
from ._layout import HEAD_KIND, KINDS, TRUST_KINDS


@dataclass
class TrustedKey:
    key_id: str
    pem: str
    name: str = ""
    kinds: list[str] = field(default_factory=lambda: list(KINDS))
    not_before: float = 0.0
    not_after: float | None = None
    revoked_at: float | None = None
    revoked_reason: str = ""

    def problem(self, kind: str | None, at: float) -> str | None:
        """Why this key cannot vouch for a ``kind`` bundle at time ``at``, or None."""
        # revoked whatever the clock says: a bundle carries no trusted time, and a verifier
        # whose clock lags the revoking machine's took a leaked key's bundles
        if self.revoked_at is not None:
            return f"key {self.key_id[:16]} was revoked at {_iso(self.revoked_at)}" + (
                f" ({self.revoked_reason})" if self.revoked_reason else "")
        if at < self.not_before:
            return f"key {self.key_id[:16]} is not valid before {_iso(self.not_before)}"
        if self.not_after is not None and at > self.not_after:
            return f"key {self.key_id[:16]} expired at {_iso(self.not_after)}"
        if kind is not None and kind not in self.kinds:
            if kind == HEAD_KIND:
                return f"key {self.key_id[:16]} is not trusted to sign the ledger's head ({HEAD_KIND})"
            bundles = [k for k in self.kinds if k != HEAD_KIND]
            return f"key {self.key_id[:16]} may sign {', '.join(bundles) or 'no'} bundles, not {kind}"
        return None


class Keyring:
    def __init__(self, path: Path | None = None, keys: dict[str, TrustedKey] | None = None) -> None:
        self.path = path
        self.keys: dict[str, TrustedKey] = keys or {}

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Keyring:
        """Read the keyring at ``path``; an absent file is an empty keyring."""
        path = Path(path)
        if not path.exists():
            return cls(path)
        try:
            # a key listed twice: json keeps the last entry, which could drop a revocation
            data = json.loads(path.read_text(), object_pairs_hook=_unique_keys)
            if not isinstance(data, dict) or not isinstance(data.get("keys"), dict):
                raise ValueError('expected {"keys": {key id: entry}}')
            keys = {k: _entry(k, v) for k, v in data["keys"].items()}
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise UsageError(f"keyring {path} is unreadable: {type(e).__name__}: {e}") from None
        return cls(path, keys)

    @classmethod
    def editing(cls, path: str | os.PathLike[str]) -> KeyringEdit:
        """``with Keyring.editing(path) as ring:`` load, change and save the keyring while
        holding its lock (see :class:`KeyringEdit`)."""
        return KeyringEdit(Path(path))

    def to_json(self) -> str:
        return json.dumps({"keys": {k: asdict(v) for k, v in sorted(self.keys.items())}},
                          indent=1, sort_keys=True) + "\n"

    def save(self) -> None:
        """Write the keyring whole (a reader sees the old file or the new one, never a part)."""
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def trust(self, pem: bytes, *, name: str = "", kinds: list[str] | None = None,
              not_before: float | None = None, not_after: float | None = None,
              add: bool = False) -> TrustedKey:
        """Add (or re-trust, with new kinds or validity) a public key; returns its entry. With
        ``add``, a key trusted already keeps its kinds, name and validity, and gains ``kinds``.
        A revoked key stays revoked (UsageError): revocation means it may be in other hands."""
        key = _keys.load_public(pem)
        for k in kinds or ():
            if k not in TRUST_KINDS:
                raise UsageError(f"unknown artifact kind {k!r} (kinds: {', '.join(TRUST_KINDS)})")
        if not_after is not None and not_after <= (time.time() if not_before is None else not_before):
            raise UsageError("the key's validity would end before it begins")
        kid = _keys.key_id(key)
        old = self.keys.get(kid)
        if old is not None and old.revoked_at is not None:
            raise UsageError(f"key {kid[:16]} was revoked ({old.revoked_reason or 'no reason given'}); "
                             "a revoked key is not trusted again: make a new key")
        if add and old is not None:
            kinds = [*old.kinds, *(k for k in kinds or () if k not in old.kinds)]
            name = name or old.name
            if not_before is None and not_after is None:
                not_before, not_after = old.not_before, old.not_after
        # valid from the start unless told otherwise: "not before now" made a machine whose
        # clock was stepped back (or a job's lagging clock) refuse the daemon's own plans
        entry = TrustedKey(kid, _keys.public_pem(key).decode(), name, list(kinds or KINDS),
                           0.0 if not_before is None else not_before, not_after)
        self.keys[kid] = entry
        return entry

    def entry_of(self, pem: bytes) -> TrustedKey | None:
        """The entry of the public key ``pem``, or None when this keyring does not hold it."""
        return self.keys.get(_keys.key_id(_keys.load_public(pem)))

    def revoke(self, key_id: str, reason: str = "", at: float | None = None) -> TrustedKey:
        entry = self.find(key_id)
        if entry.revoked_at is None:  # revoked twice: the first record stands
            entry.revoked_at, entry.revoked_reason = (time.time() if at is None else at), reason
        return entry

    def find(self, key_id: str) -> TrustedKey:
        """The entry whose id is ``key_id`` or starts with it (at least 8 characters)."""
        if key_id in self.keys:
            return self.keys[key_id]
        hits = [k for k in self.keys if len(key_id) >= 8 and k.startswith(key_id)]
        if len(hits) != 1:
            raise UsageError(f"no single key in the keyring matches {key_id!r}")
        return self.keys[hits[0]]

    def check(self, key_id: str, kind: str | None, at: float | None = None) -> TrustedKey:
        """The trusted entry for ``key_id``, valid now for ``kind``; else VerificationError."""
        entry = self.keys.get(key_id)
        if entry is None:
            raise VerificationError("signer", f"key {key_id[:16]} is not in the keyring "
                                              f"{self.path or ''}".rstrip())
        problem = entry.problem(kind, time.time() if at is None else at)
        if problem:
            raise VerificationError("signer", problem)
        return entry


_NUMBER = (int, float)
_FIELD_TYPES = {"key_id": str, "pem": str, "name": str, "not_before": _NUMBER,
                "not_after": (*_NUMBER, type(None)), "revoked_at": (*_NUMBER, type(None)),
                "revoked_reason": str}
_TIMES = ("not_before", "not_after", "revoked_at")
_YEAR_10000 = 253402300800


class KeyringEdit:
    """An edit of the keyring file by one process at a time: the file is loaded once its lock
    (``<keyring>.lock``, flock) is held and saved, if changed, before it is let go. Two editors at
    once (a daemon's first start trusting its key, ``rtxops keys trust``) each loaded the file,
    and the second save lost the first one's key. An edit left by an exception saves nothing."""

    def __init__(self, path: Path) -> None:
        lock_path = path.with_name(path.name + ".lock")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._lock = open(lock_path, "a")
        except OSError as e:
            raise UsageError(f"cannot lock keyring {path}: {e.strerror or e}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX)
            self.keyring = Keyring.load(path)
        except BaseException:
            self._lock.close()
            raise
        self._loaded = self.keyring.to_json()

    def __enter__(self) -> Keyring:
        return self.keyring

    def __exit__(self, kind, value, traceback) -> None:
        try:
            if kind is None and self.keyring.to_json() != self._loaded:
                self.keyring.save()
        finally:
            self._lock.close()   # closing the file lets go of its lock


def _entry(key_id: str, value) -> TrustedKey:
    """A keyring entry, its fields checked (a hand-edited file is read by ``rtxops verify``)."""
    if not isinstance(value, dict):
        raise ValueError(f"entry {key_id!r} is not an object")
    unknown = set(value) - {*_FIELD_TYPES, "kinds"}
    if unknown:
        raise ValueError(f"entry {key_id!r} has unknown fields {sorted(unknown)}")
    for name, kinds in _FIELD_TYPES.items():
        if name in value and (not isinstance(value[name], kinds) or isinstance(value[name], bool)
                              or (isinstance(value[name], float) and not math.isfinite(value[name]))):
            raise ValueError(f"entry {key_id!r}: {name} is {value[name]!r}")
        if name in _TIMES and isinstance(value.get(name), _NUMBER) and not 0 <= value[name] < _YEAR_10000:
            raise ValueError(f"entry {key_id!r}: {name} is {value[name]!r}, not a time (seconds "
                             "since 1970 before the year 10000)")
    kinds = value.get("kinds", list(KINDS))
    if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
        raise ValueError(f"entry {key_id!r}: kinds must be a list of names")
    entry = TrustedKey(**value)
    if entry.key_id != key_id:
        raise ValueError(f"entry {key_id!r} holds key id {entry.key_id!r}")
    return entry


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    seen: dict = {}
    for name, value in pairs:
        if name in seen:
            raise ValueError(f"{name!r} is listed twice")
        seen[name] = value
    return seen
