"""Triton kernels (forward + backward, one op per module with its autograd.Function) and their
registration as CUDA-only variants with tunable config spaces.

This module does not import triton: kernel modules are imported on the first build (see
``_variant``). Every tunable's first choice is ``"auto"``, the kernel module's heuristic for the
bucket, so a variant's default config works on any untuned bucket.
"""
from __future__ import annotations

from ._variant import AUTO, TritonVariant, triton_variant

WARPS = [AUTO, 1, 2, 4, 8, 16, 32]
ROWS_PER_PROGRAM = [AUTO, 1, 4, 16, 64, 256]
ELEMENTWISE_BLOCK = [AUTO, 256, 1024, 4096]

# op -> (kernel module, config space, description)
_TABLE: dict[str, tuple[str, dict[str, list], str]] = {
    "rms_norm": ("rms_norm", {"num_warps": WARPS, "rows_per_program": ROWS_PER_PROGRAM},
                 "Triton RMSNorm: one row per program; weight grad from per-program fp32 partials"),
    "cross_entropy": ("cross_entropy", {"block_v": [AUTO, 1024, 2048, 4096, 8192, 16384, 32768],
                                        "num_warps": WARPS, "num_stages": [AUTO, 1, 2, 3, 4]},
                      "Triton cross-entropy: online softmax over vocab tiles, gradient written in "
                      "the forward in the logits' dtype, no fp32 (rows, vocab) temporary"),
    "swiglu": ("swiglu", {"block": ELEMENTWISE_BLOCK, "num_warps": WARPS[:5]},
               "Triton silu(a) * b: elementwise, backward recomputes the sigmoid"),
    "gelu": ("gelu", {"block": ELEMENTWISE_BLOCK, "num_warps": WARPS[:5]},
             "Triton GELU (erf or tanh): elementwise, backward recomputes from the input"),
    "softmax": ("softmax", {"num_warps": WARPS},
                "Triton softmax: one row per program in one tile; backward from the saved output"),
    "layer_norm": ("layer_norm", {"num_warps": WARPS, "rows_per_program": ROWS_PER_PROGRAM},
                   "Triton LayerNorm: fp32 mean/rstd saved; weight and bias grads from "
                   "per-program fp32 partials"),
    "rope": ("rope", {"num_warps": WARPS[:5]},
             "Triton RoPE: one program per (batch, position) over all heads, strided (no layout "
             "copies), in-place safe"),
}


def ops() -> list[str]:
    """The ops that have a Triton variant."""
    return list(_TABLE)


def variants(op: str) -> list[TritonVariant]:
    """The Triton variants of ``op`` (empty when there is none)."""
    entry = _TABLE.get(op)
    if entry is None:
        return []
    module, space, description = entry
    return [triton_variant(op, module, {k: list(v) for k, v in space.items()}, description)]
