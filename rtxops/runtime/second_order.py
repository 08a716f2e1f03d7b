"""Notices a job that differentiates its gradients (``create_graph=True``: a gradient penalty,
MAML's inner step), so the dispatcher stops choosing variants whose backward cannot be
differentiated again (torch.compile's: "does not currently support double backward"), and the
compiled model region goes back to eager when those gradients are taken with respect to
parameters.

torch's two ways into a backward pass, ``torch.autograd.backward`` (``Tensor.backward`` calls
it) and ``torch.autograd.grad``, are wrapped while rtxops is on; the check is one argument
lookup per backward pass. A pass is seen when it starts: a graph that already holds such a
variant's call (a plan naming one before the job's first penalty) still fails in torch's double
backward, after a log line saying why; the graphs built after it use variants that
differentiate again.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

ENTRY_POINTS = ((torch.autograd, "backward"), (torch.autograd, "grad"))


def watching(fn: Callable, on_create_graph: Callable[[bool], None]) -> Callable:
    """``fn`` (one of :data:`ENTRY_POINTS`), calling ``on_create_graph(through_parameters)``
    before a pass that builds a graph of its gradients; ``through_parameters``: whether the
    pass is taken with respect to parameters (a backward into every leaf, or ``inputs`` holding
    an ``nn.Parameter``: Hessian-vector products, MAML), not only to tensors the job made (a
    gradient penalty's interpolates)."""
    signature = inspect.signature(fn)
    position = list(signature.parameters).index("create_graph")

    @functools.wraps(fn)
    def watched(*args, **kwargs):
        if kwargs.get("create_graph") if "create_graph" in kwargs else (
                len(args) > position and args[position]):
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:   # torch's own call says what is wrong
                return fn(*args, **kwargs)
            inputs = bound.arguments.get("inputs")
            if inputs is not None and not isinstance(inputs, (torch.Tensor, tuple, list)):
                # read once here (``model.parameters()`` is a generator): torch gets the tuple
                inputs = bound.arguments["inputs"] = tuple(inputs)
            on_create_graph(_through_parameters(inputs))
            return fn(*bound.args, **bound.kwargs)
        return fn(*args, **kwargs)

    watched.__rtxops_wrapper__ = True  # type: ignore[attr-defined]
    return watched


def _through_parameters(inputs) -> bool:
    if inputs is None:
        return True     # backward into every leaf the graph reaches
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    return any(isinstance(t, torch.nn.Parameter) for t in inputs)
