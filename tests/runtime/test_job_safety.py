"""The job never dies or changes its results because of rtxops: functions named like rope with
another signature, gated MLPs whose forward differs in train mode (dropout) or by rounding, inputs
whose values cannot be read (meta, vmap), autocast, pickling a model that holds an F function,
and spawned worker processes started under ``rtxops run``."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rtxops.runtime import originals, patching
from rtxops.runtime.dispatcher import Scoped
from rtxops.runtime.summary import summarize

from .helpers import LlamaMLP

BOOTSTRAP = Path(__file__).resolve().parents[2] / "rtxops" / "runtime" / "bootstrap"


def test_a_rope_named_function_of_another_signature_is_left_alone():
    module = types.ModuleType("gptj_like_modeling")

    def apply_rotary_pos_emb(tensor, sin, cos):  # GPT-J's order, three arguments
        return tensor * cos + tensor * sin

    apply_rotary_pos_emb.__module__ = module.__name__
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    sys.modules[module.__name__] = module
    try:
        patching.enable()
        assert module.apply_rotary_pos_emb is apply_rotary_pos_emb
        x = torch.randn(1, 5, 2, 8)
        assert torch.equal(module.apply_rotary_pos_emb(x, x, x), apply_rotary_pos_emb(x, x, x))
    finally:
        patching.disable()
        del sys.modules[module.__name__]


def test_a_routed_function_called_in_a_way_its_op_does_not_know_runs_as_written():
    module = types.ModuleType("odd_rope_modeling")

    def apply_rotary_pos_emb(q, k, cos, sin, *rest):
        return q * cos + k * sin + sum(rest)

    apply_rotary_pos_emb.__module__ = module.__name__
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    sys.modules[module.__name__] = module
    try:
        patching.enable()
        assert module.apply_rotary_pos_emb is not apply_rotary_pos_emb
        x = torch.randn(2, 3)
        # seven positional arguments: the op's key (q, k, cos, sin, position_ids, unsqueeze_dim)
        # cannot take them, the function can
        args = (x, x, x, x, 1, 2, 3)
        assert torch.equal(module.apply_rotary_pos_emb(*args), apply_rotary_pos_emb(*args))
    finally:
        patching.disable()
        del sys.modules[module.__name__]


class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class HandSiluMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        g = self.gate_proj(x)
        return self.down_proj(g * torch.sigmoid(g) * self.up_proj(x))


def test_a_gated_mlp_keeps_its_dropout_in_train_mode():
    torch.manual_seed(0)
    patching.enable().set_reroute_partial(True)
    try:
        m = DropoutMLP().eval()
        x = torch.randn(256, 8)
        with torch.no_grad():
            m(x)  # checked in eval mode first
            m.train()
            zeros = (m(x) == 0).float().mean().item()
        assert 0.4 < zeros < 0.6  # dropout still drops (the split route had none)
    finally:
        patching.disable()


def test_the_default_plan_gives_a_gated_mlp_its_own_values_bit_for_bit():
    torch.manual_seed(0)
    m, x = HandSiluMLP(), torch.randn(64, 8)
    own = [HandSiluMLP.forward(m, x) for _ in range(3)]
    patching.enable().set_reroute_partial(True)
    try:
        for want in own:
            assert torch.equal(m(x), want)
    finally:
        patching.disable()


def test_meta_and_vmapped_inputs_run_as_in_torch():
    m = nn.Sequential(DropoutMLP().eval(), nn.LayerNorm(8))
    patching.enable().set_reroute_partial(True)
    try:
        with torch.device("meta"):
            meta = DropoutMLP().eval()
        assert meta(torch.empty(4, 8, device="meta")).shape == (4, 8)
        batched = torch.func.vmap(m)(torch.randn(3, 4, 8))
        assert batched.shape == (3, 4, 8)
    finally:
        patching.disable()


def test_a_model_holding_an_f_function_can_be_saved_and_loaded_without_rtxops():
    patching.enable()
    try:
        layer = nn.TransformerEncoderLayer(16, 2, activation="gelu")
        holder = nn.Module()
        holder.act = F.silu
        buf = io.BytesIO()
        torch.save({"layer": layer, "holder": holder}, buf)
    finally:
        patching.disable()
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert loaded["holder"].act is F.silu  # the original, once rtxops is off
    assert loaded["layer"].activation is F.gelu


def test_spawned_dataloader_workers_never_overwrite_the_jobs_summary(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, torch.nn.functional as F
        from torch.utils.data import DataLoader, TensorDataset
        if __name__ == "__main__":
            lin = torch.nn.Linear(4, 4)
            opt = torch.optim.SGD(lin.parameters(), 0.1)
            data = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=16, num_workers=2,
                              multiprocessing_context="spawn")
            for (b,) in data:
                F.softmax(lin(b), -1).sum().backward()
                opt.step()
    """))
    summary = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTXOPS_")}
    env.update(RTXOPS_ENABLE="1", RTXOPS_SUMMARY=str(summary), RTXOPS_PLAN_POLL_S="not-a-number",
               PYTHONPATH=os.pathsep.join([str(BOOTSTRAP), str(BOOTSTRAP.parents[2])]))
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "RTXOPS_PLAN_POLL_S='not-a-number' is not a number of seconds" in r.stderr
    assert "runtime not enabled" not in r.stderr
    # the job's own summary, not one a worker wrote after it
    assert json.loads(summary.read_text())["steps"] == 4


