"""silu: ``y = x * sigmoid(x)``."""
from __future__ import annotations

import torch

from .. import originals
from ..bucket import Bucket, device_type, pow2
from ..spec import OpSpec, Variant
from ._chunked import over_elements
from ._compiled import compiled_variant
from ._layout import layout_key

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def reference(input, inplace=False):
    return originals.silu(input, inplace)


def key(input, inplace=False):
    try:
        return (input.shape, input.dtype, True if input.is_cpu else input.device, inplace,
                layout_key(input))
    except AttributeError:
        return None


def bucket(input, inplace=False):
    shape = input.shape
    if inplace or len(shape) == 0 or input.dtype not in _FLOATS or shape[-1] == 0:
        return None
    hidden = shape[-1]
    return (input.dtype, device_type(input), hidden, pow2(input.numel() // hidden))


def example_inputs(b: Bucket, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(b.dim("rows"), b.dim("hidden"), generator=g)
    return (x.to(b.torch_dtype).to(b.device).requires_grad_(),), {}


def eager(input, inplace=False):
    """``x * sigmoid(x)`` in fp32."""
    x = input.float()
    return (x * torch.sigmoid(x)).to(input.dtype)


def tanh_form(input, inplace=False):
    """``0.5 * x * (1 + tanh(x / 2))``, since ``sigmoid(x) = (1 + tanh(x/2)) / 2``."""
    x = input.float()
    return (0.5 * x * (1 + torch.tanh(0.5 * x))).to(input.dtype)


def _build_chunked(config, b: Bucket):
    n = config["chunk_elems"]

    def chunked(input, inplace=False):
        return over_elements(eager, n, input)

    return chunked


SPEC = OpSpec(
    key=key,
    name="silu",
    reference=reference,
    bucket=bucket,
    dims=("hidden", "rows"),
    example_inputs=example_inputs,
    description="SiLU / swish (F.silu, nn.SiLU), out of place",
)

VARIANTS = [
    Variant("silu", "eager", "eager", lambda c, b: eager, description="fp32 x * sigmoid(x)"),
    Variant("silu", "tanh", "algebraic", lambda c, b: tanh_form,
            description="0.5 * x * (1 + tanh(x / 2)) in fp32"),
    Variant("silu", "chunked", "chunked", _build_chunked,
            config_space={"chunk_elems": [1 << 16, 1 << 18, 1 << 20]},
            description="element chunks bound the fp32 temporaries"),
    compiled_variant("silu", eager),
]


def cases(dtype: torch.dtype):
    """Named (args, kwargs) cases for tests: typical and edge shapes."""
    g = torch.Generator().manual_seed(1)

    def t(*shape, scale=2.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype).requires_grad_()

    wide = torch.randn(6, 2 * 65, generator=g).to(dtype)
    return [
        ("2d", (t(16, 64),), {}),
        ("3d", (t(2, 7, 48), False), {}),
        ("one_row_odd_hidden", (t(1, 65),), {"inplace": False}),
        ("wide_range", (t(8, 32, scale=30.0),), {}),
        ("non_contiguous", (wide[:, ::2].requires_grad_(),), {}),
        ("many_elems", (t(1100, 64),), {}),
    ]
