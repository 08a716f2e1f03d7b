"""Notices a job that differentiates its gradients (``create_graph=True``: a gradient penalty,
MAML's inner step), so the dispatcher stops choosing variants whose backward cannot be
differentiated again (torch.compile's: "does not currently support double backward").

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


def watching(fn: Callable, on_create_graph: Callable[[], None]) -> Callable:
    """``fn`` (one of :data:`ENTRY_POINTS`), calling ``on_create_graph()`` before a pass that
    builds a graph of its gradients."""
    position = list(inspect.signature(fn).parameters).index("create_graph")

    @functools.wraps(fn)
    def watched(*args, **kwargs):
        if kwargs.get("create_graph") if "create_graph" in kwargs else (
                len(args) > position and args[position]):
            on_create_graph()
        return fn(*args, **kwargs)

    watched.__rtxops_wrapper__ = True  # type: ignore[attr-defined]
    return watched
