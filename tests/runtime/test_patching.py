"""enable()/disable(): what gets patched, and that torch is untouched afterwards."""
from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rtxops.runtime import originals, patching
from rtxops.runtime.dispatcher import ModuleSite
from rtxops.runtime.registry import load_builtin
from rtxops.runtime.spec import Variant

from .helpers import GeluGatedMLP, LlamaMLP, TinyNet, TinyRMSNorm, bucket_id, plan_for, train_losses


def test_enable_disable_round_trip_restores_torch_exactly():
    before = {name: getattr(F, name) for name in originals.PATCHABLE}
    init_subclass = nn.Module.__dict__.get("__init_subclass__")
    forward, linear_forward = TinyRMSNorm.forward, nn.Linear.forward
    torch.manual_seed(0)
    plain = train_losses(TinyNet())

    patching.enable()
    assert all(getattr(F, n) is not before[n] for n in originals.PATCHABLE)
    assert TinyRMSNorm.forward is not forward
    torch.manual_seed(0)
    routed = train_losses(TinyNet())
    patching.disable()

    assert {name: getattr(F, name) for name in originals.PATCHABLE} == before
    assert nn.Module.__dict__.get("__init_subclass__") is init_subclass
    assert TinyRMSNorm.forward is forward
    assert nn.Linear.forward is linear_forward
    torch.manual_seed(0)
    assert train_losses(TinyNet()) == plain
    assert routed == plain  # the default plan runs every reference: bit-identical


def test_suspended_puts_torch_back_for_a_while_and_keeps_the_dispatcher():
    before = {name: getattr(F, name) for name in originals.PATCHABLE}
    forward = TinyRMSNorm.forward
    with patching.suspended():   # not enabled: nothing to put back
        assert {name: getattr(F, name) for name in originals.PATCHABLE} == before
    d = patching.enable()
    wrappers = {name: getattr(F, name) for name in originals.PATCHABLE}
    train_losses(TinyNet(), steps=1)
    calls, steps = sum(d.readings.calls), d.readings.steps
    assert calls > 0 and steps == 1
    with patching.suspended():
        with patching.suspended():   # nested: the outer one puts the wrappers back
            pass
        assert {name: getattr(F, name) for name in originals.PATCHABLE} == before
        assert TinyRMSNorm.forward is forward
        train_losses(TinyNet(), steps=2)
    # no call routed or counted meanwhile; the step hook stayed
    assert sum(d.readings.calls) == calls and d.readings.steps == steps + 2
    assert {name: getattr(F, name) for name in originals.PATCHABLE} == wrappers
    assert TinyRMSNorm.forward is not forward
    train_losses(TinyNet(), steps=1)
    assert sum(d.readings.calls) > calls


def test_default_plan_is_bit_identical_per_op():
    x = torch.randn(4, 7, 16)
    w = torch.randn(16)
    calls = [
        lambda: F.rms_norm(x, [16], w, 1e-6),
        lambda: F.layer_norm(x, [16], w, w),
        lambda: F.softmax(x, -1),
        lambda: F.gelu(x, approximate="tanh"),
        lambda: F.silu(x),
        lambda: F.linear(x, torch.ones(5, 16), torch.ones(5)),
        lambda: F.scaled_dot_product_attention(x[None], x[None], x[None], is_causal=True),
        lambda: F.cross_entropy(x[0], torch.tensor([1, 2, 3, 4, 5, 6, 0]), label_smoothing=0.1),
    ]
    expected = [c() for c in calls]
    patching.enable()
    for c, e in zip(calls, expected):
        assert torch.equal(c(), e)


