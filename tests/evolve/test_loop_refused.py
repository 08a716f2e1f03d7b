"""A bucket whose plan the job never takes: silence counts as a refusal only once the job is
past the plan's effective step, and then the incumbent's entry goes back on the board (later
plans are derived from it, so they would carry the failed bucket's explore arms)."""
from __future__ import annotations

import json

import pytest

from rtxops.evolve import loop as L
from rtxops.evolve.candidates import Arm
from rtxops.evolve.search import make_strategy
from rtxops.telemetry import store_evolve as se

from .loop_harness import loop_over_rows


class _Board:
    def __init__(self):
        self.published, self.reports, self.signed = [], [], []

    def current(self, job):
        return self.published[-1] if self.published else None

    def promote(self, plan, job, decision, evidence):
        self.published.append(plan)
        self.signed.append((decision, evidence))   # what governance signs into the bundle
        return plan


def test_a_plan_never_taken_fails_the_bucket_and_puts_the_incumbent_back(monkeypatch):
    decisions = []
    loop = loop_over_rows(monkeypatch, [], last=30, decisions=decisions)
    loop.board = _Board()
    monkeypatch.setattr(se, "swap_step", lambda q, job, v: None)  # the job never swaps
    inc, cand = Arm.of("reference"), Arm.of("fastish")
    bt = L.BucketTuning("gelu", "b", inc, strategy=make_strategy("exhaustive", [cand], budget=2))
    loop._next_round("job", bt, 30)
    assert loop.board.current("job").entry("gelu", "b").explore  # exploring
    loop.jobs["job"] = L.JobEvolution(active=bt)
    bt.published_ns -= int(400e9)  # past the swap timeout

    loop.tick()  # ...but the job has not reached the plan's effective step: minute-long steps?
    assert bt.phase == "exploring" and not decisions

    monkeypatch.setattr(se, "last_step", lambda q, job: bt.effective_step + 10)
    loop.tick()
    assert bt.phase == "failed" and decisions[-1]["kind"] == "refused"
    entry = loop.board.current("job").entry("gelu", "b")
    assert (entry.variant, entry.explore) == ("reference", ())


def test_a_canary_without_the_winner_running_waits_then_rolls_back(monkeypatch):
    """Only the fallback ran in the canary window (the job disabled the winner): no pass on
    zero live samples; after the longest window the incumbent goes back."""
    import numpy as np

    inc, win = Arm.of("reference"), Arm.of("fastish")
    rng = np.random.default_rng(0)
    rows = [{"step": s, "variant": inc.variant, "config": "{}", "calls": 4,
             "total_ns": 4e5 * float(np.exp(rng.normal(0, .02)))} for s in range(10, 400)]
    decisions, marks = [], []
    loop = loop_over_rows(monkeypatch, rows, last=30, decisions=decisions)
    monkeypatch.setattr(se, "upsert_tuning", lambda store, key, values: marks.append(values))
    loop.board = _Board()
    bt = L.BucketTuning("gelu", "b", inc, phase="canary", winner=win, plan_version=7)
    bt.rounds = [({s: 1e5 for s in range(0, 9)}, {win: {s: 0.8e5 for s in range(0, 9)}})]
    bt.decision_ns = 0.8e5
    loop.jobs["job"] = L.JobEvolution(active=bt)
    loop.tick()
    assert bt.phase == "canary" and not decisions  # one window: wait for more
    monkeypatch.setattr(se, "last_step", lambda q, job: 399)
    loop.tick()
    assert decisions[-1]["kind"] == "rollback", decisions[-1]
    assert "nothing shows it works live" in decisions[-1]["reason"]
    assert loop.board.current("job").entry("gelu", "b").variant == "reference"
    # the too-few comparison's unbounded interval: signed as null, not as Infinity (not JSON)
    json.dumps([loop.board.signed[-1], decisions[-1]["evidence"]], allow_nan=False)
    assert loop.board.signed[-1][0]["ci_high"] is None
    # unseen is not slower: the winner is not marked regressed for every later tuning
    assert not [m for m in marks if m["status"] == "regressed"]


