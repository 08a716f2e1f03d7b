"""The last log lines stored for each job, kept in memory: following a running job's output (a
read every half second, just past the newest line) costs the store no query.

The supervisor adds a job's lines once its sink has stored them, so a read from here returns what a
read from the store would. Per job, every stored line numbered above ``floor`` is held; a read that
starts below the floor, or of a job not held, is the store's to answer. The oldest lines of the
job least recently written to are let go first, past a budget of bytes for all jobs, and lines
older than :data:`MAX_AGE_S` (the store's retention may delete lines a day old; a follower wants
the newest).
"""
from __future__ import annotations

import bisect
import collections
import threading
import time
from collections.abc import Sequence

from rtxops.telemetry.store_jobs import MAX_PAGE_BYTES

from .jobs import LogLine

MAX_BYTES = 8 << 20     # held for all jobs together: text plus LINE_OVERHEAD a line
LINE_OVERHEAD = 128     # about what a held line costs besides its text
MAX_AGE_S = 3600.0      # a line read from a job's output longer ago than this is let go


class _Held:
    __slots__ = ("floor", "lines", "sizes", "head", "held_bytes")

    def __init__(self, floor: int) -> None:
        self.floor = floor          # every stored line with a higher seq is in lines[head:]
        self.lines: list[LogLine] = []
        self.sizes: list[int] = []  # UTF-8 bytes of each text
        self.head = 0               # lines before it were let go (cut off in bulk)
        self.held_bytes = 0


class RecentLogs:
    """Thread-safe; ``max_bytes`` bounds what is held for all jobs together."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = MAX_BYTES if max_bytes is None else max_bytes
        self._lock = threading.Lock()
        self._jobs: collections.OrderedDict[str, _Held] = collections.OrderedDict()
        self._bytes = 0

    def add(self, job_id: str, attempt: int, rank: int, stream: str,
            lines: Sequence[tuple[int, int, str]]) -> None:
        """``(ts_ns, seq, text)`` lines the sink has just stored, as :meth:`JobSink.log_lines`."""
        if not lines:
            return
        new = [LogLine(job_id, seq, ts, attempt, rank, stream, text) for ts, seq, text in lines]
        sizes = [len(ln.text.encode("utf-8", "surrogatepass")) for ln in new]
        cost = sum(sizes) + LINE_OVERHEAD * len(new)
        with self._lock:
            held = self._jobs.get(job_id)
            if held is None:
                held = self._jobs[job_id] = _Held(floor=new[0].seq - 1)
            self._jobs.move_to_end(job_id)
            if len(held.lines) > held.head and new[0].seq <= held.lines[-1].seq:
                # stored out of call order (two tails of one job at once): keep seq order, and
                # nothing at or below the floor (reads there are the store's)
                merged = sorted((pair for pair in zip(held.lines[held.head:] + new,
                                                      held.sizes[held.head:] + sizes)
                                 if pair[0].seq > held.floor), key=lambda pair: pair[0].seq)
                held.lines = [ln for ln, _ in merged]
                held.sizes = [size for _, size in merged]
                held.head = 0
                cost = sum(size + LINE_OVERHEAD for _, size in merged) - held.held_bytes
            else:
                held.lines += new
                held.sizes += sizes
            held.held_bytes += cost
            self._bytes += cost
            self._let_go(time.time_ns() - int(MAX_AGE_S * 1e9))

    def read(self, job_id: str, *, rank: int | None = None, after_seq: int = 0,
             limit: int = 1000) -> list[LogLine] | None:
        """What :meth:`JobSink.read_logs` would return (its page-size rule too), or None when
        lines past ``after_seq`` may be missing here."""
        with self._lock:
            self._let_go(time.time_ns() - int(MAX_AGE_S * 1e9))
            held = self._jobs.get(job_id)
            if held is None or after_seq < held.floor:
                return None
            start = bisect.bisect_right(held.lines, after_seq, lo=held.head, key=_seq)
            page: list[LogLine] = []
            size = 0
            for i in range(start, len(held.lines)):
                line = held.lines[i]
                if rank is not None and line.rank != rank:
                    continue
                if len(page) == limit or (page and size >= MAX_PAGE_BYTES):
                    break
                page.append(line)
                size += held.sizes[i]
            return page

    def forget(self, job_id: str) -> None:
        with self._lock:
            held = self._jobs.pop(job_id, None)
            if held is not None:
                self._bytes -= held.held_bytes

    def _let_go(self, read_before_ns: int) -> None:
        """Past the budget, the oldest lines of the jobs least recently written to; and every
        line read before ``read_before_ns``."""
        while self._bytes > self.max_bytes:
            job_id, held = next(iter(self._jobs.items()))
            self._drop_oldest(job_id, held)
        for job_id, held in list(self._jobs.items()):
            while job_id in self._jobs and held.lines[held.head].ts_ns < read_before_ns:
                self._drop_oldest(job_id, held)

    def _drop_oldest(self, job_id: str, held: _Held) -> None:
        cost = held.sizes[held.head] + LINE_OVERHEAD
        held.floor = max(held.floor, held.lines[held.head].seq)
        held.head += 1
        held.held_bytes -= cost
        self._bytes -= cost
        if held.head == len(held.lines):
            del self._jobs[job_id]
        elif held.head > len(held.lines) // 2:
            del held.lines[:held.head], held.sizes[:held.head]
            held.head = 0


def _seq(line: LogLine) -> int:
    return line.seq
