"""layer_norm: ``y = (x - mean(x, -1)) / sqrt(var(x, -1) + eps) * weight + bias`` over the last dim
(biased variance)."""
from __future__ import annotations

import torch

from .. import originals
from ..bucket import Bucket, device_type, pow2
from ..spec import OpSpec, Variant
from ._chunked import over_rows
from ._compiled import compiled_variant
from .triton import variants as triton_variants
from ._layout import layout_key

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def reference(input, normalized_shape, weight=None, bias=None, eps=1e-05):
    return originals.layer_norm(input, normalized_shape, weight, bias, eps)


def key(input, normalized_shape, weight=None, bias=None, eps=1e-05):
    try:
        ns = normalized_shape if type(normalized_shape) is tuple else tuple(normalized_shape)
        return (input.shape, input.dtype, True if input.is_cpu else input.device, ns,
                None if weight is None else (weight.dtype, weight.shape),
                None if bias is None else (bias.dtype, bias.shape), layout_key(input))
    except (AttributeError, TypeError):
        return None


def bucket(input, normalized_shape, weight=None, bias=None, eps=1e-05):
    shape = input.shape
    dtype = input.dtype
    if (
        len(shape) == 0
        or not isinstance(normalized_shape, (list, tuple))
        or len(normalized_shape) != 1
        or normalized_shape[0] != shape[-1]
        or dtype not in _FLOATS
        or shape[-1] == 0
        or (weight is not None and (weight.dtype != dtype or weight.shape != shape[-1:]))
        or (bias is not None and (bias.dtype != dtype or bias.shape != shape[-1:]))
    ):   # (a weight of another shape: torch's error, not a variant's broadcast)
        return None
    hidden = shape[-1]
    return (dtype, device_type(input), hidden, pow2(input.numel() // hidden))


def example_inputs(b: Bucket, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden, rows = b.dim("hidden"), b.dim("rows")
    x = torch.randn(rows, hidden, generator=g)
    w = 1 + 0.1 * torch.randn(hidden, generator=g)
    bias = 0.1 * torch.randn(hidden, generator=g)
    x, w, bias = (t.to(b.torch_dtype).to(b.device).requires_grad_() for t in (x, w, bias))
    return (x, [hidden], w, bias, 1e-5), {}


def _norm(input, weight, bias, eps):
    x = input.float().contiguous()   # torch's layer_norm answers a strided input contiguous
    mean = x.mean(-1, keepdim=True)
    xc = x - mean
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y.to(input.dtype)


def _f32(t):
    return None if t is None else t.float()


def eager(input, normalized_shape, weight=None, bias=None, eps=1e-05):
    """Two-pass mean/variance in fp32, affine in fp32, one rounding to the input dtype."""
    return _norm(input, _f32(weight), _f32(bias), eps)


def native(input, normalized_shape, weight=None, bias=None, eps=1e-05):
    """aten.native_layer_norm directly (returns output, mean, rstd)."""
    return torch.ops.aten.native_layer_norm(input, list(normalized_shape), weight, bias, eps)[0]


def _build_chunked(config, b: Bucket):
    rows = config["chunk_rows"]

    def chunked(input, normalized_shape, weight=None, bias=None, eps=1e-05):
        w, bias = _f32(weight), _f32(bias)  # cast once: their grads sum over chunks in fp32
        return over_rows(lambda c: _norm(c, w, bias, eps), input, rows)

    return chunked


SPEC = OpSpec(
    key=key,
    name="layer_norm",
    reference=reference,
    bucket=bucket,
    dims=("hidden", "rows"),
    example_inputs=example_inputs,
    description="layer normalization over the last dim (F.layer_norm, nn.LayerNorm)",
)

VARIANTS = [
    Variant("layer_norm", "eager", "eager", lambda c, b: eager,
            description="fp32 two-pass hand-written math"),
    Variant("layer_norm", "native", "aten", lambda c, b: native,
            description="aten.native_layer_norm"),
    Variant("layer_norm", "chunked", "chunked", _build_chunked,
            config_space={"chunk_rows": [256, 1024, 4096]},
            description="row chunks bound the fp32 temporaries"),
    compiled_variant("layer_norm", eager),
] + triton_variants("layer_norm")


def cases(dtype: torch.dtype):
    """Named (args, kwargs) cases for tests: typical and edge shapes."""
    g = torch.Generator().manual_seed(1)

    def t(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=g)).to(dtype).requires_grad_()

    wide = torch.randn(6, 2 * 65, generator=g).to(dtype)
    cs = [
        ("2d", (t(16, 64), [64], t(64), t(64), 1e-5), {}),
        ("3d_default_eps", (t(2, 7, 48), (48,), t(48), t(48)), {}),
        ("one_row_odd_hidden", (t(1, 65), (65,), t(65), t(65), 1e-6), {}),
        ("no_affine", (t(4, 32), [32]), {}),
        ("weight_only", (t(3, 5, 24), [24]), {"weight": t(24), "eps": 1e-6}),
        ("offset_input", (t(8, 40, scale=2.0, shift=3.0), [40], t(40), t(40)), {}),
        ("non_contiguous", (wide[:, ::2].requires_grad_(), [65], t(65), t(65)), {}),
        ("many_rows", (t(600, 16), [16]), {}),
    ]
    if dtype == torch.float32:
        # not in bf16: ATen's bf16 CPU backward sums dweight/dbias over rows with ~5% error at 600
        # rows (20x further from the fp64 truth than the fp32-accumulating variants)
        cs.append(("many_rows_affine", (t(600, 16), [16], t(16), t(16)), {}))
    return cs
