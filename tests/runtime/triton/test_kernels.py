"""Every Triton kernel against its op's reference on the op's own test cases (forward and
gradients, fp32 and bf16), under every config of its space, and across repeated trials."""
from __future__ import annotations

import importlib
import itertools
import random

import pytest
import torch

from rtxops.runtime.ops.triton import ops as triton_ops
from rtxops.runtime.registry import default_registry

from .compare import assert_matches, build_for, clone_args, run, tensors, triton_variant

DTYPES = [torch.float32, torch.bfloat16]
MAX_ELEMS = 4096  # the interpreter runs programs one by one in Python: keep cases tiny
MAX_CONFIGS = 24  # larger spaces are tested on a fixed sample (plus the default config)


def small_cases(op: str, dtype: torch.dtype) -> list:
    cases = importlib.import_module(f"rtxops.runtime.ops.{op}").cases(dtype)
    small = [c for c in cases if max(t.numel() for t in _tensors(c)) <= MAX_ELEMS]
    assert len(small) >= 3, f"{op}: too few small cases"
    return small


def _tensors(case) -> list[torch.Tensor]:
    _, args, kwargs = case
    return [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]


def sample_configs(op: str) -> list[dict]:
    variant = triton_variant(op)
    configs = list(variant.configs())
    if len(configs) <= MAX_CONFIGS:
        return configs
    rng = random.Random(op)
    return [variant.default_config] + rng.sample(configs, MAX_CONFIGS - 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("op", triton_ops())
def test_kernel_matches_reference_on_every_case(op, dtype):
    spec = default_registry().op(op)
    for name, args, kwargs in small_cases(op, dtype):
        assert_matches(spec, build_for(op, args, kwargs), args, kwargs, name)


@pytest.mark.parametrize("op", triton_ops())
def test_every_config_gives_the_reference_result(op):
    spec = default_registry().op(op)
    name, args, kwargs = small_cases(op, torch.float32)[0]
    for config in sample_configs(op):
        assert_matches(spec, build_for(op, args, kwargs, config), args, kwargs, f"{name} {config}")


@pytest.mark.parametrize("op", triton_ops())
def test_repeated_trials_give_identical_results_and_leave_inputs_alone(op):
    name, args, kwargs = small_cases(op, torch.bfloat16)[0]
    fn = build_for(op, args, kwargs)
    args, kwargs = clone_args(args, kwargs)
    before = [t.detach().clone() for t in _tensors((name, args, kwargs))]
    first = run(fn, args, kwargs)
    for _ in range(2):
        again = run(fn, args, kwargs)
        for a, b in zip(itertools.chain(*first), itertools.chain(*again)):
            assert torch.equal(a, b), name
    for t, b in zip(_tensors((name, args, kwargs)), before):
        assert torch.equal(t.detach(), b), f"{name}: an input was modified"


def _second_order(fn, args, kwargs):
    """Gradients of a gradient penalty: d/d(inputs) of the squared gradients of a random
    projection of ``fn``'s outputs, taken with create_graph (as WGAN-GP does)."""
    args, kwargs = clone_args(args, kwargs)
    out = [o for o in tensors(fn(*args, **kwargs)) if o.is_floating_point() and o.requires_grad]
    inputs = [t for t in tensors(args) + tensors(list(kwargs.values())) if t.requires_grad]
    g = torch.Generator().manual_seed(3)
    total = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in out)
    first = torch.autograd.grad(total, inputs, create_graph=True, allow_unused=True)
    penalty = sum((f.float() ** 2).sum() for f in first if f is not None and f.requires_grad)
    if not torch.is_tensor(penalty):
        return [None] * len(inputs)
    return torch.autograd.grad(penalty, inputs, allow_unused=True)


@pytest.mark.parametrize("op", triton_ops())
def test_gradients_of_gradients_match_the_reference(op):
    """A kernel backward wrote its gradient into a buffer that autograd took as a constant: a
    gradient penalty through a Triton variant silently lost its second-order terms."""
    spec = default_registry().op(op)
    compared = 0
    for name, args, kwargs in small_cases(op, torch.float32):
        if compared == 2:
            break
        want = _second_order(spec.reference, args, kwargs)
        if not any(w is not None and w.abs().max() > 0 for w in want):
            continue   # linear in its inputs (rope without trig gradients): nothing to lose
        compared += 1
        got = _second_order(build_for(op, args, kwargs), args, kwargs)
        for g, w in zip(got, want):
            if w is None:
                assert g is None or not g.any(), name
                continue
            assert g is not None, f"{op} {name}: a second-order gradient is missing"
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"{op} {name}: {m}")
    assert compared, f"{op}: no case has second-order terms"


@pytest.mark.parametrize("op", triton_ops())
def test_a_retained_graph_runs_backward_twice_with_the_same_gradients(op):
    name, args, kwargs = small_cases(op, torch.float32)[0]
    fn = build_for(op, args, kwargs)
    args, kwargs = clone_args(args, kwargs)
    inputs = [t for t in tensors(args) + tensors(list(kwargs.values())) if t.requires_grad]
    total = sum(o.float().sum() for o in tensors(fn(*args, **kwargs)) if o.requires_grad)
    first = torch.autograd.grad(total, inputs, retain_graph=True, allow_unused=True)
    again = torch.autograd.grad(total, inputs, allow_unused=True)
    for a, b in zip(first, again):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, msg=lambda m: f"{op} {name}: {m}")


@pytest.mark.parametrize("op", triton_ops())
def test_outputs_keep_torchs_layout_and_can_be_changed_in_place(op):
    """Outputs that were views made inside the autograd.Function could not be changed in place
    (torch's can); an elementwise output on a channels-last or transposed input came back
    contiguous (torch keeps the input's layout; the job may .view() it)."""
    spec = default_registry().op(op)
    for name, args, kwargs in small_cases(op, torch.float32):
        ref = [o for o in tensors(spec.reference(*clone_args(args, kwargs)[0], **kwargs))]
        a, k = clone_args(args, kwargs)
        out = tensors(build_for(op, args, kwargs)(*a, **k))
        for o, r in zip(out, ref):
            strides = [s for s, n in zip(o.stride(), o.shape) if n > 1]
            assert strides == [s for s, n in zip(r.stride(), r.shape) if n > 1], (op, name)
        if op == "softmax":
            continue   # torch's own softmax output cannot be changed in place and backpropagated
        out[0].mul_(2)
        sum(o.float().sum() for o in out if o.requires_grad).backward()
