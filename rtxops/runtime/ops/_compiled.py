"""Shared builder for ``torch.compile`` variants, compiled once per bucket."""
from __future__ import annotations

import types
from typing import Any, Callable

import torch

from ..bucket import Bucket
from ..spec import Variant
from ._grads import reference_grads

COMPILE_SPACE = {"mode": ["default", "max-autotune-no-cudagraphs"], "dynamic": [False, True]}


def _fresh_copy(fn: Callable) -> Callable:
    # Dynamo keys its cache (and its recompile limit) on the code object: a copy per bucket keeps
    # buckets from evicting each other.
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compiled_variant(op: str, fn: Callable, description: str = "", **kwargs) -> Variant:
    """A variant that runs ``torch.compile(fn)`` built for each bucket."""

    def build(config: dict, bucket: Bucket) -> Callable:
        compiled = torch.compile(
            _fresh_copy(fn), mode=config.get("mode", "default"), dynamic=config.get("dynamic", False)
        )
        return _twice_differentiable(compiled, fn)

    return Variant(
        op, "compiled", "compiled", build, config_space=dict(COMPILE_SPACE),
        description=description or f"torch.compile of the {op} math, one graph per bucket", **kwargs,
    )


def compiled_saving_output(op: str, fn: Callable, grad_of: Callable, description: str = "",
                           **kwargs) -> Variant:
    """A ``torch.compile(fn)`` variant of an op whose torch kernel keeps only its output for
    backward (softmax): the compiled forward runs alone, and ``grad_of(output, grad)`` gives
    the input's gradient. Compiled whole, the graph kept the input, and a job that changes it
    in place after the call (torch allows that here) had its backward fail."""

    def build(config: dict, bucket: Bucket) -> Callable:
        compiled = torch.compile(
            _fresh_copy(fn), mode=config.get("mode", "default"), dynamic=config.get("dynamic", False)
        )

        def run(input, *args, **kw):
            if not (torch.is_grad_enabled() and input.requires_grad):
                return compiled(input, *args, **kw)
            return _FromOutput.apply(lambda x: compiled(x, *args, **kw), grad_of, input)

        return run

    return Variant(
        op, "compiled", "compiled", build, config_space=dict(COMPILE_SPACE),
        description=description or f"torch.compile of the {op} forward; backward from its output",
        **kwargs,
    )


class _FromOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward, grad_of, input):
        out = forward(input)
        ctx.grad_of = grad_of
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors   # differentiable itself: the output's graph is this op
        return None, None, ctx.grad_of(out, grad)


def _twice_differentiable(compiled: Callable, math: Callable) -> Callable:
    """``compiled``, whose backward differentiates again: torch.compile's autograd has no double
    backward, so a gradient penalty (``create_graph``) failed inside backward, where no fallback
    reaches. Calls that need no gradient run ``compiled`` as it is."""

    def run(*args, **kwargs):
        slots = [("a", i) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        slots += [("k", k) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        tensors = [args[i] if where == "a" else kwargs[i] for where, i in slots]
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
            return compiled(*args, **kwargs)
        return _Compiled.apply(compiled, math, (args, kwargs, slots), *tensors)

    return run


def _with(call: tuple, tensors) -> tuple[list, dict]:
    """The call's arguments with ``tensors`` in its tensors' places."""
    args, kwargs, slots = call
    args, kwargs = list(args), dict(kwargs)
    for (where, i), t in zip(slots, tensors):
        if where == "a":
            args[i] = t
        else:
            kwargs[i] = t
    return args, kwargs


class _Compiled(torch.autograd.Function):
    """Forward and backward by the compiled graph; a backward under ``create_graph``, or one
    run again (a retained graph), by autograd through the op's eager math."""

    @staticmethod
    def forward(ctx, compiled, math, call, *tensors):
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        args, kwargs = _with(call, leaves)
        with torch.enable_grad():
            out = compiled(*args, **kwargs)
        ctx.graph, ctx.leaves, ctx.math, ctx.call = out, leaves, math, call
        ctx.save_for_backward(*tensors)   # unpacked only for the eager path
        return tuple(o.detach() for o in out) if isinstance(out, tuple) else out.detach()

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad[3:]
        if torch.is_grad_enabled() or ctx.graph is None:
            def math(*tensors: Any):
                args, kwargs = _with(ctx.call, tensors)
                return ctx.math(*args, **kwargs)

            return (None, None, None, *reference_grads(math, ctx.saved_tensors, grads, needs))
        outs = list(ctx.graph) if isinstance(ctx.graph, tuple) else [ctx.graph]
        ctx.graph = None   # torch.autograd.grad frees it
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [i for i, (t, need) in enumerate(zip(ctx.leaves, needs)) if need and t.requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], [ctx.leaves[i] for i in wanted],
                                  [g for _, g in pairs], allow_unused=True) if pairs and wanted else ()
        out: list = [None] * len(ctx.leaves)
        for i, g in zip(wanted, got):
            out[i] = g
        return (None, None, None, *out)
