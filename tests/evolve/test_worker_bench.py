"""The worker's offline benchmark on CPU: a repetition times a run of calls long enough that the
host's timer ticks and page faults do not decide it, and reports the time of one call."""
from __future__ import annotations

import statistics

from rtxops.evolve.runner import run_worker

BUCKET = "float32/cpu/tanh=0,hidden=64,rows=16"  # one forward + backward: tens of µs


def _bench(min_rep_ns: int) -> dict:
    (result,) = run_worker({"command": "bench", "op": "gelu", "bucket": BUCKET, "warmup": 2,
                            "reps": 5, "min_rep_ns": min_rep_ns,
                            "arms": [{"variant": "reference", "config": {}}]}, timeout_s=120)
    assert result["status"] == "ok" and len(result["values"]) == 5
    return result


def test_a_repetition_runs_many_short_calls_and_reports_one_calls_time():
    min_rep_ns = 5_000_000
    r = _bench(min_rep_ns)
    assert r["calls_per_rep"] > 1
    # the value is per call, not the whole repetition
    assert statistics.median(r["values"]) < min_rep_ns / 2
    assert r["median_ns"] == statistics.median(r["values"])


def test_without_a_minimum_a_repetition_is_one_call():
    assert _bench(0)["calls_per_rep"] == 1


def test_the_worker_runs_with_a_fixed_malloc_threshold_unless_the_environment_sets_one(monkeypatch):
    import subprocess

    from rtxops.evolve import runner

    seen: list[dict] = []
    real = subprocess.Popen

    def spy(*args, **kwargs):
        seen.append(kwargs["env"])
        return real(*args, **kwargs)

    monkeypatch.setattr(runner.subprocess, "Popen", spy)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    _bench(0)
    assert seen[-1]["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    _bench(0)
    assert seen[-1]["MALLOC_MMAP_THRESHOLD_"] == "131072"
