"""GeGLU (``gelu(a) * b``) has no registry op: its kernel is checked against eager math here."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rtxops.runtime.registry import default_registry

from .compare import assert_matches

GELU = default_registry().op("gelu")  # same tolerances as the gelu op


def eager_geglu(a, b, approximate="none"):
    return F.gelu(a, approximate=approximate) * b


def t(*shape, dtype, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype).requires_grad_()


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_geglu_matches_eager(dtype, approximate):
    from rtxops.runtime.ops.triton.gelu import geglu

    fused = t(5, 2 * 45, dtype=dtype, seed=3)
    cases = [
        ("2d", (t(4, 96, dtype=dtype), t(4, 96, dtype=dtype, seed=1)), {}),
        ("one_row_odd", (t(1, 33, dtype=dtype), t(1, 33, dtype=dtype, seed=2)), {}),
        ("non_contiguous_halves", (fused[:, :45].detach().requires_grad_(),
                                   fused[:, 45:].detach().requires_grad_()), {}),
    ]
    for name, args, kwargs in cases:
        assert_matches(GELU, lambda a, b: geglu(a, b, approximate, {"block": 64}), args, kwargs,
                       name, reference=lambda a, b: eager_geglu(a, b, approximate))
