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


def test_the_worker_holds_malloc_steady_unless_the_environment_tunes_it_itself():
    from rtxops.evolve.runner import STEADY_MALLOC, worker_environment

    env = worker_environment({"PATH": "/bin", "RTXOPS_ENABLE": "1"})
    assert {k: env[k] for k in STEADY_MALLOC} == STEADY_MALLOC and env["RTXOPS_ENABLE"] == "0"
    # one variable of the user's own: none of ours (our top pad alone would undo their threshold)
    for own in ({"MALLOC_MMAP_THRESHOLD_": "131072"}, {"MALLOC_ARENA_MAX_": "2"},
                {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}):
        env = worker_environment({"PATH": "/bin", **own})
        assert not (env.keys() & STEADY_MALLOC.keys() - own.keys()), own
        assert all(env[k] == v for k, v in own.items())
    assert worker_environment({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}).keys() >= STEADY_MALLOC.keys()


def test_calibration_is_not_set_by_a_cold_first_call():
    """Without warm-up the first call of a compiled arm is its compile; the run length must not
    shrink to one call for it."""
    (result,) = run_worker({"command": "bench", "op": "gelu", "bucket": BUCKET, "warmup": 0,
                            "reps": 3, "min_rep_ns": 5_000_000,
                            "arms": [{"variant": "compiled",
                                      "config": {"dynamic": False, "mode": "default"}}]},
                           timeout_s=300)
    assert result["status"] == "ok", result
    assert result["calls_per_rep"] > 1


def test_a_kernel_that_raises_while_timed_fails_alone_and_the_worker_goes_on(monkeypatch):
    """An exception in the timed repetitions (only the build and warm-up were guarded) ended the
    worker: every arm ran again in a process of its own, and the reason was a traceback's tail."""
    from pathlib import Path

    monkeypatch.setenv("RTXOPS_VARIANT_MODULES", "tests.evolve.plugins_broken")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    reference, flaky = run_worker({"command": "bench", "op": "gelu", "bucket": BUCKET, "warmup": 2,
                                   "reps": 5, "min_rep_ns": 0,
                                   "arms": [{"variant": "reference", "config": {}},
                                            {"variant": "flaky", "config": {}}]}, timeout_s=120)
    assert reference["status"] == "ok" and len(reference["values"]) == 5
    assert flaky["status"] == "failed" and flaky["values"] == []
    assert flaky["reason"] == "RuntimeError: this kernel fails now and then, on purpose"
