"""A bucket that stops being called mid-exploration (as when the model's compiled region takes over
its op) is closed with the reason, instead of being explored round after round with no samples."""
from __future__ import annotations

import sys
import textwrap

from rtxops.daemon.jobs import JobSpec
from rtxops.runtime.plan import Plan, PlanEntry
from rtxops.telemetry import store_evolve
from tests.evolve.test_loop_e2e import PLUGIN, ROOT, evolving_daemon, gelu_bucket, until  # noqa: F401

# gelu on 64 rows until the stop file appears, then the same model without gelu
JOB = textwrap.dedent("""
    import os, sys, time, torch
    import torch.nn.functional as F
    stop = sys.argv[1]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    w = torch.nn.Parameter(torch.ones(256))
    opt = torch.optim.SGD([w], lr=1e-6)
    x = torch.randn(64, 256)
    for step in range(200000):
        h = x * w
        gone = os.path.exists(stop)
        for _ in range(8):
            h = (torch.tanh(h) if gone else F.gelu(h)) + x
        loss = h.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.008)
""")


def test_a_bucket_that_stops_being_called_is_closed_with_the_reason(evolving_daemon, tmp_path):
    d = evolving_daemon
    bucket = gelu_bucket(64)
    d.board.publish(Plan(version=1, entries=(PlanEntry("gelu", bucket, "slow3x"),)))
    stop = tmp_path / "stop-gelu"
    script = tmp_path / "train.py"
    script.write_text(JOB)
    env = {"RTXOPS_VARIANT_MODULES": PLUGIN, "PYTHONPATH": str(ROOT), "RTXOPS_PLAN_POLL_S": "0.2",
           "RTXOPS_EXPORT_INTERVAL_S": "0.5", "RTXOPS_TEST_SLOW_FILE": str(tmp_path / "never")}
    job = d.supervisor.submit(JobSpec((sys.executable, str(script), str(stop)), name="vanish", env=env))
    try:
        def exploring():
            plan = d.board.current(job.id)
            entry = plan.entry("gelu", bucket) if plan else None
            return entry is not None and bool(entry.explore)
        until(exploring, 150, "the loop to explore the gelu bucket")
        stop.write_text("")

        def rejected():
            return [r for r in store_evolve.decisions(d.store, job.id)
                    if r["kind"] == "reject" and r["bucket"] == bucket]
        (decision,) = until(rejected, 120, "the loop to close the bucket")
    finally:
        d.supervisor.cancel(job.id)

    assert "no calls of this bucket" in decision["reason"], decision["reason"]
    assert not [r for r in store_evolve.decisions(d.store, job.id) if r["kind"] == "promote"]
    # the job's plan is back on the incumbent, without explore arms
    entry = d.board.current(job.id).entry("gelu", bucket)
    assert entry.variant == "slow3x" and not entry.explore
