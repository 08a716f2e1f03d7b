"""Triton kernel check and benchmark (GPU; ``--dry-run`` runs tiny shapes on the CPU interpreter).

1. Correctness: every Triton kernel against its op's reference, forward and gradients, fp32 and
   bf16, on the op's test cases (plus GeGLU and the fused linear + cross-entropy).
2. Benchmark: forward+backward time (median) and peak extra memory of eager PyTorch,
   ``torch.compile``, rtxops Triton and Liger-Kernel (when importable) on LLM shapes.
Writes one JSON file (``--out``) and prints it. Exit code 1 when a correctness check fails.
"""
from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/gpu_kernels.json")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU interpreter, tiny shapes, no torch.compile (checks the script runs)")
    p.add_argument("--seq", type=int, default=8192, help="rows (batch x sequence)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336, help="MLP width (swiglu, gelu)")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--only", default="", help="comma-separated kernels to benchmark")
    args = p.parse_args(argv)
    if args.dry_run:
        args.seq, args.hidden, args.intermediate, args.vocab = 8, 64, 96, 200
        args.heads, args.kv_heads, args.head_dim = 4, 2, 16
        args.iters, args.warmup, args.no_compile = 1, 0, True
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:  # before triton is imported: kernels are decorated as interpreted
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["RTXOPS_TRITON_INTERPRET"] = "1"
    kb = sys.modules[__name__]
    device = "cpu" if args.dry_run else "cuda"
    report = {"device": kb.device_name(device), "dry_run": args.dry_run,
              "shapes": {k: getattr(args, k) for k in
                         ("seq", "hidden", "intermediate", "vocab", "heads", "kv_heads",
                          "head_dim")},
              "versions": kb.versions()}
    report["correctness"] = kb.correctness(device, tiny=args.dry_run)
    failed = [c for c in report["correctness"] if not c["ok"]]
    report["correctness_failed"] = len(failed)
    report["benchmarks"] = {}
    kb.write(report, args.out, quiet=True)   # each step on disk: a run cut short keeps what it had
    kb.benchmarks(args, device, report["benchmarks"], lambda: kb.write(report, args.out, quiet=True))
    kb.write(report, args.out)
    return 1 if failed else 0


# ---- everything below imports torch/triton: only after main() has set the environment ----

def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "triton", "liger-kernel"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _to(obj, device):
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device).requires_grad_(obj.requires_grad)
    if isinstance(obj, tuple):
        return tuple(_to(o, device) for o in obj)
    return obj


def correctness(device: str, tiny: bool) -> list[dict]:
    """Every Triton kernel vs its reference on the op's cases (forward and gradients)."""
    import importlib

    import torch

    from rtxops.runtime.ops.triton import ops as triton_ops
    from rtxops.runtime.registry import default_registry
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tests.runtime.triton.compare import assert_matches

    results = []
    registry = default_registry()
    for op in triton_ops():
        spec, variant = registry.op(op), registry.variant(op, "triton")
        module = importlib.import_module(f"rtxops.runtime.ops.{op}")
        for dtype in (torch.float32, torch.bfloat16):
            for name, args, kwargs in module.cases(dtype):
                if tiny and max(a.numel() for a in list(args) + list(kwargs.values())
                                if isinstance(a, torch.Tensor)) > 4096:
                    continue
                args = tuple(_to(a, device) for a in args)
                kwargs = {k: _to(v, device) for k, v in kwargs.items()}
                entry = {"op": op, "case": name, "dtype": str(dtype)[6:], "ok": True}
                try:
                    bucket = spec.to_bucket(spec.bucket(*args, **kwargs))
                    fn = variant.build(variant.default_config, bucket)
                    assert_matches(spec, fn, args, kwargs, name)
                except Exception as e:  # reported, not raised: every case is checked
                    entry.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
                results.append(entry)
    results += _fused_correctness(device)
    return results


