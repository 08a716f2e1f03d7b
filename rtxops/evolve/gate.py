"""The correctness gate: a candidate runs in a job only after it matched the reference on inputs of
the bucket's real shapes, forward and gradients.

The oracle is the reference computed in float64. A candidate passes where it is within the op's
tolerance of the oracle, or no further from it than twice the reference's own error in the bucket's
dtype (ATen's bf16/fp16 kernels are sometimes less accurate than an fp32-accumulating variant,
which must not fail for being better), both elementwise and over each whole tensor against its
size (``‖c − o‖ ≤ rtol·‖o‖``, so values all below the absolute tolerance are still checked).
Where the oracle is finite the candidate must be too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rtxops.runtime.bucket import Bucket
from rtxops.runtime.spec import OpSpec, Variant

REFERENCE_ERROR_FACTOR = 2.0
# the whole tensor's error, against its size, may be the op's rtol (4× passed a bf16 cross-entropy
# that dropped label_smoothing: its gradient 11 % off against 12 % allowed)
NORM_RTOL_FACTOR = 1.0
RULES = 3   # stored verdicts of other rules are not used (1 passed anything below atol, 2 4× rtol)


@dataclass(frozen=True)
class GateResult:
    passed: bool
    reason: str
    max_error: float | None = None
    # the check could not judge the kernel (memory ran out, no example inputs, the reference
    # failed): not stored as its verdict, asked again next time
    no_verdict: bool = False


def _out_of_memory(e: BaseException) -> bool:
    text = str(e).lower()
    return (isinstance(e, (MemoryError, torch.OutOfMemoryError))
            or "can't allocate memory" in text or "out of memory" in text)


def check(spec: OpSpec, variant: Variant, config: dict, bucket: Bucket, seed: int = 0) -> GateResult:
    """Run ``variant`` with ``config`` on ``bucket``'s example inputs against the reference."""
    try:
        args, kwargs = spec.example_inputs(bucket, seed)
    except Exception as e:
        return GateResult(False, f"no example inputs for {bucket}: {type(e).__name__}: {e}",
                          no_verdict=True)
    grad_seed = seed + 1
    oracle = _run(spec.reference, args, kwargs, torch.float64, grad_seed)
    if isinstance(oracle, Exception):  # a reference without float64 support: its own dtype
        oracle = _run(spec.reference, args, kwargs, None, grad_seed)
        if isinstance(oracle, Exception):
            return GateResult(False, f"the reference itself fails on {bucket}: {oracle}",
                              no_verdict=True)
    reference = _run(spec.reference, args, kwargs, None, grad_seed)
    if isinstance(reference, Exception):   # fine in float64 (the oracle), not in this dtype
        return GateResult(False, f"the reference itself fails on {bucket}: "
                                 f"{type(reference).__name__}: {reference}", no_verdict=True)
    try:
        fn = variant.build(dict(config), bucket)
    except Exception as e:
        return GateResult(False, f"build failed: {type(e).__name__}: {e}",
                          no_verdict=_out_of_memory(e))
    candidate = _run(fn, args, kwargs, None, grad_seed)
    if isinstance(candidate, Exception):
        return GateResult(False, f"raised {type(candidate).__name__}: {candidate}",
                          no_verdict=_out_of_memory(candidate))
    (c_out, c_grad), (o_out, o_grad), (r_out, _) = candidate, oracle, reference
    if len(c_out) != len(o_out):
        return GateResult(False, f"{len(c_out)} tensor outputs, the reference has {len(o_out)}")
    for i, (c, r) in enumerate(zip(c_out, r_out)):
        if c.dtype != r.dtype:
            return GateResult(False, f"output {i}: dtype {c.dtype}, the reference gives {r.dtype}")
    if len(c_grad) != len(o_grad) or any(c is None and o is not None for c, o in zip(c_grad, o_grad)):
        return GateResult(False, "no gradient where the reference has one (autograd is cut)")
    worst = 0.0
    for what, (c, o, r) in _pairs(candidate, oracle, reference):
        grad = what.startswith("grad")
        tol = spec.tolerance(bucket.torch_dtype, grad=grad)
        problem, err = _compare(c, o, r, tol)
        worst = max(worst, err)
        if problem:
            return GateResult(False, f"{what}: {problem}", err)
    return GateResult(True, "matches the reference", worst)


