"""What routing costs on CUDA (run on a GPU machine; bench/gpu_check.sh runs it). Prints JSON.

1. Host cost added per routed call: F.gelu, F.rms_norm and F.softmax on small CUDA inputs, bare
   vs routed on the reference plan with the job telemetry on (CUDA-event timing), in interleaved
   batches with an optimizer step every 50 calls (the step boundary resolves the events); with
   every call timed by events and with one in 8 (``RTXOPS_CUDA_TIME_EVERY``). Then a profile of
   the routed calls (every call timed), to see where the host time goes.
2. Step-time overhead of examples/train_gpt.py's GPT, eager vs routed on the reference plan with
   telemetry (every call timed, and one in 8), at a small size (launch-bound) and a larger one;
   alternating blocks of steps.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from time import perf_counter_ns

import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rtxops.runtime import originals, patching
from rtxops.telemetry import schema as S
from rtxops.telemetry.job import start_job_telemetry

STEP_EVERY = 50


def _routed(every: int):
    """Enable rtxops (reference plan, telemetry into memory), timing one CUDA call in ``every``
    with events; returns the function that turns it off again."""
    d = patching.enable()
    d.cuda_time_every = every   # what RTXOPS_CUDA_TIME_EVERY sets, before any CUDA route exists
    telemetry = start_job_telemetry(d, InMemorySpanExporter(), resource={S.JOB_ID: "gpu-dispatch"})

    def finish() -> None:
        telemetry.close(d)
        patching.disable()
    return finish


def per_call(batches: int, n: int) -> list[dict]:
    x = torch.randn(8, 256, device="cuda")
    w = torch.randn(256, device="cuda")
    cases = {"gelu": ("gelu", (x,)), "rms_norm": ("rms_norm", (x, [256], w, 1e-6)),
             "softmax": ("softmax", (x, -1))}
    p = torch.zeros(1, device="cuda", requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.0)

    def loop(fn, args) -> float:
        torch.cuda.synchronize()
        t0 = perf_counter_ns()
        for i in range(n):
            fn(*args)
            if i % STEP_EVERY == STEP_EVERY - 1:
                opt.step()
        torch.cuda.synchronize()
        return (perf_counter_ns() - t0) / n

    results = []
    for every in (1, 8):
        finish = _routed(every)
        try:
            with torch.no_grad():
                for op, (name, args) in cases.items():
                    bare, routed = originals.original(name), getattr(torch.nn.functional, name)
                    assert bare is not routed, "rtxops is not routing torch.nn.functional"
                    for _ in range(2):
                        loop(bare, args)
                        loop(routed, args)
                    bares, added = [], []
                    for _ in range(batches):
                        b = loop(bare, args)
                        bares.append(b)
                        added.append(loop(routed, args) - b)
                    results.append({"op": op, "cuda_time_every": every,
                                    "bare_ns": round(statistics.median(bares)),
                                    "added_ns": round(statistics.median(added))})
        finally:
            finish()
    return results


def profile_of_routed_calls(n: int) -> str:
    """cProfile's top functions (own time) over ``n`` routed F.gelu calls, every call timed."""
    import cProfile
    import io
    import pstats

    x = torch.randn(8, 256, device="cuda")
    p = torch.zeros(1, device="cuda", requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.0)
    finish = _routed(1)
    try:
        with torch.no_grad():
            gelu = torch.nn.functional.gelu
            for _ in range(200):
                gelu(x)
            opt.step()
            profiler = cProfile.Profile()
            profiler.enable()
            for i in range(n):
                gelu(x)
                if i % STEP_EVERY == STEP_EVERY - 1:
                    opt.step()
            torch.cuda.synchronize()
            profiler.disable()
    finally:
        finish()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def gpt_overhead(size: dict, blocks: int, steps: int) -> dict:
    sys.path.insert(0, "examples")
    import train_gpt

    def block(every: int) -> float:   # 0: rtxops off
        finish = None
        if every:
            finish = _routed(every)
        try:
            torch.manual_seed(0)
            model = train_gpt.GPT(size["vocab"], size["dim"], size["layers"], size["heads"],
                                  size["seq"]).cuda()
            opt = torch.optim.AdamW(model.parameters())
            times = []
            for i in range(steps + 5):
                tokens = torch.randint(0, size["vocab"], (size["batch"], size["seq"] + 1), device="cuda")
                torch.cuda.synchronize()
                t0 = perf_counter_ns()
                loss = model(tokens[:, :-1], tokens[:, 1:])
                opt.zero_grad()
                loss.backward()
                opt.step()
                torch.cuda.synchronize()
                if i >= 5:
                    times.append(perf_counter_ns() - t0)
            return statistics.median(times) / 1e6
        finally:
            if finish is not None:
                finish()

    runs: dict[int, list] = {0: [], 1: [], 8: []}
    for _ in range(blocks):
        for every, times in runs.items():
            times.append(block(every))
    e = statistics.median(runs[0])
    out = {"size": size, "eager_ms": round(e, 3), "blocks_ms": {str(k): v for k, v in runs.items()}}
    for every in (1, 8):
        r = statistics.median(runs[every])
        out[f"routed_every_{every}"] = {"ms": round(r, 3), "overhead": round(r / e - 1, 4)}
    return out


SIZES = {
    "small": {"vocab": 2048, "dim": 256, "layers": 2, "heads": 4, "seq": 128, "batch": 8},
    "larger": {"vocab": 32000, "dim": 1024, "layers": 8, "heads": 16, "seq": 512, "batch": 8},
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=15)
    p.add_argument("--calls", type=int, default=2000, help="calls per batch")
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 1
    out = {"bench": "gpu_dispatch", "device": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "per_call": per_call(args.batches, args.calls),
           "profile_every_1": profile_of_routed_calls(args.calls * 5),
           "gpt": {name: gpt_overhead(size, args.blocks, args.steps) for name, size in SIZES.items()}}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
