"""Bundle layout: which files a bundle holds, their sha256, and the path rules (sorted relative
POSIX paths, no symlinks, no ``..``, no absolute paths)."""
from __future__ import annotations

import errno
import hashlib
import os
import queue
import stat
import threading
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from ._errors import VerificationError

PLAN = "plan.json"
SBOM = "sbom.cdx.json"
PROVENANCE = "provenance.intoto.json"
SIGNATURE = "bundle.sigstore.json"
KINDS = ("plan", "checkpoint", "telemetry", "ledger")
# what a keyring may trust a key for: the bundle kinds, and signing the ledger's head (the
# daemon's key only, unless someone trusts another for it: a head signer vouches for the chain)
HEAD_KIND = "ledger-head"
TRUST_KINDS = (*KINDS, HEAD_KIND)

MAX_SIGNATURE_BYTES = 32 << 20  # the Sigstore bundle (statement with one line per file: ~180 B)
MAX_METADATA_BYTES = 16 << 20   # plan, SBOM, provenance: parsed as JSON
MAX_FILES = 100_000
MAX_DEPTH = 64          # folders within folders a bundle may hold
_CHUNK = 1 << 20
_PIPELINE_BYTES = 8 << 20


def check_name(name: str) -> str:
    """``name`` as a safe relative POSIX path, else VerificationError."""
    if not isinstance(name, str) or not name:
        raise VerificationError("manifest", f"file name {name!r} is not a non-empty string")
    p = PurePosixPath(name)
    if p.is_absolute() or name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise VerificationError("manifest", f"file name {name!r} is an absolute path")
    if "\\" in name:  # a Windows separator: the name would mean another path there
        raise VerificationError("manifest", f"file name {name!r} holds a backslash")
    if any(part in ("..", ".", "") for part in name.split("/")):
        raise VerificationError("manifest", f"file name {name!r} has '..', '.' or an empty part")
    if any(ord(c) < 32 or 0x7f <= ord(c) <= 0x9f for c in name):
        raise VerificationError("manifest", f"file name {name!r} has control characters")
    try:   # (a name of bytes that are not UTF-8 comes from the file system as surrogates)
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise VerificationError("manifest", f"file name {name!r} is not UTF-8") from None
    return name


def list_files(root: Path) -> list[str]:
    """Every regular file under ``root`` (sorted relative POSIX paths) except the signature.
    A symlink or a special file anywhere, or a folder that cannot be listed (a file in it would go
    unseen), is a VerificationError."""
    names: list[str] = []

    def unlistable(e: OSError) -> None:
        rel = Path(os.path.relpath(e.filename, root)).as_posix() if e.filename else "a folder"
        if len(rel) > 160:
            rel = f"{rel[:60]}…{rel[-60:]}"
        raise VerificationError("layout", f"cannot list {rel}: {e.strerror or e}")

    for dirpath, dirnames, filenames in os.walk(root, onerror=unlistable, followlinks=False):
        if dirnames and len(Path(os.path.relpath(dirpath, root)).parts) >= MAX_DEPTH:
            # (os.walk recurses: a deep enough tree is a RecursionError, not an answer)
            raise VerificationError("layout", f"folders nested deeper than {MAX_DEPTH} "
                                              "(oversized input)")
        for d in dirnames:
            if os.path.islink(os.path.join(dirpath, d)):
                rel = os.path.relpath(os.path.join(dirpath, d), root)
                raise VerificationError("layout", f"{Path(rel).as_posix()} is a symlink; bundles hold no symlinks")
        for f in filenames:
            full = os.path.join(dirpath, f)
            rel = Path(os.path.relpath(full, root)).as_posix()
            mode = os.lstat(full).st_mode
            if stat.S_ISLNK(mode):
                raise VerificationError("layout", f"{rel} is a symlink; bundles hold no symlinks")
            if not stat.S_ISREG(mode):
                raise VerificationError("layout", f"{rel} is not a regular file")
            if rel != SIGNATURE:
                names.append(check_name(rel))
            if len(names) > MAX_FILES:
                raise VerificationError("layout", f"more than {MAX_FILES} files (oversized input)")
    return sorted(names)


def sha256_file(path: Path, stop: threading.Event | None = None) -> str:
    """The sha256 hex digest of ``path``; a big file is read on a second thread while this one
    hashes (reading is ~8 % of a serial pass over a page-cached file). ``stop`` set: give up
    (CancelledError) at the next chunk. No link is followed, and only a regular file is read:
    a file swapped for a FIFO or a link to /dev/zero after the listing would hang the hash."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    with open(fd, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if os.fstat(f.fileno()).st_size < _PIPELINE_BYTES:
            h = hashlib.sha256()
            buf = bytearray(_CHUNK)
            view = memoryview(buf)
            while n := f.readinto(buf):
                h.update(view[:n])
            return h.hexdigest()
        return _sha256_pipelined(f, stop)


def _sha256_pipelined(f, stop: threading.Event | None) -> str:
    h = hashlib.sha256()
    free: queue.SimpleQueue = queue.SimpleQueue()
    full: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(2):
        free.put(bytearray(_CHUNK))
    failed: list[BaseException] = []

    def read() -> None:
        try:
            while (buf := free.get()) is not None:
                n = f.readinto(buf)
                full.put((buf, n))
                if not n:
                    return
        except BaseException as e:  # noqa: BLE001 - re-raised on the hashing thread
            failed.append(e)
            full.put((None, 0))

    reader = threading.Thread(target=read, name="rtxops-hash-read", daemon=True)
    reader.start()
    try:
        while True:
            buf, n = full.get()
            if not n:
                break
            if stop is not None and stop.is_set():
                raise CancelledError
            h.update(memoryview(buf)[:n])
            free.put(buf)
    finally:
        free.put(None)
        reader.join()
    if failed:
        raise failed[0]
    return h.hexdigest()


def hash_files(root: Path, names: list[str]) -> Future:
    """Start hashing ``names`` on worker threads (hashlib lets go of the GIL on big buffers, so
    the caller builds metadata meanwhile); the future gives ``{name: sha256 hex}``. Cancelling
    it stops the hashing within a chunk (a check failed: a huge file is not read to its end)."""
    pool = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)),
                              thread_name_prefix="rtxops-hash")
    stop = threading.Event()
    futures = {n: pool.submit(sha256_file, root / n, stop) for n in names}
    pool.shutdown(wait=False)
    done: Future = Future()

    def stopped(f: Future) -> None:
        if f.cancelled():
            stop.set()
            for part in futures.values():
                part.cancel()

    done.add_done_callback(stopped)

    def collect(_f=None) -> None:
        if done.done() or not all(f.done() for f in futures.values()):
            return
        try:
            done.set_result({n: f.result() for n, f in futures.items()})
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            if not done.done():
                done.set_exception(e)

    for f in futures.values():
        f.add_done_callback(collect)
    collect()
    return done


def read_limited(path: Path, limit: int, what: str) -> bytes:
    """The bytes of ``path`` if it is a file of at most ``limit`` bytes (oversized input is
    refused). One open, no link followed, at most ``limit + 1`` bytes read: a file swapped for a
    bigger one (or a link to /dev/zero) after a size check is refused too."""
    try:
        # O_NONBLOCK: opening a FIFO swapped in would wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise VerificationError(what, f"cannot read {path.name}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise VerificationError(what, f"{path.name} is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise VerificationError(what, f"{path.name} is over the {limit} byte limit (oversized input)")
    return data
