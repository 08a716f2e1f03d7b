"""swiglu: ``y = silu(a) * b = a * sigmoid(a) * b`` (the gated MLP activation; no torch function,
canonical signature ``swiglu(a, b)``)."""
from __future__ import annotations

import torch

from .. import originals
from ..bucket import Bucket, device_type, pow2
from ..spec import OpSpec, Variant
from ._chunked import over_elements
from ._compiled import compiled_variant
from .triton import variants as triton_variants
from ._layout import layout_key

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def reference(a, b):
    return originals.silu(a) * b


def key(a, b):
    try:
        return (a.shape, a.dtype, True if a.is_cpu else a.device, b.shape, b.dtype, layout_key(a),
                layout_key(b))
    except AttributeError:
        return None


def bucket(a, b):
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None
    shape = a.shape
    if (
        len(shape) == 0
        or b.shape != shape
        or a.dtype not in _FLOATS
        or b.dtype != a.dtype
        or shape[-1] == 0
    ):
        return None
    hidden = shape[-1]
    return (a.dtype, device_type(a), hidden, pow2(a.numel() // hidden))


def example_inputs(bk: Bucket, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (bk.dim("rows"), bk.dim("hidden"))
    a, b = (2 * torch.randn(shape, generator=g) for _ in range(2))
    return tuple(t.to(bk.torch_dtype).to(bk.device).requires_grad_() for t in (a, b)), {}


def eager(a, b):
    """``a * sigmoid(a) * b`` in fp32, one rounding."""
    x = a.float()
    return (x * torch.sigmoid(x) * b.float()).to(a.dtype)


def tanh_form(a, b):
    """``0.5 * a * (1 + tanh(a / 2)) * b`` in fp32."""
    x = a.float()
    return (0.5 * x * (1 + torch.tanh(0.5 * x)) * b.float()).to(a.dtype)


def _build_chunked(config, bk: Bucket):
    n = config["chunk_elems"]

    def chunked(a, b):
        return over_elements(eager, n, a, b)

    return chunked


SPEC = OpSpec(
    key=key,
    name="swiglu",
    reference=reference,
    bucket=bucket,
    dims=("hidden", "rows"),
    example_inputs=example_inputs,
    description="silu(a) * b with a and b of one shape (SwiGLU MLPs)",
)

VARIANTS = [
    Variant("swiglu", "eager", "eager", lambda c, b: eager, description="fp32 a * sigmoid(a) * b"),
    Variant("swiglu", "tanh", "algebraic", lambda c, b: tanh_form,
            description="sigmoid via 0.5 * (1 + tanh(a / 2)), fp32"),
    Variant("swiglu", "chunked", "chunked", _build_chunked,
            config_space={"chunk_elems": [1 << 16, 1 << 18, 1 << 20]},
            description="element chunks bound the fp32 temporaries"),
    compiled_variant("swiglu", eager),
] + triton_variants("swiglu")


def cases(dtype: torch.dtype):
    """Named (args, kwargs) cases for tests: typical and edge shapes."""
    g = torch.Generator().manual_seed(1)

    def t(*shape, scale=2.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype).requires_grad_()

    fused = torch.randn(6, 2 * 65, generator=g).to(dtype)
    gate, up = fused[:, :65], fused[:, 65:]
    return [
        ("2d", (t(16, 64), t(16, 64)), {}),
        ("3d", (t(2, 7, 48), t(2, 7, 48)), {}),
        ("one_row_odd_hidden", (t(1, 65),), {"b": t(1, 65)}),
        ("kwargs", (), {"a": t(8, 32, scale=8.0), "b": t(8, 32)}),
        ("non_contiguous_halves", (gate.requires_grad_(), up.requires_grad_()), {}),
        ("many_elems", (t(1100, 64), t(1100, 64)), {}),
    ]