def _regressing_canary(monkeypatch, swaps):
    """A winner promoted at 0.8 of the incumbent's time runs 3x slower live: the canary rolls
    it back. ``swaps``: plan version -> the step the job swapped to it (absent: never)."""
    inc, win = Arm.of("reference"), Arm.of("fastish")
    rows = [{"step": s, "variant": win.variant, "config": "{}", "calls": 4, "total_ns": 4 * 2.4e5}
            for s in range(10, 60)]
    decisions, marks = [], []
    loop = loop_over_rows(monkeypatch, rows, last=40, decisions=decisions)
    monkeypatch.setattr(se, "upsert_tuning", lambda store, key, values: marks.append(values))
    monkeypatch.setattr(se, "swap_step", lambda q, job, v: swaps.get(v))
    loop.board = _Board()
    bt = L.BucketTuning("gelu", "b", inc, phase="canary", winner=win, plan_version=7)
    bt.rounds = [({s: 1e5 for s in range(0, 9)}, {win: {s: 0.8e5 for s in range(0, 9)}})]
    loop.jobs["job"] = L.JobEvolution(active=bt)
    return loop, bt, decisions, marks


def test_a_rollback_counts_once_the_job_runs_it_and_is_newer_than_what_the_job_runs(monkeypatch):
    """The board lost the job's plan (a damaged file, then a reload): the rollback must still be
    newer than plan 7, which the job runs; the bucket is rolled back only once the job swaps."""
    swaps = {7: 9}
    loop, bt, decisions, marks = _regressing_canary(monkeypatch, swaps)
    loop.tick()
    assert decisions[-1]["kind"] == "rollback" and [m["status"] for m in marks] == ["regressed"]
    (rollback,) = loop.board.published
    assert rollback.version == 8 and rollback.entry("gelu", "b").variant == "reference"
    assert bt.phase == "rolling_back" and loop.jobs["job"].active is bt
    swaps[8] = 46
    loop.tick()
    assert bt.phase == "rolled_back" and loop.jobs["job"].active is None


def test_a_rollback_the_job_refuses_is_reported_as_failed(monkeypatch):
    loop, bt, decisions, _ = _regressing_canary(monkeypatch, {7: 9})
    loop.tick()
    loop.board.reports.append({"job_id": "job", "version": 8, "reason": "bad signature"})
    loop.tick()
    assert [d["kind"] for d in decisions[-3:]] == ["rollback", "refused", "rollback_failed"]
    assert "still running" in decisions[-1]["reason"] and bt.phase == "failed"


def test_drift_checks_on_one_step_windows_skip_a_bucket_not_called(monkeypatch):
    """RTXOPS_EVOLVE_WINDOW_STEPS=1 is allowed: a settled bucket with no calls in the last
    window is not checked (it raised on every tick, and no other bucket was tuned)."""
    loop = loop_over_rows(monkeypatch, [], last=30)
    loop.config = L.LoopConfig(window_steps=1, min_steps=5)
    bt = L.BucketTuning("gelu", "b", Arm.of("reference"), phase="settled", winner=Arm.of("fastish"))
    bt.decision_ns = 1e5
    state = L.JobEvolution(done={("gelu", "b"): bt})
    loop._check_drift("job", state, 30)
    assert bt.drift_strikes == 0 and ("gelu", "b") in state.done


def test_a_job_between_two_attempts_keeps_its_canary(monkeypatch):
    """A crash restart's backoff takes the job off the running list for a tick or two: its
    tuning state (a canary under way) stays; a job that ended loses it."""
    loop, bt, decisions, _ = _regressing_canary(monkeypatch, {7: 9})
    unfinished = {"job"}
    loop.running_jobs, loop.unfinished_jobs = (lambda: []), (lambda: set(unfinished))
    loop.tick()
    assert loop.jobs["job"].active is bt and bt.phase == "canary" and not decisions
    unfinished.clear()
    loop.tick()
    assert "job" not in loop.jobs