def test_a_route_checked_outside_autocast_is_checked_again_inside_it():
    from rtxops.runtime.plan import Plan

    d = patching.enable()
    try:
        d.install_plan(Plan.from_dict({"version": 1, "defaults": {"linear": "matmul"}}))
        d.apply_pending()
        lin, x = nn.Linear(32, 32), torch.randn(8, 32)
        with torch.no_grad():
            lin(x)  # routed to matmul, checked in fp32
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = lin(x)
        assert y.dtype == torch.bfloat16  # as torch gives under autocast
    finally:
        patching.disable()


def test_per_call_cuda_memory_readings_are_off_unless_asked_for(tmp_path):
    # on by default they reset torch's peak counter before every routed CUDA call, which the
    # job's own max_memory_allocated() reports; the switch is read at start-up, and so is the
    # share of CUDA calls timed with events
    script = tmp_path / "probe.py"
    script.write_text("from rtxops.runtime import patching\nd = patching.active()\n"
                      "print('CALL_MEMORY', d.call_memory, 'TIME_EVERY', d.cuda_time_every)\n")
    for memory, every, want in ((None, None, "False TIME_EVERY 1"), ("1", "8", "True TIME_EVERY 8"),
                                (None, "zero", "False TIME_EVERY 1")):
        env = {k: v for k, v in os.environ.items() if not k.startswith("RTXOPS_")}
        env.update(RTXOPS_ENABLE="1", PYTHONPATH=os.pathsep.join([str(BOOTSTRAP), str(BOOTSTRAP.parents[2])]))
        if memory:
            env["RTXOPS_CALL_MEMORY"] = memory
        if every:
            env["RTXOPS_CUDA_TIME_EVERY"] = every
        r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
        assert f"CALL_MEMORY {want}" in r.stdout, r.stderr
        if every == "zero":
            assert "RTXOPS_CUDA_TIME_EVERY='zero' is not a whole number; every CUDA call is timed" in r.stderr


def test_a_first_call_inside_activation_checkpointing_saves_what_its_recomputation_saves():
    """The first call of a route is checked against the reference; the reference runs without
    autograd, so a non-reentrant checkpoint sees the same saved tensors when it recomputes."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    m, x = LlamaMLP().eval(), torch.randn(4, 8, requires_grad=True)
    LlamaMLP.forward(m, x).sum().backward()
    want = x.grad.clone()
    x.grad = None
    patching.enable().set_reroute_partial(True)
    try:
        m.train()                               # a bucket and mode not seen yet: a first call
        checkpoint(m, x, use_reentrant=False).sum().backward()
        torch.testing.assert_close(x.grad, want)
    finally:
        patching.disable()


@pytest.mark.parametrize("make", ["not swiglu", "holds more"])
def test_a_gated_mlp_put_back_on_its_first_call_inside_a_checkpoint_trains_as_without_rtxops(make):
    """The gate and up projections ran with autograd before the route was known; the class then
    went back on its own forward, which the recompute ran alone (CheckpointError)."""
    from torch.utils.checkpoint import checkpoint

    from rtxops.runtime.plan import Plan

    from .helpers import GeluGatedMLP

    class ScaledMLP(nn.Module):   # swiglu, and a parameter the op does not take
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(8, 16), nn.Linear(8, 16)
            self.down_proj = nn.Linear(16, 8)
            self.scale = nn.Parameter(torch.full((8,), 2.0))

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)) * self.scale

    def model():
        torch.manual_seed(0)
        return GeluGatedMLP() if make == "not swiglu" else ScaledMLP()

    x = torch.randn(4, 8, requires_grad=True)
    m = model()
    checkpoint(m, x, use_reentrant=False).sum().backward()
    want = x.grad.clone()
    x.grad = None
    patching.enable(Plan.from_dict({"version": 1, "defaults": {"swiglu": "eager"}}))
    try:
        m = model()
        checkpoint(m, x, use_reentrant=False).sum().backward()
        torch.testing.assert_close(x.grad, want)
    finally:
        patching.disable()


def test_a_gated_mlp_answered_by_its_own_forward_computes_its_projections_once():
    """A route on the class's own forward (outputs never readable: a zero-initialised down
    projection) ran after the wrapper had computed the gate and up projections for nothing."""
    from rtxops.runtime.plan import Plan

    torch.manual_seed(0)
    m = LlamaMLP()
    nn.init.zeros_(m.down_proj.weight)
    nn.init.zeros_(m.down_proj.bias)
    calls = [0]

    def count(module, args, out):
        calls[0] += 1

    for layer in (m.gate_proj, m.up_proj, m.down_proj):
        layer.register_forward_hook(count)
    patching.enable(Plan.from_dict({"version": 1, "defaults": {"swiglu": "eager"}}))
    try:
        for _ in range(20):   # unreadable first calls, then the class's own forward
            m(torch.randn(4, 8))
        calls[0] = 0
        m(torch.randn(4, 8))
        assert calls[0] == 3
    finally:
        patching.disable()


@pytest.mark.parametrize("plan", ["defaults", "explore"])
def test_routed_variants_inside_non_reentrant_checkpointing_train_as_without_rtxops(plan):
    """A non-reentrant checkpoint stops its recomputation early by raising from inside the
    last op it needs: that is the checkpoint's control flow, not a variant failing."""
    from torch.utils.checkpoint import checkpoint

    from rtxops.runtime.plan import ExploreArm

    from .helpers import TinyRMSNorm, bucket_id, plan_for

    torch.manual_seed(0)
    norm, lin, w = TinyRMSNorm(16), nn.Linear(16, 16), torch.randn(16, 16)
    xs = [torch.randn(8, 16, requires_grad=True) for _ in range(4)]

    def block(x):
        return F.gelu(norm(lin(x)) @ w)

    def grads() -> list[torch.Tensor]:
        out = []
        for x in xs:
            x.grad = None
            checkpoint(block, x, use_reentrant=False).sum().backward()
            out.append(x.grad.clone())
        return out

    want = grads()
    if plan == "defaults":
        routed = plan_for(1, defaults={"gelu": "eager", "rms_norm": "eager"})
    else:
        routed = plan_for(1, ("gelu", bucket_id("gelu", torch.randn(8, 16)), "reference", {},
                              [ExploreArm("eager", {}, 0.5)]))
    dispatcher = patching.enable(routed)
    try:
        for got, expected in zip(grads(), want):
            torch.testing.assert_close(got, expected)
        assert not dispatcher.disabled
    finally:
        patching.disable()


