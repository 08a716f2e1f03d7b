"""The separate process that runs candidate kernels for the evolve loop: correctness gates and
offline benchmarks. A kernel that crashes or hangs takes this process down, not the daemon.

Protocol: one JSON request on stdin, JSON lines on stdout (``{"event": "progress", ...}`` while
working, then ``{"event": "result", ...}`` per item). Run as ``python -m rtxops.evolve.worker``.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import threading
import time
from typing import Any

GPU_FLUSH_BYTES = 256 << 20
# On CPU one repetition times a run of calls at least this long: a single call of a small kernel
# is as short as the host's page faults and timer ticks, which then decide the ranking.
CPU_MIN_REP_NS = 2_000_000
CPU_MAX_CALLS_PER_REP = 256


_protocol = sys.stdout   # where the JSON lines go (see _own_stdout)


def _own_stdout() -> None:
    """The protocol keeps the process's stdout to itself: what kernels print (Python's print,
    C code's printf) goes to stderr instead. A printed line ran into a result's line (a correct
    kernel stored as failed), a printed number broke the reader."""
    global _protocol
    sys.stdout.flush()
    _protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)


def main() -> int:
    _own_stdout()
    # background work: training jobs come first (a process of its own, so no thread of the
    # daemon holds the GIL niced); and it goes when the daemon does, also a daemon killed -9
    if hasattr(os, "nice"):
        os.nice(10)
    exit_with_parent(os.getppid())
    try:
        request = json.loads(sys.stdin.read())
        command = request["command"]
    except (ValueError, KeyError, TypeError) as e:
        _emit({"event": "error", "error": f"bad request: {e}"})
        return 2
    import torch

    torch.set_num_threads(int(request.get("threads", 1)))
    from rtxops.runtime.registry import default_registry

    registry = default_registry()
    if command == "gate":
        _gate(registry, request["items"])
    elif command == "bench":
        _bench(registry, request)
    else:
        _emit({"event": "error", "error": f"unknown command {command!r}"})
        return 2
    return 0


def exit_with_parent(parent: int, every_s: float = 1.0) -> threading.Thread:
    """Kill this process's group (the worker, and whatever a kernel started) once ``parent`` is
    no longer its parent: the daemon that started it has died, and a benchmark left running
    would compete with the next jobs for hours."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os.killpg(0, signal.SIGKILL)

    thread = threading.Thread(target=watch, name="rtxops-parent-watch", daemon=True)
    thread.start()
    return thread


def _gate(registry, items: list[dict]) -> None:
    from rtxops.runtime.bucket import Bucket

    from .gate import check

    for i, item in enumerate(items):
        started = time.perf_counter()
        try:
            spec = registry.op(item["op"])
            variant = registry.variant(item["op"], item["variant"])
            bucket = Bucket.parse(item["op"], item["bucket"])
        except Exception as e:  # not the kernel's fault: reported, not stored as its verdict
            out = {"passed": False, "reason": f"{type(e).__name__}: {e}", "max_error": None,
                   "setup_error": True}
        else:
            result = check(spec, variant, item.get("config", {}), bucket)
            out = {"passed": result.passed, "reason": result.reason, "max_error": result.max_error,
                   "setup_error": result.no_verdict}
        _emit({"event": "result", "index": i, **item, **out,
               "seconds": round(time.perf_counter() - started, 3)})
        _emit({"event": "progress", "done": i + 1, "total": len(items)})


