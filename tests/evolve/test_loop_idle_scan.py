"""A job with nothing left worth tuning is scanned for hot spots less and less often (twice the gap
each time, up to ``idle_scan_max_s``); a scan that opens a bucket, or a bucket re-opened for
drift, brings the scans back to every tick."""
from __future__ import annotations

from rtxops.evolve import loop as L
from rtxops.evolve.candidates import Arm
from rtxops.telemetry import store_evolve

from .loop_harness import loop_over_rows

REF = Arm.of("reference")


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _scanning_loop(monkeypatch, rows: list[dict], hot: list[dict]):
    """A loop at step 100 whose hot-spot query answers ``hot`` (a list the test may change) and
    notes the time of each call (seconds from the start); its clock is the test's."""
    loop = loop_over_rows(monkeypatch, rows, last=100)
    clock = loop.clock = _Clock()
    start = clock.now
    scans: list[float] = []

    def hotspots(q, job, since):
        scans.append(clock.now - start)
        return list(hot)

    monkeypatch.setattr(store_evolve, "hotspots", hotspots)
    region = loop.region_swap = [None]   # the step of the job's last region swap (the test sets it)
    monkeypatch.setattr(store_evolve, "region_swap_step", lambda q, job: region[0])
    return loop, scans, clock


def _ticks(loop, clock, seconds: float, every: float = 1.0) -> None:
    end = clock.now + seconds
    while clock.now < end:
        loop.tick()
        clock.now += every


def test_quiet_scans_back_off_to_the_cap(monkeypatch):
    loop, scans, clock = _scanning_loop(monkeypatch, [], hot=[])
    loop.config.interval_s, loop.config.idle_scan_max_s = 2.0, 60.0
    _ticks(loop, clock, 200)   # a tick a second for 200 s
    # at 0 s, then 4, 8, 16 and 32 s after the scan before, then every 60 s (the cap)
    assert scans == [0, 4, 12, 28, 60, 120, 180], scans
    assert loop.jobs["job"].quiet_scans == 7


def test_a_bucket_that_turns_hot_is_opened_at_the_next_scan_and_scans_resume(monkeypatch):
    hot: list[dict] = []
    loop, scans, clock = _scanning_loop(monkeypatch, [], hot=hot)
    opened: list[str] = []

    def open_(job, state, hs, last):
        opened.append(hs["bucket"])
        return L.BucketTuning(hs["op"], hs["bucket"], REF, phase="settled")  # decided at once

    loop._open = open_
    _ticks(loop, clock, 30)          # quiet: scans at 0, 4, 12 and 28 s
    assert scans == [0, 4, 12, 28]
    hot.append({"op": "gelu", "bucket": "b", "share": 0.2, "variant": "reference", "config": "{}"})
    _ticks(loop, clock, 20)          # the next scan is at 60 s: not yet
    assert opened == [] and len(scans) == 4
    _ticks(loop, clock, 15)          # 50..64 s
    # b opened (and decided) at 60 s; the scans start over: the next tick's (quiet) scan, then 4 s
    assert opened == ["b"] and scans == [0, 4, 12, 28, 60, 61]
    hot.append({"op": "gelu", "bucket": "c", "share": 0.1, "variant": "reference", "config": "{}"})
    _ticks(loop, clock, 2)           # 65, 66 s
    assert opened == ["b", "c"] and scans[6] == 65   # 4 s after the quiet scan at 61 s


def test_a_bucket_reopened_for_drift_is_scanned_for_at_the_next_tick(monkeypatch):
    # the settled winner now takes twice its decision-time figure, in two checks a window apart
    rows = [{"step": s, "variant": "reference", "config": "{}", "calls": 1, "total_ns": 2e6}
            for s in range(0, 200)]
    loop, scans, clock = _scanning_loop(monkeypatch, rows, hot=[])
    settled = L.BucketTuning("gelu", "b", REF, phase="settled", winner=REF, decision_ns=1e6)
    loop.jobs["job"] = L.JobEvolution(done={("gelu", "b"): settled})
    loop.tick()                      # drift strike 1 (the window is checked once per window)
    assert settled.drift_strikes == 1
    _ticks(loop, clock, 40)
    quiet = len(scans)
    assert quiet == 4                # at 0, 4, 12 and 28 s
    settled.drift_checked = 100 - loop.config.window_steps    # a window later: strike 2
    loop.tick()
    assert ("gelu", "b") not in loop.jobs["job"].done
    assert len(scans) == quiet + 1   # re-opened: the scan ran in the same tick
    assert loop.jobs["job"].quiet_scans == 1   # (nothing hot in this test's answer)


def test_a_region_swap_brings_the_next_scan_forward(monkeypatch):
    """The whole-model region swapped in: the ops the job routes changed, so their hot spots are
    looked for at the next tick, not after the back-off."""
    loop, scans, clock = _scanning_loop(monkeypatch, [], hot=[])
    _ticks(loop, clock, 30)
    assert scans == [0, 4, 12, 28]
    loop.region_swap[0] = 80
    _ticks(loop, clock, 10)          # 30..39 s
    assert scans == [0, 4, 12, 28, 30, 34], scans   # at once, then backing off afresh