def test_a_plan_queued_during_an_optimizer_in_backward_step_swaps_in_after_that_backward():
    """Optimizers stepped from gradient hooks (PyTorch's "optimizer step in backward", torchtune's
    optimizer_in_bwd) fired the step boundary mid-backward: the queued plan swapped in there and
    a checkpoint recomputed later in that backward took the new variant (CheckpointError)."""
    from torch.utils.checkpoint import checkpoint

    from .helpers import bucket_id, plan_for

    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
                           for _ in range(2))
    optimizers = {p: torch.optim.SGD([p], lr=0.01) for p in blocks.parameters()}

    def step(p):
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in blocks.parameters():
        p.register_post_accumulate_grad_hook(step)
    d = patching.enable()
    try:
        for i in range(3):
            if i == 1:   # the daemon's plan arrives while a step runs
                d.install_plan(plan_for(2, ("gelu", bucket_id("gelu", torch.randn(8, 16)), "eager")))
            h = torch.randn(8, 16)
            for block in blocks:
                h = checkpoint(block, h, use_reentrant=False)
            h.sum().backward()
        assert d.plan.version == 2 and d.step == 3
        assert [s[:3] for s in d.readings.swaps] == [(2, 0, 2)]   # at the second step's end
    finally:
        patching.disable()


@pytest.mark.parametrize("op, extra", [("softmax", (-1,)), ("gelu", ()), ("silu", ()),
                                       ("layer_norm", ([8],)), ("rms_norm", ([8],))])
def test_a_non_contiguous_input_gets_the_layout_torch_gives_after_a_contiguous_one(op, extra):
    """A route is checked against torch on its first call; a view of another layout with the
    same shape is checked on its own (eager math keeps the input's layout, torch may not)."""
    from .helpers import plan_for

    original = getattr(F, op)
    plan = plan_for(1, defaults={op: "eager"})
    dispatcher = patching.enable(plan)
    try:
        routed = getattr(F, op)
        routed(torch.randn(16, 8), *extra)
        x = torch.randn(8, 16).t()                     # (16, 8), not contiguous
        got, want = routed(x, *extra), original(x, *extra)
        torch.testing.assert_close(got, want)
        assert got.stride() == want.stride()
        routed(torch.randn(16, 8), *extra)
        assert not dispatcher.disabled
    finally:
        patching.disable()


@pytest.mark.parametrize("variant", ["math", "chunked"])
def test_attention_on_transposed_views_after_contiguous_inputs_keeps_torchs_layout(variant):
    """The attention key held no layout: the route checked on contiguous q/k/v answered the usual
    (B, L, H, E)-transposed views in its own layout, and the job's .view() of it failed."""
    from .helpers import plan_for

    B, L, H, E = 2, 16, 4, 8
    dispatcher = patching.enable(plan_for(1, defaults={"attention": variant}))
    try:
        q, k, v = (torch.randn(B, H, L, E) for _ in range(3))
        F.scaled_dot_product_attention(q, k, v)
        x = torch.randn(B, L, 3, H, E)
        q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
        got = F.scaled_dot_product_attention(q, k, v)
        want = originals.scaled_dot_product_attention(q, k, v)
        torch.testing.assert_close(got, want)
        assert got.transpose(1, 2).view(B, L, H * E).shape == (B, L, H * E)
        # the variant answers in torch's layout, so it stays taken (it was disabled for the bucket)
        assert not dispatcher.disabled
        used = {s.variant for s, n in zip(dispatcher.slots, dispatcher.readings.calls) if n}
        assert variant in used
    finally:
        patching.disable()


