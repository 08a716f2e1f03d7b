"""GPU checks of the runtime (run on a machine with CUDA; exits 1 on a failed check).

- CUDA routes are timed with events resolved at step boundaries, and report per-call memory;
- every non-reference variant that supports CUDA matches the reference on the example inputs;
- the example GPT trains under the runtime on CUDA with the default plan.
Prints JSON."""
from __future__ import annotations

import json
import sys

import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rtxops.runtime import patching
from rtxops.runtime.registry import default_registry
from rtxops.runtime.spec import REFERENCE
from rtxops.telemetry import schema as S
from rtxops.telemetry.job import start_job_telemetry


def variants_match() -> list[dict]:
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
                    if v.name == REFERENCE or not v.supports(bucket):
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
    kernels = [s for s in exporter.get_finished_spans() if s.name == S.KERNEL]
    with_memory = [k for k in kernels if S.MEM_PEAK in k.attributes]
    return {"kernel_spans": len(kernels), "with_memory": len(with_memory),
            "ok": bool(kernels) and len(with_memory) == len(kernels)
            and all(k.attributes[S.TOTAL_NS] > 0 for k in kernels)}


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 1
    matches = variants_match()
    timing = cuda_timing()
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "variants": matches, "cuda_timing": timing,
              "ok": all(m["ok"] for m in matches) and timing["ok"]}
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
