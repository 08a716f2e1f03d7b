"""Added cost per call of the rtxops dispatcher against the bare torch call, per op and shape.

Both are timed in the same process, interleaved in batches; the figure is the median over batches of
(dispatched - bare) per call. An OpenTelemetry SDK ``start_span``/``end`` pair is measured in the same
run for scale. Prints JSON (and writes it with ``--out``).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
from time import perf_counter_ns

import torch

from _report import report
from rtxops.runtime import originals, patching
from rtxops.runtime.bucket import Bucket
from rtxops.runtime.registry import default_registry
from rtxops.telemetry.recorder import Recorder

SHAPES = {"small": {"rows": 8, "hidden": 64}, "large": {"rows": 2048, "hidden": 1024}}


def _inputs(op: str, size: str):
    """(bare callable, args, kwargs) for an op at a shape, inputs without autograd."""
    r, h = SHAPES[size]["rows"], SHAPES[size]["hidden"]
    x = torch.randn(r, h)
    w = torch.randn(h)
    if op == "rms_norm":
        return "rms_norm", (x, [h], w, 1e-6), {}
    if op == "layer_norm":
        return "layer_norm", (x, [h], w, w), {}
    if op == "softmax":
        return "softmax", (x, -1), {}
    if op == "gelu":
        return "gelu", (x,), {}
    if op == "silu":
        return "silu", (x,), {}
    if op == "cross_entropy":
        return "cross_entropy", (x, torch.randint(0, h, (r,))), {}
    if op == "linear":
        return "linear", (x, torch.randn(h, h)), {}
    if op == "attention":
        s = max(8, r // 16)
        q = torch.randn(1, 4, s, 64)
        return "scaled_dot_product_attention", (q, q, q), {"is_causal": True}
    raise KeyError(op)


def _time(fn, args, kwargs, n: int) -> float:
    t0 = perf_counter_ns()
    for _ in range(n):
        fn(*args, **kwargs)
    return (perf_counter_ns() - t0) / n


def measure(bare, dispatched, args, kwargs, batches: int, n: int) -> dict:
    for _ in range(3):
        _time(bare, args, kwargs, n)
        _time(dispatched, args, kwargs, n)
    diffs, bares = [], []
    for _ in range(batches):
        b = _time(bare, args, kwargs, n)
        d = _time(dispatched, args, kwargs, n)
        bares.append(b)
        diffs.append(d - b)
    return {"bare_ns": statistics.median(bares), "added_ns": statistics.median(diffs),
            "added_p90_ns": sorted(diffs)[int(0.9 * (len(diffs) - 1))]}


def _measure_ops(dispatcher, quick: bool, batches: int) -> list[dict]:
    rope_site = dispatcher.function_site("rope", "bench:rope", default_registry().op("rope").reference)
    results = []
    with torch.no_grad():
        for size in SHAPES:
            n = 20 if quick else (400 if size == "small" else 10)
            for op in ("rms_norm", "layer_norm", "softmax", "gelu", "silu", "cross_entropy",
                       "attention", "linear"):
                fname, args, kwargs = _inputs(op, size)
                bare = originals.original(fname)
                wrapped = getattr(torch.nn.functional, fname)
                assert wrapped is not bare, "dispatcher not enabled"
                results.append({"op": op, "shape": size, **measure(bare, wrapped, args, kwargs, batches, n)})
            rows = SHAPES[size]["rows"]
            bucket = Bucket.parse("rope", f"float32/cpu/head_dim=64,seq={max(8, rows // 16)},rows=4,"
                                  "unsqueeze_dim=1,same_qk=1")
            args, kwargs = default_registry().op("rope").example_inputs(bucket, 0)
            args = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in args)
            results.append({"op": "rope", "shape": size, **measure(
                rope_site.reference, rope_site.wrapper, args, kwargs, batches, n)})
    return results


def otel_span_pair_ns(n: int = 20000) -> dict[str, float]:
    """Cost of an OpenTelemetry SDK ``start_span``/``end`` pair, measured two ways: a bare span on a
    provider with no processor, and a span like an ``rtx.call`` would be (six attributes) on a
    provider with the SDK's BatchSpanProcessor, i.e. what tracing each call with OTel would cost."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class _Discard(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    bare = TracerProvider().get_tracer("rtxops.bench")
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_Discard(), max_queue_size=1 << 20))
    realistic = provider.get_tracer("rtxops.bench")
    attrs = {"rtx.op": "silu", "rtx.variant": "reference", "rtx.bucket": "float32/cpu/hidden=64,rows=8",
             "rtx.config": "{}", "rtx.phase": "fwd", "rtx.site": "F.silu"}

    def timed(fn) -> float:
        samples = []
        for _ in range(5):
            t0 = perf_counter_ns()
            for _ in range(n // 5):
                fn()
            samples.append((perf_counter_ns() - t0) / (n // 5))
        return statistics.median(samples)

    out = {
        "bare_ns": timed(lambda: bare.start_span("rtx.call").end()),
        "with_attributes_and_batch_processor_ns": timed(
            lambda: realistic.start_span("rtx.call", attributes=attrs).end()),
    }
    provider.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batches", type=int, default=41)
    p.add_argument("--quick", action="store_true", help="few repetitions (smoke run)")
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args()
    batches = 5 if a.quick else a.batches
    torch.set_num_threads(1)
    results = []
    for mode in ("dispatch", "dispatch+telemetry"):
        dispatcher = patching.enable()
        if mode == "dispatch+telemetry":
            dispatcher.set_readings(Recorder(lambda rec: None))
        results += [{"mode": mode, **r} for r in _measure_ops(dispatcher, a.quick, batches)]
        patching.disable()
    span = otel_span_pair_ns(2000 if a.quick else 20000)
    out = {
        "bench": "dispatch_overhead",
        "machine": {"threads": torch.get_num_threads(), "python": platform.python_version(),
                    "torch": torch.__version__, "platform": platform.platform()},
        "method": "median over interleaved batches of (dispatched - bare) per call; default plan; "
                  "dispatch = CallStats readings (telemetry off), dispatch+telemetry = the hot-path "
                  "telemetry Recorder (what rtxops run uses); inputs without autograd",
        "otel_span_pair_ns": span,
        "targets": {"added_ns_max": 3000, "ratio_to_otel_span_max": 0.1},
    }
    for mode in ("dispatch", "dispatch+telemetry"):
        small = [r["added_ns"] for r in results if r["shape"] == "small" and r["mode"] == mode]
        med = statistics.median(small)
        out[mode] = {
            "median_added_ns_small": med,
            "max_added_ns_small": max(small),
            "ratio_to_bare_otel_span": med / span["bare_ns"],
            "ratio_to_otel_call_span": med / span["with_attributes_and_batch_processor_ns"],
        }
    out["results"] = results
    report(out, a.out)
    sys.exit(0)


if __name__ == "__main__":
    main()
