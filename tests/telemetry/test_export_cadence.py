"""A job exports every ``interval_s`` while something in it changes (its start, a swap, a plan that
explores) and every ``quiet_interval_s`` otherwise: fewer requests for the daemon to take beside a
converged job."""
from __future__ import annotations

import time
from array import array

import pytest

from rtxops import settings
from rtxops.daemon.jobs import JobSpec
from rtxops.daemon.launch import environment
from rtxops.telemetry import exporters
from rtxops.telemetry.exporters import ExportThread, StepProcessor
from rtxops.telemetry.recorder import StepRecord


class _Exports:
    def __init__(self) -> None:
        self.at: list[float] = []

    def export(self, spans):
        self.at.append(time.monotonic())
        return exporters.SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def _record(step: int, swapped: bool = False) -> StepRecord:
    swaps = [(step, 1, 2, "digest", 0)] if swapped else []
    return StepRecord(step, 0, 1, 1, 0, array("q"), swaps=swaps)


def _thread(exports: _Exports, **kw) -> ExportThread:
    processor = StepProcessor()
    return ExportThread(lambda rec, counters: processor.on_end(("span of", rec.step)), processor,
                        exports, interval_s=0.1, poll_s=0.02, quiet_interval_s=30, **kw)


def _stepping(thread: ExportThread, seconds: float, swap_at: float | None = None) -> None:
    start = time.monotonic()
    step = 0
    while time.monotonic() - start < seconds:
        step += 1
        swapped = swap_at is not None and time.monotonic() - start >= swap_at
        thread.submit(_record(step, swapped))
        swap_at = None if swapped else swap_at
        time.sleep(0.01)


def test_a_quiet_job_exports_at_the_quiet_interval_after_its_start(monkeypatch):
    monkeypatch.setattr(exporters, "ACTIVE_S", 1.5)
    exports = _Exports()
    started = time.monotonic()
    thread = _thread(exports)
    assert thread.current_interval_s() == 0.1
    _stepping(thread, 3.5)
    assert thread.current_interval_s() == 30
    thread.close()
    early = [t for t in exports.at[:-1] if t - started < 1.5]
    late = [t for t in exports.at[:-1] if t - started >= 1.8]   # (the last one: the close)
    assert len(early) >= 3 and late == [], [round(t - started, 2) for t in exports.at]


def test_a_swap_brings_the_short_interval_back(monkeypatch):
    monkeypatch.setattr(exporters, "ACTIVE_S", 1.5)
    exports = _Exports()
    thread = _thread(exports)
    _stepping(thread, 2.0)
    assert thread.current_interval_s() == 30
    quiet = len(exports.at)
    _stepping(thread, 1.0, swap_at=0.0)
    assert thread.current_interval_s() == 0.1
    assert len(exports.at) - quiet >= 3
    thread.close()


def test_a_plan_that_explores_keeps_the_short_interval(monkeypatch):
    monkeypatch.setattr(exporters, "ACTIVE_S", 0.0)
    exploring = [True]
    thread = _thread(_Exports(), exploring=lambda: exploring[0])
    assert thread.current_interval_s() == 0.1
    exploring[0] = False
    assert thread.current_interval_s() == 30
    thread.close()


def test_the_quiet_interval_is_the_interval_where_only_that_is_set(monkeypatch):
    monkeypatch.delenv("RTXOPS_EXPORT_QUIET_INTERVAL_S", raising=False)
    monkeypatch.delenv("RTXOPS_EXPORT_INTERVAL_S", raising=False)
    assert settings.export_quiet_interval_s() == settings.EXPORT_QUIET_INTERVAL_S
    monkeypatch.setenv("RTXOPS_EXPORT_INTERVAL_S", "0.5")
    assert settings.export_quiet_interval_s() == 0.5
    monkeypatch.setenv("RTXOPS_EXPORT_QUIET_INTERVAL_S", "0.1")
    assert settings.export_quiet_interval_s() == 0.5     # never shorter than the interval
    monkeypatch.setenv("RTXOPS_EXPORT_QUIET_INTERVAL_S", "nonsense")
    with pytest.raises(settings.SettingError):
        settings.export_quiet_interval_s()


@pytest.mark.parametrize("hang_timeout_s, own, expected", [
    (None, {}, None),
    (30.0, {}, 3.0),                                              # a tenth of the hang timeout
    (600.0, {}, settings.EXPORT_QUIET_INTERVAL_S),
    (600.0, {"RTXOPS_EXPORT_QUIET_INTERVAL_S": "300"}, 60.0),     # asked for, and clamped
    (600.0, {"RTXOPS_EXPORT_INTERVAL_S": "0.5"}, 0.5),            # only that set: it stands
    (600.0, {"RTXOPS_EXPORT_QUIET_INTERVAL_S": "soon"}, None),    # the job refuses that itself
])
def test_a_job_with_a_hang_timeout_is_heard_well_within_it(hang_timeout_s, own, expected):
    spec = JobSpec(command=["python", "train.py"], hang_timeout_s=hang_timeout_s)
    env = environment(spec, job_id="j-1", token="t", attempt=1, base=own, extra_env={})
    quiet = env.get("RTXOPS_EXPORT_QUIET_INTERVAL_S")
    if expected is None:
        assert quiet == own.get("RTXOPS_EXPORT_QUIET_INTERVAL_S")
    else:
        assert float(quiet) == expected


def test_a_quiet_jobs_first_step_after_a_silence_goes_out_at_once(monkeypatch):
    """The interval runs from the last request, not from the last look that found nothing: a
    step (a heartbeat) after a long silence is not held back up to a quiet interval."""
    monkeypatch.setattr(exporters, "ACTIVE_S", 0.0)
    exports = _Exports()
    processor = StepProcessor()
    thread = ExportThread(lambda rec, counters: processor.on_end(("span of", rec.step)), processor,
                          exports, interval_s=0.1, poll_s=0.02, quiet_interval_s=2.0)
    time.sleep(2.5)                 # setting up, say: nothing to send
    stepped = time.monotonic()
    thread.submit(_record(1))
    deadline = stepped + 5
    while not exports.at and time.monotonic() < deadline:
        time.sleep(0.01)
    thread.close()
    assert exports.at and exports.at[0] - stepped < 0.8, [t - stepped for t in exports.at]
