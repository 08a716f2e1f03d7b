"""Follow an attempt's stdout/stderr files and hand over complete lines with a timestamp and a rank.

Jobs write to files, not pipes, so a job outlives a daemon restart (a pipe whose reader died fails
the job's next write) and the new daemon can go on reading where the old one stopped. Timestamps are
taken when a line is read: at most ``poll_s`` after it was written (``busy_poll_s`` while the job
keeps writing: each read that finds lines is a write to the store).
"""
from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .jobs import LAUNCHER_RANK

# a longer line is stored (and shown) in pieces of at most this: below DuckDB's 4 KiB inline
# string limit. Longer strings go to overflow blocks the store's memory limit cannot hold: a
# job writing lines of a mebibyte (tqdm's "\r" updates, to a file) ran it out of memory after
# ~90 MB, and every write after failed, its spans too
MAX_LINE_BYTES = 4000
READ_CHUNK_BYTES = 4 << 20
MAX_STORED_BYTES = 256 << 20  # per stream of an attempt (RTXOPS_JOB_LOG_MAX_BYTES)
FINAL_RETRY_S = 120.0         # how long the last lines are offered again to a failing store
_RANK_PREFIX = re.compile(rb"^\[rank(\d+)\]:")

Lines = list[tuple[int, int, str]]
"""``(ts_ns, rank, text)`` in the order read."""


def split_rank(line: bytes, torchrun: bool) -> tuple[int, bytes]:
    """The rank a line belongs to and the line without torchrun's ``[rankN]:`` prefix."""
    if not torchrun:
        return 0, line
    m = _RANK_PREFIX.match(line)
    return (int(m.group(1)), line[m.end():]) if m else (LAUNCHER_RANK, line)


def _char_boundary(data: bytes, limit: int) -> int:
    """The largest cut at or below ``limit`` that does not split a UTF-8 character."""
    cut = limit
    while cut > limit - 3 and cut > 0 and (data[cut] & 0xC0) == 0x80:
        cut -= 1
    return cut if cut > 0 else limit