def _fused_correctness(device: str) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from rtxops.runtime.ops.triton.gelu import geglu
    from rtxops.runtime.ops.triton.linear_cross_entropy import linear_cross_entropy
    from rtxops.runtime.registry import default_registry
    from tests.runtime.triton.compare import assert_matches

    out = []
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(9, 48, generator=g).to(dtype).to(device).requires_grad_()
        w = (torch.randn(300, 48, generator=g) / 7).to(dtype).to(device).requires_grad_()
        t = torch.randint(0, 300, (9,), generator=g).to(device)
        t[2] = -100
        a = (3 * torch.randn(6, 80, generator=g)).to(dtype).to(device).requires_grad_()
        b = torch.randn(6, 80, generator=g).to(dtype).to(device).requires_grad_()
        checks = [
            ("linear_cross_entropy", default_registry().op("cross_entropy"),
             lambda x, w: linear_cross_entropy(x, w, t, config={"chunk_rows": 4}),
             lambda x, w: F.cross_entropy(F.linear(x, w), t), (x, w)),
            ("geglu_tanh", default_registry().op("gelu"), lambda a, b: geglu(a, b, "tanh"),
             lambda a, b: F.gelu(a, approximate="tanh") * b, (a, b)),
        ]
        for name, spec, fn, ref, args in checks:
            entry = {"op": name, "case": "small", "dtype": str(dtype)[6:], "ok": True}
            try:
                assert_matches(spec, fn, args, {}, name, reference=ref, dtype=dtype)
            except Exception as e:
                entry.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
            out.append(entry)
    return out


def _workloads(args, device: str) -> dict:
    """name -> (make_inputs() -> (args, kwargs), {impl: fn}) on LLM shapes."""
    import torch
    import torch.nn.functional as F

    from rtxops.runtime.ops import rope as rope_op
    from rtxops.runtime.ops.triton.linear_cross_entropy import linear_cross_entropy
    from rtxops.runtime.registry import default_registry

    bf16, n, h, m, v = torch.bfloat16, args.seq, args.hidden, args.intermediate, args.vocab
    reg = default_registry()

    def t(*shape, scale=1.0, grad=True):
        return (scale * torch.randn(*shape, device=device, dtype=torch.float32)).to(bf16) \
            .requires_grad_(grad)

    def triton_of(op, args_, kwargs_):
        spec, variant = reg.op(op), reg.variant(op, "triton")
        return variant.build(variant.default_config,
                             spec.to_bucket(spec.bucket(*args_, **kwargs_)))

    def ce_inputs():
        target = torch.randint(0, v, (n,), device=device)
        target[::10] = -100
        return (t(n, v, scale=2.0), target), {}

    def rope_inputs():
        cos, sin = rope_op._cos_sin(n, args.head_dim, bf16, device)
        return (t(1, args.heads, n, args.head_dim), t(1, args.kv_heads, n, args.head_dim),
                cos, sin), {}

    def lce_inputs():
        target = torch.randint(0, v, (n,), device=device)
        target[::10] = -100
        return (t(n, h), t(v, h, scale=h ** -0.5), target), {}

    specs = {
        "rms_norm": ("rms_norm", lambda: ((t(n, h), [h], t(h), 1e-6), {})),
        "layer_norm": ("layer_norm", lambda: ((t(n, h), [h], t(h), t(h), 1e-5), {})),
        "softmax": ("softmax", lambda: ((t(n, h, scale=2.0), -1), {})),
        "swiglu": ("swiglu", lambda: ((t(n, m), t(n, m)), {})),
        "gelu": ("gelu", lambda: ((t(n, m),), {"approximate": "tanh"})),
        "cross_entropy": ("cross_entropy", ce_inputs),
        "rope": ("rope", rope_inputs),
    }
    out = {}
    for name, (op, make) in specs.items():
        ref = reg.op(op).reference
        impls = {"eager": ref, "triton": ("build", op)}
        liger = _liger(name)
        if liger is not None:
            impls["liger"] = liger
        if not args.no_compile:  # last: its build is the slow part of a row
            impls["torch_compile"] = torch.compile(ref)
        out[name] = (make, impls, triton_of)
    lce_impls = {"eager": lambda x, w, tg: F.cross_entropy(F.linear(x, w), tg),
                 "triton": lambda x, w, tg: linear_cross_entropy(x, w, tg),
                 "triton_weight_dtype_accum":
                     lambda x, w, tg: linear_cross_entropy(x, w, tg, config={"grad_accum": "weight"})}
    liger = _liger("linear_cross_entropy")
    if liger is not None:
        lce_impls["liger"] = liger
    if not args.no_compile:
        lce_impls["torch_compile"] = torch.compile(lce_impls["eager"])
    out["linear_cross_entropy"] = (lce_inputs, lce_impls, triton_of)
    return out


