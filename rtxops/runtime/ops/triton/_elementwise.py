"""Shared launch plumbing of the elementwise kernels (swiglu, gelu, GeGLU): flat contiguous views,
one ``block``-wide tile per program."""
from __future__ import annotations

import torch

from ...bucket import Bucket
from ._common import cdiv

DEFAULT_BLOCK = 1024


def heuristic(bucket: Bucket | None = None) -> dict:
    """Elementwise tiles do not depend on the shape; the bucket is accepted for uniformity."""
    return {"block": DEFAULT_BLOCK, "num_warps": 4}


def flat(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Contiguous versions (copies only for non-contiguous inputs): the kernels index flat."""
    return [t.contiguous() for t in tensors]


def grid(n: int, config: dict) -> tuple[int]:
    return (cdiv(n, config["block"]),)
