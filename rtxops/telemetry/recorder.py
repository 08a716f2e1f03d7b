"""The hot-path recorder: fixed-width call records in a preallocated buffer.

``record_since(slot, start_ns)`` (``record(slot, start_ns, duration_ns)`` where the caller has the
duration) is the only telemetry code that runs per call: a clock read and three int64 stores
into a preallocated buffer (C methods, ``_native/call_buffer.c``; closures over an ``array('q')``
where it is not built), no OpenTelemetry object, no lock, no allocation. At each optimizer
step the training thread hands the step's records to the export thread as one
:class:`StepRecord` (a single copy of the used part of the buffer) and starts over. A job that
has not stepped an optimizer yet (an inference loop, a long evaluation before training) hands
its records over as step -1 once the buffer is full or ``flush_every_s`` has passed.
"""
from __future__ import annotations

import threading
from array import array
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Callable

import torch

from rtxops.runtime.readings import CallStats, Readings, Slot

try:   # built from _native/call_buffer.c: record() without a Python frame
    from ._call_buffer import CallBuffer as _NativeCallBuffer
except ImportError:  # built without a compiler: the closures of _make_buffer
    _NativeCallBuffer = None

RECORD_WIDTH = 3  # slot, start_ns, duration_ns
# a build without CUDA (or ROCm, which torch.cuda also serves) never initializes it: its steps
# skip the check (a Python call at every step)
_CUDA_BUILT = torch.backends.cuda.is_built() or torch.version.hip is not None


@dataclass
class StepRecord:
    """Everything recorded between two optimizer steps."""

    step: int
    start_ns: int  # perf_counter_ns
    end_ns: int
    plan_version: int
    rss_bytes: int
    calls: array  # flat (slot, start_ns, duration_ns) triples
    backward: list[tuple[int, int, int]] = field(default_factory=list)
    builds: list[tuple[int, int, int, bool]] = field(default_factory=list)  # slot, start, dur, hit
    errors: list[tuple[int, str, int]] = field(default_factory=list)  # slot, message, time
    swaps: list[tuple[int, int, int, str, int]] = field(default_factory=list)
    memory: dict[int, tuple[int, int]] = field(default_factory=dict)  # slot -> (sum delta, max peak)
    dropped_records: int = 0
    # the training thread's CUDA device when the record was taken (-1: CUDA not initialized);
    # the export thread's own current device is device 0 whatever the rank's is
    cuda_device: int = -1


class Recorder(Readings):
    """Readings sink for telemetry. ``on_step`` receives each finished :class:`StepRecord`.

    ``totals`` are the whole run's per-slot calls and time, added up off the hot path by whoever
    consumes the step records (the span builder), for the run summary. ``on_close`` runs at exit.
    """

    def __init__(self, on_step: Callable[[StepRecord], None], capacity: int = 1 << 16,
                 flush_every_s: float | None = None) -> None:
        self.slots: list[Slot] = []
        self.on_step = on_step
        self.capacity = capacity
        self._lock = threading.Lock()  # guards the slow-path lists only
        self._start_ns = perf_counter_ns()
        self._backward: list = []
        self._builds: list = []
        self._errors: list = []
        self._swaps: list = []
        self._memory: dict[int, tuple[int, int]] = {}
        self._dropped_elsewhere = 0   # records a CUDA timer could not queue
        self._plan_version = 0        # the plan the job runs (the last swap's), for a full buffer
        self._stepped = False
        self.record, self.record_since, self._take, self._steps_now = _make_buffer(
            capacity, _HandOver(self._hand_over_early),
            None if flush_every_s is None else int(flush_every_s * 1e9))
        self.totals = CallStats()
        self.on_close: Callable[[], None] | None = None

    def register_slot(self, slot: Slot) -> None:
        if slot.id >= len(self.slots):
            self.slots.append(slot)
        self.totals.register_slot(slot)

    def close(self) -> None:
        if self.on_close is not None:
            self.on_close()

    def backward(self, slot: int, start_ns: int, duration_ns: int) -> None:
        with self._lock:
            self._backward.append((slot, start_ns, duration_ns))

    def memory(self, slot: int, delta_bytes: int, peak_bytes: int) -> None:
        delta, peak = self._memory.get(slot, (0, 0))
        self._memory[slot] = (delta + delta_bytes, max(peak, peak_bytes))

    def dropped(self, records: int) -> None:
        with self._lock:
            self._dropped_elsewhere += records

    def build(self, slot: int, duration_ns: int, cache_hit: bool) -> None:
        with self._lock:
            self._builds.append((slot, perf_counter_ns() - duration_ns, duration_ns, cache_hit))

    def error(self, slot: int, message: str) -> None:
        with self._lock:
            self._errors.append((slot, message, perf_counter_ns()))

    def swap(self, step: int, old_version: int, new_version: int, digest: str) -> None:
        self._plan_version = new_version
        with self._lock:
            self._swaps.append((step, old_version, new_version, digest, perf_counter_ns()))

    def step(self, step: int, end_ns: int, plan_version: int, rss_bytes: int) -> None:
        if not self._stepped:   # from now on steps hand the records over, whatever they last
            self._stepped = True
            self._steps_now()
        rec = self._take_record(step, end_ns, plan_version, rss_bytes)
        self._start_ns = end_ns
        self.totals.step(step, end_ns, plan_version, rss_bytes)
        self.on_step(rec)

    def _hand_over_early(self) -> None:
        """The buffer is full before the step ends (a job without an optimizer, an evaluation
        pass between steps), or a job that has not stepped recorded for ``flush_every_s``: its
        calls are handed over as they are (step -1, as at exit), on the calling thread, rather
        than dropped or held back."""
        self.flush(self._plan_version, 0)

    def flush(self, plan_version: int, rss_bytes: int) -> None:
        """Hand over what was recorded since the last step (at exit, or for a job with no optimizer)."""
        rec = self._take_record(-1, perf_counter_ns(), plan_version, rss_bytes)
        if not (len(rec.calls) or rec.dropped_records or rec.backward or rec.builds or rec.errors
                or rec.swaps or rec.memory):
            return
        try:
            self.on_step(rec)
        except Exception:
            with self._lock:   # what it took is lost with the failure: counted, never silent
                self._dropped_elsewhere += len(rec.calls) // RECORD_WIDTH + rec.dropped_records
            raise

    def _take_record(self, step: int, end_ns: int, plan_version: int, rss_bytes: int) -> StepRecord:
        """Everything recorded since the last hand-over, as one record; the lists start anew."""
        calls, dropped = self._take()
        with self._lock:
            rec = StepRecord(step, self._start_ns, end_ns, plan_version, rss_bytes, calls,
                             self._backward, self._builds, self._errors, self._swaps, self._memory,
                             dropped + self._dropped_elsewhere,
                             torch.cuda.current_device() if _CUDA_BUILT and torch.cuda.is_initialized()
                             else -1)
            self._backward, self._builds, self._errors, self._swaps = [], [], [], []
            self._memory, self._dropped_elsewhere = {}, 0
        return rec


