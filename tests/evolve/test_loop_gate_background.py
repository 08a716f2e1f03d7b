"""The gate runs candidate kernels in worker processes, which may take minutes (a compile): it
ran on the loop's thread, and every other job's canary and rollback waited for it. It now runs
in the background; the bucket waits in phase ``gating`` and the loop ticks on."""
from __future__ import annotations

import threading
import time

from rtxops.evolve import loop as L
from rtxops.evolve.candidates import Arm
from rtxops.telemetry import store_evolve as se

from .loop_harness import loop_over_rows

BUCKET = "float32/cpu/hidden=64,rows=512"
HOT = {"op": "gelu", "bucket": BUCKET, "variant": "reference", "config": "{}", "share": 0.5}


class _Board:
    def __init__(self):
        self.published = []

    def current(self, job):
        return self.published[-1] if self.published else None

    def promote(self, plan, job, decision, evidence):
        self.published.append(plan)
        return plan


def _loop(monkeypatch, screen=None, gate=None):
    """A loop over one hot gelu bucket whose screening is ``screen`` (arms -> (passed, failed)),
    or the real screening with ``gate`` for its worker (arms -> {arm: (ok, reason)})."""
    decisions: list[dict] = []
    loop = loop_over_rows(monkeypatch, [], last=50, decisions=decisions)
    loop.board = _Board()
    loop.registry.op = lambda op: None
    monkeypatch.setattr(se, "region_swap_step", lambda q, job: None)
    monkeypatch.setattr(se, "hotspots", lambda q, job, since: [HOT])
    monkeypatch.setattr(se, "swap_step", lambda q, job, v: None)
    monkeypatch.setattr(L, "candidates", lambda *a, **k: [Arm.of("reference"), Arm.of("fast")])
    if screen is not None:
        monkeypatch.setattr(L, "screen", lambda tuning, op, bucket, arms, timeout_s, worker_slot:
                            screen(tuning, op, bucket, arms, timeout_s))
    if gate is not None:
        from rtxops.evolve import screen as screening

        monkeypatch.setattr(screening, "_gate", gate)
    monkeypatch.setattr(se, "tuning_rows", lambda *a, **k: [])
    monkeypatch.setattr(L, "GATE_WAIT_S", 0.05, raising=False)
    return loop, decisions


def test_a_slow_gate_does_not_hold_up_the_loop(monkeypatch):
    release = threading.Event()

    def slow_screen(tuning, op, bucket, arms, timeout_s):
        assert arms == [Arm.of("fast")]
        release.wait(30)
        return arms, {}

    loop, decisions = _loop(monkeypatch, slow_screen)
    started = time.monotonic()
    loop.tick()
    loop.tick()
    assert time.monotonic() - started < 5, "the ticks waited for the gate"
    bt = loop.jobs["job"].active
    assert bt.phase == "gating" and loop.status()["job"]["active"]["phase"] == "gating"
    assert not loop.board.published
    release.set()
    bt.gating.result(10)
    loop.tick()
    assert bt.phase == "exploring" and bt.round_arms == [Arm.of("fast")]
    assert loop.board.current("job").entry("gelu", BUCKET).explore


def test_verdicts_already_known_explore_in_the_same_tick(monkeypatch):
    loop, _ = _loop(monkeypatch, lambda tuning, op, bucket, arms, timeout_s: (arms, {}))
    monkeypatch.setattr(L, "GATE_WAIT_S", 5.0, raising=False)
    loop.tick()
    assert loop.jobs["job"].active.phase == "exploring"


def test_a_gate_failing_every_candidate_rejects_the_bucket(monkeypatch):
    loop, decisions = _loop(monkeypatch, lambda tuning, op, bucket, arms, timeout_s:
                            ([], {a: "max error 3.0" for a in arms}))
    monkeypatch.setattr(L, "GATE_WAIT_S", 5.0, raising=False)
    loop.tick()
    state = loop.jobs["job"]
    assert state.active is None and state.done[("gelu", BUCKET)].phase == "rejected"
    assert decisions[-1]["kind"] == "no_candidates"