class LogTail:
    """A thread that polls the files of ``paths`` (stream → file) and calls ``on_lines(stream, lines)``.

    ``on_lines`` may return the seq it gave the last line; :meth:`committed` pairs it with the offsets.
    A tail that resumes at ``offsets`` (whose last lines had the seqs ``seqs``) drops the first
    ``skip[stream] = (count, seq of the last)`` lines it reads: lines a previous tail handed over
    after the offsets were saved. Past ``max_bytes`` of a stream, lines are no longer handed over
    (one line says so): a job that floods its output fills its own file, not the store.
    """

    def __init__(self, paths: dict[str, Path], on_lines: Callable[[str, Lines], int | None], *,
                 offsets: dict[str, int] | None = None, seqs: dict[str, int] | None = None,
                 skip: dict[str, tuple[int, int]] | None = None, torchrun: bool = False,
                 poll_s: float = 0.05, busy_poll_s: float | None = None,
                 on_error: Callable[[Exception], None] | None = None,
                 max_bytes: int | None = MAX_STORED_BYTES,
                 on_late_drain: Callable[[], None] | None = None) -> None:
        self.paths = dict(paths)
        self.offsets = {s: (offsets or {}).get(s, 0) for s in paths}
        self.seqs = {s: (seqs or {}).get(s, 0) for s in paths}
        self._skip = {s: (skip or {}).get(s, (0, 0)) for s in paths}
        self._on_lines = on_lines
        self._on_error = on_error
        self._torchrun = torchrun
        self._poll_s = poll_s
        # after a read that handed lines over: a job printing a line a step would otherwise
        # cost the store a transaction every poll
        self._busy_poll_s = poll_s if busy_poll_s is None else max(poll_s, busy_poll_s)
        self._handed_over = False    # the last poll handed lines over
        self.max_bytes = max_bytes
        self._past_budget: set[str] = set()  # streams whose "not stored" line was handed over
        self._partial = {s: b"" for s in paths}
        # per stream, the rank of a line cut at MAX_LINE_BYTES whose start was handed over: its
        # next piece is that line's (torchrun prefixes only a line's start)
        self._continued: dict[str, int | None] = {s: None for s in paths}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._drained = False
        self._final_read = threading.Event()   # the first read after stop() is done
        self._on_late_drain = on_late_drain
        self._ending = threading.Lock()    # stop()'s answer against the thread's last retry
        self._finished = False             # the thread is past its last read
        self._given_up = False             # stop() answered False
        self._thread = threading.Thread(target=self._run, name="rtxops-logtail", daemon=True)

    def start(self) -> LogTail:
        self._thread.start()
        return self

    def committed_offsets(self) -> dict[str, int]:
        """Bytes of each file handed over as complete lines: where a new tail resumes."""
        return self.committed()[0]

    def committed(self) -> tuple[dict[str, int], dict[str, int]]:
        """The committed offsets and, taken with them, the seq of the last line handed over from
        each stream (0: none, or ``on_lines`` returns no seqs)."""
        with self._lock:
            return {s: self.offsets[s] - len(self._partial[s]) for s in self.paths}, dict(self.seqs)

    def stop(self, timeout: float | None = None) -> bool:
        """Read what is left (an unterminated last line too) and end the thread; whether every
        line was handed over within ``timeout`` (by default it is waited for: its last lines are
        often a traceback). When that last read fails (``on_lines`` raised: the store cannot
        write just now) this returns False at once, and the thread offers the lines again for
        up to FINAL_RETRY_S; if they are then handed over, ``on_late_drain`` is called (from the
        thread: the caller that got False left the files for it)."""
        self._stop.set()
        self._final_read.wait(timeout)
        if self._drained:
            self._thread.join(timeout)
        with self._ending:
            done = self._drained and self._finished
            self._given_up = not done
        return done

    def _run(self) -> None:
        while not self._stop.is_set():
            self._handed_over = False
            self._poll()
            self._stop.wait(self._busy_poll_s if self._handed_over else self._poll_s)
        deadline = time.monotonic() + FINAL_RETRY_S
        self._drained = self._poll(final=True)
        self._final_read.set()
        wait = self._poll_s
        while not self._drained and time.monotonic() < deadline:
            time.sleep(wait)
            wait = min(wait * 2, 2.0)
            self._drained = self._poll(final=True)
        with self._ending:
            self._finished = True
            late = self._given_up and self._drained
        if late and self._on_late_drain is not None:
            try:
                self._on_late_drain()
            except Exception as e:  # (the thread ends either way)
                if self._on_error:
                    self._on_error(e)

    def _poll(self, final: bool = False) -> bool:
        """Read every stream; whether all of it was handed over."""
        ok = True
        for stream, path in self.paths.items():
            try:
                self._read(stream, path, final)
            except Exception as e:  # a failing read must not end the tail; the next poll retries
                ok = False
                if self._on_error:
                    self._on_error(e)
        return ok

    def _read(self, stream: str, path: Path, final: bool) -> None:
        # in chunks: a backlog (written while no daemon read it) never lands in memory at once
        with open(path, "rb") as f:
            f.seek(self.offsets[stream])
            while True:
                if self.max_bytes is not None and self.offsets[stream] >= self.max_bytes:
                    self._skip_to_end(stream, path, os.fstat(f.fileno()).st_size)
                    return
                data = f.read(READ_CHUNK_BYTES)
                more = len(data) == READ_CHUNK_BYTES
                self._take(stream, data, final and not more)
                if not more:
                    return

    def _skip_to_end(self, stream: str, path: Path, size: int) -> None:
        """Past the budget: say so once (where a tail crosses it), then only follow the size."""
        if stream not in self._past_budget:
            note = (f"[rtxops] {stream} is past {self.max_bytes} bytes: what follows is not stored "
                    f"(it is all in {path})")
            seq = self._on_lines(stream, [(time.time_ns(), 0, note)])
            self._past_budget.add(stream)
            with self._lock:
                self._partial[stream] = b""  # a line cut at the budget is not stored either
                self._continued[stream] = None
                if seq is not None:
                    self.seqs[stream] = seq
        with self._lock:
            self.offsets[stream] = max(self.offsets[stream], size)

    def _take(self, stream: str, data: bytes, final: bool) -> None:
        if not data and not (final and self._partial[stream]):
            return
        *complete, rest = (self._partial[stream] + data).split(b"\n")
        now = time.time_ns()
        lines: Lines = []
        continued = self._continued[stream]

        def piece(raw: bytes, continued: int | None) -> int:
            rank, text = split_rank(raw, self._torchrun) if continued is None else (continued, raw)
            text = text.decode("utf-8", "replace").rstrip("\r")
            if text or continued is None:   # a CRLF's "\r" cut off its line is not a line
                lines.append((now, rank, text))
            return rank

        for raw in complete:
            while len(raw) > MAX_LINE_BYTES:
                cut = _char_boundary(raw, MAX_LINE_BYTES)
                continued = piece(raw[:cut], continued)
                raw = raw[cut:]
            piece(raw, continued)
            continued = None
        while len(rest) > MAX_LINE_BYTES:
            cut = _char_boundary(rest, MAX_LINE_BYTES)
            continued = piece(rest[:cut], continued)
            rest = rest[cut:]
        if final and rest:
            piece(rest, continued)
            rest, continued = b"", None
        seq = None
        left, last_skipped = skip = self._skip[stream]
        if left:
            dropped = min(left, len(lines))
            lines = lines[dropped:]
            skip = (left - dropped, last_skipped)
            if dropped == left:
                seq = last_skipped
        if lines:   # (raises when the lines cannot be stored: this data is read again)
            seq = self._on_lines(stream, lines)
            self._handed_over = True
        self._skip[stream] = skip
        with self._lock:
            self.offsets[stream] += len(data)
            self._partial[stream] = rest
            self._continued[stream] = continued
            if seq is not None:
                self.seqs[stream] = seq