def _bench(registry, request: dict) -> None:
    """Forward + backward time of every arm on the bucket's example inputs: warm-up, then
    repetitions interleaved across arms (so drift hits every arm alike). A value is the time of
    one call; on CPU it is the mean of a run of calls lasting at least ``min_rep_ns``."""
    import torch

    from rtxops.runtime.bucket import Bucket

    op, bucket = request["op"], Bucket.parse(request["op"], request["bucket"])
    spec = registry.op(op)
    warmup, reps = int(request.get("warmup", 3)), int(request.get("reps", 20))
    arms = request["arms"]
    args, kwargs = spec.example_inputs(bucket, 0)
    cuda = bucket.device == "cuda"
    flush = torch.empty(GPU_FLUSH_BYTES, dtype=torch.int8, device="cuda") if cuda else None
    min_rep_ns = 0 if cuda else int(request.get("min_rep_ns", CPU_MIN_REP_NS))
    runs: list[Any] = []
    calls: list[int] = []
    for arm in arms:
        try:
            fn = registry.variant(op, arm["variant"]).build(dict(arm.get("config", {})), bucket)
            for _ in range(warmup):
                _fwd_bwd(fn, args, kwargs)
            calls.append(_calls_per_rep(fn, args, kwargs, min_rep_ns))
            runs.append(fn)
        except Exception as e:
            runs.append(e)
            calls.append(1)
    values: list[list[float]] = [[] for _ in arms]
    total, done = reps * len(arms), 0
    for _ in range(reps):
        for i, fn in enumerate(runs):
            done += 1
            if isinstance(fn, Exception):
                continue
            if flush is not None:
                flush.zero_()  # evict the last arm's data from L2
            try:
                values[i].append(_timed(fn, args, kwargs, cuda, calls[i]))
            except Exception as e:   # a kernel that fails now and then: its failure, not the run's
                runs[i] = e
            if done % max(1, total // 50) == 0:
                _emit({"event": "progress", "done": done, "total": total})
    for i, (arm, fn) in enumerate(zip(arms, runs)):
        out = {"event": "result", "index": i, **arm}
        if isinstance(fn, Exception):
            out.update(status="failed", reason=f"{type(fn).__name__}: {fn}", values=[])
        else:
            v = values[i]
            out.update(status="ok", values=v, calls_per_rep=calls[i], median_ns=statistics.median(v),
                       p95_ns=sorted(v)[int(0.95 * (len(v) - 1))],
                       spread=statistics.pstdev(v) / statistics.mean(v) if len(v) > 1 else 0.0,
                       peak_bytes=_peak(fn, args, kwargs) if cuda else None)
        _emit(out)


def _fwd_bwd(fn, args, kwargs) -> None:
    import torch

    out = fn(*args, **kwargs)
    outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
            if isinstance(t, torch.Tensor) and t.requires_grad]
    leaves = [x for x in [*args, *kwargs.values()] if isinstance(x, torch.Tensor) and x.requires_grad]
    if outs and leaves:
        torch.autograd.grad([o.sum() for o in outs], leaves, allow_unused=True)


def _calls_per_rep(fn, args, kwargs, min_rep_ns: int) -> int:
    """How many back-to-back calls make one repetition last ``min_rep_ns`` (1 when 0): doubled
    until a run lasts that long, after one untimed call (a cold first call, or one slow outlier,
    would otherwise set the count)."""
    if min_rep_ns <= 0:
        return 1
    _fwd_bwd(fn, args, kwargs)
    calls = 1
    while calls < CPU_MAX_CALLS_PER_REP and _timed(fn, args, kwargs, False, calls) * calls < min_rep_ns:
        calls *= 2
    return min(calls, CPU_MAX_CALLS_PER_REP)


def _timed(fn, args, kwargs, cuda: bool, calls: int = 1) -> float:
    """Time of one forward + backward (the mean over ``calls`` back-to-back calls on CPU)."""
    import torch

    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _fwd_bwd(fn, args, kwargs)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e6
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        _fwd_bwd(fn, args, kwargs)
    return (time.perf_counter_ns() - t0) / calls


def _peak(fn, args, kwargs) -> int:
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _fwd_bwd(fn, args, kwargs)
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)


def _emit(obj: dict) -> None:
    _protocol.write(json.dumps(obj, default=str) + "\n")
    _protocol.flush()


if __name__ == "__main__":
    sys.exit(main())
