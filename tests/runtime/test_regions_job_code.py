"""The compiled model swapped in under a job's own code: BatchNorm statistics, a backward run
twice, a gradient penalty, hooks added after the swap, the forward's signature."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from rtxops.runtime import patching
from rtxops.runtime.regions import RegionCompiler, _shadow


def aot_eager(fn, **kw):
    return torch.compile(fn, backend="aot_eager")


def until_swapped(model: nn.Module, step, max_steps: int = 3000) -> tuple[RegionCompiler, int]:
    """Run ``step(i)`` under a region until the compiled forward is on ``model``."""
    d = patching.enable()
    regions = d.regions = RegionCompiler(lambda step, outcome: None, trial_steps=3, compile_fn=aot_eager)
    i = 0
    while "forward" not in model.__dict__:
        assert i < max_steps and regions.error is None, (i, regions.state, regions.error)
        step(i)
        i += 1
    return regions, i


def stop(regions: RegionCompiler) -> None:
    patching.disable()
    regions.close()


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def test_the_background_pass_leaves_the_jobs_batchnorm_statistics_alone():
    """The pass ran on the model's own buffers: it updated the running statistics in place
    once more than eager, and when that landed between the job's forward and backward, the
    job's backward (which saved them) failed. Its shadow holds copies now."""
    model = bn_model()
    shadow = _shadow(model)
    assert shadow[1].running_mean is not model[1].running_mean
    assert torch.equal(shadow[1].running_mean, model[1].running_mean)

    def trainer(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(i):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i))
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return step

    model = bn_model()
    regions, steps = until_swapped(model, trainer(model))
    stop(regions)
    plain = bn_model()
    step = trainer(plain)
    for i in range(steps):
        step(i)
    assert model[1].num_batches_tracked == plain[1].num_batches_tracked == steps
    torch.testing.assert_close(model[1].running_mean, plain[1].running_mean)


def test_two_backwards_through_one_forward_and_a_gradient_penalty_run_on_the_compiled_model():
    """``retain_graph=True`` failed on the compiled backward (donated buffers), and a gradient
    penalty (``create_graph=True`` through the model) cannot run through it at all: the job's
    own backward raised, past anything that could fall back to eager."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(i):
        out = model(torch.randn(16, 8, generator=torch.Generator().manual_seed(i)))
        opt.zero_grad()
        out[:, 0].pow(2).mean().backward(retain_graph=True)
        out[:, 1].abs().mean().backward()
        opt.step()

    regions, steps = until_swapped(model, step)
    try:
        for i in range(steps, steps + 3):
            step(i)
        x = torch.randn(16, 8, requires_grad=True)    # WGAN-GP's interpolates
        grad, = torch.autograd.grad(model(x).sum(), x, create_graph=True)
        penalty = (grad.norm(2, dim=1) - 1).pow(2).mean()
        penalty.backward()
        assert all(p.grad is not None for p in model.parameters())
        assert regions.error is None, regions.error
    finally:
        stop(regions)


def test_a_job_taking_hessian_vector_products_keeps_its_model_eager():
    """Gradients taken with respect to the parameters with ``create_graph=True`` (AdaHessian's
    Hessian-vector products) go through the model on inputs that do not require grad: the
    compiled model was swapped in, and the job's second backward raised through it."""
    import time

    from rtxops.runtime.regions import COMPILED, EAGER, FAILED

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.01)
    d = patching.enable()
    regions = d.regions = RegionCompiler(lambda step, outcome: None, trial_steps=3, compile_fn=aot_eager)

    def step(i):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i))
        grads = torch.autograd.grad(model(x).pow(2).mean(), params, create_graph=True)
        hv = torch.autograd.grad(sum(g.sum() for g in grads), params)
        opt.zero_grad()
        for p, g, h in zip(params, grads, hv):
            p.grad = g.detach() + 0.01 * h
        opt.step()

    try:
        i, deadline = 0, time.monotonic() + 120
        while regions.state not in (COMPILED, EAGER, FAILED) and time.monotonic() < deadline:
            step(i)
            i += 1
        for j in range(i, i + 5):
            step(j)
        assert regions.state == FAILED and "create_graph" in regions.error, regions.state
        assert "forward" not in model.__dict__
    finally:
        stop(regions)


def test_a_hook_added_after_the_swap_runs_and_the_signature_is_the_models():
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 4)

        def forward(self, x, scale: float = 1.0):
            return self.b(torch.relu(self.a(x))) * scale

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(i):
        loss = model(torch.randn(16, 8, generator=torch.Generator().manual_seed(i))).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    regions, _ = until_swapped(model, step)
    try:
        assert list(inspect.signature(model.forward).parameters) == ["x", "scale"]   # not (*args, **kwargs)
        seen = []
        handle = model.a.register_forward_hook(lambda module, args, out: seen.append(out.shape))
        x = torch.randn(4, 8)
        with torch.no_grad():
            model(x)
        assert seen == [torch.Size([4, 32])]
        handle.remove()
        zeroed = model.a.register_forward_hook(lambda module, args, out: out * 0)
        with torch.no_grad():
            torch.testing.assert_close(model(x), model.b.bias.expand(4, 4))
        zeroed.remove()
    finally:
        stop(regions)


@pytest.fixture(autouse=True)
def _torch_settings_restored():
    """The region sets two torch.compile settings for the process: other tests see them as
    they were."""
    import torch._dynamo.config
    import torch._functorch.config

    before = (torch._functorch.config.donated_buffer, torch._dynamo.config.skip_nnmodule_hook_guards)
    yield
    torch._functorch.config.donated_buffer, torch._dynamo.config.skip_nnmodule_hook_guards = before
