"""rope (Hugging Face ``apply_rotary_pos_emb``): with ``c, s = cos, sin`` unsqueezed at
``unsqueeze_dim``, ``x_embed = x * c + rotate_half(x) * s`` for ``x`` in ``(q, k)``, where
``rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])``. Equivalently, on the halves ``x1, x2``:
``(x1 * c1 - x2 * s1, x2 * c2 + x1 * s2)``."""
from __future__ import annotations

import torch

from ..bucket import Bucket, device_type, pow2
from ..spec import OpSpec, Variant
from ._compiled import compiled_variant
from ._layout import in_layout_of
from .triton import variants as triton_variants

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def key(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    try:
        # with the layouts: the output follows q's and k's (often transposed views), and each
        # layout's first call is checked for it
        return (q.shape, q.dtype, True if q.is_cpu else q.device, k.shape, k.dtype, cos.shape,
                cos.dtype, sin.shape, sin.dtype, unsqueeze_dim, q.stride(), k.stride())
    except AttributeError:
        return None


def bucket(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
        return None
    qs, ks, cs = q.shape, k.shape, cos.shape
    dtype = q.dtype
    if (
        len(qs) != 4 or len(ks) != 4 or len(cs) != 3 or sin.shape != cs
        or dtype not in _FLOATS or k.dtype != dtype or cos.dtype != dtype or sin.dtype != dtype
        or type(unsqueeze_dim) is not int or unsqueeze_dim not in (1, 2)
    ):
        return None
    batch, head_dim = qs[0], qs[3]
    seq, heads = (qs[2], qs[1]) if unsqueeze_dim == 1 else (qs[1], qs[2])
    if (
        head_dim == 0 or head_dim % 2 or ks[3] != head_dim or cs[2] != head_dim
        or ks[0] != batch or ks[3 - unsqueeze_dim] != seq or cs[1] != seq
        or cs[0] not in (1, batch) or seq == 0 or batch * heads == 0 or ks[unsqueeze_dim] == 0
    ):
        return None
    return (dtype, device_type(q), head_dim, pow2(seq), pow2(batch * heads), unsqueeze_dim,
            int(qs == ks))


def _cos_sin(seq, dim, dtype, device):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1)[None]
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def example_inputs(b: Bucket, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dim, seq, rows, layout = b.dim("head_dim"), b.dim("seq"), b.dim("rows"), b.dim("unsqueeze_dim")
    kv_rows = rows if b.dim("same_qk") else max(1, rows // 2)

    def t(heads):
        shape = (1, heads, seq, dim) if layout == 1 else (1, seq, heads, dim)
        return torch.randn(shape, generator=g).to(b.torch_dtype).to(b.device).requires_grad_()

    cos, sin = _cos_sin(seq, dim, b.torch_dtype, b.device)
    return (t(rows), t(kv_rows), cos, sin), {"unsqueeze_dim": layout}


def halves(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Rotation written on the two halves, no rotate_half temporary."""
    half = q.shape[-1] // 2
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]

    def rotate(x):
        x1, x2 = x[..., :half], x[..., half:]
        return in_layout_of(torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1), x)

    return rotate(q), rotate(k)


def fused_qk(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """q and k stacked and rotated by one set of kernels when their shapes match (and both
    or neither need a gradient: stacked, a frozen k would take q's graph along)."""
    if q.shape != k.shape or q.requires_grad != k.requires_grad:
        return reference(q, k, cos, sin, position_ids, unsqueeze_dim)
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    x = torch.stack((q, k))
    out = x * cos + rotate_half(x) * sin
    return in_layout_of(out[0], q), in_layout_of(out[1], k)


def addcmul(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """``torch.addcmul(x * cos, rotate_half(x), sin)``: one fused multiply-add kernel."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (torch.addcmul(q * cos, rotate_half(q), sin),
            torch.addcmul(k * cos, rotate_half(k), sin))


SPEC = OpSpec(
    key=key,
    name="rope",
    reference=reference,
    bucket=bucket,
    dims=("head_dim", "seq", "rows", "unsqueeze_dim", "same_qk"),
    example_inputs=example_inputs,
    description="rotary position embedding on q and k (Hugging Face apply_rotary_pos_emb)",
)

VARIANTS = [
    Variant("rope", "halves", "eager", lambda c, b: halves,
            description="rotation on the two halves, no rotate_half temporary"),
    Variant("rope", "fused_qk", "fused", lambda c, b: fused_qk,
            description="q and k stacked into one tensor when shapes match"),
    Variant("rope", "addcmul", "aten", lambda c, b: addcmul, description="torch.addcmul"),
    compiled_variant("rope", reference),
] + triton_variants("rope")


def cases(dtype: torch.dtype):
    """Named (args, kwargs) cases for tests: typical and edge shapes."""
    g = torch.Generator().manual_seed(1)

    def t(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    def cs(seq, dim, batch=1, grad=False):
        cos, sin = _cos_sin(seq, dim, dtype, "cpu")
        cos, sin = cos.expand(batch, -1, -1).clone(), sin.expand(batch, -1, -1).clone()
        return cos.requires_grad_(grad), sin.requires_grad_(grad)

    wide = torch.randn(2, 6, 4, 2 * 16, generator=g).to(dtype)
    bshd = torch.randn(2, 6, 4, 16, generator=g).to(dtype)
    return [
        ("bhsd", (t(2, 4, 8, 16), t(2, 4, 8, 16), *cs(8, 16)), {}),
        ("bshd_unsqueeze2", (t(2, 8, 4, 16), t(2, 8, 4, 16), *cs(8, 16, batch=2)),
         {"unsqueeze_dim": 2}),
        ("gqa_fewer_k_heads", (t(1, 8, 5, 32), t(1, 2, 5, 32), *cs(5, 32)), {}),
        ("gqa_unsqueeze2", (t(2, 5, 6, 8), t(2, 5, 3, 8), *cs(5, 8)), {"unsqueeze_dim": 2}),
        ("one_token", (t(3, 2, 1, 64), t(3, 2, 1, 64), *cs(1, 64)), {}),
        ("odd_sizes", (t(1, 3, 7, 10), t(1, 3, 7, 10), *cs(7, 10)), {"position_ids": None}),
        ("cos_sin_grad", (t(2, 3, 5, 12), t(2, 3, 5, 12), *cs(5, 12, batch=2, grad=True)), {}),
        ("position_ids", (t(1, 2, 6, 8), t(1, 2, 6, 8), *cs(6, 8)),
         {"position_ids": torch.arange(6)[None]}),
        ("non_contiguous_bhsd_from_bshd",
         (bshd.transpose(1, 2).requires_grad_(), wide[..., ::2].transpose(1, 2).requires_grad_(),
          *cs(6, 16)), {}),
    ]