def _run(fn, args: tuple, kwargs: dict, dtype: torch.dtype | None, grad_seed: int):
    """Outputs and input gradients of ``fn`` on fresh copies of the inputs (cast to ``dtype``)."""
    try:
        a = [_fresh(x, dtype) for x in args]
        k = {n: _fresh(v, dtype) for n, v in kwargs.items()}
        out = fn(*a, **k)
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(t, torch.Tensor)]
        leaves = [x for x in [*a, *k.values()] if isinstance(x, torch.Tensor) and x.requires_grad]
        grads: list[Any] = []
        diff = [t for t in outs if t.requires_grad]
        if diff and leaves:
            g = torch.Generator().manual_seed(grad_seed)
            cotangents = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device, t.dtype)
                          for t in diff]
            grads = list(torch.autograd.grad(diff, leaves, cotangents, allow_unused=True))
        return [t.detach() for t in outs], grads
    except Exception as e:
        return e


def _fresh(x, dtype: torch.dtype | None):
    if not isinstance(x, torch.Tensor):
        return x
    y = x.detach().clone()
    if dtype is not None and y.is_floating_point():
        y = y.to(dtype)
    return y.requires_grad_(x.requires_grad)


def _pairs(candidate, oracle, reference):
    (c_out, c_grad), (o_out, o_grad), (r_out, r_grad) = candidate, oracle, reference
    for i, triple in enumerate(zip(c_out, o_out, r_out)):
        yield f"output {i}", triple
    for i, triple in enumerate(zip(c_grad, o_grad, r_grad)):
        yield f"grad of input {i}", triple


def _compare(c, o, r, tol) -> tuple[str | None, float]:
    if c is None or o is None:
        return (None if c is None and o is None else "gradient missing on one side"), 0.0
    if c.shape != o.shape:
        return f"shape {tuple(c.shape)} != reference {tuple(o.shape)}", float("inf")
    c64, o64 = c.double(), o.double()
    finite = torch.isfinite(o64)
    if not torch.isfinite(c64[finite]).all():
        return "NaN/Inf where the reference has none", float("inf")
    err = (c64 - o64).abs()[finite]
    worst = float(err.max()) if err.numel() else 0.0
    r64 = r.double() if r is not None else None
    # the whole tensor against its own size: an absolute tolerance passes anything where the
    # values are all below it (a mean-reduced loss's gradient, 1/rows each: a backward answering
    # zeros passed)
    relative = _relative_error(c64, o64, finite)
    ref_relative = _relative_error(r64, o64, finite) if r64 is not None else float("inf")
    if relative > NORM_RTOL_FACTOR * tol.rtol and not relative <= REFERENCE_ERROR_FACTOR * ref_relative:
        return (f"error {relative:.3g} of the tensor's size exceeds {NORM_RTOL_FACTOR:g}× rtol "
                f"{tol.rtol} and {REFERENCE_ERROR_FACTOR:g}× the reference's own "
                f"{ref_relative:.3g}"), worst
    if bool((err <= tol.atol + tol.rtol * o64.abs()[finite]).all()):
        return None, worst
    ref_err = (r64 - o64).abs()[finite] if r64 is not None else None
    # where the reference itself overflows (inf against a finite oracle) it allows nothing: an
    # infinite allowance would pass any candidate
    ref_err = ref_err[torch.isfinite(ref_err)] if ref_err is not None else None
    allowed = REFERENCE_ERROR_FACTOR * float(ref_err.max()) if ref_err is not None and ref_err.numel() else 0.0
    if worst <= allowed:
        return None, worst
    return (f"max error {worst:.3g} exceeds tolerance (atol {tol.atol}, rtol {tol.rtol}) and "
            f"{REFERENCE_ERROR_FACTOR:g}× the reference's own error {allowed / REFERENCE_ERROR_FACTOR:.3g}"), worst


def _relative_error(c64: torch.Tensor, o64: torch.Tensor, finite: torch.Tensor) -> float:
    """``‖c − o‖ / ‖o‖`` over the oracle's finite values (0 when both are zero, inf when only
    the oracle is, nan-free)."""
    diff = float(torch.linalg.vector_norm(c64[finite] - o64[finite]))
    size = float(torch.linalg.vector_norm(o64[finite]))
    if size == 0:
        return 0.0 if diff == 0 else float("inf")
    return diff / size if diff == diff else float("inf")
