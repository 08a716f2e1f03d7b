"""The readings interface: where the dispatcher reports what it measured.

The dispatcher calls :meth:`Readings.record_since` once per routed call (hot path) and the other
methods off the hot path. The telemetry package plugs in a recorder with the same methods; the
runtime's own :class:`CallStats` keeps per-slot totals for ``rtxops run``'s summary.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter_ns


@dataclass(frozen=True)
class Slot:
    """What one routed (site, variant, config, bucket) is; slots are numbered from 0."""

    id: int
    op: str
    variant: str
    config: str  # canonical JSON of the config
    bucket: str
    site: str
    family: str
    phase: str = "fwd"


class Readings:
    """Base readings sink: ignores everything. Subclasses override what they keep."""

    def register_slot(self, slot: Slot) -> None: ...

    def record(self, slot: int, start_ns: int, duration_ns: int) -> None: ...

    def record_since(self, slot: int, start_ns: int) -> None:
        """:meth:`record` of a call from ``start_ns`` to now: the hot path's form (a sink that
        reads the clock itself saves the caller a call)."""
        self.record(slot, start_ns, perf_counter_ns() - start_ns)

    def backward(self, slot: int, start_ns: int, duration_ns: int) -> None: ...

    def memory(self, slot: int, delta_bytes: int, peak_bytes: int) -> None: ...

    def build(self, slot: int, duration_ns: int, cache_hit: bool) -> None: ...

    def error(self, slot: int, message: str) -> None: ...

    def step(self, step: int, end_ns: int, plan_version: int, rss_bytes: int) -> None: ...

    def swap(self, step: int, old_version: int, new_version: int, digest: str) -> None: ...

    def dropped(self, records: int) -> None:
        """Calls measured and not kept (a CUDA timer's queue full): counted, never silent."""

    def close(self) -> None:
        """The process is ending: hand over anything still held (the bootstrap calls this)."""


MAX_ERRORS_KEPT = 1000  # a job's whole life: errors past these are counted, not kept


@dataclass
class CallStats(Readings):
    """Per-slot call counts and time; enough for the run summary and tests."""

    slots: list[Slot] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    total_ns: list[int] = field(default_factory=list)
    build_misses: list[int] = field(default_factory=list)
    errors: list[tuple[int, str]] = field(default_factory=list)  # the first MAX_ERRORS_KEPT
    errors_dropped: int = 0
    steps: int = 0
    peak_rss: int = 0
    swaps: list[tuple[int, int, int, str]] = field(default_factory=list)

    def register_slot(self, slot: Slot) -> None:
        if slot.id < len(self.slots):  # already known (re-registered after set_readings)
            return
        self.slots.append(slot)
        self.calls.append(0)
        self.total_ns.append(0)
        self.build_misses.append(0)

    def __post_init__(self) -> None:
        calls, total = self.calls, self.total_ns

        def record(slot: int, start_ns: int, duration_ns: int) -> None:
            calls[slot] += 1
            total[slot] += duration_ns

        def record_since(slot: int, start_ns: int) -> None:
            calls[slot] += 1
            total[slot] += perf_counter_ns() - start_ns

        # closures: no attribute lookups per call
        self.record = record  # type: ignore[method-assign]
        self.record_since = record_since  # type: ignore[method-assign]

    def build(self, slot: int, duration_ns: int, cache_hit: bool) -> None:
        if not cache_hit:
            self.build_misses[slot] += 1

    def error(self, slot: int, message: str) -> None:
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append((slot, message))
        else:
            self.errors_dropped += 1

    def step(self, step: int, end_ns: int, plan_version: int, rss_bytes: int) -> None:
        self.steps = step
        self.peak_rss = max(self.peak_rss, rss_bytes)

    def swap(self, step: int, old_version: int, new_version: int, digest: str) -> None:
        self.swaps.append((step, old_version, new_version, digest))