def test_unsupported_calls_give_torchs_result_or_torchs_error():
    x = torch.randn(3, 5)
    patching.enable()
    torch.testing.assert_close(F.softmax(x, dim=0), originals.softmax(x, dim=0), rtol=0, atol=0)
    assert torch.equal(F.softmax(x, -1, dtype=torch.float64), originals.softmax(x, -1, dtype=torch.float64))
    assert torch.equal(F.gelu(torch.ones(0, 4)), originals.gelu(torch.ones(0, 4)))
    ints = torch.ones(3, 5, dtype=torch.int64)
    for bad in (lambda f: f(ints, -1), lambda f: f(x, 5)):
        with pytest.raises(Exception) as ours:
            bad(F.softmax)
        with pytest.raises(Exception) as theirs:
            bad(originals.softmax)
        assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)
    with pytest.raises(RuntimeError) as ours:
        F.linear(x, torch.ones(4, 4))
    with pytest.raises(RuntimeError) as theirs:
        originals.linear(x, torch.ones(4, 4))
    assert str(ours.value) == str(theirs.value)


def test_modules_defined_after_enable_are_patched_and_checked():
    d = patching.enable()

    class LateRMSNorm(TinyRMSNorm):
        def forward(self, x):  # same math, own forward
            return super().forward(x)

    class GemmaStyleRMSNorm(nn.Module):  # (1 + weight): not what rms_norm computes
        def __init__(self, dim):
            super().__init__()
            self.weight = nn.Parameter(torch.full((dim,), 0.5))
            self.eps = 1e-6

        def forward(self, x):
            x32 = x.float()
            out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (out * (1.0 + self.weight.float())).to(x.dtype)

    late, gemma = LateRMSNorm(8), GemmaStyleRMSNorm(8)
    x = torch.randn(3, 8)
    assert isinstance(d.site_named(f"module:{__name__}.{LateRMSNorm.__qualname__}"), ModuleSite)
    patched = GemmaStyleRMSNorm.__dict__["forward"]
    assert hasattr(patched, "__wrapped__"), "a class defined after enable() is patched too"
    assert torch.equal(late(x), TinyRMSNorm.forward.__wrapped__(late, x))
    # on the default plan an RMSNorm class runs its own forward, whatever its math
    assert torch.equal(gemma(x), patched.__wrapped__(gemma, x))


def test_mismatching_module_class_goes_back_to_its_own_forward():
    own_forward = GeluGatedMLP.forward
    d = patching.enable()
    d.set_reroute_partial(True)
    assert GeluGatedMLP.forward is not own_forward
    m = GeluGatedMLP()
    x = torch.randn(4, 8)
    expected = own_forward(m, x)
    assert torch.equal(m(x), expected)
    site = d.site_named(f"module:{GeluGatedMLP.__module__}.{GeluGatedMLP.__qualname__}")
    assert site.failed and "max abs difference" in site.failed
    assert GeluGatedMLP.forward is own_forward  # for good
    assert torch.equal(m(x), expected)


def test_a_variant_that_fails_to_build_leaves_a_class_its_own_forward_if_it_differs():
    """On a build failure the class got the op's math without the check against its forward:
    a gated MLP that is no swiglu gave other values on every call."""
    from rtxops.runtime.plan import Plan

    def unbuildable(config, bucket):   # a Triton kernel on a machine whose triton fails, say
        raise ImportError("no triton here")

    registry = load_builtin()
    registry.add_variant(Variant("swiglu", "broken", "triton", unbuildable))
    own_forward = GeluGatedMLP.forward
    torch.manual_seed(0)
    m, x = GeluGatedMLP(), torch.randn(4, 8)
    expected = own_forward(m, x)
    d = patching.enable(registry=registry, plan=Plan(version=1, defaults={"swiglu": "broken"}))
    assert all(torch.equal(m(x), expected) for _ in range(3))
    assert d.site_named(f"module:{GeluGatedMLP.__module__}.{GeluGatedMLP.__qualname__}").failed


class OffsetRMSNorm(nn.Module):
    """gemma_pytorch's: whether the weight has a unit offset is chosen per instance."""

    def __init__(self, dim, eps=1e-6, add_unit_offset=True):
        super().__init__()
        self.eps, self.add_unit_offset = eps, add_unit_offset
        self.weight = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        x = x.float()
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return out * (1 + self.weight if self.add_unit_offset else self.weight)