def test_the_jobs_pythonpath_keeps_its_entries_in_order_and_gains_only_the_bootstrap():
    """rtxops' package root is not put on the job's PYTHONPATH: for an installed rtxops it is a
    whole site-packages, which stood before the job's own stdlib and packages (its torch too)."""
    from rtxops.runtime.bootstrap import DIRECTORY, child_environment

    root = str(BOOTSTRAP.parents[2])
    # an empty entry is the working directory: `export PYTHONPATH=$PYTHONPATH:/x` with none set
    env = child_environment({"PYTHONPATH": ":/opt/extra"})
    assert env["PYTHONPATH"].split(os.pathsep) == [DIRECTORY, "", "/opt/extra"]
    assert env["RTXOPS_PACKAGE_ROOT"] == root
    assert child_environment({})["PYTHONPATH"].split(os.pathsep) == [DIRECTORY]
    again = child_environment(env)  # a job started under rtxops starting another: no duplicates
    assert again["PYTHONPATH"] == env["PYTHONPATH"]


def test_a_python_that_cannot_import_rtxops_finds_it_after_its_own_packages(tmp_path):
    """The job's interpreter without rtxops installed: the bootstrap appends the package root
    to sys.path (last) and starts the runtime."""
    from rtxops.runtime.bootstrap import child_environment

    probe = textwrap.dedent("""
        import os, runpy, sys
        # this interpreter as if rtxops were not installed in it
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in str(getattr(f, "__module__", ""))]
        root = os.environ["RTXOPS_PACKAGE_ROOT"]
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != root]
        for name in [m for m in sys.modules if m == "rtxops" or m.startswith("rtxops.")]:
            del sys.modules[name]
        import importlib.util
        assert importlib.util.find_spec("rtxops") is None
        os.environ["RTXOPS_ENABLE"] = "1"
        runpy.run_path(sys.argv[1])
        import torch   # (the runtime starts with it)
        from rtxops.runtime import patching
        print("ACTIVE", patching.active() is not None, sys.path[-1] == root)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTXOPS_")}
    env = child_environment(env)
    env.update(RTXOPS_ENABLE="0", RTXOPS_TELEMETRY="off")   # this start-up's bootstrap stays off
    r = subprocess.run([sys.executable, "-c", probe, str(BOOTSTRAP / "sitecustomize.py")], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "ACTIVE True True" in r.stdout, r.stdout + r.stderr


def test_ranks_started_by_torch_multiprocessing_spawn_get_the_runtime_and_one_summary(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.nn.functional as F
        import torch.multiprocessing as mp

        def train(rank):
            lin = torch.nn.Linear(4, 4)
            opt = torch.optim.SGD(lin.parameters(), 0.1)
            for _ in range(3 + rank):
                F.softmax(lin(torch.randn(2, 4)), -1).sum().backward()
                opt.step()

        if __name__ == "__main__":
            mp.spawn(train, nprocs=2)
    """))
    summary = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTXOPS_")}
    env.update(RTXOPS_ENABLE="1", RTXOPS_SUMMARY=str(summary), RTXOPS_RUN_ID="run-1",
               PYTHONPATH=os.pathsep.join([str(BOOTSTRAP), str(BOOTSTRAP.parents[2])]))
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads(summary.read_text())
    # both ranks' calls, added up (the parent, which trained nothing, left no mark)
    assert data["processes"] == 2
    assert data["steps"] == 4   # the ranks step side by side: the furthest one's steps
    assert sum(s["calls"] for s in data["slots"] if s["op"] == "softmax") == 3 + 4
    assert not list(tmp_path.glob("*.part"))


