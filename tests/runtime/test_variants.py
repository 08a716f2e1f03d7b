"""Every variant of every op against its reference: forward and gradients, on typical and edge cases."""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from rtxops.runtime.dispatcher import _layout
from rtxops.runtime.registry import OP_MODULES, default_registry
from rtxops.runtime.spec import REFERENCE

DTYPES = [torch.float32, torch.bfloat16]


def _params():
    registry = default_registry()
    for op in OP_MODULES:
        for variant in registry.variants(op):
            if variant.name == REFERENCE or "cpu" not in variant.devices:
                continue
            for dtype in DTYPES:
                if dtype in variant.dtypes:
                    yield pytest.param(op, variant.name, dtype, id=f"{op}-{variant.name}-{str(dtype)[6:]}")


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _clone_args(args, kwargs):
    def c(o):
        if isinstance(o, torch.Tensor):
            out = o.detach().clone()
            if o.stride() != out.stride():  # keep non-contiguous layouts non-contiguous
                out = torch.empty_strided(o.size(), o.stride(), dtype=o.dtype).copy_(o)
            return out.requires_grad_(o.requires_grad)
        if isinstance(o, tuple):
            return tuple(c(x) for x in o)
        return o
    return tuple(c(a) for a in args), {k: c(v) for k, v in kwargs.items()}


def _run(fn, args, kwargs, grad_seed: int):
    out = fn(*args, **kwargs)
    outs = [o for o in _tensors(out) if o.is_floating_point()]
    inputs = [t for t in _tensors(args) + _tensors(list(kwargs.values())) if t.requires_grad]
    grads = []
    if inputs and any(o.requires_grad for o in outs):
        g = torch.Generator().manual_seed(grad_seed)
        total = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs if o.requires_grad)
        grads = torch.autograd.grad(total, inputs, allow_unused=True)
    return outs, grads


@pytest.mark.parametrize("op,variant_name,dtype", list(_params()))
def test_variant_matches_reference(op, variant_name, dtype):
    registry = default_registry()
    spec = registry.op(op)
    variant = registry.variant(op, variant_name)
    module = importlib.import_module(f"rtxops.runtime.ops.{op}")
    cases = module.cases(dtype)
    if variant.family == "compiled":
        cases = cases[:2]  # each case is a fresh compile: keep the suite fast
    tol = spec.tolerance(dtype)
    gtol = spec.tolerance(dtype, grad=True)
    for name, args, kwargs in cases:
        key = spec.bucket(*args, **kwargs)
        assert key is not None, f"case {name} should be supported"
        bucket = spec.to_bucket(key)
        assert variant.supports(bucket)
        fn = variant.build(variant.default_config, bucket)
        ref_out, ref_grads = _run(spec.reference, *_clone_args(args, kwargs), grad_seed=7)
        out, grads = _run(fn, *_clone_args(args, kwargs), grad_seed=7)
        assert len(out) == len(ref_out), name
        for o, r in zip(out, ref_out):
            assert o.shape == r.shape and o.dtype == r.dtype, name
            # the first-call check compares layouts too (a job may .view() torch's output): a
            # variant answering in another layout would be disabled for the bucket
            assert _layout(o) == _layout(r), f"{name}: strides {o.stride()}, reference {r.stride()}"
            torch.testing.assert_close(o, r, atol=tol.atol, rtol=tol.rtol, msg=lambda m: f"{name}: {m}")
        assert len(grads) == len(ref_grads)
        for gv, gr in zip(grads, ref_grads):
            if gr is None:
                assert gv is None or not gv.any(), name
                continue
            torch.testing.assert_close(gv, gr, atol=gtol.atol, rtol=gtol.rtol,
                                       msg=lambda m: f"{name} grad: {m}")


@pytest.mark.parametrize("op", OP_MODULES)
def test_every_op_has_three_variants_besides_the_reference(op):
    variants = [v for v in default_registry().variants(op) if "cpu" in v.devices]
    assert REFERENCE in {v.name for v in variants}
    others = [v for v in variants if v.name != REFERENCE]
    assert len(others) >= 3 and len({v.family for v in others}) >= 2, [v.name for v in others]


@pytest.mark.parametrize("op", OP_MODULES)
def test_every_config_point_is_valid(op):
    for variant in default_registry().variants(op):
        for config in variant.configs():
            assert variant.check_config(config) is None


def _chunked_ce(logits, target):
    registry = default_registry()
    spec, variant = registry.op("cross_entropy"), registry.variant("cross_entropy", "chunked")
    bucket = spec.to_bucket(spec.bucket(logits, target))
    return variant.build({**variant.default_config, "chunk_rows": 4}, bucket)


def test_chunked_cross_entropy_lets_go_of_the_logits_once_backward_ran():
    """The variant kept the logits on its autograd node: anything holding the loss after
    backward (``losses.append(loss)``, ``total += loss``) held an N x vocab tensor a step."""
    import gc
    import weakref

    x, target = torch.randn(6, 7, requires_grad=True), torch.tensor([0, 3, -100, 5, 1, 6])
    chunked = _chunked_ce(x, target)
    kept = []
    for _ in range(3):
        logits = x * 2
        alive = weakref.ref(logits)
        loss = chunked(logits, target)
        del logits
        loss.backward()
        kept.append(loss)
        gc.collect()
        assert alive() is None