def test_instances_of_a_class_that_differ_in_their_settings_are_checked_apart():
    """The first call's check held for every instance of the class in that bucket: an instance
    with the unit offset ran the plain RMSNorm of the one checked before it."""
    from rtxops.runtime.plan import Plan

    torch.manual_seed(0)
    plain, offset = OffsetRMSNorm(16, add_unit_offset=False), OffsetRMSNorm(16)
    x = torch.randn(4, 16)
    want = OffsetRMSNorm.forward(offset, x)
    patching.enable(plan=Plan(version=1, defaults={"rms_norm": "eager"}))
    plain(x)
    plain(x)
    assert torch.allclose(offset(x), want) and torch.allclose(offset(x), want)


def test_gated_mlp_is_rerouted_through_swiglu():
    d = patching.enable()
    d.set_reroute_partial(True)
    m = LlamaMLP()
    x = torch.randn(4, 8)
    for _ in range(3):
        torch.testing.assert_close(m(x), LlamaMLP.forward.__wrapped__(m, x))
    stats = d.readings
    swiglu = [s for s in stats.slots if s.op == "swiglu"]
    assert swiglu and sum(stats.calls[s.id] for s in swiglu) == 3
    assert not d.site_named(f"module:{LlamaMLP.__module__}.{LlamaMLP.__qualname__}").failed


