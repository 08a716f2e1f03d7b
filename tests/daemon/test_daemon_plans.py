"""Plans reach a running job: published on the daemon for the job (signed into a bundle), polled by
the job, verified, swapped in at the step the daemon set (last heartbeat step + margin); a plan
without a signed bundle is refused, reported back, and the job goes on with the plan it runs."""
from __future__ import annotations

import json
import signal
from collections import Counter

from rtxops.telemetry.store import ReadOnlyStore

from .live import script, until

# A small model with F.gelu and an optimizer, stepping slowly until the file argv[1] appears.
TRAIN = """
    import os, sys, time
    import torch, torch.nn as nn, torch.nn.functional as F

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x):
            return self.down(F.gelu(self.up(x)))

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    step = 0
    while not os.path.exists(sys.argv[1]) and step < 3000:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        step += 1
        time.sleep(0.3)  # the daemon's margin of 5 steps must cover heartbeat lag and one poll, loaded
    print(f"trained {step} steps", flush=True)
"""


def test_plan_published_mid_run_is_installed_and_an_invalid_one_refused(daemon, tmp_path):
    train, stop = script(tmp_path, "train.py", TRAIN), tmp_path / "stop"
    summary = tmp_path / "summary.json"
    job = daemon.submit(["python", train, str(stop)],
                        env={"RTXOPS_PLAN_POLL_S": "0.1", "RTXOPS_SUMMARY": str(summary)})
    job_id = job["id"]
    c = daemon.client()

    def last_step() -> int:
        return daemon.job(job_id)["last_step"] or 0

    until(lambda: last_step() >= 3, 60, what="the job's first heartbeats")
    r = c.post("/v1/plans", params={"job": job_id}, json={"version": 1, "defaults": {"gelu": "algebraic"}})
    assert r.status_code == 201, r.text
    published = r.json()
    effective = published["effective_step"]
    assert published["version"] == 1 and published["job"] == job_id and effective >= 8
    current = c.get("/v1/plans/current", params={"job": job_id})
    assert current.status_code == 200 and current.json()["effective_step"] == effective
    assert current.headers["x-rtxops-plan-version"] == "1"
    assert current.headers["etag"] == f'"{published["digest"]}"'
    unchanged = c.get("/v1/plans/current", params={"job": job_id},
                      headers={"If-None-Match": current.headers["etag"]})
    assert unchanged.status_code == 304
    until(lambda: last_step() >= effective + 3, 30, what="steps past the effective step")

    # a plan written by hand into the daemon's plans, loaded on SIGHUP: nothing signed it
    (daemon.home / "plans" / f"{job_id}.json").write_text(
        json.dumps({"version": 2, "defaults": {"gelu": "warp"}}))
    daemon.proc.send_signal(signal.SIGHUP)
    until(lambda: c.get("/v1/plans/current", params={"job": job_id}).json()["version"] == 2, 10,
          what="the daemon to serve the reloaded plan")
    reports = until(lambda: [r for r in c.get("/v1/plans/reports").json()["reports"]
                             if r["job_id"] == job_id], 30, what="the job's refusal")
    assert [r["version"] for r in reports] == [2] and "no signed bundle" in reports[0]["reason"]
    refused_at = last_step()
    until(lambda: last_step() >= refused_at + 3, 30, what="the job to go on after refusing")
    stop.touch()
    done = daemon.wait(job_id, 60)
    assert done["state"] == "succeeded" and done["exit_code"] == 0, daemon.texts(job_id)

    data = json.loads(summary.read_text())
    steps = data["steps"]
    assert data["plan_version"] == 1, ("the job kept the plan it ran", data["plan_rejections"])
    assert [r for r in data["plan_rejections"] if "no signed bundle" in r]
    assert [line for line in daemon.texts(job_id) if line == f"trained {steps} steps"]
    gelu = Counter()
    for s in data["slots"]:
        if s["op"] == "gelu":
            gelu[s["variant"]] += s["calls"]
    # one gelu call per step: the reference up to the swap at the effective step, then algebraic
    assert gelu == {"reference": effective, "algebraic": steps - effective}, (gelu, effective, steps)

    metrics = c.get("/metrics").text
    assert "rtxops_plan_swaps_total 1.0" in metrics and "rtxops_plans_refused_total 1.0" in metrics, metrics

    assert daemon.terminate() == 0
    store = ReadOnlyStore(daemon.home / "rtxops.duckdb")
    try:
        swaps = store.query("SELECT rank, step, plan_from, plan_to FROM swaps WHERE job_id = ?", [job_id])
        assert swaps == [{"rank": 0, "step": effective, "plan_from": 0, "plan_to": 1}]
        versions = {r["step"]: r["plan_version"] for r in store.query(
            "SELECT step, plan_version FROM step_times WHERE job_id = ?", [job_id])}
        assert sorted(versions) == list(range(1, steps + 1))
        # the step that ends in the swap ran under plan 0: it is reported so
        assert {s for s, v in versions.items() if v == 1} == set(range(effective + 1, steps + 1))
        assert set(versions.values()) == {0, 1}, "plan 2 never ran"
        kernels = store.query("""SELECT step, variant, sum(count) AS calls FROM kernel_spans
                                 WHERE job_id = ? AND op = 'gelu' AND phase = 'fwd'
                                 GROUP BY ALL ORDER BY step""", [job_id])
        assert {(k["variant"], k["step"] > effective) for k in kernels} == {
            ("reference", False), ("algebraic", True)}
    finally:
        store.close()