class _CallBuffer(array):
    """The preallocated buffer. A wrapper pickled by value (see ``dispatcher._Live``) takes
    ``record`` with it, and so this: it goes empty, not as megabytes of this job's calls."""

    __slots__ = ()

    def __reduce_ex__(self, protocol):  # array's own __reduce_ex__ would take precedence over __reduce__
        return (array, ("q",))


class _HandOver:
    """The buffer's ``on_full``, pickled (with ``record``, see :class:`_CallBuffer`) as one that
    does nothing: not as the recorder, its lock and its consumer."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def __call__(self) -> None:
        self.fn()

    def __reduce__(self):
        return (_HandOver, (_nothing,))


def _nothing() -> None:
    pass


_NEVER = 2**63 - 1


def _make_buffer(capacity: int, on_full: Callable[[], None] | None = None,
                 every_ns: int | None = None):
    """(record, record_since, take, stop_timer) sharing one preallocated buffer through closure
    cells (``record_since(slot, start_ns)``: ``record`` of a call that ends now). A call
    that finds the buffer full first has ``on_full`` empty it (through ``take``); one that finds
    it full again (``on_full`` failed, or is running) is dropped and counted. With ``every_ns``,
    a call starting ``every_ns`` after the last ``take`` has ``on_full`` empty it too, until
    ``stop_timer()``. The C buffer's methods where it is built (the same, without a Python frame
    per record)."""
    if _NativeCallBuffer is not None:
        native = _NativeCallBuffer(capacity, on_full, every_ns)
        return native.record, native.record_since, native.take, native.stop_timer
    limit = capacity * RECORD_WIDTH
    buf = _CallBuffer("q", bytes(8 * limit))
    pos = 0
    dropped = 0
    emptying = False
    if on_full is None:
        every_ns = None
    due = _NEVER if every_ns is None else perf_counter_ns() + every_ns

    def make_room() -> int:
        """The buffer's position once ``on_full`` emptied it, if it could."""
        nonlocal emptying
        if on_full is not None and not emptying:
            emptying = True
            try:
                on_full()
            except Exception:  # noqa: BLE001 - never the job's failure: the call is dropped
                pass
            finally:
                emptying = False
        return pos

    def record(slot: int, start_ns: int, duration_ns: int) -> None:
        nonlocal pos, dropped
        i = pos
        if i >= limit or start_ns >= due:
            i = make_room()
            if i >= limit:
                dropped += 1
                return
        buf[i] = slot
        buf[i + 1] = start_ns
        buf[i + 2] = duration_ns
        pos = i + 3

    def record_since(slot: int, start_ns: int) -> None:
        record(slot, start_ns, perf_counter_ns() - start_ns)

    def take() -> tuple[array, int]:
        nonlocal pos, dropped, due
        out, n = buf[:pos], dropped
        pos = dropped = 0
        if every_ns is not None:
            due = perf_counter_ns() + every_ns
        return out, n

    def stop_timer() -> None:
        nonlocal every_ns, due
        every_ns, due = None, _NEVER

    return record, record_since, take, stop_timer
