"""attention (F.scaled_dot_product_attention) on (B, H, L, E) inputs:
``out = softmax(q @ k^T * scale + bias) @ v`` with ``scale = 1/sqrt(E)`` unless given, ``bias``
``-inf`` where a boolean mask is False or above the top-left diagonal when causal, or the float mask
itself. Rows with every key masked give zeros (torch's safe softmax)."""
from __future__ import annotations

import torch

from .. import originals
from ..bucket import Bucket, device_type, pow2
from ..spec import OpSpec, Variant
from ._compiled import compiled_variant
from ._layout import in_layout_of

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def reference(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    return originals.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p,
                                                  is_causal, scale=scale, enable_gqa=enable_gqa)


def key(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
        enable_gqa=False):   # scale, enable_gqa: keyword-only, as torch takes them
    try:
        mask = None if attn_mask is None else (attn_mask.shape, attn_mask.dtype)
        # the layouts too: torch's output follows the query's (a (B, L, H, E) view transposed
        # to (B, H, L, E) gets an output the job can .view() back), a variant's may not; each
        # layout's first call is checked for it
        return (query.shape, query.dtype, True if query.is_cpu else query.device, key.shape,
                key.dtype, value.shape, value.dtype, mask, dropout_p, is_causal, enable_gqa,
                query.stride(), key.stride(), value.stride())
    except AttributeError:
        return None


def bucket(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
           enable_gqa=False):
    if dropout_p != 0 or enable_gqa or type(is_causal) is not bool:
        return None
    qs, ks, vs = query.shape, key.shape, value.shape
    dtype = query.dtype
    if (len(qs) != 4 or ks != vs or dtype not in _FLOATS
            or key.dtype != dtype or value.dtype != dtype):
        return None
    batch, heads, seq_q, head_dim = qs
    if ks[0] != batch or ks[1] != heads or ks[3] != head_dim or query.numel() == 0 or ks[2] == 0:
        return None
    mask = 0
    if attn_mask is not None:
        if is_causal or not isinstance(attn_mask, torch.Tensor) or not 2 <= attn_mask.dim() <= 4:
            return None
        mask = 1 if attn_mask.dtype == torch.bool else 2 if attn_mask.dtype == dtype else 0
        if not mask:
            return None
    return (dtype, device_type(query), head_dim, pow2(seq_q), pow2(ks[2]), pow2(batch * heads),
            int(is_causal), mask)


