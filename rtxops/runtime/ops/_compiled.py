"""Shared builder for ``torch.compile`` variants, compiled once per bucket."""
from __future__ import annotations

import types
from typing import Callable

import torch

from ..bucket import Bucket
from ..spec import Variant

COMPILE_SPACE = {"mode": ["default", "max-autotune-no-cudagraphs"], "dynamic": [False, True]}


def _fresh_copy(fn: Callable) -> Callable:
    # Dynamo keys its cache (and its recompile limit) on the code object: a copy per bucket keeps
    # buckets from evicting each other.
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _compile(fn: Callable, config: dict) -> Callable:
    return torch.compile(
        _fresh_copy(fn), mode=config.get("mode", "default"), dynamic=config.get("dynamic", False)
    )


def compiled_variant(op: str, fn: Callable, description: str = "", **kwargs) -> Variant:
    """A variant that runs ``torch.compile(fn)`` built for each bucket. Its backward is
    torch.compile's, which cannot be differentiated again."""

    def build(config: dict, bucket: Bucket) -> Callable:
        return _compile(fn, config)

    return Variant(
        op, "compiled", "compiled", build, config_space=dict(COMPILE_SPACE),
        description=description or f"torch.compile of the {op} math, one graph per bucket",
        **{"double_backward": False, **kwargs},
    )


def compiled_saving_output(op: str, fn: Callable, grad_of: Callable, description: str = "",
                           **kwargs) -> Variant:
    """A ``torch.compile(fn)`` variant of an op whose torch kernel keeps only its output for
    backward (softmax): the compiled forward runs alone, and ``grad_of(output, grad)`` gives
    the input's gradient. Compiled whole, the graph kept the input, and a job that changes it
    in place after the call (torch allows that here) had its backward fail."""

    def build(config: dict, bucket: Bucket) -> Callable:
        compiled = _compile(fn, config)

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
