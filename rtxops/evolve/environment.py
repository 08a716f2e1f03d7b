"""What a tuning result depends on besides the kernel: library versions and the device model."""
from __future__ import annotations

import functools

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