def test_chunked_cross_entropy_evaluates_under_inference_mode_and_no_grad():
    """Inference tensors have no version counter: the variant raised on one, so the dispatcher
    turned it off for the bucket, training calls included, for the rest of the job."""
    x, target = torch.randn(6, 7), torch.tensor([0, 3, -100, 5, 1, 6])
    chunked = _chunked_ce(x, target)
    want = torch.nn.functional.cross_entropy(x, target)
    with torch.inference_mode():
        torch.testing.assert_close(chunked(x.clone(), target), want)
    with torch.no_grad():
        out = chunked(x.clone().requires_grad_(), target)
    torch.testing.assert_close(out, want)
    assert out.grad_fn is None


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_chunked_cross_entropy_has_the_references_second_derivative(reduction, smoothing):
    """A gradient penalty (create_graph=True) through the chunked variant: its gradient, made in
    forward, was a constant to autograd, so the penalty's second-order term was silently 0."""
    registry = default_registry()
    spec = registry.op("cross_entropy")
    target = torch.tensor([0, 3, -100, 5, 1, 6])
    logits = torch.randn(6, 7)
    variant = registry.variant("cross_entropy", "chunked")
    bucket = spec.to_bucket(spec.bucket(logits, target, reduction=reduction, label_smoothing=smoothing))
    chunked = variant.build({**variant.default_config, "chunk_rows": 4}, bucket)

    def penalty_grad(fn):
        z = logits.clone().requires_grad_()
        loss = fn(z, target, reduction=reduction, label_smoothing=smoothing)
        weights = torch.linspace(-1, 1, loss.numel()).view_as(loss)
        gz, = torch.autograd.grad((loss * weights).sum(), z, create_graph=True)
        hz, = torch.autograd.grad(gz.pow(2).sum(), z)
        return gz.detach(), hz

    (g_ref, h_ref), (g, h) = penalty_grad(spec.reference), penalty_grad(chunked)
    torch.testing.assert_close(g, g_ref)
    torch.testing.assert_close(h, h_ref)
    assert h_ref.abs().max() > 0


@pytest.mark.parametrize("frozen", ["q", "k"])
def test_fused_rope_leaves_a_frozen_input_out_of_the_graph(frozen):
    """q and k stacked joined their graphs: with only q trained (LoRA on q and v), k's output
    required a gradient, and backward ran through k's path for nothing."""
    from rtxops.runtime.ops.rope import fused_qk, reference

    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    (q if frozen == "k" else k).requires_grad_(True)
    cos, sin = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    got, want = fused_qk(q, k, cos, sin), reference(q, k, cos, sin)
    assert [t.requires_grad for t in got] == [t.requires_grad for t in want]
    assert all(torch.allclose(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("op,call", [("softmax", lambda x: F.softmax(x, -1))])
def test_the_compiled_softmax_differentiates_twice_as_the_reference(op, call):
    """torch.compile's autograd has no double backward: a gradient penalty raised inside
    backward ("does not currently support double backward"), where no fallback reaches. The
    compiled softmax takes its gradient from its output, which differentiates again (the other
    compiled variants do not: see the README)."""
    from rtxops.runtime import patching
    from rtxops.runtime.plan import Plan

    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)

    def penalty():
        g, = torch.autograd.grad(call(x).pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(g.pow(2).sum(), x)[0], torch.autograd.grad(call(x).sum(), x)[0]

    want = penalty()
    d = patching.enable(plan=Plan(version=1, defaults={op: "compiled"}))
    try:
        got = penalty()
        assert not d.disabled   # the compiled variant ran: nothing fell back
    finally:
        patching.disable()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_chunked_elementwise_ops_answer_a_sliced_transposed_input_in_torchs_layout():
    """torch keeps the order of a sliced input's strides (dense in that order); the chunked
    variants answered such an input contiguous, and the first-call check then disabled them
    for every call of the bucket, contiguous ones too."""
    from rtxops.runtime.ops._chunked import over_elements

    for x in (torch.randn(512, 512)[::2].t(), torch.randn(8, 16, 32)[:, ::2].permute(2, 0, 1),
              torch.randn(1, 512).expand(256, 512).t(), torch.randn(512, 256).t()):
        got, want = over_elements(F.gelu, 4096, x), F.gelu(x)
        assert got.stride() == want.stride(), (x.stride(), got.stride(), want.stride())
        torch.testing.assert_close(got, want)


def _on_meta(args, kwargs):
    def to(o):
        if isinstance(o, torch.Tensor):
            return o.detach().to("meta")
        return tuple(to(x) for x in o) if isinstance(o, tuple) else o
    return tuple(to(a) for a in args), {k: to(v) for k, v in kwargs.items()}


@pytest.mark.parametrize("op", OP_MODULES)
def test_a_calls_key_tells_its_device_apart_and_equal_calls_share_one(op):
    """The keys hold a CPU tensor's device as True (``is_cpu``: no device object made per call):
    a meta tensor's call, all else equal, keys apart; equal calls on other tensors key alike."""
    spec = default_registry().op(op)
    module = importlib.import_module(f"rtxops.runtime.ops.{op}")
    for name, args, kwargs in module.cases(torch.float32):
        here = spec.call_key(*args, **kwargs)
        copy_args, copy_kwargs = _clone_args(args, kwargs)
        again = spec.call_key(*copy_args, **copy_kwargs)
        meta_args, meta_kwargs = _on_meta(args, kwargs)
        meta = spec.call_key(*meta_args, **meta_kwargs)
        assert here is not None and here == again and hash(here) == hash(again), name
        assert meta != here and torch.device("meta") in meta, name
        assert torch.device("cpu") not in here, name