def test_rope_functions_in_loaded_modules_are_patched_and_restored():
    module = types.ModuleType("fake_llama_modeling")

    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    apply_rotary_pos_emb.__module__ = module.__name__
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    sys.modules[module.__name__] = module
    try:
        d = patching.enable()
        assert module.apply_rotary_pos_emb is not apply_rotary_pos_emb
        q = torch.randn(2, 4, 6, 8)
        cos, sin = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
        got = module.apply_rotary_pos_emb(q, q, cos, sin)
        want = apply_rotary_pos_emb(q, q, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert any(s.op == "rope" for s in d.readings.slots)
        patching.disable()
        assert module.apply_rotary_pos_emb is apply_rotary_pos_emb
    finally:
        del sys.modules[module.__name__]


def test_inside_torch_compile_the_wrapper_steps_aside():
    patching.enable()

    def f(x):
        return F.gelu(F.linear(x, torch.ones(4, 4)))

    x = torch.randn(2, 4)
    compiled = torch.compile(f, backend="eager", fullgraph=True)  # a graph break would raise
    torch.testing.assert_close(compiled(x), f(x))


class _ScriptableNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net, self.norm, self.mlp = TinyNet(dim=8, classes=8), TinyRMSNorm(8), LlamaMLP()
        self.ln, self.act, self.sm = nn.LayerNorm(8), nn.GELU(), nn.Softmax(-1)

    def forward(self, x):
        return self.sm(self.act(self.ln(self.mlp(self.norm(self.net(x))))))


def _layer_norm_gelu(x):
    return F.gelu(F.layer_norm(x, (8,)))


def test_torchscript_script_and_trace_work_on_routed_models():
    torch.manual_seed(0)
    model, x = _ScriptableNet(), torch.randn(4, 8)
    expected = model(x)
    d = patching.enable()
    wrapped = {n: getattr(F, n) for n in originals.PATCHABLE}
    forward = TinyRMSNorm.__dict__["forward"]
    torch.testing.assert_close(model(x), expected)  # routes exist before the scripting
    norm = nn.RMSNorm(8)
    small = [_layer_norm_gelu(x), norm(x)]
    calls = sum(d.readings.calls)

    scripted = torch.jit.script(model)
    torch.testing.assert_close(scripted(x), expected)
    torch.testing.assert_close(torch.jit.script(_layer_norm_gelu)(x), small[0])
    torch.testing.assert_close(torch.jit.script(norm)(x), small[1])
    with warnings.catch_warnings():
        # a trace through the wrappers warns about traced sizes
        warnings.simplefilter("error", torch.jit.TracerWarning)
        traced = torch.jit.trace(model, x)
    torch.testing.assert_close(traced(x), expected)
    assert sum(d.readings.calls) == calls, "scripting and tracing route nothing"
    assert not any(s.failed for s in d.sites if isinstance(s, ModuleSite))

    # routing is back in place afterwards
    assert {n: getattr(F, n) for n in originals.PATCHABLE} == wrapped
    assert TinyRMSNorm.__dict__["forward"] is forward
    torch.testing.assert_close(model(x), expected)
    assert sum(d.readings.calls) > calls
    patching.disable()
    assert torch.jit.script.__module__ == "torch.jit._script"


def test_an_untraced_entry_point_records_torchs_own_ops():
    patching.enable()
    x = torch.randn(4, 8)
    graph, _ = torch.jit._get_trace_graph(_layer_norm_gelu, (x,))  # torch.onnx's way in
    assert "aten::gelu" in str(graph) and "aten::layer_norm" in str(graph)


def test_a_class_put_back_for_good_while_scripting_stays_back():
    own_forward = GeluGatedMLP.forward
    d = patching.enable()
    site = d.site_named(f"module:{GeluGatedMLP.__module__}.{GeluGatedMLP.__qualname__}")
    assert GeluGatedMLP.forward is not own_forward
    with patching.suspended():  # another thread scripts a model meanwhile
        site.give_up("its first call failed its check")
    assert GeluGatedMLP.forward is own_forward


def test_fx_symbolic_trace_records_the_functions_by_their_names():
    """The graph calls ``torch.nn.functional.gelu`` as the model does (fx quantization's patterns
    compare targets with ``F.linear``); it runs routed while rtxops is on, as torch's after."""
    torch.manual_seed(0)
    model, x = _ScriptableNet(), torch.randn(4, 8)
    expected = model(x)
    d = patching.enable()
    torch.testing.assert_close(model(x), expected)

    class OwnTracer(torch.fx.Tracer):          # as Hugging Face's tracer: its own trace()
        def trace(self, root, concrete_args=None):
            return super().trace(root, concrete_args)

    graph_modules = (torch.fx.symbolic_trace(model), torch.fx.GraphModule(model, OwnTracer().trace(model)))
    for graph_module in graph_modules:
        targets = {n.target for n in graph_module.graph.nodes if n.op == "call_function"}
        assert F.gelu in targets and originals.original("gelu") not in targets
        assert "torch.nn.functional.gelu(" in graph_module.code
        torch.testing.assert_close(graph_module(x), expected)
    assert F.gelu is not originals.original("gelu") and not any(
        isinstance(s, ModuleSite) and s.failed for s in d.sites)
    patching.disable()
    torch.testing.assert_close(graph_modules[0](x), expected)
    assert torch.fx.Tracer.__dict__["trace"].__module__ == "torch.fx._symbolic_trace"


def test_a_trace_on_another_thread_leaves_the_jobs_thread_routed():
    """AOTAutograd's make_fx (inside every torch.compile, the --compile-model background compile
    among them) goes through fx's Tracer: it took every patch down process-wide, so the job's
    steps ran unrouted meanwhile and a checkpoint recomputed torch's op (CheckpointError)."""
    import threading

    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(16, 16), nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)

    def block(t):
        return lin2(F.gelu(lin1(t)))

    d = patching.enable(plan_for(1, ("gelu", bucket_id("gelu", torch.randn(8, 16)), "eager")))
    tracing, done = threading.Event(), threading.Event()

    def traced(t):      # a long trace: held until the job's thread is done
        tracing.set()
        done.wait(30)
        return F.gelu(t) * 2

    graphs = []
    tracer = threading.Thread(target=lambda: graphs.append(make_fx(traced)(torch.randn(2))))
    try:
        block(x)   # the first call, checked
        y = checkpoint(block, x, use_reentrant=False)
        tracer.start()
        assert tracing.wait(30)
        eager = next(s.id for s in d.readings.slots if s.op == "gelu" and s.variant == "eager")
        before = d.readings.calls[eager]
        assert getattr(F.gelu, "__rtxops_wrapper__", False)
        F.gelu(torch.randn(8, 16))
        assert d.readings.calls[eager] == before + 1   # still routed and recorded
        y.sum().backward()                             # the recompute took the same variant
        assert x.grad is not None
    finally:
        done.set()
        tracer.join(30)
        patching.disable()
    targets = {n.target for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.gelu.default in targets   # the trace saw torch's own op


def test_a_thread_left_unrouted_by_an_exception_routes_again():
    """A routed call reads one count of the threads in an unrouted scope (a thread-local read
    every call cost several µs with the caches cold): a scope ended by an exception sets it back,
    and meanwhile the thread's own calls ran unrouted."""
    from rtxops.runtime import dispatcher

    d = patching.enable()
    x = torch.randn(4, 8)
    F.gelu(x)
    slot = next(s.id for s in d.readings.slots if s.op == "gelu")
    before = d.readings.calls[slot]
    with pytest.raises(RuntimeError, match="the trace failed"):
        with dispatcher.unrouted_on_this_thread():
            assert dispatcher._unrouted_threads[0] == 1
            F.gelu(x)   # torch's own, not recorded
            raise RuntimeError("the trace failed")
    assert dispatcher._unrouted_threads[0] == 0 and d.readings.calls[slot] == before
    F.gelu(x)
    assert d.readings.calls[slot] == before + 1


class _HoldsFunctions(nn.Module):
    """Holds F functions taken before scripting or tracing (as nn.TransformerEncoderLayer does)."""

    def __init__(self):
        super().__init__()
        self.lin, self.act, self.act2, self.sm = nn.Linear(8, 8), F.gelu, F.silu, F.softmax

    def forward(self, x):
        return self.sm(self.act2(self.act(self.lin(x))), -1)


def test_functions_held_as_attributes_script_trace_and_compile():
    patching.enable()
    torch.manual_seed(0)
    model, x = _HoldsFunctions(), torch.randn(4, 8)
    layer = nn.TransformerEncoderLayer(8, 2, 16, activation="gelu").eval()
    src = torch.randn(3, 2, 8)
    expected, expected_layer = model(x), layer(src)
    torch.testing.assert_close(torch.jit.script(model)(x), expected)
    torch.testing.assert_close(torch.jit.script(layer)(src), expected_layer)
    torch.testing.assert_close(torch.fx.symbolic_trace(model)(x), expected)
    torch.testing.assert_close(torch.compile(model, backend="eager", fullgraph=True)(x), expected)


def test_inputs_the_op_keys_cannot_read_run_as_written():
    torch.manual_seed(0)
    mlp = LlamaMLP()
    q = torch.nested.nested_tensor([torch.randn(2, 3, 8), torch.randn(2, 5, 8)],
                                   layout=torch.jagged).transpose(1, 2)   # (batch, heads, jagged, dim)
    rows = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)])
    want_attention = F.scaled_dot_product_attention(q, q, q)
    want_mlp = mlp(rows)
    patching.enable()
    for got, want in ((F.scaled_dot_product_attention(q, q, q), want_attention), (mlp(rows), want_mlp)):
        for a, b in zip(got.unbind(), want.unbind()):
            assert torch.equal(a, b)


