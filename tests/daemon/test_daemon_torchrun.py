"""A 2-rank torchrun job (gloo, CPU) under a real daemon: each rank's steps land in the store with
its rank, and a plan published mid-run swaps in at the same step on both ranks."""
from __future__ import annotations

from collections import defaultdict

from rtxops.telemetry.store import ReadOnlyStore

from .live import script, until

# DDP over gloo; every step the ranks agree (all_reduce) whether the file argv[1] exists, so they
# stop at the same step.
TRAIN = """
    import os, sys, time
    import torch, torch.nn as nn, torch.nn.functional as F
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x):
            return self.down(F.gelu(self.up(x)))

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16) + rank, torch.randn(8, 4)
    step = 0
    while step < 3000:
        stop = torch.tensor([float(os.path.exists(sys.argv[1]))])
        dist.all_reduce(stop)
        if stop.item():
            break
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        step += 1
        time.sleep(0.4)  # the daemon's margin of 5 steps must cover heartbeat lag and one poll, loaded
    print(f"rank {rank} trained {step} steps", flush=True)
    dist.destroy_process_group()
"""


def test_two_rank_job_stores_each_ranks_steps_and_swaps_both_at_the_same_step(daemon, tmp_path):
    train, stop = script(tmp_path, "ddp.py", TRAIN), tmp_path / "stop"
    job = daemon.submit(["python", train, str(stop)], nproc_per_node=2, grace_s=10,
                        env={"RTXOPS_PLAN_POLL_S": "0.1"})
    job_id = job["id"]

    def last_step() -> int:
        return daemon.job(job_id)["last_step"] or 0

    until(lambda: last_step() >= 3, 90, what="heartbeats of the ranks")
    r = daemon.client().post("/v1/plans", params={"job": job_id},
                             json={"version": 1, "defaults": {"gelu": "algebraic"}})
    assert r.status_code == 201, r.text
    effective = r.json()["effective_step"]
    assert effective >= 8
    until(lambda: last_step() >= effective + 3, 60, what="steps past the effective step")
    stop.touch()
    done = daemon.wait(job_id, 60)
    assert done["state"] == "succeeded" and done["exit_code"] == 0, daemon.texts(job_id)
    finals = {rank: [ln["text"] for ln in daemon.logs(job_id, rank=rank) if "trained" in ln["text"]]
              for rank in (0, 1)}
    steps = int(finals[0][0].split()[3])
    assert finals == {0: [f"rank 0 trained {steps} steps"], 1: [f"rank 1 trained {steps} steps"]}

    assert daemon.terminate() == 0
    store = ReadOnlyStore(daemon.home / "rtxops.duckdb")
    try:
        per_rank = defaultdict(dict)
        for row in store.query("SELECT rank, step, plan_version FROM spans "
                               "WHERE job_id = ? AND name = 'rtx.step'", [job_id]):
            assert row["step"] not in per_rank[row["rank"]], f"step stored twice: {row}"
            per_rank[row["rank"]][row["step"]] = row["plan_version"]
        assert sorted(per_rank) == [0, 1]
        for rank, versions in per_rank.items():
            assert sorted(versions) == list(range(1, steps + 1)), rank
            # the step that ends in the swap ran under plan 0: it is reported so
            assert {s for s, v in versions.items() if v == 1} == set(range(effective + 1, steps + 1)), rank
        swaps = store.query("SELECT rank, step, plan_from, plan_to FROM swaps WHERE job_id = ? "
                            "ORDER BY rank", [job_id])
        assert swaps == [{"rank": r, "step": effective, "plan_from": 0, "plan_to": 1} for r in (0, 1)]
        kernels = store.query("""SELECT DISTINCT rank, variant, step > ? AS after FROM kernel_spans
                                 WHERE job_id = ? AND op = 'gelu' AND phase = 'fwd'""",
                              [effective, job_id])
        assert sorted((k["rank"], k["variant"], k["after"]) for k in kernels) == [
            (0, "algebraic", True), (0, "reference", False), (1, "algebraic", True), (1, "reference", False)]
        ranks = {r["rank"] for r in store.query("SELECT rank FROM resources WHERE job_id = ?", [job_id])}
        assert ranks == {0, 1}
    finally:
        store.close()
