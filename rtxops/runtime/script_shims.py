"""TorchScript-compilable stand-ins for torch's C functions among the patched ones.

A model that stored a patched function before it was scripted (``self.act = F.gelu``) hands
TorchScript the dispatching wrapper, a Python function, which TorchScript compiles from source.
The wrappers of Python functions point it at torch's own source; these give the C ones a source
with torch's signature that calls the C function itself (a TorchScript builtin).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def gelu(input: Tensor, approximate: str = "none") -> Tensor:
    return torch._C._nn.gelu(input, approximate=approximate)


def linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    return torch._C._nn.linear(input, weight, bias)


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> Tensor:
    return torch._C._nn.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p,
                                                     is_causal, scale=scale, enable_gqa=enable_gqa)


SHIMS = {"gelu": gelu, "linear": linear, "scaled_dot_product_attention": scaled_dot_product_attention}
