"""The torch functions as they were before rtxops patched anything.

Variants must call these, never ``torch.nn.functional.X`` (which may be our own wrapper). Each one
that is a Python function is a copy that finds itself under its own name: ``F.layer_norm`` hands
itself, by its module-level name, to a tensor subclass or a torch function mode
(``torch.set_default_device``), and that name is our wrapper while rtxops is on; a subclass
keyed on torch's function would not know it, and a mode would call the wrapper again from
inside the route."""
from __future__ import annotations

import inspect
import types
from typing import Callable

import torch.nn.functional as _F

PATCHABLE = (
    "rms_norm",
    "layer_norm",
    "softmax",
    "gelu",
    "silu",
    "cross_entropy",
    "scaled_dot_product_attention",
    "linear",
)



def naming_itself(fn: Callable) -> Callable:
    """``fn``, made to find itself under its own name: a copy that reads a snapshot of its
    module's namespace where that name is ``fn`` (``fn`` as it is when not a Python function
    its module holds under its name)."""
    if not inspect.isfunction(fn) or fn.__globals__.get(fn.__name__) is not fn:
        return fn
    namespace = dict(fn.__globals__)
    copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__, copy.__module__, copy.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    copy.__wrapped__ = fn  # type: ignore[attr-defined]
    namespace[fn.__name__] = fn
    return copy


_TORCH = {name: getattr(_F, name) for name in PATCHABLE}
_ORIGINAL = {name: naming_itself(fn) for name, fn in _TORCH.items()}


def original(name: str):
    """The unpatched ``torch.nn.functional.<name>`` (see the module's docstring)."""
    return _ORIGINAL[name]


def torch_function(name: str):
    """``torch.nn.functional.<name>`` itself, as torch made it (what TorchScript knows)."""
    return _TORCH[name]


rms_norm = _ORIGINAL["rms_norm"]
layer_norm = _ORIGINAL["layer_norm"]
softmax = _ORIGINAL["softmax"]
gelu = _ORIGINAL["gelu"]
silu = _ORIGINAL["silu"]
cross_entropy = _ORIGINAL["cross_entropy"]
scaled_dot_product_attention = _ORIGINAL["scaled_dot_product_attention"]
linear = _ORIGINAL["linear"]
