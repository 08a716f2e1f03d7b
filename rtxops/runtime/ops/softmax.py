"""softmax over the last dim: ``y = exp(x - max(x)) / sum(exp(x - max(x)))``."""
from __future__ import annotations

import torch

from .. import originals
from ..bucket import Bucket, device_type, pow2
from ..spec import OpSpec, Variant
from ._chunked import over_rows
from ._compiled import compiled_saving_output
from .triton import variants as triton_variants
from ._layout import layout_key

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def reference(input, dim=None, _stacklevel=3, dtype=None):
    return originals.softmax(input, dim, _stacklevel, dtype)


def key(input, dim=None, _stacklevel=3, dtype=None):
    try:
        return (input.shape, input.dtype, True if input.is_cpu else input.device, dim, dtype,
                layout_key(input))
    except AttributeError:
        return None


def bucket(input, dim=None, _stacklevel=3, dtype=None):
    shape = input.shape
    ndim = len(shape)
    if (
        dtype is not None
        or type(dim) is not int
        or ndim == 0
        or (dim != -1 and dim != ndim - 1)
        or input.dtype not in _FLOATS
        or shape[-1] == 0
    ):
        return None
    cols = shape[-1]
    return (input.dtype, device_type(input), cols, pow2(input.numel() // cols))


def example_inputs(b: Bucket, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(b.dim("rows"), b.dim("cols"), generator=g)
    return (x.to(b.torch_dtype).to(b.device).requires_grad_(), -1), {}


def eager(input, dim=None, _stacklevel=3, dtype=None):
    """Max-subtracted exp over the sum, in fp32."""
    x = input.float().contiguous()   # torch's softmax answers a strided input contiguous
    # the shift is detached: its gradient is zero (softmax does not change under it), and amax
    # would save the input itself, which the job may change in place before backward (torch's
    # softmax saves only its output)
    e = (x - x.detach().amax(-1, keepdim=True)).exp()
    return (e / e.sum(-1, keepdim=True)).to(input.dtype)


def aten(input, dim=None, _stacklevel=3, dtype=None):
    """aten._softmax directly (no dim inference, no dtype handling)."""
    return torch.ops.aten._softmax(input, -1, False)


def logsumexp(input, dim=None, _stacklevel=3, dtype=None):
    """``exp(x - logsumexp(x))`` in fp32: no division."""
    x = input.float().contiguous()
    # logsumexp by hand around a detached shift: torch.logsumexp saves its input (see eager)
    m = x.detach().amax(-1, keepdim=True)
    lse = m + (x - m).exp().sum(-1, keepdim=True).log()
    return (x - lse).exp().to(input.dtype)


def _grad_from_output(y, grad):
    """The input's gradient from softmax's output, as torch's kernel has it (in fp32)."""
    y32, g32 = y.float(), grad.float()
    return (y32 * (g32 - (g32 * y32).sum(-1, keepdim=True))).to(y.dtype)


def _build_chunked(config, b: Bucket):
    rows = config["chunk_rows"]

    def chunked(input, dim=None, _stacklevel=3, dtype=None):
        return over_rows(eager, input, rows)

    return chunked


SPEC = OpSpec(
    key=key,
    name="softmax",
    reference=reference,
    bucket=bucket,
    dims=("cols", "rows"),
    example_inputs=example_inputs,
    description="softmax over the last dim (F.softmax with dim=-1, no dtype)",
)

VARIANTS = [
    Variant("softmax", "eager", "eager", lambda c, b: eager,
            description="fp32 max-subtracted hand-written math"),
    Variant("softmax", "aten", "aten", lambda c, b: aten, description="aten._softmax"),
    Variant("softmax", "logsumexp", "algebraic", lambda c, b: logsumexp,
            description="exp(x - logsumexp(x)) in fp32"),
    Variant("softmax", "chunked", "chunked", _build_chunked,
            config_space={"chunk_rows": [256, 1024, 4096]},
            description="row chunks bound the fp32 temporaries"),
    compiled_saving_output("softmax", eager, _grad_from_output),
] + triton_variants("softmax")


def cases(dtype: torch.dtype):
    """Named (args, kwargs) cases for tests: typical and edge shapes."""
    g = torch.Generator().manual_seed(1)

    def t(*shape, scale=2.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype).requires_grad_()

    wide = torch.randn(6, 2 * 65, generator=g).to(dtype)
    return [
        ("2d", (t(16, 64), -1), {}),
        ("3d_dim_kw", (t(2, 7, 48),), {"dim": 2}),
        ("one_row_odd_cols", (t(1, 65), -1), {}),
        ("4d_attention_scores", (t(2, 3, 5, 17), -1), {}),
        ("large_logits", (t(4, 32, scale=30.0), 1), {}),
        ("single_col", (t(5, 1), -1), {}),
        ("non_contiguous", (wide[:, ::2].requires_grad_(), -1), {}),
        ("many_rows", (t(600, 16), -1), {}),
    ]