def test_torch_compile_worker_processes_do_not_get_the_runtime(tmp_path):
    """Inductor's compile workers inherit the job's environment and PYTHONPATH; they train
    nothing, and a runtime there would poll the daemon and export under the job's rank."""
    (tmp_path / "marker.py").write_text(textwrap.dedent("""
        import os, pathlib
        def attach(dispatcher):
            pathlib.Path(os.environ["MARKS"], str(os.getpid())).touch()
    """))
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os
        from torch._inductor.async_compile import AsyncCompile
        if __name__ == "__main__":
            pool = AsyncCompile.process_pool()
            pool.submit(os.getpid).result(timeout=240)   # the worker is up and ran a task
            print(os.getpid())
    """))
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTXOPS_")}
    env.update(RTXOPS_ENABLE="1", RTXOPS_READINGS_FACTORY="marker:attach", MARKS=str(marks),
               TORCHINDUCTOR_COMPILE_THREADS="2", RTXOPS_PLAN_POLL_S="0",
               PYTHONPATH=os.pathsep.join([str(BOOTSTRAP), str(BOOTSTRAP.parents[2]), str(tmp_path)]))
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in marks.iterdir()) == [r.stdout.strip()]   # the job's alone


def test_a_first_call_under_torch_func_grad_leaves_an_autograd_function_variant_enabled():
    """The route's first call checks the variant without autograd (it passes), then runs it
    with autograd; under torch.func.grad that raised (no torch.func support) and the variant
    was disabled for the bucket, as if it computed the op wrong."""
    from .helpers import plan_for

    dispatcher = patching.enable(plan_for(1, defaults={"cross_entropy": "chunked"}))
    try:
        x, t = torch.randn(8, 50), torch.randint(0, 50, (8,))
        want = torch.func.grad(lambda z: originals.cross_entropy(z, t))(x)
        torch.testing.assert_close(torch.func.grad(lambda z: F.cross_entropy(z, t))(x), want)
        assert not dispatcher.disabled
        F.cross_entropy(x.clone().requires_grad_(), t).backward()
        slots = [s.id for s in dispatcher.slots if s.variant == "chunked"]
        assert sum(dispatcher.readings.calls[i] for i in slots) >= 1
    finally:
        patching.disable()


def test_torch_func_over_an_autograd_function_variant_leaves_it_enabled():
    """chunked cross_entropy is an autograd.Function without torch.func support: a job taking
    per-sample gradients with torch.func (vmap over grad) got them from the reference, but the
    variant was disabled for its bucket, and the job's ordinary training lost it for good."""
    from .helpers import plan_for

    dispatcher = patching.enable(plan_for(1, defaults={"cross_entropy": "chunked"}))
    try:
        x, t = torch.randn(8, 50), torch.randint(0, 50, (8,))
        F.cross_entropy(x.clone().requires_grad_(), t).backward()
        want = torch.func.grad(lambda z: originals.cross_entropy(z, t))(x)
        torch.testing.assert_close(torch.func.grad(lambda z: F.cross_entropy(z, t))(x), want)
        per_sample = torch.func.vmap(torch.func.grad(
            lambda z, tt: F.cross_entropy(z[None], tt[None])))(x, t)
        torch.testing.assert_close(per_sample, want * len(t))
        assert not dispatcher.disabled
        slots = [s.id for s in dispatcher.slots if s.variant == "chunked"]
        before = sum(dispatcher.readings.calls[i] for i in slots)
        F.cross_entropy(x.clone().requires_grad_(), t).backward()
        assert sum(dispatcher.readings.calls[i] for i in slots) == before + 1
    finally:
        patching.disable()


def test_rms_norm_with_a_weight_of_another_dtype_keeps_torchs_output_dtype():
    """The bucket ignored the weight's dtype: after a call with a bf16 weight, a bf16 input with
    an fp32 weight took the same checked route and came out fp32 (torch's stays bf16), and the
    job's next bf16 linear failed."""
    from .helpers import plan_for

    patching.enable(plan_for(1, defaults={"rms_norm": "eager"}))
    try:
        x = torch.randn(4, 16).bfloat16()
        F.rms_norm(x, (16,), torch.ones(16).bfloat16())
        got = F.rms_norm(x, (16,), torch.ones(16))
        want = originals.rms_norm(x, (16,), torch.ones(16))
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)
    finally:
        patching.disable()


@pytest.mark.parametrize("reentrant", [False, True])
def test_explored_calls_inside_a_checkpoint_are_recomputed_on_the_arm_they_ran(reentrant):
    """Explore arms took turns by a per-call counter, so a checkpoint's recompute often ran
    another arm than its forward, which saved other tensors: CheckpointError from backward,
    every explore round, whenever the explored op was not the block's last. Inside a checkpoint
    (and its recompute) calls now keep the main arm; outside, they explore as before."""
    from torch.utils.checkpoint import checkpoint

    from rtxops.runtime.plan import ExploreArm

    from .helpers import bucket_id, plan_for

    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(16, 16), nn.Linear(16, 16)
    xs = [torch.randn(8, 16, requires_grad=True) for _ in range(30)]

    def block(x):
        return lin2(F.gelu(lin1(x)))   # gelu between two layers, as in any MLP

    def grads() -> list[torch.Tensor]:
        out = []
        for x in xs:
            x.grad = None
            checkpoint(block, x, use_reentrant=reentrant).sum().backward()
            out.append(x.grad.clone())
        return out

    want = grads()
    explore = plan_for(1, ("gelu", bucket_id("gelu", torch.randn(8, 16)), "reference", {},
                           [ExploreArm("eager", {}, 0.5)]))
    dispatcher = patching.enable(explore)

    def gelu_calls() -> dict:
        return {s["variant"]: s["calls"] for s in summarize(dispatcher)["slots"] if s["op"] == "gelu"}

    try:
        for got, expected in zip(grads(), want):
            torch.testing.assert_close(got, expected)
        # reentrant checkpointing runs its forward with grad off, outside any hook: the forward
        # explored while the recompute kept the main arm (the loss of one, the gradient of another)
        assert gelu_calls().get("eager", 0) == 0, gelu_calls()
        for x in xs:                   # outside a checkpoint the arm still gets its share
            block(x).sum().backward()
        calls = gelu_calls()
        assert calls.get("eager", 0) >= 10, calls
        assert not dispatcher.disabled
    finally:
        patching.disable()


class DropRMSNorm(nn.Module):
    """An RMSNorm whose forward ends in a dropout (a module without parameters)."""

    def __init__(self, dim: int, p: float = 0.5):
        super().__init__()
        self.weight, self.eps, self.drop = nn.Parameter(torch.ones(dim)), 1e-6, nn.Dropout(p)

    def forward(self, x):
        return self.drop(self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class OffsetRMSNorm(nn.Module):
    unit_offset = False

    def __init__(self, dim: int):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim)), 1e-6

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * (1 + self.weight if self.unit_offset else self.weight)


