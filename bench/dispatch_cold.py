"""What a routed call costs with the caches cold, as between a training step's ops (issue #3).

``dispatch_overhead.py`` times calls back to back, everything the wrapper touches in cache: ~1 µs
a call. In a training step the routing costs 10-20 µs a call (``step_overhead_interleaved.py``'s
routed part over a step's ~27 routed calls): each routed call runs between ops whose tensors
push its code and data out. Here each timed call comes after a 24 MB write, once through
``F.linear``'s wrapper and once through torch's own function (paired, alternating; tiny tensors,
so the op's own time is small), and the same for stand-ins that do one part of the wrapper's work
each (a bare Python wrapper, its guards, its call key, the key and the route lookup, the timing and
record), to show where the cold cost goes in Python. The routed call goes through the C++ core
where it is built (``dispatch_core`` in the JSON; ``RTXOPS_DISPATCH_CORE=0``: the Python path).
Hot figures (no write between calls) beside them. Medians of per-pair differences, µs. JSON on
stdout (``--out`` writes it too).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from time import perf_counter_ns

import torch
import torch.nn.functional as F
from _report import report
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from rtxops.runtime import dispatcher as D
from rtxops.runtime import originals, patching
from rtxops.runtime.ops import linear
from rtxops.telemetry.job import start_job_telemetry


class _Nowhere(SpanExporter):
    """The job's spans are built and dropped: only the training thread's side is timed here."""

    def export(self, spans):
        return SpanExportResult.SUCCESS


def stand_ins(d: D.Dispatcher, torch_own) -> dict:
    """The wrapper's parts, one more in each (as ``FunctionSite._make_wrapper`` spells them)."""
    site = d.site_named("F.linear")
    route_of, cell, live = site.routes.get, d.record_cell, d.live
    here, unrouted_threads = D._this_thread, D._unrouted_threads
    key, compiling, flag_of = linear.key, D._is_dynamo_compiling, D._compiler
    has_torch_function = D._has_torch_function

    def bare(*args, **kwargs):
        return torch_own(*args, **kwargs)

    def guards(*args, **kwargs):
        if not live[0] or compiling() or (flag_of._is_compiling_flag and D._traced_here()):
            return torch_own(*args, **kwargs)
        if (unrouted_threads[0] and here.unrouted) or has_torch_function(args) or (
                kwargs and has_torch_function(kwargs.values())):
            return torch_own(*args, **kwargs)
        return torch_own(*args, **kwargs)

    def call_key(*args, **kwargs):
        key(*args, **kwargs)
        return torch_own(*args, **kwargs)

    def key_and_lookup(*args, **kwargs):
        route_of(key(*args, **kwargs))
        return torch_own(*args, **kwargs)

    def timing(*args, **kwargs):
        t0 = perf_counter_ns()
        out = torch_own(*args, **kwargs)
        cell[0](0, t0)
        return out

    return {"bare_wrapper": bare, "guards": guards, "call_key": call_key,
            "key_and_lookup": key_and_lookup, "clock_and_record": timing}


def paired(fn, reference, args: tuple, n: int, junk: torch.Tensor | None) -> float:
    """Median of (fn's call - reference's call) over ``n`` pairs, µs. Which of the two runs
    first alternates from pair to pair: the first timed call of a pair runs a few µs slower or
    faster than the second even where both are the same call (1.5-3 µs for
    ``scaled_dot_product_attention`` on the AMD host), a bias that a fixed order adds to every
    difference."""
    diffs = []
    for i in range(n):
        got = [0, 0]
        for j in ((0, 1) if i % 2 == 0 else (1, 0)):
            f = (fn, reference)[j]
            if junk is not None:
                junk.fill_(1.0)
            t0 = time.perf_counter_ns()
            f(*args)
            got[j] = time.perf_counter_ns() - t0
        diffs.append(got[0] - got[1])
    return round(statistics.median(diffs) / 1e3, 2)


def arguments(doc: str, pairs: int) -> argparse.Namespace:
    """``--pairs``, ``--rounds`` and ``--out`` of a cold-cache bench, on one thread from here on."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--pairs", type=int, default=pairs)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out")
    a = p.parse_args()
    torch.set_num_threads(1)
    return a


def main() -> None:
    a = arguments(__doc__, 2000)
    args = (torch.randn(2, 16), torch.randn(16, 16), torch.randn(16))
    junk = torch.empty(24 * 2**20 // 4)
    torch_own = originals.original("linear")
    d = patching.enable()
    telemetry = start_job_telemetry(d, _Nowhere())
    try:
        for _ in range(20):
            F.linear(*args)   # the route, its slot, the recorder's record_since
        candidates = {"routed": F.linear, **stand_ins(d, torch_own)}
        rounds = []
        with torch.no_grad():
            for _ in range(a.rounds):
                rounds.append({name: {"cold_us": paired(fn, torch_own, args, a.pairs, junk),
                                      "hot_us": paired(fn, torch_own, args, a.pairs, None)}
                               for name, fn in candidates.items()})
    finally:
        telemetry.close()
        patching.disable()
    median = {name: {k: statistics.median(r[name][k] for r in rounds) for k in ("cold_us", "hot_us")}
              for name in rounds[0]}
    report({"bench": "dispatch_cold", "python": platform.python_version(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "dispatch_core": D._Core is not None, "op": "F.linear on (2, 16) x (16, 16)", "pairs": a.pairs,
            "method": "each timed call after a 24 MB write (cold) or right after the last (hot); "
                      "median of per-pair differences against torch's own function",
            "median_of_rounds": median, "rounds": rounds}, a.out)


if __name__ == "__main__":
    main()