def _liger(name: str):
    """Liger-Kernel's equivalent with the reference's signature, or None when not installed."""
    try:
        from liger_kernel.transformers import functional as L
    except Exception:
        return None
    table = {
        "rms_norm": lambda x, shape, w, eps: L.liger_rms_norm(x, w, eps),
        "layer_norm": lambda x, shape, w, b, eps: L.liger_layer_norm(x, w, b, eps),
        "swiglu": lambda a, b: L.liger_swiglu(a, b),
        "cross_entropy": lambda x, tg: L.liger_cross_entropy(x, tg),
        "rope": lambda q, k, c, s: L.liger_rope(q, k, c, s),
        "linear_cross_entropy": lambda x, w, tg: L.liger_fused_linear_cross_entropy(x, w, tg),
        "gelu": None,  # Liger has GeGLU, not plain GELU
        "softmax": getattr(L, "liger_softmax", None) and (lambda x, dim: L.liger_softmax(x)),
    }
    return table.get(name)


def _measure(fn, make, device: str, iters: int, warmup: int) -> dict:
    """Median fwd+bwd time and peak memory above the inputs."""
    import statistics
    import time

    import torch

    inputs, kwargs = make()
    leaves = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
    times = []
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + iters):
        for leaf in leaves:
            leaf.grad = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = fn(*inputs, **kwargs)
        outs = [o for o in (out if isinstance(out, tuple) else (out,))]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        if cuda:
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            elapsed = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(elapsed)
        del out, outs
    result = {"ms": round(statistics.median(times), 4)}
    if cuda:
        result["peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
    return result


def benchmarks(args, device: str, results: dict, saved=lambda: None) -> dict:
    """Per kernel and implementation: fwd+bwd ms and peak extra MiB; speedups vs eager. Rows
    go into ``results`` as they are measured, ``saved()`` called after each."""
    import time

    only = {s for s in args.only.split(",") if s}
    for name, (make, impls, triton_of) in _workloads(args, device).items():
        if only and name not in only:
            continue
        row = {}
        for impl, fn in impls.items():
            started = time.monotonic()
            try:
                if isinstance(fn, tuple):  # the Triton variant, built for this bucket
                    a, k = make()
                    fn = triton_of(fn[1], a, k)
                row[impl] = _measure(fn, make, device, args.iters, args.warmup)
            except Exception as e:  # one failing baseline must not hide the others
                row[impl] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            _free(device)
            print(f"gpu_kernels: {name} {impl}: {row[impl]} ({time.monotonic() - started:.1f} s "
                  "with builds)", file=sys.stderr, flush=True)
        eager = row.get("eager", {})
        for impl, r in row.items():
            if "ms" in r and "ms" in eager and impl != "eager":
                r["speedup_vs_eager"] = round(eager["ms"] / r["ms"], 2)
                if r.get("peak_extra_mib") and eager.get("peak_extra_mib"):
                    r["memory_saving_vs_eager"] = round(eager["peak_extra_mib"]
                                                        / r["peak_extra_mib"], 2)
        results[name] = row
        saved()
    return results


def _free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def write(report: dict, path: str, quiet: bool = False) -> None:
    import json

    text = json.dumps(report, indent=2, sort_keys=True)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(text + "\n")
    os.replace(path + ".tmp", path)
    if not quiet:
        print(text)


if __name__ == "__main__":
    sys.exit(main())
