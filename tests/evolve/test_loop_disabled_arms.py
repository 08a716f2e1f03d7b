"""Arms a job disabled (a first call that differed from the reference, a compiled variant in a
job that differentiates gradients) get no calls there: the loop neither waits for them to be
measured nor offers them again."""
from __future__ import annotations

import time

from opentelemetry.proto.trace.v1.trace_pb2 import Span

from rtxops.evolve import loop as L
from rtxops.evolve.candidates import Arm
from rtxops.evolve.search import make_strategy
from rtxops.telemetry import otlp, store_evolve
from rtxops.telemetry.schema import ERROR_EVENT
from rtxops.telemetry.store import Store

from ..telemetry.otlp_helpers import kvs, request, span
from .loop_harness import loop_over_rows

INC, FAST, DISABLED = Arm.of("reference"), Arm.of("fast"), Arm.of("compiled", {"mode": "default"})


def _disabled(op: str, bucket: str, variant: str, config: str = "{}") -> Span.Event:
    return Span.Event(time_unix_nano=time.time_ns(), name=ERROR_EVENT, attributes=kvs(
        {"rtx.op": op, "rtx.bucket": bucket, "rtx.variant": variant, "rtx.config": config,
         "rtx.reason": "the job differentiates gradients (create_graph=True)"}))


def test_the_store_names_the_arms_a_job_disabled_in_one_bucket(tmp_path):
    t0 = time.time_ns()
    mine = span("rtx.step", {"rtx.step": 3}, start=t0, events=[
        _disabled("gelu", "b", "compiled", DISABLED.config_json), _disabled("gelu", "other", "fused"),
        _disabled("softmax", "b", "fused")])
    theirs = span("rtx.step", {"rtx.step": 3}, start=t0, events=[_disabled("gelu", "b", "triton")])
    with Store(tmp_path / "s.duckdb") as store:
        for spans, job in (([mine], "job"), ([theirs], "another")):
            resource = {"service.name": "trainer", "rtx.job.id": job, "rtx.rank": 0}
            store.write(otlp.convert(request(spans, resource).SerializeToString(), otlp.PROTOBUF,
                                     time.time_ns()), timeout=30)
        assert store_evolve.disabled_arms(store, "job", "gelu", "b") == \
            {("compiled", DISABLED.config_json)}
        assert store_evolve.disabled_arms(store, "job", "rms_norm", "b") == set()


def _rows(first: int, last: int) -> list[dict]:
    """Four calls a step of the incumbent, one of the fast arm; none of the disabled one."""
    return [r for s in range(first, last + 1) for r in (
        {"step": s, "variant": "reference", "config": "{}", "calls": 4, "total_ns": 4e6},
        {"step": s, "variant": "fast", "config": "{}", "calls": 1, "total_ns": 0.7e6})]


def test_a_round_ends_without_the_arm_the_job_disabled_which_is_not_offered_again(monkeypatch):
    decisions: list[dict] = []
    loop = loop_over_rows(monkeypatch, _rows(10, 400), last=30, decisions=decisions)
    monkeypatch.setattr(store_evolve, "disabled_arms",
                        lambda q, job, op, bucket: {(DISABLED.variant, DISABLED.config_json)})
    bt = L.BucketTuning("gelu", "b", INC, plan_version=5, strategy=make_strategy(
        "successive_halving", [FAST, DISABLED], budget=8, batch=2))
    bt.round_arms = bt.strategy.ask()
    assert set(bt.round_arms) == {FAST, DISABLED}
    loop.jobs["job"] = L.JobEvolution(active=bt)
    loop.tick()   # one window after the swap: the fast arm is measured, the other never will be
    assert bt.windows == [[10, 30]], bt.phase
    assert DISABLED not in bt.strategy.arms
    assert all(DISABLED not in arms for _, arms in bt.rounds[1:])
    assert bt.round_arms != [DISABLED] and DISABLED not in (bt.pending_arms or [])


def test_a_round_of_arms_the_job_runs_still_waits_for_them(monkeypatch):
    """The control: without the disabled report, the round waits for the arm's samples."""
    loop = loop_over_rows(monkeypatch, _rows(10, 400), last=30)
    monkeypatch.setattr(store_evolve, "disabled_arms", lambda q, job, op, bucket: set())
    bt = L.BucketTuning("gelu", "b", INC, plan_version=5, strategy=make_strategy(
        "successive_halving", [FAST, DISABLED], budget=8, batch=2))
    bt.round_arms = bt.strategy.ask()
    loop.jobs["job"] = L.JobEvolution(active=bt)
    loop.tick()
    assert bt.windows == [] and bt.phase == "exploring"


def test_a_bucket_opened_again_does_not_gate_or_offer_what_the_job_disabled(monkeypatch):
    from .test_loop_gate_background import BUCKET, _loop

    screened = []

    def screen(tuning, op, bucket, arms, timeout_s):
        screened.append(list(arms))
        return arms, {}

    loop, _ = _loop(monkeypatch, screen)
    monkeypatch.setattr(L, "GATE_WAIT_S", 5.0, raising=False)
    monkeypatch.setattr(L, "candidates", lambda *a, **k: [INC, FAST, DISABLED])
    asked = []
    monkeypatch.setattr(store_evolve, "disabled_arms", lambda q, job, op, bucket: asked.append(
        (job, op, bucket)) or {(DISABLED.variant, DISABLED.config_json)})
    loop.tick()
    assert ("job", "gelu", BUCKET) in asked
    assert screened == [[FAST]]
    assert loop.jobs["job"].active.round_arms == [FAST]
