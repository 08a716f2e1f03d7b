"""linear: ``y = x @ W^T + b`` over the last dim of ``x`` (W is (out, in), b optional)."""
from __future__ import annotations

import torch

from .. import originals
from ..bucket import Bucket, device_type, pow2
from ..spec import OpSpec, Variant
from ._compiled import compiled_variant

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def reference(input, weight, bias=None):
    return originals.linear(input, weight, bias)


def key(input, weight, bias=None):
    try:
        return (input.shape, input.dtype, True if input.is_cpu else input.device, weight.shape,
                weight.dtype, None if bias is None else (bias.shape, bias.dtype))
    except AttributeError:
        return None


def bucket(input, weight, bias=None):
    ws, xs = weight.shape, input.shape
    dtype = input.dtype
    if (len(ws) != 2 or len(xs) == 0 or xs[-1] != ws[1]
            or dtype not in _FLOATS or weight.dtype != dtype):
        return None
    if bias is not None and (bias.dtype != dtype or bias.shape != ws[:1]):
        return None
    out_features, in_features = ws
    rows = input.numel() // in_features if in_features else 0
    if rows == 0 or out_features == 0:
        return None
    return (dtype, device_type(input), in_features, out_features, pow2(rows), int(bias is not None))


def example_inputs(b: Bucket, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n_in, n_out, rows = b.dim("in_features"), b.dim("out_features"), b.dim("rows")

    def t(*shape, scale=1.0):
        x = (scale * torch.randn(*shape, generator=g)).to(b.torch_dtype)
        return x.to(b.device).requires_grad_()

    args = (t(rows, n_in), t(n_out, n_in, scale=n_in ** -0.5))
    return args + ((t(n_out),) if b.dim("bias") else ()), {}


def matmul(input, weight, bias=None):
    """``input @ weight.T`` then a separate bias add."""
    out = input @ weight.t()
    return out + bias if bias is not None else out


def addmm(input, weight, bias=None):
    """Rows flattened to 2-D, one ``torch.addmm`` (GEMM with the bias folded in)."""
    flat = input.reshape(-1, input.shape[-1])
    out = torch.addmm(bias, flat, weight.t()) if bias is not None else torch.mm(flat, weight.t())
    return out.view(*input.shape[:-1], weight.shape[0])


SPEC = OpSpec(
    key=key,
    name="linear",
    reference=reference,
    bucket=bucket,
    dims=("in_features", "out_features", "rows", "bias"),
    example_inputs=example_inputs,
    description="affine map over the last dim (F.linear, nn.Linear)",
)

VARIANTS = [
    Variant("linear", "matmul", "eager", lambda c, b: matmul, description="x @ W.T + b"),
    Variant("linear", "addmm", "aten", lambda c, b: addmm,
            description="2-D torch.addmm / torch.mm"),
    compiled_variant("linear", matmul),
]


def cases(dtype: torch.dtype):
    """Named (args, kwargs) cases for tests: typical and edge shapes."""
    g = torch.Generator().manual_seed(1)

    def t(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    wide = torch.randn(6, 2 * 33, generator=g).to(dtype)
    w_t = torch.randn(33, 17, generator=g).to(dtype)
    return [
        ("bias", (t(8, 32), t(16, 32), t(16)), {}),
        ("3d_no_bias", (t(2, 5, 24), t(40, 24)), {}),
        ("one_row_odd", (t(1, 33), t(17, 33), t(17)), {}),
        ("1d_input", (t(33), t(7, 33), t(7)), {}),
        ("bias_kwarg_4d", (t(2, 3, 4, 12), t(9, 12)), {"bias": t(9)}),
        ("non_contiguous_input", (wide[:, ::2].requires_grad_(), t(17, 33), t(17)), {}),
        ("transposed_weight", (t(4, 33), w_t.t().requires_grad_()), {}),
        ("wide_out", (t(3, 64), t(300, 64), t(300)), {}),
    ]
