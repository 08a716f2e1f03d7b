"""Run a variant and the reference on cloned inputs and compare outputs and gradients."""
from __future__ import annotations

from typing import Any, Callable

import torch

from rtxops.runtime.registry import default_registry
from rtxops.runtime.spec import OpSpec


def tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors(o)]
    return []


def clone_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Fresh leaves with the same values, strides (non-contiguous stays so) and requires_grad."""
    def c(o):
        if isinstance(o, torch.Tensor):
            out = torch.empty_strided(o.size(), o.stride(), dtype=o.dtype, device=o.device)
            out.copy_(o.detach())
            return out.requires_grad_(o.requires_grad)
        if isinstance(o, tuple):
            return tuple(c(x) for x in o)
        return o
    return tuple(c(a) for a in args), {k: c(v) for k, v in kwargs.items()}


def run(fn: Callable, args: tuple, kwargs: dict, grad_seed: int = 7):
    """Outputs and the gradients of a random projection of them w.r.t. every input needing grad."""
    out = fn(*args, **kwargs)
    outs = [o for o in tensors(out) if o.is_floating_point()]
    inputs = [t for t in tensors(args) + tensors(list(kwargs.values())) if t.requires_grad]
    grads: tuple = ()
    if inputs and any(o.requires_grad for o in outs):
        g = torch.Generator().manual_seed(grad_seed)
        total = sum((o.float() * torch.randn(o.shape, generator=g).to(o.device)).sum()
                    for o in outs if o.requires_grad)
        grads = torch.autograd.grad(total, inputs, allow_unused=True)
    return outs, grads


def assert_matches(spec: OpSpec, fn: Callable, args: tuple, kwargs: dict, name: str,
                   reference: Callable | None = None, dtype: torch.dtype | None = None) -> None:
    """``fn`` agrees with the op's reference (forward and gradients) within the op's tolerances."""
    ref = reference or spec.reference
    dtype = dtype or tensors(args + tuple(kwargs.values()))[0].dtype
    tol, gtol = spec.tolerance(dtype), spec.tolerance(dtype, grad=True)
    ref_out, ref_grads = run(ref, *clone_args(args, kwargs))
    out, grads = run(fn, *clone_args(args, kwargs))
    assert len(out) == len(ref_out), name
    for o, r in zip(out, ref_out):
        assert o.shape == r.shape and o.dtype == r.dtype, (name, o.shape, r.shape, o.dtype, r.dtype)
        torch.testing.assert_close(o, r, atol=tol.atol, rtol=tol.rtol, equal_nan=True,
                                   msg=lambda m: f"{name}: {m}")
    assert len(grads) == len(ref_grads), name
    for gv, gr in zip(grads, ref_grads):
        if gr is None:
            assert gv is None or not gv.any(), name
            continue
        assert gv is not None, f"{name}: missing gradient"
        torch.testing.assert_close(gv, gr, atol=gtol.atol, rtol=gtol.rtol, equal_nan=True,
                                   msg=lambda m: f"{name} grad: {m}")
        # the whole tensor against its size too: a mean-reduced loss's gradient (1/rows each)
        # lies below atol, so the elementwise check passed a backward of zeros
        finite = torch.isfinite(gr)
        diff, size = (float(torch.linalg.vector_norm(t.double()[finite])) for t in (gv - gr, gr))
        assert diff <= gtol.rtol * size, f"{name} grad: error {diff / max(size, 1e-300):.3g} of its size > rtol {gtol.rtol}"


def triton_variant(op: str):
    return default_registry().variant(op, "triton")


def build_for(op: str, args: tuple, kwargs: dict, config: dict | None = None) -> Callable:
    """Build the op's Triton variant for the bucket of this call (default or given config)."""
    spec = default_registry().op(op)
    variant = triton_variant(op)
    key = spec.bucket(*args, **kwargs)
    assert key is not None, "call outside the op's buckets"
    bucket = spec.to_bucket(key)
    assert variant.supports(bucket)
    return variant.build({**variant.default_config, **(config or {})}, bucket)