class UnitOffsetRMSNorm(OffsetRMSNorm):   # inherits the forward, changes what it computes
    unit_offset = True


def test_an_rms_norm_class_with_a_dropout_keeps_it_after_an_eval_pass():
    """Checked first in eval (a validation pass), the rewrite was reused in train mode: the
    Dropout never ran again (0 of 128 zeros where its own forward gives ~64)."""
    torch.manual_seed(0)
    m, x, own = DropRMSNorm(16), torch.randn(8, 16), DropRMSNorm.forward
    patching.enable(_plan({"rms_norm": "eager"}))
    try:
        m.eval()
        with torch.no_grad():
            m(x)
        m.train()
        torch.manual_seed(1)
        got = m(x)
        torch.manual_seed(1)
        torch.testing.assert_close(got, own(m, x))
        assert int((got == 0).sum()) > 20
    finally:
        patching.disable()


def test_an_rms_norm_class_finds_its_route_after_its_first_call_in_each_mode():
    """A class's call looks its route up by a plain tuple, filed on the miss as a Scoped key:
    the two must be equal, or every call would resolve again (the bucket's route found anew,
    the job's modules scanned, at each call)."""
    torch.manual_seed(0)
    m, x = OffsetRMSNorm(16), torch.randn(8, 16)
    d = patching.enable(_plan({"rms_norm": "eager"}))
    resolved = []
    resolve = d._resolve
    d._resolve = lambda *a, **k: resolved.append(a[1]) or resolve(*a, **k)
    try:
        for mode in (True, False, True):
            m.train(mode)
            for _ in range(3):
                torch.testing.assert_close(m(x), OffsetRMSNorm.forward.__wrapped__(m, x))
    finally:
        patching.disable()
    assert len(resolved) == 2   # once in train mode, once in eval
    assert all(isinstance(k, Scoped) for k in resolved) and resolved[0].scope[0] is True


def test_a_subclass_inheriting_an_rms_norm_forward_is_checked_on_its_own():
    """A subclass that changes what the inherited forward computes took the parent's route,
    checked on the parent's instances: silently other values (max error 2.4)."""
    torch.manual_seed(0)
    a, b, x = OffsetRMSNorm(16), UnitOffsetRMSNorm(16), torch.randn(8, 16)
    own = OffsetRMSNorm.forward
    d = patching.enable(_plan({"rms_norm": "eager"}))
    try:
        a(x), a(x)
        torch.testing.assert_close(b(x), own(b, x))
        torch.testing.assert_close(b(x), own(b, x))
        torch.testing.assert_close(a(x), own(a, x))
        # only the subclass went back on its own forward: the parent's instances keep routing
        assert "forward" in UnitOffsetRMSNorm.__dict__
        eager = lambda: sum(d.readings.calls[s.id] for s in d.readings.slots  # noqa: E731
                            if s.op == "rms_norm" and s.variant == "eager")
        before = eager()
        a(x)
        assert eager() == before + 1
        assert [m["site"] for m in summarize(d)["modules_on_own_forward"]] == [
            f"module:{__name__}.OffsetRMSNorm subclass {__name__}.UnitOffsetRMSNorm"]
    finally:
        patching.disable()
    assert "forward" not in UnitOffsetRMSNorm.__dict__   # disable() takes it off again


def _plan(defaults: dict):
    from .helpers import plan_for

    return plan_for(1, defaults=defaults)


@pytest.mark.parametrize("op", ["silu", "gelu"])
def test_a_chunked_activation_answers_a_transposed_input_in_its_layout(op):
    """Sliced (a GLU's ``chunk``) and transposed inputs share one route, checked on the first:
    chunked answered every one contiguous, so the transposed input's output, which torch lays
    out transposed, could no longer be ``.view()``-ed as the job's next line did."""
    from .helpers import plan_for

    patching.enable(plan_for(1, defaults={op: "chunked"}))
    try:
        fn = getattr(F, op)
        for _ in range(2):
            fn(torch.randn(8, 64, 512).chunk(2, -1)[0])
        x = torch.randn(8, 256, 64).transpose(1, 2)
        y = fn(x)
        assert y.stride() == x.stride()
        y.transpose(1, 2).view(8 * 256, 64)
        torch.testing.assert_close(y, originals.original(op)(x))
    finally:
        patching.disable()


def test_a_variant_that_fails_under_autocast_is_disabled_there_only():
    """torch upcasts cross_entropy to fp32 under autocast; a bf16 variant checked there failed
    and was disabled for the bucket's calls outside autocast too, for good."""

    from .helpers import plan_for

    x, t = torch.randn(8, 16).bfloat16(), torch.randint(0, 16, (8,))
    dispatcher = patching.enable(plan_for(1, defaults={"cross_entropy": "logsoftmax_nll"}))
    try:
        for _ in range(3):
            F.cross_entropy(x, t)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(x, t)
            F.cross_entropy(x, t)
        before = {s["variant"]: s["calls"] for s in summarize(dispatcher)["slots"]}
        for _ in range(3):
            F.cross_entropy(x, t)
        data = summarize(dispatcher)
        after = {s["variant"]: s["calls"] for s in data["slots"]}
        assert after["logsoftmax_nll"] - before["logsoftmax_nll"] == 3, (before, after)
        assert [d["reason"] for d in data["disabled"]] and all(
            "under autocast cpu bfloat16" in d["reason"] for d in data["disabled"]), data["disabled"]
    finally:
        patching.disable()


