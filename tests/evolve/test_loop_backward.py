"""Training runs each routed op's backward too: a variant whose forward is faster but whose
backward costs more than that saves must not be promoted on its forward calls alone."""
from __future__ import annotations

import numpy as np

from rtxops.evolve.candidates import Arm

from .loop_harness import loop_over_rows, tick_one_arm

INC, CAND = Arm.of("reference"), Arm.of("candidate")


def rows_of(fwd: dict[Arm, float], bwd: dict[Arm, float], *, bwd_every: int = 8,
            seed: int = 0) -> list[dict]:
    """Every step calls the incumbent and the candidate four times each (ms a call, noise 3 %);
    every ``bwd_every`` steps one backward call of each is timed, as the runtime samples them."""
    rng = np.random.default_rng(seed)
    noise = lambda: float(np.exp(rng.normal(0, 0.03)))  # noqa: E731
    rows = []
    for step in range(10, 121):
        for arm in (INC, CAND):
            rows.append({"step": step, "variant": arm.variant, "config": "{}", "calls": 4,
                         "total_ns": 4e6 * fwd[arm] * noise()})
            if step % bwd_every == 0:
                rows.append({"step": step, "variant": arm.variant, "config": "{}", "calls": 1,
                             "phase": "bwd", "total_ns": 1e6 * bwd[arm] * noise()})
    return rows


def decide(monkeypatch, rows: list[dict]) -> dict:
    decisions: list[dict] = []
    tick_one_arm(loop_over_rows(monkeypatch, rows, last=120, decisions=decisions), "gelu", INC, CAND)
    return decisions[-1]


def test_a_faster_forward_with_a_backward_that_costs_more_is_rejected(monkeypatch):
    decision = decide(monkeypatch, rows_of({INC: 1.0, CAND: 0.7}, {INC: 2.0, CAND: 3.0}))
    assert decision["kind"] == "reject", decision
    assert "forward -30% a call, but forward + backward +" in decision["reason"]
    assert "its backward costs more than its forward saves" in decision["reason"]


def test_a_faster_forward_whose_backward_keeps_the_gain_is_promoted(monkeypatch):
    decision = decide(monkeypatch, rows_of({INC: 1.0, CAND: 0.7}, {INC: 2.0, CAND: 2.1}))
    assert decision["kind"] == "promote", decision["reason"]


def test_one_cold_forward_call_does_not_veto_a_winner_whose_backward_is_cheaper(monkeypatch):
    """A kernel built inside its first timed call (a JIT compile) is one slow call in a step:
    per-step figures leave it out, a mean over the tuning took it as a forward 80 % slower."""
    rows = rows_of({INC: 1.0, CAND: 0.7}, {INC: 2.0, CAND: 1.9})
    first = next(r for r in rows if r["variant"] == "candidate" and r.get("phase", "fwd") == "fwd")
    first["total_ns"] += 500e6
    decision = decide(monkeypatch, rows)
    assert decision["kind"] == "promote", decision["reason"]


def test_too_few_timed_backward_calls_leave_the_forward_decision_alone(monkeypatch):
    """Two timed backward calls each (a short job, or one not training) are no evidence."""
    rows = rows_of({INC: 1.0, CAND: 0.7}, {INC: 2.0, CAND: 9.0}, bwd_every=50)
    assert sum(r.get("phase") == "bwd" and r["variant"] == "candidate" for r in rows) == 2
    decision = decide(monkeypatch, rows)
    assert decision["kind"] == "promote"
    # and the promotion says so
    assert "backward not compared (2 and 2 backward calls timed, 3 needed)" in decision["reason"]


def test_a_cuda_bucket_promoted_on_its_forward_says_its_backward_was_not_timed(monkeypatch):
    """The runtime times no backward of a CUDA route yet: the veto cannot apply there, and the
    promotion must say it was decided on the forward alone."""
    from rtxops.evolve import loop as L

    rows = [r for r in rows_of({INC: 1.0, CAND: 0.7}, {INC: 2.0, CAND: 2.0})
            if r.get("phase", "fwd") == "fwd"]
    loop = loop_over_rows(monkeypatch, rows, last=120)
    bt = L.BucketTuning("gelu", "float32/cuda/rows=8", INC)
    bt.windows = [[10, 120]]
    veto, unchecked = loop._backward_veto("job", bt, CAND, 120)
    assert veto is None and "CUDA routes' backward is not timed yet" in unchecked


def test_an_incumbent_timed_at_zero_is_no_division_by_zero(monkeypatch):
    """Kernel spans of zero time (a client that sends them): the veto divided by the
    incumbent's forward time, and the tick failed the same way every time, the bucket never
    leaving its round."""
    from rtxops.evolve import loop as L

    rows = rows_of({INC: 0.0, CAND: 0.7}, {INC: 0.0, CAND: 2.0})
    loop = loop_over_rows(monkeypatch, rows, last=120)
    bt = L.BucketTuning("gelu", "b", INC)
    bt.windows = [[10, 120]]
    assert loop._backward_veto("job", bt, CAND, 120)[0] is None
