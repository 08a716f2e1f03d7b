"""rms_norm: ``y = x / sqrt(mean(x**2, -1) + eps) * weight`` over the last dim."""
from __future__ import annotations

import torch

from .. import originals
from ..bucket import Bucket, device_type, pow2
from ..spec import OpSpec, Variant
from ._chunked import over_rows
from ._compiled import compiled_variant
from ._layout import layout_key, suggested_memory_format
from .triton import variants as triton_variants

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def reference(input, normalized_shape, weight=None, eps=None):
    return originals.rms_norm(input, normalized_shape, weight, eps)


def key(input, normalized_shape, weight=None, eps=None):
    try:
        ns = normalized_shape if type(normalized_shape) is tuple else tuple(normalized_shape)
        return (input.shape, input.dtype, True if input.is_cpu else input.device, ns,
                None if weight is None else (weight.dtype, weight.shape), layout_key(input))
    except (AttributeError, TypeError):
        return None


def bucket(input, normalized_shape, weight=None, eps=None):
    shape = input.shape
    if (
        len(shape) == 0
        or len(normalized_shape) != 1
        or normalized_shape[0] != shape[-1]
        or input.dtype not in _FLOATS
        or shape[-1] == 0
        # the output's dtype follows the weight's too: a route checked with one weight dtype
        # must not answer another's (torch keeps a bf16 input's dtype under an fp32 weight)
        or (weight is not None and weight.dtype != input.dtype)
        or (weight is not None and weight.shape != shape[-1:])   # torch's error, not a broadcast
    ):
        return None
    hidden = shape[-1]
    return (input.dtype, device_type(input), hidden, pow2(input.numel() // hidden))


def example_inputs(b: Bucket, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden, rows = b.dim("hidden"), b.dim("rows")
    x = torch.randn(rows, hidden, generator=g).to(b.torch_dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(b.torch_dtype)
    return (x.to(b.device).requires_grad_(), [hidden], w.to(b.device).requires_grad_(), 1e-6), {}


def eps_or_default(x, eps):
    """``eps``, or torch's default for ``x`` when None."""
    if eps is not None:
        return eps
    # torch's default: the epsilon of the dtype it computes in (fp32 for bf16/fp16: theirs,
    # 0.0078 and 0.00098, made nn.RMSNorm(dim) of small activations wrong by 80 %)
    return torch.finfo(torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype).eps


def eager(input, normalized_shape, weight=None, eps=None):
    """Hand-written math with fp32 accumulation (what Llama-style modules do)."""
    # torch's rms_norm answers a strided input contiguous, and a channels-last one channels-last
    x = input.float().contiguous(memory_format=suggested_memory_format(input))
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps_or_default(input, eps))
    y = y.to(input.dtype)
    return y * weight if weight is not None else y


def fused(input, normalized_shape, weight=None, eps=None):
    """ATen's fused RMSNorm kernel (returns the output and the inverse rms it saves)."""
    return torch.ops.aten._fused_rms_norm(input, list(normalized_shape), weight, eps)[0]


def _build_chunked(config, b: Bucket):
    rows = config["chunk_rows"]

    def chunked(input, normalized_shape, weight=None, eps=None):
        out = over_rows(lambda c: eager(c, normalized_shape, weight, eps), input, rows)
        return out.contiguous(memory_format=suggested_memory_format(input))   # (as eager's)

    return chunked


SPEC = OpSpec(
    key=key,
    name="rms_norm",
    reference=reference,
    bucket=bucket,
    dims=("hidden", "rows"),
    example_inputs=example_inputs,
    description="RMS normalization over the last dim (F.rms_norm, Llama-style RMSNorm modules)",
)

VARIANTS = [
    Variant("rms_norm", "eager", "eager", lambda c, b: eager,
            description="fp32-accumulating hand-written math"),
    Variant("rms_norm", "fused", "aten", lambda c, b: fused, description="aten._fused_rms_norm"),
    Variant("rms_norm", "chunked", "chunked", _build_chunked,
            config_space={"chunk_rows": [256, 1024, 4096]},
            description="row chunks bound the fp32 temporaries"),
    compiled_variant("rms_norm", eager),
] + triton_variants("rms_norm")


def cases(dtype: torch.dtype):
    """Named (args, kwargs) cases for tests: typical and edge shapes."""
    g = torch.Generator().manual_seed(1)

    def t(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    wide = torch.randn(6, 2 * 65, generator=g).to(dtype)
    return [
        ("2d", (t(16, 64), [64], t(64), 1e-6), {}),
        ("3d_default_eps", (t(2, 7, 48), [48], t(48)), {}),
        ("one_row_odd_hidden", (t(1, 65), (65,), t(65), 1e-5), {}),
        ("no_weight", (t(4, 32), [32]), {"eps": 1e-6}),
        ("non_contiguous", (wide[:, ::2].requires_grad_(), [65], t(65), 1e-6), {}),
    ]
