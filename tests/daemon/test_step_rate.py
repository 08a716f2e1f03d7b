"""The daemon's step-rate estimate (the lead it gives a plan's effective step) exists from a job's
second reported step, and settles on whole seconds once they are seen."""
from rtxops.daemon.home import Home
from rtxops.daemon.server import Daemon

S = 1_000_000_000


def test_a_rate_from_the_second_step_then_settled_on_whole_seconds(tmp_path, monkeypatch):
    monkeypatch.setenv("RTXOPS_EVOLVE", "0")
    d = Daemon(Home(tmp_path / "home"), port=0)
    try:
        t0 = 10 * S
        d._note_step("j", 0, t0)
        assert "j" not in d._step_rates                       # one step: no rate yet
        d._note_step("j", 2, t0 + S // 2)
        assert abs(d._step_rates["j"] - 4.0) < 1e-9            # 2 steps in 0.5 s, an estimate
        d._note_step("j", 3, t0 + 3 * S // 4)
        assert abs(d._step_rates["j"] - 4.0) < 1e-9            # refined over what was seen
        d._note_step("j", 10, t0 + 2 * S)
        assert abs(d._step_rates["j"] - 5.0) < 1e-9            # 10 steps over 2 s: settled
        d._note_step("j", 30, t0 + 2 * S + S // 10)
        assert abs(d._step_rates["j"] - 5.0) < 1e-9            # a burst under a second: kept
    finally:
        d.shutdown()


def test_step_spans_of_jobs_the_daemon_does_not_run_keep_no_rate(tmp_path, monkeypatch):
    """Any OTLP client's job ids reach on_batch: their rates were kept for good (one entry per
    id ever seen)."""
    import pyarrow as pa

    monkeypatch.setenv("RTXOPS_EVOLVE", "0")
    d = Daemon(Home(tmp_path / "home"), port=0).prepare()
    try:
        spans = pa.table({"name": ["rtx.step"] * 2, "job_id": ["elsewhere-1", "elsewhere-2"],
                          "rank": [0, 0], "step": [1, 2], "end_ns": [10 * S, 11 * S]})
        d.on_batch(type("Batch", (), {"spans": spans})())
        assert d._step_marks == {} and d._step_rates == {}
    finally:
        d.shutdown()


def test_a_jobs_step_now_is_carried_on_from_its_newest_report_at_its_rate():
    from rtxops.daemon.server import MAX_BEHIND_S, reached_step

    ended = 100 * S
    assert reached_step(40, None, 5.0, ended + 3 * S) == 40          # no step span seen
    assert reached_step(40, (40, ended), 5.0, ended + 3 * S) == 55   # 3 s at 5 steps/s
    assert reached_step(40, (40, ended), 5.0, ended - S) == 40       # a clock behind: no less
    assert reached_step(70, (40, ended), 5.0, ended + S) == 70       # a newer heartbeat wins
    far = reached_step(40, (40, ended), 5.0, ended + 3600 * S)       # a job stuck for an hour
    assert far == 40 + int(5 * MAX_BEHIND_S)