class _ZeroDownGeluMLP(nn.Module):
    """A gated-MLP layout whose forward is not swiglu, with a down projection that starts at zero
    (one first call cannot tell), and a side effect of its own."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        nn.init.zeros_(self.down_proj.weight)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))


def test_a_gated_mlp_runs_its_own_forward_unless_a_plan_routes_swiglu():
    torch.manual_seed(0)
    m, x = _ZeroDownGeluMLP(), torch.randn(4, 8)
    with torch.no_grad():
        m.down_proj.weight.normal_()        # trained: its forward is not swiglu
    want = _ZeroDownGeluMLP.forward(m, x)
    fresh = _ZeroDownGeluMLP()
    seen = []
    fresh.gate_proj.register_forward_hook(lambda *a: seen.append(1))
    d = patching.enable()
    site = d.site_named(f"module:{__name__}.{_ZeroDownGeluMLP.__qualname__}")
    opt = torch.optim.SGD(fresh.parameters(), lr=0.5)
    for _ in range(3):                      # the down projection leaves zero after a step
        fresh(x).sum().backward()
        opt.step()
    with torch.no_grad():
        fresh.load_state_dict(m.state_dict())
    assert torch.equal(fresh(x), want) and fresh.calls == 4 and len(seen) == 4
    assert not any(s.op == "swiglu" for s in d.readings.slots), "not rewritten, not timed"

    # a plan that routes swiglu (here: its reference) turns the rewrite on, checked per bucket
    bucket = bucket_id("swiglu", torch.randn(4, 16), torch.randn(4, 16))
    d.install_plan(plan_for(2, ("swiglu", bucket, "reference")))
    d.apply_pending()
    assert not site._dormant[0]
    d.install_plan(plan_for(3))
    d.apply_pending()
    assert site._dormant[0]


class _BiasedRMSNorm(nn.Module):
    """An RMSNorm with a bias that starts at zero (OLMo style): its first call looks like the op."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = 1e-5

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y + self.bias


