"""What a tuning result depends on besides the kernel: library versions and the device model."""
from __future__ import annotations

import functools

from rtxops.telemetry import schema as S
from rtxops.telemetry.resource import cpu_model


@functools.lru_cache(maxsize=None)
def environment(device: str = "cpu") -> dict[str, str]:
    """torch and triton versions and the device model (the GPU's name, or the CPU's)."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # not installed, or broken: tuned results then carry no triton version
        triton_version = ""
    if device == "cuda" and torch.cuda.is_available():
        model = torch.cuda.get_device_name()
    else:
        model = cpu_model()
    return {"torch_version": torch.__version__, "triton_version": triton_version,
            "device": f"{device}:{model}"}


def job_environment(resource: dict, device: str) -> dict[str, str] | None:
    """The same facts as a job reported them (its resource attributes): a job's live results
    are keyed by the torch, triton and device it ran on, not the daemon's. None when the
    resource lacks them (a client that is not rtxops)."""
    torch_version = resource.get(S.TORCH_VERSION)
    model = resource.get(S.HW_GPU_MODEL if device == "cuda" else S.HW_CPU_MODEL)
    if not torch_version or not model:
        return None
    return {"torch_version": str(torch_version),
            "triton_version": str(resource.get(S.TRITON_VERSION) or ""),
            "device": f"{device}:{model}"}