def test_a_gate_that_could_not_run_leaves_the_bucket_to_be_opened_again(monkeypatch):
    calls = []

    def broken(tuning, op, bucket, arms, timeout_s):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("no worker")
        return arms, {}

    loop, decisions = _loop(monkeypatch, broken)
    monkeypatch.setattr(L, "GATE_WAIT_S", 5.0, raising=False)
    loop.tick()
    assert loop.jobs["job"].active is None and not loop.jobs["job"].done and not decisions
    loop.tick()
    assert loop.jobs["job"].active.phase == "exploring" and len(calls) == 2


def test_gates_of_several_jobs_run_one_at_a_time(monkeypatch):
    """Each gate is a worker process importing torch beside the jobs themselves: with eight jobs
    opening buckets at once, eight of them ran together. ``RTXOPS_EVOLVE_GATES`` (1) bounds them;
    a bucket waiting for its turn stays in phase gating."""
    release, running, most = threading.Event(), [0], [0]
    lock = threading.Lock()

    def slow_gate(tuning, op, bucket, arms, timeout_s):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        release.wait(30)
        with lock:
            running[0] -= 1
        return {a: (True, "") for a in arms}

    loop, _ = _loop(monkeypatch, gate=slow_gate)
    jobs = ["a", "b", "c"]
    loop.running_jobs = lambda: jobs
    loop.tick()
    time.sleep(0.3)   # time for every gate thread to reach the screen if nothing held it back
    assert [loop.jobs[j].active.phase for j in jobs] == ["gating"] * 3
    assert most[0] == 1
    release.set()
    for j in jobs:
        loop.jobs[j].active.gating.result(10)
    loop.tick()
    assert [loop.jobs[j].active.phase for j in jobs] == ["exploring"] * 3
    assert most[0] == 1


def test_a_bucket_whose_verdicts_are_stored_does_not_wait_for_another_jobs_gate(monkeypatch):
    release = threading.Event()

    def gate(tuning, op, bucket, arms, timeout_s):
        release.wait(30)
        return {a: (True, "") for a in arms}

    known = [False]
    loop, _ = _loop(monkeypatch, gate=gate)
    monkeypatch.setattr(loop.tuning, "gate", lambda op, bucket, arm: {"passed": True} if known[0] else None)
    loop.running_jobs = lambda: ["a"]
    loop.tick()                                  # job a's gate holds the slot
    assert loop.jobs["a"].active.phase == "gating"
    known[0] = True                              # (as if another home's gate had stored them)
    loop.running_jobs = lambda: ["a", "b"]
    monkeypatch.setattr(L, "GATE_WAIT_S", 5.0, raising=False)
    started = time.monotonic()
    loop.tick()
    assert loop.jobs["b"].active.phase == "exploring" and time.monotonic() - started < 4
    release.set()


def test_the_canary_baseline_is_a_window_after_the_jobs_last_swap(monkeypatch):
    """A slower plan rolled back a few steps before a new bucket opens: its steps were in the
    baseline the winner's canary is judged against, hiding a winner as slow as it. Exploring
    now waits for a window of the plan the job runs."""
    loop, _ = _loop(monkeypatch, lambda tuning, op, bucket, arms, timeout_s: (arms, {}))
    monkeypatch.setattr(L, "GATE_WAIT_S", 5.0, raising=False)
    monkeypatch.setattr(se, "last_swap_step", lambda q, job: 41)
    asked = []
    monkeypatch.setattr(se, "step_durations", lambda q, job, since, until=None:
                        asked.append((since, until)) or [])
    loop.tick()                                  # step 50: the swap was 9 steps ago
    assert loop.jobs["job"].active.phase == "gating" and asked == []
    monkeypatch.setattr(se, "last_step", lambda q, job: 61)
    loop.tick()
    assert loop.jobs["job"].active.phase == "exploring"
    assert asked == [(42, 61)]   # after the swap, not steps 41 and before