def example_inputs(b: Bucket, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dim, seq_q, seq_kv, rows = b.dim("head_dim"), b.dim("seq_q"), b.dim("seq_kv"), b.dim("rows")

    def t(seq):
        x = torch.randn(1, rows, seq, dim, generator=g).to(b.torch_dtype)
        return x.to(b.device).requires_grad_()

    kwargs = {"is_causal": bool(b.dim("causal"))}
    if b.dim("mask") == 1:
        mask = torch.rand(seq_q, seq_kv, generator=g) > 0.3
        mask[:, 0] = True
        kwargs["attn_mask"] = mask.to(b.device)
    elif b.dim("mask") == 2:
        kwargs["attn_mask"] = torch.randn(seq_q, seq_kv, generator=g).to(b.torch_dtype).to(b.device)
    return (t(seq_q), t(seq_kv), t(seq_kv)), kwargs


def _scores(q, k, mask, is_causal, scale, row0):
    s = (q @ k.transpose(-2, -1)) * scale
    if is_causal:
        rows = torch.arange(row0, row0 + q.shape[-2], device=q.device)
        cols = torch.arange(k.shape[-2], device=q.device)
        s = s.masked_fill(cols > rows[:, None], float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    return s


def _safe_softmax(s, masked):
    if not masked:
        return torch.softmax(s, -1)
    dead = s.isneginf().all(-1, keepdim=True)
    return torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)


def math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
         enable_gqa=False):
    """Explicit fp32 softmax(q k^T * scale + bias) v over the whole (L, S) score matrix."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    s = _scores(query.float(), key.float(), attn_mask, is_causal, scale, 0)
    return in_layout_of(_safe_softmax(s, attn_mask is not None) @ value.float(), query, query.dtype)


def _build_chunked(config, b: Bucket):
    block = config["block_q"]

    def chunked(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
        seq_q = query.shape[-2]
        if seq_q <= block:
            return math(query, key, value, attn_mask, dropout_p, is_causal, scale)
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        k, v = key.float(), value.float()
        rows_of_mask = attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.shape[-2] != 1
        out = []
        for start in range(0, seq_q, block):
            mask = attn_mask[..., start:start + block, :] if rows_of_mask else attn_mask
            q = query[..., start:start + block, :].float()
            s = _scores(q, k, mask, is_causal, scale, start)
            out.append(_safe_softmax(s, attn_mask is not None) @ v)
        return in_layout_of(torch.cat(out, -2), query, query.dtype)

    return chunked


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def flash_cpu(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    """ATen's CPU flash kernel; a mask that needs its own gradient, or a 3-D one (torch takes its
    math backend there, whose backward has a derivative: a gradient penalty works through it),
    goes through ``math``."""
    if attn_mask is not None:
        if attn_mask.requires_grad or attn_mask.dim() == 3:
            return math(query, key, value, attn_mask, dropout_p, is_causal, scale)
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device) \
                .masked_fill(~attn_mask, float("-inf"))
    return _flash(query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]


SPEC = OpSpec(
    key=key,
    name="attention",
    reference=reference,
    bucket=bucket,
    dims=("head_dim", "seq_q", "seq_kv", "rows", "causal", "mask"),
    example_inputs=example_inputs,
    description="scaled dot product attention (F.scaled_dot_product_attention), no dropout",
)

VARIANTS = [
    Variant("attention", "math", "eager", lambda c, b: math,
            description="explicit fp32 softmax(QK^T*scale + mask)V"),
    Variant("attention", "chunked", "chunked", _build_chunked,
            config_space={"block_q": [64, 128, 256]},
            description="query blocks bound the (L, S) score matrix to (block_q, S)"),
    Variant("attention", "flash_cpu", "aten", lambda c, b: flash_cpu, devices=frozenset({"cpu"}),
            description="aten._scaled_dot_product_flash_attention_for_cpu"),
    compiled_variant("attention", math),
]


def cases(dtype: torch.dtype):
    """Named (args, kwargs) cases for tests: typical and edge shapes."""
    g = torch.Generator().manual_seed(1)

    def t(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    def qkv(batch, heads, seq_q, seq_kv, dim):
        return (t(batch, heads, seq_q, dim), t(batch, heads, seq_kv, dim),
                t(batch, heads, seq_kv, dim))

    bool_mask = torch.rand(7, 11, generator=g) > 0.4
    bool_mask[:, 3] = True
    holes = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    holes[1, 0, 2] = False
    float_mask = torch.randn(2, 1, 5, 9, generator=g).to(dtype)
    bshd = [torch.randn(2, 10, 3, 16, generator=g).to(dtype) for _ in range(3)]
    return [
        ("basic", qkv(2, 4, 16, 16, 32), {}),
        ("causal", qkv(1, 2, 12, 12, 16), {"is_causal": True}),
        ("one_query", qkv(2, 3, 1, 9, 64), {}),
        ("odd_sizes", qkv(1, 3, 7, 11, 24), {}),
        ("causal_rectangular", qkv(1, 2, 5, 9, 8), {"is_causal": True}),
        ("bool_mask_2d", qkv(2, 2, 7, 11, 16), {"attn_mask": bool_mask}),
        ("bool_mask_fully_masked_row", qkv(2, 2, 6, 6, 8), {"attn_mask": holes}),
        ("float_mask_4d", qkv(2, 3, 5, 9, 16), {"attn_mask": float_mask}),
        ("float_mask_3d", qkv(1, 2, 4, 6, 8),
         {"attn_mask": torch.randn(2, 4, 6, generator=g).to(dtype)}),
        ("float_mask_needs_grad", qkv(1, 2, 5, 5, 8), {"attn_mask": t(5, 5)}),
        ("scale", qkv(1, 2, 6, 6, 16), {"scale": 0.3}),
        ("non_contiguous", tuple(x.transpose(1, 2).requires_grad_() for x in bshd), {}),
        ("long_float_mask", qkv(1, 2, 150, 150, 16),
         {"attn_mask": torch.randn(1, 1, 150, 150, generator=g).to(dtype)}),
        ("long_causal", qkv(1, 1, 140, 160, 8), {"is_causal": True}),
    ]
