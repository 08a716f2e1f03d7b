"""A job that differentiates its gradients (a gradient penalty) stops getting variants whose
backward cannot be differentiated again: torch.compile's raises in the penalty's backward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rtxops.runtime import patching
from rtxops.runtime.plan import Plan

COMPILED_GELU = Plan(version=2, defaults={"gelu": "compiled"})


def _penalty(x: torch.Tensor, entry: str) -> torch.Tensor:
    """The gradient of a gradient penalty through ``F.gelu``, its first backward taken through
    ``entry``."""
    x.grad = None
    y = F.gelu(x).pow(2).sum()
    if entry == "grad":
        g, = torch.autograd.grad(y, x, create_graph=True)
    else:
        if entry == "Tensor.backward":
            y.backward(create_graph=True)
        else:
            torch.autograd.backward([y], None, None, True)   # create_graph by position
        g, x.grad = x.grad, None
    return torch.autograd.grad(g.pow(2).sum(), x)[0]


def _calls(dispatcher, op: str, variant: str) -> int:
    readings = dispatcher.readings
    return sum(readings.calls[s.id] for s in dispatcher.slots if (s.op, s.variant) == (op, variant))


@pytest.mark.parametrize("entry", ["grad", "Tensor.backward", "autograd.backward"])
def test_after_a_gradient_penalty_a_plan_naming_a_compiled_variant_runs_one_that_differentiates_again(entry):
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    want = _penalty(x, entry)
    d = patching.enable()
    try:
        _penalty(x, entry)              # the job's first penalty, before any plan names compiled
        patching.enable(plan=COMPILED_GELU)   # what the evolve loop may publish later
        got = _penalty(x, entry)
    finally:
        patching.disable()
    torch.testing.assert_close(got, want)
    assert d.second_order
    assert _calls(d, "gelu", "compiled") == 0 and _calls(d, "gelu", "reference") > 0


def test_a_job_that_never_differentiates_a_gradient_keeps_its_compiled_variant():
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    d = patching.enable(plan=COMPILED_GELU)
    try:
        for _ in range(2):
            F.gelu(x).sum().backward(create_graph=False)
            torch.autograd.grad(F.gelu(x).sum(), x, create_graph=False)
    finally:
        patching.disable()
    assert not d.second_order
    assert _calls(d, "gelu", "compiled") == 4


def test_a_compiled_arm_the_plan_asks_for_after_the_first_penalty_is_reported_once():
    """The evolve loop learns from the job's ``rtx.variant.disabled`` events that the arm does
    not run there."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    d = patching.enable(plan=COMPILED_GELU)
    try:
        F.gelu(x).sum().backward()
        assert _calls(d, "gelu", "compiled") == 1 and not d.readings.errors
        # a penalty whose graph holds no compiled call (a lazy regularizer's first)
        torch.autograd.grad((x * x).sum(), x, create_graph=True)
        for _ in range(3):
            _penalty(x, "grad")
        compiled = {s.id for s in d.slots if (s.op, s.variant) == ("gelu", "compiled")}
        assert [slot for slot, _ in d.readings.errors] == list(compiled)
        assert "create_graph" in d.readings.errors[0][1]
        assert _calls(d, "gelu", "compiled") == 1
        torch.autograd.grad((x * x).sum(), x, create_graph=True)
        _penalty(x, "grad")
        assert len(d.readings.errors) == 1
    finally:
        patching.disable()


def test_disable_puts_torchs_backward_entry_points_back():
    before = torch.autograd.backward, torch.autograd.grad
    patching.enable()
    assert (torch.autograd.backward, torch.autograd.grad) != before
    patching.disable()
    assert (torch.autograd.backward, torch.autograd.grad) == before


def test_torch_func_grad_is_not_taken_for_a_gradient_penalty():
    """torch.func.grad asks torch.autograd.grad for a graph on every call (so that it nests)."""
    x = torch.randn(4, 8)
    d = patching.enable(plan=COMPILED_GELU)
    try:
        torch.func.grad(lambda z: F.gelu(z).sum())(x)
    finally:
        patching.disable()
    assert not d.second_order


def test_torchscript_compiles_a_function_calling_torch_autograd_grad_while_it_is_watched():
    """TorchScript knows torch.autograd.grad as a builtin by identity: the watching wrapper
    must not be what it sees."""
    patching.enable()
    try:
        @torch.jit.script
        def gradient(x: torch.Tensor) -> torch.Tensor:
            g = torch.autograd.grad([(x * x).sum()], [x], create_graph=True)[0]
            assert g is not None
            return g

        x = torch.randn(3, requires_grad=True)
        torch.testing.assert_close(gradient(x), 2 * x)
    finally:
        patching.disable()


def test_inputs_given_as_a_generator_reach_torch_whole():
    """``torch.autograd.grad(loss, model.parameters(), create_graph=True)``: the watcher looks
    at the inputs (are they parameters?) and must not use the generator up."""
    model = torch.nn.Linear(4, 2)
    want = torch.autograd.grad(model(torch.ones(3, 4)).square().sum(), model.parameters(),
                               create_graph=True)
    d = patching.enable()
    try:
        got = torch.autograd.grad(model(torch.ones(3, 4)).square().sum(), model.parameters(),
                                  create_graph=True)
        model(torch.ones(3, 4)).square().sum().backward(inputs=model.parameters(), create_graph=True)
    finally:
        patching.disable()
    assert d.second_order
    assert len(got) == 2 and all(torch.equal(g, w) for g, w in zip(got, want))
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