def test_a_norm_weight_of_another_shape_gets_torchs_error_once_a_route_exists():
    """The variants broadcast a weight torch refuses: after a first good call, a (4, 8) weight
    for an (8,) normalized shape was applied row by row instead of raising."""
    from .helpers import plan_for

    x, w, b = torch.randn(4, 8), torch.randn(8), torch.randn(8)
    patching.enable(plan_for(1, defaults={"layer_norm": "eager", "rms_norm": "eager"}))
    try:
        for _ in range(2):
            F.layer_norm(x, (8,), w, b)
            F.rms_norm(x, (8,), w)
        with pytest.raises(RuntimeError):
            F.layer_norm(x, (8,), torch.ones(4, 8), b)
        with pytest.raises(RuntimeError):
            F.rms_norm(x, (8,), torch.ones(1))
    finally:
        patching.disable()


def test_a_chunked_activation_answers_a_broadcast_input_as_torch_does():
    """Stride-0 dimensions sort innermost: a broadcast input came out transposed where torch
    answers contiguous, and its first-call check disabled chunked for the whole bucket."""
    from .helpers import plan_for

    dispatcher = patching.enable(plan_for(1, defaults={"gelu": "chunked"}))
    try:
        x = torch.randn(1, 1024).expand(512, 1024)
        y = F.gelu(x)
        assert y.stride() == originals.original("gelu")(x).stride()
        assert not dispatcher.disabled
    finally:
        patching.disable()


@pytest.mark.parametrize("variant", ["eager", "chunked"])
def test_rms_norm_answers_a_channels_last_input_channels_last(variant):
    """torch's rms_norm answers a transposed input contiguous and a channels-last one
    channels-last; the variants answered both contiguous, and the two share a route (checked on
    whichever came first)."""
    from .helpers import plan_for

    patching.enable(plan_for(1, defaults={"rms_norm": variant}))
    try:
        w = torch.randn(8)
        for _ in range(2):
            F.rms_norm(torch.randn(64, 8, 4, 3).transpose(1, 3), [8], w, 1e-6)   # same shape
        x = torch.randn(64, 3, 4, 8).to(memory_format=torch.channels_last)
        y = F.rms_norm(x, [8], w, 1e-6)
        want = originals.original("rms_norm")(x, [8], w, 1e-6)
        assert y.stride() == want.stride()
        torch.testing.assert_close(y, want)
    finally:
        patching.disable()


