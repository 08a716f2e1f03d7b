"""gelu: ``y = x * Phi(x)`` (``approximate='none'``) or
``y = 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`` (``approximate='tanh'``)."""
from __future__ import annotations

import math

import torch

from .. import originals
from ..bucket import Bucket, device_type, pow2
from ..spec import OpSpec, Variant
from ._chunked import over_elements
from ._compiled import compiled_variant
from .triton import variants as triton_variants
from ._layout import layout_key

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_APPROX = {"none": 0, "tanh": 1}
_K = math.sqrt(2 / math.pi)


def reference(input, approximate="none"):
    return originals.gelu(input, approximate=approximate)


def key(input, *, approximate="none"):   # keyword-only, as torch takes it
    try:
        return (input.shape, input.dtype, True if input.is_cpu else input.device, approximate,
                layout_key(input))
    except AttributeError:
        return None


def bucket(input, *, approximate="none"):
    shape = input.shape
    if (
        type(approximate) is not str
        or approximate not in _APPROX
        or len(shape) == 0
        or input.dtype not in _FLOATS
        or shape[-1] == 0
    ):
        return None
    hidden = shape[-1]
    rows = pow2(input.numel() // hidden)
    return (input.dtype, device_type(input), _APPROX[approximate], hidden, rows)


def example_inputs(b: Bucket, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(b.dim("rows"), b.dim("hidden"), generator=g)
    approximate = "tanh" if b.dim("tanh") else "none"
    return (x.to(b.torch_dtype).to(b.device).requires_grad_(),), {"approximate": approximate}


def eager(input, approximate="none"):
    """The textbook erf / tanh formulas in fp32."""
    x = input.float()
    if approximate == "tanh":
        y = 0.5 * x * (1 + torch.tanh(_K * (x + 0.044715 * x * x * x)))
    else:
        y = 0.5 * x * (1 + torch.erf(x * math.sqrt(0.5)))
    return y.to(input.dtype)


def algebraic(input, approximate="none"):
    """``x * ndtr(x)``; tanh form: ``x * sigmoid(2z)`` since ``(1 + tanh z) / 2 = sigmoid(2z)``."""
    x = input.float()
    if approximate == "tanh":
        y = x * torch.sigmoid((2 * _K) * (x + 0.044715 * x * x * x))
    else:
        y = x * torch.special.ndtr(x)
    return y.to(input.dtype)


def _build_chunked(config, b: Bucket):
    n = config["chunk_elems"]

    def chunked(input, approximate="none"):
        return over_elements(lambda c: eager(c, approximate), n, input)

    return chunked


SPEC = OpSpec(
    key=key,
    name="gelu",
    reference=reference,
    bucket=bucket,
    dims=("tanh", "hidden", "rows"),
    example_inputs=example_inputs,
    description="GELU, exact or tanh-approximated (F.gelu, nn.GELU); tanh=1: approximate='tanh'",
)

VARIANTS = [
    Variant("gelu", "eager", "eager", lambda c, b: eager, description="fp32 erf / tanh formulas"),
    Variant("gelu", "algebraic", "algebraic", lambda c, b: algebraic,
            description="x * ndtr(x); tanh form via the sigmoid identity"),
    Variant("gelu", "chunked", "chunked", _build_chunked,
            config_space={"chunk_elems": [1 << 16, 1 << 18, 1 << 20]},
            description="element chunks bound the fp32 temporaries"),
    compiled_variant("gelu", eager),
] + triton_variants("gelu")


def cases(dtype: torch.dtype):
    """Named (args, kwargs) cases for tests: typical and edge shapes."""
    g = torch.Generator().manual_seed(1)

    def t(*shape, scale=2.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype).requires_grad_()

    wide = torch.randn(6, 2 * 65, generator=g).to(dtype)
    return [
        ("2d", (t(16, 64),), {}),
        ("3d_tanh", (t(2, 7, 48),), {"approximate": "tanh"}),
        ("one_row_odd_hidden", (t(1, 65),), {"approximate": "none"}),
        ("one_row_odd_hidden_tanh", (t(1, 65),), {"approximate": "tanh"}),
        ("wide_range", (t(8, 32, scale=8.0),), {}),
        ("wide_range_tanh", (t(8, 32, scale=8.0),), {"approximate": "tanh"}),
        ("non_contiguous", (wide[:, ::2].requires_grad_(),), {}),
        ("many_elems", (t(1100, 64),), {"approximate": "tanh"}),
    ]