def test_a_canary_the_daemon_restarted_in_is_watched_again(monkeypatch):
    """The daemon restarted after a promotion and before its canary ended: a new loop rebuilds
    the canary from the decision's windows and rolls back a winner that runs slow live."""
    inc, win = Arm.of("reference"), Arm.of("fastish")
    rows = [{"step": s, "variant": v, "config": "{}", "calls": 4, "total_ns": 4 * ns}
            for s in range(10, 30) for v, ns in ((inc.variant, 1e5), (win.variant, 0.8e5))]
    rows += [{"step": s, "variant": win.variant, "config": "{}", "calls": 4, "total_ns": 4 * 2.4e5}
             for s in range(36, 80)]
    decisions = []
    loop = loop_over_rows(monkeypatch, rows, last=70, swapped=35, decisions=decisions)
    promote = {"op": "gelu", "bucket": "b", "kind": "promote", "plan_version": 7, "at_ns": 5,
               "incumbent_variant": "reference", "incumbent_config": "{}",
               "candidate_variant": "fastish", "candidate_config": "{}",
               "evidence": '{"windows": [[10, 29]], "trial_ids": ["t1"]}'}
    older = {**promote, "kind": "explore", "at_ns": 1}
    monkeypatch.setattr(se, "decisions", lambda q, job, limit=200, offset=0: [promote, older])
    loop.board = _Board()
    loop.tick()
    assert decisions and decisions[-1]["kind"] == "rollback", decisions
    assert loop.board.published[-1].entry("gelu", "b").variant == "reference"


def test_a_settled_canary_is_not_watched_again(monkeypatch):
    loop = loop_over_rows(monkeypatch, [], last=70)
    row = {"op": "gelu", "bucket": "b", "kind": "canary_pass", "plan_version": None, "at_ns": 9}
    monkeypatch.setattr(se, "decisions", lambda q, job, limit=200, offset=0: [row])
    loop.tick()
    assert loop.jobs["job"].active is None


class _BusyOnceBoard(_Board):
    """Cannot issue the first plan (a full disk, the ledger busy); takes the next."""

    def __init__(self):
        super().__init__()
        self.busy = True

    def promote(self, plan, job, decision, evidence):
        from rtxops.runtime.errors import PlanNotIssued

        if self.busy:
            self.busy = False
            raise PlanNotIssued(f"plan version {plan.version} could not be issued: OSError: "
                                "[Errno 28] No space left on device")
        return super().promote(plan, job, decision, evidence)


def test_a_plan_not_issued_for_now_is_retried_not_recorded_as_refused(monkeypatch):
    """A board that could not issue a plan (the disk, the ledger) was taken for a refusal: the
    bucket failed for good, with a 'refused' decision."""
    decisions = []
    loop = loop_over_rows(monkeypatch, [], last=30, decisions=decisions)
    loop.board = _BusyOnceBoard()
    inc, cand = Arm.of("reference"), Arm.of("fastish")
    bt = L.BucketTuning("gelu", "b", inc, strategy=make_strategy("exhaustive", [cand], budget=2))
    try:
        loop._next_round("job", bt, 30)
    except Exception as e:
        assert "could not be issued" in str(e)
    else:
        raise AssertionError("the board's failure was swallowed")
    assert bt.phase != "failed" and not decisions
    loop._next_round("job", bt, 31)      # the next tick takes the step again
    assert loop.board.current("job").entry("gelu", "b").explore and bt.phase == "exploring"


