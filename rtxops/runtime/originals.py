"""The torch functions as they were before rtxops patched anything.

Variants must call these, never ``torch.nn.functional.X`` (which may be our own wrapper)."""
from __future__ import annotations

import torch.nn.functional as _F

PATCHABLE = (
    "rms_norm",
    "layer_norm",
    "softmax",
    "gelu",
    "silu",
    "cross_entropy",
    "scaled_dot_product_attention",
    "linear",
)

_ORIGINAL = {name: getattr(_F, name) for name in PATCHABLE}


def original(name: str):
    """The unpatched ``torch.nn.functional.<name>``."""
    return _ORIGINAL[name]


rms_norm = _ORIGINAL["rms_norm"]
layer_norm = _ORIGINAL["layer_norm"]
softmax = _ORIGINAL["softmax"]
gelu = _ORIGINAL["gelu"]
silu = _ORIGINAL["silu"]
cross_entropy = _ORIGINAL["cross_entropy"]
scaled_dot_product_attention = _ORIGINAL["scaled_dot_product_attention"]
linear = _ORIGINAL["linear"]