class _OffsetRMSNorm(nn.Module):
    """Gemma style: scaled by ``1 + weight`` (weight starts at zero)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = 1e-5

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


def _train_norm(norm: _BiasedRMSNorm, steps: int = 4) -> tuple[list[float], torch.Tensor]:
    torch.manual_seed(0)
    head = nn.Linear(16, 4)
    opt = torch.optim.SGD([*norm.parameters(), *head.parameters()], lr=0.5)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        loss = F.cross_entropy(head(norm(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, norm.bias


class _NoEpsRMSNorm(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * self.weight


def test_an_rms_norm_classs_key_is_the_ops_key_of_its_split():
    """The key an RMSNorm class's call is routed by is the op's key of the op's arguments the
    split makes of it, and None wherever the split makes none (the call runs as written)."""
    from rtxops.runtime.ops import rms_norm
    from rtxops.runtime.patching import _rms_norm_key, _split_rms_norm

    norm, bf16 = TinyRMSNorm(8), TinyRMSNorm(8).to(torch.bfloat16)
    x = torch.randn(2, 3, 8)
    calls = [
        (norm, (x,), {}), (norm, (x.transpose(0, 1),), {}), (norm, (x[..., :4],), {}),
        (norm, (x.to(torch.bfloat16),), {}), (bf16, (x,), {}), (norm, (torch.randn(8),), {}),
        (norm, (torch.tensor(1.0),), {}), (norm, (), {}), (norm, (x, x), {}),
        (norm, (), {"x": x}), (norm, ([1.0] * 8,), {}), (_NoEpsRMSNorm(), (x,), {}),
        (TinyRMSNorm(4), (x,), {}), (nn.Module(), (x,), {}),
    ]
    keys = []
    for module, args, kwargs in calls:
        parts = _split_rms_norm(module, *args, **kwargs)
        want = None if parts is None else rms_norm.key(*parts[0])
        assert _rms_norm_key(module, *args, **kwargs) == want
        keys.append(want)
    assert sum(k is not None for k in keys) == 5 and len(set(keys)) == 6   # five keys and None


def _linears() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    plain, no_bias, lazy = nn.Linear(8, 4), nn.Linear(8, 4, bias=False), nn.LazyLinear(4)
    normed = torch.nn.utils.parametrizations.weight_norm(nn.Linear(8, 4))
    replaced = nn.Linear(8, 4)
    weight = replaced.weight.detach().clone().requires_grad_()
    del replaced.weight
    replaced.weight = weight            # a plain tensor attribute, as some wrappers leave it
    return {"plain": plain, "no bias": no_bias, "lazy": lazy, "weight norm": normed,
            "plain attribute": replaced}


def test_linear_layers_compute_as_torchs_own_and_plain_ones_route_through_f_linear():
    """While rtxops is on, ``nn.Linear`` reads its weight and bias from its parameter table
    (torch's forward reads them through ``Module.__getattr__``): every kind of linear layer
    computes what torch's own forward does, gradients included, and a plain one's call is
    routed (and counted) as ``F.linear``."""
    x = torch.randn(3, 8)

    def run(layers):
        out = {}
        for name, layer in layers.items():
            y = layer(x)
            y.sum().backward()
            out[name] = (y.detach(), [p.grad for p in layer.parameters()])
        return out

    want = run(_linears())
    d = patching.enable()
    try:
        got = run(_linears())
        counted = sum(d.readings.calls[s.id] for s in d.slots if s.site == "F.linear")
        looked_up = []
        getattr_of_modules = nn.Module.__getattr__

        def counting(module, name):
            looked_up.append(name)
            return getattr_of_modules(module, name)

        nn.Module.__getattr__ = counting
        try:
            layers = _linears()
            looked_up.clear()
            layers["plain"](x)
            plain = list(looked_up)
            layers["weight norm"](x)
        finally:
            nn.Module.__getattr__ = getattr_of_modules
    finally:
        patching.disable()
    for name, (y, grads) in want.items():
        assert torch.equal(got[name][0], y), name
        assert all(torch.equal(a, b) for a, b in zip(got[name][1], grads)), name
    assert counted == len(want)          # each layer's call routed once
    assert plain == [] and "bias" in looked_up   # the table for a plain one, torch's otherwise


class _LinearExplodingLater:
    """A linear variant whose first call (the checked one) is right and whose later calls raise."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input, weight, bias=None):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("linear kernel exploded")
        return torch.ops.aten.linear(input, weight, bias)


def test_a_linear_layers_routed_calls_are_each_counted_and_a_variant_failing_later_is_put_aside():
    """``nn.Linear`` routes its calls itself once ``F.linear``'s route is known: each call
    recorded as F.linear's; a variant that raises there is disabled and torch answers."""
    registry = load_builtin()
    registry.add_variant(Variant("linear", "explodes_later", "eager",
                                 lambda config, bucket: _LinearExplodingLater()))
    torch.manual_seed(0)
    layer, x = nn.Linear(8, 4), torch.randn(3, 8)
    want = torch.ops.aten.linear(x, layer.weight, layer.bias)
    d = patching.enable(registry=registry)
    try:
        for _ in range(3):
            torch.testing.assert_close(layer(x), want)
        counted = sum(d.readings.calls[s.id] for s in d.slots if s.site == "F.linear")
        d.install_plan(plan_for(2, ("linear", bucket_id("linear", x, layer.weight, layer.bias),
                                    "explodes_later")))
        d.apply_pending(at_once=True)
        for _ in range(3):
            torch.testing.assert_close(layer(x), want)
    finally:
        patching.disable()
    assert counted == 3
    (key, reason), = d.disabled.items()
    assert key[:2] == ("linear", "explodes_later") and "exploded" in reason


def test_a_linear_layer_calls_f_linear_as_it_stands_when_another_library_replaced_it():
    """Put in after rtxops, another library's ``F.linear`` takes nn.Linear's calls, as it
    does without rtxops (torch's forward calls ``F.linear`` as its module holds it)."""
    layer, x = nn.Linear(8, 4), torch.randn(3, 8)
    seen = []
    d = patching.enable()
    try:
        layer(x)   # the route is known: the layer would route the next call itself
        ours = F.linear

        def theirs(*args, **kwargs):
            seen.append(len(args))
            return ours(*args, **kwargs)

        F.linear = theirs
        try:
            got = layer(x)
        finally:
            F.linear = ours
        counted = sum(d.readings.calls[s.id] for s in d.slots if s.site == "F.linear")
    finally:
        patching.disable()
    assert seen == [3] and counted == 2
    torch.testing.assert_close(got, torch.ops.aten.linear(x, layer.weight, layer.bias))


def test_a_norm_class_with_a_parameter_the_op_does_not_take_is_not_rewritten():
    """Once a plan routed rms_norm, the class was rewritten as the bare op after its first call
    matched: its bias then never moved and never counted."""
    want_losses, want_bias = _train_norm(_BiasedRMSNorm())
    d = patching.enable()
    bucket = bucket_id("rms_norm", torch.randn(8, 16), (16,), torch.ones(16), 1e-5)
    d.install_plan(plan_for(2, ("rms_norm", bucket, "eager")))
    d.apply_pending(at_once=True)
    losses, bias = _train_norm(_BiasedRMSNorm())
    assert losses == pytest.approx(want_losses, rel=1e-5) and bias.abs().sum() > 0
    torch.testing.assert_close(bias, want_bias)
    site = d.site_named(f"module:{__name__}.{_BiasedRMSNorm.__qualname__}")
    assert site.failed and "holds 'bias'" in site.failed
    assert d.disabled == {}, "the variant is not at fault"


def test_a_norm_class_checked_on_zeros_stays_on_probation_until_it_can_differ():
    """A dummy forward on zeros matched (both sides 0) and the Gemma-style class was rewritten as
    rms_norm(x) * weight, which is 0 while its weight is."""
    d = patching.enable()
    bucket = bucket_id("rms_norm", torch.randn(8, 16), (16,), torch.ones(16), 1e-5)
    d.install_plan(plan_for(2, ("rms_norm", bucket, "eager")))
    d.apply_pending(at_once=True)
    norm, own = _OffsetRMSNorm(), _OffsetRMSNorm.forward.__wrapped__
    assert torch.equal(norm(torch.zeros(8, 16)), torch.zeros(8, 16))   # the dummy forward
    x = torch.randn(8, 16)
    torch.testing.assert_close(norm(x), own(norm, x))
    site = d.site_named(f"module:{__name__}.{_OffsetRMSNorm.__qualname__}")
    assert site.failed and "max abs difference" in site.failed
    assert d.disabled == {}, "the variant gives rms_norm's values: it stays"


def test_a_plain_mlp_named_like_a_gated_one_runs_each_layer_once():
    """w1, w2, w3 that do not fit gate/up/down: the split ran w1 (and failed on w3) before the
    class's own forward ran w1 again, on every call."""

    class PlainMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2, self.w3 = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)

        def forward(self, x):
            return self.w3(F.relu(self.w2(F.relu(self.w1(x)))))

    d = patching.enable()
    d.set_reroute_partial(True)
    m, calls = PlainMLP(), []
    m.w1.register_forward_hook(lambda *a: calls.append(1))
    for _ in range(3):
        m(torch.randn(4, 8))
    assert len(calls) == 3