class _DenyingBoard(_Board):
    """Refuses plans of one decision kind, as a policy denies them (PlanBoard._issue)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def promote(self, plan, job, decision, evidence):
        from rtxops.runtime.errors import PlanError

        if decision.get("kind") == self.kind:
            raise PlanError("denied by policy measured-gain")
        return super().promote(plan, job, decision, evidence)


def test_a_refused_promotion_puts_the_incumbent_back_without_the_explore_arms(monkeypatch):
    """The promotion was refused (a policy's larger minimum gain): the bucket failed, but the
    board kept the last round's plan, so the job explored on for good, and every later bucket's
    plan (derived from the board's) carried these arms too."""
    decisions = []
    loop = loop_over_rows(monkeypatch, [], last=40, decisions=decisions)
    loop.board = _DenyingBoard("promote")
    inc, cand = Arm.of("reference"), Arm.of("fastish")
    bt = L.BucketTuning("gelu", "b", inc, strategy=make_strategy("exhaustive", [cand], budget=1))
    loop._next_round("job", bt, 10)
    assert loop.board.current("job").entry("gelu", "b").explore
    bt.rounds = [({s: 1e5 for s in range(10, 40)}, {cand: {s: 0.5e5 for s in range(10, 40)}})]
    bt.strategy.tell(cand, 0.5e5)
    bt.pending_arms = []
    loop._decide("job", bt, 40)
    assert bt.phase == "failed" and decisions[-1]["kind"] == "refused"
    entry = loop.board.current("job").entry("gelu", "b")
    assert (entry.variant, entry.explore) == ("reference", ())


def test_a_rollback_whose_records_failed_is_not_watched_as_the_promotions_canary(monkeypatch):
    """The rollback was published, then writing its 'regressed' mark failed: the bucket stayed
    in its canary and watched the rollback plan as the promotion's, rolled back a second time
    with another reason, and never marked the winner regressed."""
    swaps = {7: 9}
    loop, bt, decisions, marks = _regressing_canary(monkeypatch, swaps)
    failures = [TimeoutError("the store's writer timed out")]

    def upsert(store, key, values):
        if failures:
            raise failures.pop()
        marks.append(values)

    monkeypatch.setattr(se, "upsert_tuning", upsert)
    loop.tick()                       # publishes the rollback; the mark's write fails
    assert bt.phase == "rolling_back" and len(loop.board.published) == 1
    swaps[8] = 46
    loop.tick()                       # the mark is written, and the job runs the rollback
    assert [d["kind"] for d in decisions] == ["rollback"]
    assert "kernel time" in decisions[0]["reason"]
    assert [m["status"] for m in marks] == ["regressed"]
    assert bt.phase == "rolled_back" and len(loop.board.published) == 1


def test_a_bucket_called_less_than_once_a_window_is_not_taken_for_gone(monkeypatch):
    """A hot bucket called every 25th step had no call in its first 20-step window: it was
    rejected as 'no longer run through rtxops' (the loop allows a seldom bucket 10 windows)."""
    decisions = []
    inc, cand = Arm.of("reference"), Arm.of("fastish")
    rows = [{"step": s, "variant": v, "config": "{}", "calls": 1, "total_ns": ns}
            for s in range(35, 400, 25) for v, ns in ((inc.variant, 1e5), (cand.variant, 0.5e5))]
    loop = loop_over_rows(monkeypatch, rows, last=30, decisions=decisions)
    loop.board = _Board()
    bt = L.BucketTuning("gelu", "b", inc, strategy=make_strategy("exhaustive", [cand], budget=1))
    loop._next_round("job", bt, 5)
    loop.jobs["job"] = L.JobEvolution(active=bt)
    loop.tick()                                  # steps 10-30: no call yet
    assert bt.phase == "exploring" and not decisions
    monkeypatch.setattr(se, "last_step", lambda q, job: 300)
    loop.tick()
    assert decisions and decisions[-1]["kind"] != "reject", decisions[-1]


def test_a_step_time_regression_is_rolled_back_at_once_with_its_own_figures(monkeypatch):
    """The winner was hardly seen live (the job disabled it) and step time rose 50 %: the reason
    said 'step time -0.0%' with the kernel comparison's figures, after waiting 10 windows."""
    inc, win = Arm.of("reference"), Arm.of("fastish")
    rows = [{"step": s, "variant": inc.variant, "config": "{}", "calls": 4, "total_ns": 4e5}
            for s in range(10, 60)]
    decisions = []
    loop = loop_over_rows(monkeypatch, rows, last=40, decisions=decisions)
    monkeypatch.setattr(se, "step_durations", lambda q, job, since, until: [
        {"step": s, "duration_ns": 30e6 * (1 + 0.01 * (s % 3))} for s in range(since, until + 1)])
    loop.board = _Board()
    bt = L.BucketTuning("gelu", "b", inc, phase="canary", winner=win, plan_version=7)
    bt.rounds = [({s: 1e5 for s in range(0, 9)}, {win: {s: 0.8e5 for s in range(0, 9)}})]
    bt.step_before = [20e6 * (1 + 0.01 * (s % 3)) for s in range(20)]
    loop.jobs["job"] = L.JobEvolution(active=bt)
    loop.tick()
    assert decisions and decisions[-1]["kind"] == "rollback", decisions
    assert "step time +50" in decisions[-1]["reason"], decisions[-1]["reason"]
    assert decisions[-1]["gain"] < -0.4


def test_a_decision_time_figure_of_zero_does_not_stop_the_jobs_tuning(monkeypatch):
    """Kernel spans of zero time (another OTLP client) promoted at 0 ns: the drift ratio divided
    by zero on every tick, and no other bucket of the job was tuned again."""
    win = Arm.of("fastish")
    rows = [{"step": s, "variant": win.variant, "config": "{}", "calls": 1, "total_ns": 0.0}
            for s in range(0, 40)]
    loop = loop_over_rows(monkeypatch, rows, last=30)
    bt = L.BucketTuning("gelu", "b", Arm.of("reference"), phase="settled", winner=win)
    bt.decision_ns = 0.0
    state = L.JobEvolution(done={("gelu", "b"): bt})
    loop._check_drift("job", state, 30)
    assert ("gelu", "b") in state.done


def test_explore_arms_an_earlier_daemon_left_on_the_plan_are_taken_off(monkeypatch):
    """The daemon restarted during an explore round: the new loop owns no tuning of that bucket,
    so unless it happened to tune it again the job explored its arms for good (and every later
    plan carried them). The first tick puts the bucket's incumbent back without the arms."""
    from rtxops.runtime.plan import ExploreArm, PlanEntry, default_plan

    class _JobBoard(_Board):
        default = None

        def current(self, job):
            return self.default if job is None else super().current(job)

    loop = loop_over_rows(monkeypatch, [], last=3)      # below min_steps: nothing is opened
    loop.board = _JobBoard()
    exploring = PlanEntry("gelu", "b", "reference", {}, (ExploreArm("fastish", {}, 0.1),))
    settled = PlanEntry("softmax", "c", "online", {})
    # the default plan (every job's, the user's) is left as it is
    loop.board.default = default_plan().derive(entries=[exploring])
    loop.board.published.append(loop.board.default)
    loop.tick()
    assert len(loop.board.published) == 1
    del loop.jobs["job"]
    loop.board.published.append(default_plan().derive(entries=[exploring, settled]))
    loop.tick()
    current = loop.board.current("job")
    assert current.entry("gelu", "b") == PlanEntry("gelu", "b", "reference", {})
    assert current.entry("softmax", "c") == settled
    loop.tick()
    assert len(loop.board.published) == 3, "the arms are taken off once"


def test_rounds_whose_arms_never_ran_are_rejected_saying_so(monkeypatch):
    """Under saved-tensor hooks everywhere (every block checkpointed) no call takes an explore
    arm: the bucket was rejected with a comparison's reason, as if the arms had been measured."""
    decisions = []
    loop = loop_over_rows(monkeypatch, [], last=40, decisions=decisions)
    inc, cand = Arm.of("reference"), Arm.of("fastish")
    bt = L.BucketTuning("gelu", "b", inc, strategy=make_strategy("exhaustive", [cand], budget=1))
    bt.rounds = [({s: 1e5 for s in range(10, 40)}, {cand: {}})]
    bt.strategy.tell(cand, float("inf"))
    loop._decide("job", bt, 40)
    assert bt.phase == "rejected" and "no call ran an explore arm in 1 rounds" in decisions[-1]["reason"]


def _drift_loop(monkeypatch, rows):
    loop = loop_over_rows(monkeypatch, rows, last=0)
    loop.config = L.LoopConfig(window_steps=20, min_steps=5)
    bt = L.BucketTuning("gelu", "b", Arm.of("reference"), phase="settled", winner=Arm.of("fastish"))
    bt.decision_ns = 1e5
    return loop, bt, L.JobEvolution(done={("gelu", "b"): bt})


def _window_rows(start: int, ns: float, every: int = 1) -> list[dict]:
    return [{"step": s, "variant": "fastish", "config": "{}", "calls": 2, "total_ns": 2 * ns}
            for s in range(start, start + 20, every)]


def test_drift_needs_two_slow_windows_in_a_row(monkeypatch):
    """A window with too few calls to tell left the strike count as it was: two slow windows with
    quiet ones between them re-opened the bucket, as if in a row."""
    rows: list[dict] = []
    loop, bt, state = _drift_loop(monkeypatch, rows)
    for last in (20, 40, 60, 80, 100):     # slow, quiet x3, slow
        if last in (20, 100):
            rows += _window_rows(last - 20, 3e5)
        loop._check_drift("job", state, last)
    assert ("gelu", "b") in state.done and bt.drift_strikes == 1


def test_a_bucket_called_every_third_step_is_checked_for_drift(monkeypatch):
    """Windows were judged only with calls in half their steps: a bucket called every 3rd step
    (7 of 20) 3x slower than at its decision was never re-opened."""
    rows = _window_rows(0, 3e5, every=3) + _window_rows(20, 3e5, every=3)
    loop, bt, state = _drift_loop(monkeypatch, rows)
    for last in (20, 40):
        loop._check_drift("job", state, last)
    assert ("gelu", "b") not in state.done


def test_a_plan_published_by_hand_meanwhile_is_built_on_not_recorded_as_a_refusal(monkeypatch, tmp_path):
    """The loop derives its plan from the board's current one; a plan published for the job in
    between (by hand, through POST /v1/plans) takes that version first. The loop derives again
    from it, keeping its entries, instead of failing the bucket as refused."""
    from rtxops.daemon.plans import PlanBoard
    from rtxops.runtime.plan import Plan

    class RacingBoard(PlanBoard):
        raced = False

        def promote(self, plan, job, decision=None, evidence=None):
            if not self.raced:   # a manual publish lands between the loop's read and its publish
                self.raced = True
                self.publish(Plan.from_dict({"version": plan.version, "defaults": {"silu": "reference"}}), job)
            return super().promote(plan, job, decision=decision, evidence=evidence)

    decisions = []
    loop = loop_over_rows(monkeypatch, [], last=30, decisions=decisions)
    loop.board = RacingBoard(tmp_path)
    inc, cand = Arm.of("reference"), Arm.of("eager")
    bucket = "float32/cpu/tanh=0,hidden=256,rows=64"   # the board validates plans
    bt = L.BucketTuning("gelu", bucket, inc, strategy=make_strategy("exhaustive", [cand], budget=2))
    loop._next_round("job", bt, 30)
    plan = loop.board.current("job")
    assert loop.board.raced and not decisions, [d.get("reason") for d in decisions]
    assert bt.phase == "exploring"
    assert plan.version == 2 and bt.plan_version == 2      # the manual plan took version 1
    assert plan.entry("gelu", bucket).explore and dict(plan.defaults) == {"silu": "reference"}


@pytest.mark.parametrize("running, tuned", [(None, True), (0, True), (7, False)])
def test_a_job_running_a_plan_the_board_does_not_hold_is_left_to_it(monkeypatch, caplog, running, tuned):
    """`rtxops run --plan` (version 7) under a daemon whose board holds no plan for the job: the
    loop published versions 1, 2, ... (each refused as older: every hot bucket failed), and its
    plans, derived from the board's, would have dropped the job's own entries once numbered
    past it. The job is left to its plan, said once."""
    loop = loop_over_rows(monkeypatch, [], last=400, running=running)
    opened = []
    # (a scan that opens a bucket: the next tick scans again, where a quiet one would wait)
    monkeypatch.setattr(loop, "_open_hot_bucket", lambda job, state, last: opened.append(job) or True)
    with caplog.at_level("WARNING", logger="rtxops.evolve"):
        loop.tick()
        loop.tick()
    assert opened == (["job", "job"] if tuned else [])
    warned = [r for r in caplog.records if "plan board does not hold" in r.getMessage()]
    assert len(warned) == (0 if tuned else 1)
    assert loop.status()["job"].get("own_plan") == (None if tuned else 7)


def test_a_plan_starts_from_the_step_the_job_has_reached_not_the_stores_newest(monkeypatch):
    """A settled job reports every 10 s: the store's newest step lags. The plan's effective step
    is counted from the daemon's estimate of where the job is now, where it has one."""
    loop = loop_over_rows(monkeypatch, [], last=30, decisions=[])
    loop.board = _Board()
    bt = L.BucketTuning("gelu", "b", Arm.of("reference"),
                        strategy=make_strategy("exhaustive", [Arm.of("fastish")], budget=2))
    loop._next_round("job", bt, 30)
    assert loop.board.current("job").effective_step == 30 + loop.config.margin_steps
    loop.current_step = lambda job: 250
    bt2 = L.BucketTuning("gelu", "c", Arm.of("reference"),
                         strategy=make_strategy("exhaustive", [Arm.of("fastish")], budget=2))
    loop._next_round("job", bt2, 30)
    assert loop.board.current("job").effective_step == 250 + loop.config.margin_steps
    loop.current_step = lambda job: None    # a job the daemon has no estimate for
    loop._next_round("job", bt2, 40)
    assert loop.board.current("job").effective_step == 40 + loop.config.margin_steps