@pytest.mark.parametrize("variant", ["eager", "chunked"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_without_eps_uses_torchs_default_for_half_types(variant, dtype):
    """`nn.RMSNorm(dim)` passes eps=None: the variants took bf16's own epsilon (0.0078) where torch
    takes fp32's; the first call (activations near 1) passed the check, later small ones were
    off by 80 %."""
    from .helpers import plan_for

    patching.enable(plan_for(1, defaults={"rms_norm": variant}))
    try:
        w = torch.ones(64, dtype=dtype)
        F.rms_norm(torch.randn(8, 64, dtype=dtype), [64], w, None)
        x = (0.02 * torch.randn(8, 64)).to(dtype)
        torch.testing.assert_close(F.rms_norm(x, [64], w, None),
                                   originals.original("rms_norm")(x, [64], w, None))
    finally:
        patching.disable()


def test_arguments_torch_takes_by_keyword_only_are_refused_positionally_once_routed():
    """gelu's approximate and attention's scale/enable_gqa are keyword-only in torch; once a
    route existed the variants took them positionally, and a call torch refuses ran."""
    from .helpers import plan_for

    patching.enable(plan_for(1, defaults={"gelu": "eager", "attention": "math"}))
    try:
        x, q = torch.randn(8, 16), torch.randn(1, 2, 4, 8)
        for _ in range(2):
            F.gelu(x, approximate="tanh")
            F.scaled_dot_product_attention(q, q, q, None, 0.0, False, scale=0.5)
        with pytest.raises(TypeError):
            F.gelu(x, "tanh")
        with pytest.raises(TypeError):
            F.scaled_dot_product_attention(q, q, q, None, 0.0, False, 0.5)
    finally:
        patching.disable()


def test_attention_with_a_3d_mask_keeps_torchs_double_backward():
    """torch takes its math backend for a 3-D mask, whose backward has a derivative (a gradient
    penalty works); flash_cpu called ATen's flash kernel, whose backward has none: the job died
    in backward, past anything the first-call check sees."""
    from .helpers import plan_for

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    mask = torch.randn(2, 4, 4)

    def penalty_grad(sdpa):
        qq = q.clone().requires_grad_()
        (g,) = torch.autograd.grad(sdpa(qq, k, v, attn_mask=mask).square().sum(), qq, create_graph=True)
        (gg,) = torch.autograd.grad(g.square().sum(), qq)
        return gg

    want = penalty_grad(originals.original("scaled_dot_product_attention"))
    patching.enable(plan_for(1, defaults={"attention": "flash_cpu"}))
    try:
        for _ in range(2):
            torch.testing.assert_close(penalty_grad(F.scaled_dot_product_attention), want)
    finally:
        patching.disable()


@pytest.mark.parametrize("op,variant", [("softmax", "eager"), ("softmax", "logsumexp"),
                                        ("softmax", "chunked"), ("softmax", "compiled"),
                                        ("cross_entropy", "chunked")])
def test_changing_the_input_in_place_after_the_call_leaves_backward_as_torchs(op, variant):
    """torch's softmax and cross-entropy save their output for backward, so a job may change the
    input in place afterwards; these variants saved the input, and backward died."""
    from .helpers import plan_for

    def run(fn_of_input):
        torch.manual_seed(0)
        leaf = torch.randn(64, 32, requires_grad=True)
        x = leaf * 1.0
        out = fn_of_input(x)
        x.mul_(0)                       # e.g. a buffer reused for the next micro-batch
        out.sum().backward() if op == "softmax" else out.backward()
        return leaf.grad

    target = torch.randint(0, 32, (64,))
    call = (lambda x: F.softmax(x, -1)) if op == "softmax" else (lambda x: F.cross_entropy(x, target))
    patching.enable(plan_for(1, defaults={op: variant}))
    try:
        run(call)
        got = run(call)
    finally:
        patching.disable()
    want = run(call)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("op", ["gelu", "silu"])
def test_each_strided_layout_of_a_shape_is_checked_on_its_own(op):
    """Strided inputs of one shape shared one route, checked on whichever came first: a sliced
    row-major input passed, and a sliced transposed one then got a row-major answer where torch
    keeps the transpose (the job's `.t().view(-1)` failed)."""
    from .helpers import plan_for

    patching.enable(plan_for(1, defaults={op: "chunked"}))
    try:
        fn = getattr(F, op)
        for _ in range(2):
            fn(torch.randn(512, 512)[:, ::2])                 # (512, 256), row-major, sliced
        x = torch.randn(512, 512)[::2].t()                    # (512, 256), transposed, sliced
        y = fn(x)
        want = originals.original(op)(x)
        assert y.stride() == want.stride()
        torch.testing.assert_close(y, want)
        y.t().reshape(-1).view(-1)
    finally:
        patching.disable()


def test_the_users_own_sitecustomize_runs_as_a_package_and_a_failing_one_leaves_rtxops_on(tmp_path):
    """rtxops's sitecustomize shadows the user's: a package ``sitecustomize/`` was not run, and
    one that raised turned rtxops off without a word."""
    script = tmp_path / "probe.py"
    script.write_text("import os\nfrom rtxops.runtime import patching\n"
                      "print('USER', os.environ.get('USER_SC'), 'RTXOPS', patching.active() is not None)\n")
    for name, body, want in (
            ("pkg", "import os\nos.environ['USER_SC'] = 'package'\n", "USER package RTXOPS True"),
            ("bad", "raise RuntimeError('user sitecustomize broke')\n", "USER None RTXOPS True")):
        user = tmp_path / name
        path = user / "sitecustomize" / "__init__.py" if name == "pkg" else user / "sitecustomize.py"
        path.parent.mkdir(parents=True)
        path.write_text(body)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RTXOPS_")}
        env.update(RTXOPS_ENABLE="1", RTXOPS_TELEMETRY="off",
                   PYTHONPATH=os.pathsep.join([str(BOOTSTRAP), str(user), str(BOOTSTRAP.parents[2])]))
        r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
        assert want in r.stdout, (name, r.stdout, r.stderr)
        if name == "bad":
            assert "Error in sitecustomize; set PYTHONVERBOSE for traceback:\nRuntimeError: user sitecustomize broke" in r.stderr


def test_a_cuda_error_left_at_exit_costs_neither_the_last_export_nor_the_summary(tmp_path, caplog):
    """A job that ended on a CUDA error (sticky: every later CUDA call raises it): draining the
    CUDA timers raised, at exit and again in the telemetry's close, and the last step's spans and
    the summary were lost. (No GPU here: the synchronize raises as it would there.)"""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from rtxops.runtime import bootstrap
    from rtxops.runtime.timing import CudaEventTimer
    from rtxops.telemetry.job import start_job_telemetry

    d = patching.enable()
    exporter = InMemorySpanExporter()
    try:
        start_job_telemetry(d, exporter, export_interval_s=3600)
        F.gelu(torch.randn(4, 4))   # the last, unfinished step
        d.cuda_timer = CudaEventTimer(d.readings, memory=False)
        d.cuda_timer._pending.append((0, 1, None, None, -1))

        def sticky_error():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        d.cuda_timer.drain = sticky_error
        summary = tmp_path / "summary.json"
        bootstrap._at_exit(d, str(summary), os.getpid())
    finally:
        patching.disable()
    assert [s["op"] for s in json.loads(summary.read_text())["slots"]] == ["gelu"]
    assert any(span.name == "rtx.step" for span in exporter.get_finished_spans())
    assert "illegal memory access" in caplog.text