def test_a_forward_held_from_before_stays_the_classs_own_once_put_back_or_disabled():
    """accelerate's hooks keep ``module._old_forward = module.forward``: through it, a class put
    back on its own forward was checked again on every call (its forward ran three times), and
    after disable() it still went through the wrapper."""
    d = patching.enable()
    d.set_reroute_partial(True)
    m = GeluGatedMLP()
    held = m.forward                      # the wrapper, bound
    seen = []
    m.gate_proj.register_forward_hook(lambda *a: seen.append(1))
    x = torch.randn(4, 8)
    held(x)                               # checked: not swiglu, put back for good
    seen.clear()
    for _ in range(3):
        held(x)
    assert len(seen) == 3, "one forward per call"
    assert len(d.readings.errors) <= 1
    patching.disable()
    seen.clear()
    held(x)
    assert len(seen) == 1


_MODE_IN_COMPILED_CODE = """
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from rtxops.runtime import patching

seen = []

class Spy(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))

def f(x):
    with Spy():
        return F.gelu(x) + 1

patching.enable()   # before anything asked torch which functions are overridable
torch.compile(f, backend="eager")(torch.randn(4, 8))
print("SEEN", sorted(set(seen)))
"""


def test_a_torch_function_mode_in_compiled_code_still_sees_the_routed_ops():
    """torch builds its table of overridable functions on first use; built while rtxops's
    wrappers stood in for torch's functions, dynamo dispatched no call of them to a mode."""
    import subprocess

    r = subprocess.run([sys.executable, "-c", _MODE_IN_COMPILED_CODE], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "'gelu'" in r.stdout.split("SEEN", 1)[1], r.stdout
