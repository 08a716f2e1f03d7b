"""GPU checks of the runtime (run on a machine with CUDA; exits 1 on a failed check).

- CUDA routes are timed with events resolved at step boundaries, and report per-call memory;
- every non-reference variant that supports CUDA matches the reference on the example inputs
  (the ``compiled`` variants last, within ``--compile-budget-s``: each shape is an Inductor build);
- the example GPT trains under the runtime on CUDA with the default plan;
- and with every op that has a Triton kernel routed to it: the same losses as eager (same seed),
  the kernel spans name the Triton variant, and the median step time of each.
Prints JSON."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rtxops.runtime import patching
from rtxops.runtime.registry import default_registry
from rtxops.runtime.spec import REFERENCE
from rtxops.telemetry import schema as S
from rtxops.telemetry.job import start_job_telemetry


def variants_match(compiled: bool, deadline: float = float("inf")) -> list[dict]:
    """Each variant (the ``compiled`` ones alone when ``compiled``, else all others) against
    the reference on two cases per op and dtype; cases past ``deadline`` are reported skipped."""
    out = []
    reg = default_registry()
    for op in reg.ops():
        import importlib

        module = importlib.import_module(f"rtxops.runtime.ops.{op.name}")
        for dtype in (torch.float32, torch.bfloat16):
            for name, args, kwargs in module.cases(dtype)[:2]:
                args = tuple(a.detach().cuda().requires_grad_(a.requires_grad)
                             if isinstance(a, torch.Tensor) else a for a in args)
                key = op.bucket(*args, **kwargs)
                bucket = op.to_bucket(key)
                ref = op.reference(*args, **kwargs)
                for v in reg.variants(op.name):
                    if v.name == REFERENCE or not v.supports(bucket) or \
                            (v.name == "compiled") != compiled:
                        continue
                    if time.monotonic() > deadline:
                        out.append({"op": op.name, "variant": v.name, "dtype": str(dtype),
                                    "case": name, "ok": True, "skipped": "time budget"})
                        continue
                    try:
                        got = v.build(v.default_config, bucket)(*args, **kwargs)
                        tol = op.tolerance(dtype)
                        refs = ref if isinstance(ref, tuple) else (ref,)
                        gots = got if isinstance(got, tuple) else (got,)
                        ok = all(torch.allclose(g.float(), r.float(), atol=tol.atol, rtol=tol.rtol,
                                                equal_nan=True) for g, r in zip(gots, refs))
                        out.append({"op": op.name, "variant": v.name, "dtype": str(dtype), "case": name,
                                    "ok": bool(ok)})
                    except Exception as e:
                        out.append({"op": op.name, "variant": v.name, "dtype": str(dtype), "case": name,
                                    "ok": False, "error": f"{type(e).__name__}: {e}"})
    return out


def cuda_timing() -> dict:
    sys.path.insert(0, "examples")
    import train_gpt

    d = patching.enable()
    d.call_memory = True   # RTXOPS_CALL_MEMORY=1: per-call allocator delta and peak
    exporter = InMemorySpanExporter()
    telemetry = start_job_telemetry(d, exporter, resource={S.JOB_ID: "gpu-check"})
    model = train_gpt.GPT(2048, 256, 2, 4, 128).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(5):
        tokens = torch.randint(0, 2048, (8, 129), device="cuda")
        loss = model(tokens[:, :-1], tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    telemetry.close(d)
    patching.disable()
    spans = exporter.get_finished_spans()
    kernels = [s for s in spans if s.name == S.KERNEL]
    steps = [s for s in spans if s.name == S.STEP]
    with_memory = [k for k in kernels if S.MEM_PEAK in k.attributes]
    allocator = (S.CUDA_ALLOCATED, S.CUDA_RESERVED, S.CUDA_FRAGMENTATION, S.CUDA_PEAK,
                 S.CUDA_ALLOC_RETRIES, S.CUDA_OOMS)
    with_allocator = [s for s in steps if all(a in s.attributes for a in allocator)]
    return {"kernel_spans": len(kernels), "with_memory": len(with_memory),
            "step_spans": len(steps), "steps_with_allocator_stats": len(with_allocator),
            "last_step_allocator": {a: steps[-1].attributes.get(a) for a in allocator} if steps else {},
            "ok": bool(kernels) and len(with_memory) == len(kernels)
            and all(k.attributes[S.TOTAL_NS] > 0 for k in kernels)
            and bool(steps) and len(with_allocator) == len(steps)}


def triton_training(steps: int = 30, device: str = "cuda", variant: str = "triton") -> dict:
    sys.path.insert(0, "examples")
    import train_gpt

    from rtxops.runtime.ops.triton import ops as triton_ops
    from rtxops.runtime.plan import Plan

    def train(plan: Plan | None) -> tuple[list[float], float, dict]:
        torch.manual_seed(0)
        model = train_gpt.GPT(2048, 256, 2, 4, 128).to(device)
        opt = torch.optim.AdamW(model.parameters())
        g = torch.Generator(device=device).manual_seed(1)
        if plan is not None:
            d = patching.enable(plan)
            exporter = InMemorySpanExporter()
            telemetry = start_job_telemetry(d, exporter, resource={S.JOB_ID: "gpu-check-triton"})
        losses, times = [], []
        for _ in range(steps):
            tokens = torch.randint(0, 2048, (8, 129), device=device, generator=g)
            started = time.perf_counter()
            loss = model(tokens[:, :-1], tokens[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
            losses.append(loss.item())
        variants: dict = {}
        if plan is not None:
            telemetry.close(d)
            patching.disable()
            for span in exporter.get_finished_spans():
                if span.name == S.KERNEL:
                    variants.setdefault(span.attributes[S.OP], set()).add(span.attributes[S.VARIANT])
        return losses, statistics.median(times[5:]), {k: sorted(v) for k, v in variants.items()}

    eager_losses, eager_s, _ = train(None)
    routed = sorted(triton_ops())
    _, reference_s, _ = train(Plan.from_dict({"version": 1}))   # routed, timed, nothing swapped
    plan = Plan.from_dict({"version": 1, "defaults": {op: variant for op in routed}})
    losses, triton_s, variants = train(plan)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, eager_losses))
    used = [op for op in routed if variant in variants.get(op, ())]
    return {"routed": routed, "ran_variant": used, "variants_seen": variants,
            "worst_relative_loss_gap": worst, "last_loss": [losses[-1], eager_losses[-1]],
            "median_step_ms": {"eager": round(eager_s * 1e3, 3),
                           "rtxops_reference_plan": round(reference_s * 1e3, 3),
                           variant: round(triton_s * 1e3, 3)},
            "ok": worst < 1e-2 and bool(used)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compile-budget-s", type=float, default=120.0,
                   help="time for the compiled variants' checks; the rest are reported skipped")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 1
    timing = cuda_timing()
    try:
        training = triton_training()
    except Exception as e:   # reported, and the variant checks still run
        training = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}
    matches = variants_match(compiled=False)
    matches += variants_match(compiled=True, deadline=time.monotonic() + args.compile_budget_s)
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "variants": matches, "cuda_timing": timing, "triton_training": training,
              "skipped": sum(1 for m in matches if "skipped" in m),
              "ok": all(m["ok"] for m in matches) and timing["ok"] and training["ok"]}
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
