"""Zero-code integration: ``enable()`` patches torch and known module classes; ``disable()`` undoes it.

Patched:
- ``torch.nn.functional`` functions (see ``originals.PATCHABLE``);
- module classes whose forward is hand-written op math, matched by name and attributes
  (RMSNorm modules, gated SiLU MLPs): those defined before ``enable()`` and those defined after
  (through ``nn.Module.__init_subclass__``);
- module-level functions named ``apply_rotary_pos_emb`` (Hugging Face convention) in loaded modules
  and in ``__main__``, looked for again whenever a new bucket is seen;
- ``torch.jit.script``, ``torch.jit.trace``, ``torch.jit.trace_module`` and
  ``torch.fx.Tracer.trace`` (``symbolic_trace``): they run with every patch above taken back, so
  TorchScript and FX compile (or record) torch's own functions and the classes' own forwards,
  never the dispatching wrappers.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
import sys
import threading
import types
from typing import Callable

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch import nn

from . import originals, script_shims, second_order
from .dispatcher import Dispatcher, ModuleSite, routed_linear_forward, unrouted_on_this_thread
from .ops._layout import layout_key
from .plan import Plan
from .readings import Readings
from .registry import Registry

FUNCTIONAL_OPS = {
    "rms_norm": "rms_norm",
    "layer_norm": "layer_norm",
    "softmax": "softmax",
    "gelu": "gelu",
    "silu": "silu",
    "cross_entropy": "cross_entropy",
    "scaled_dot_product_attention": "attention",
    "linear": "linear",
}
ROPE_FUNCTION_NAMES = ("apply_rotary_pos_emb",)
# (owner, attribute) of the tracers and compilers that must see torch unpatched. TorchScript's
# compiler reads the classes' forward source: they are put back meanwhile, in every thread. The
# tracers run the code on the calling thread, which alone runs unrouted meanwhile (AOTAutograd's
# make_fx traces through fx's Tracer in a background compile, beside the job's routed steps).
PUT_BACK_ENTRY_POINTS = ((torch.jit, "script"),)
UNROUTED_ENTRY_POINTS = (*PUT_BACK_ENTRY_POINTS, (torch.jit, "trace"), (torch.jit, "trace_module"),
                         (torch.fx.Tracer, "trace"))

log = logging.getLogger("rtxops.runtime")
_lock = threading.RLock()
_active: _Patch | None = None


def enable(plan: Plan | None = None, readings: Readings | None = None,
           registry: Registry | None = None, verify_first_call: bool = True) -> Dispatcher:
    """Route torch's hot ops through a new :class:`Dispatcher` and return it.

    With no plan every op runs its reference, so behaviour is unchanged. Calling ``enable()``
    while enabled returns the active dispatcher.
    """
    global _active
    with _lock:
        if _active is None:
            # torch builds its table of overridable functions once, on first use: built while
            # our wrappers stand in for torch's functions it would hold them instead, and
            # dynamo would dispatch no call of those ops to a TorchFunctionMode in compiled code
            torch.overrides.get_overridable_functions()
            dispatcher = Dispatcher(registry, readings, verify_first_call)
            _active = _Patch(dispatcher)
            _active.apply()
        if plan is not None:
            _active.dispatcher.install_plan(plan)
            _active.dispatcher.apply_pending()
        return _active.dispatcher


def disable() -> None:
    """Restore every patched function, class and hook; torch behaves exactly as before."""
    global _active
    with _lock:
        if _active is not None:
            _active.undo()
            _active = None


def active() -> Dispatcher | None:
    return _active.dispatcher if _active else None


@contextlib.contextmanager
def suspended():
    """Nothing routed meanwhile, in any thread (torch's functions and the classes' forwards as
    they were); the dispatcher, its routes and its step hook stay. A no-op while not enabled."""
    with _lock:
        patch = _active
    if patch is None:
        yield
        return
    with patch.suspended():
        yield


# ---- module patterns ------------------------------------------------------------------------
_EPS_NAMES = ("variance_epsilon", "eps", "epsilon")


def _rms_norm_weight_eps(module, hidden_states, args: tuple, kwargs: dict):
    """(weight, eps, input's shape, weight's shape) of an RMSNorm class's call the op can take,
    else None (the shapes for the key and the split, read here once; the key runs this on every
    call)."""
    params = module._parameters
    # a parameter from the module's own table: getattr goes through Module.__getattr__ (0.7 µs)
    weight = params.get("weight") if "weight" in params else getattr(module, "weight", None)
    if hidden_states is None or args or kwargs or weight is None or \
            not isinstance(hidden_states, torch.Tensor):
        return None
    shape, weight_shape = hidden_states.shape, weight.shape
    if len(weight_shape) != 1 or not shape or weight_shape[0] != shape[-1]:
        return None
    for name in _EPS_NAMES:
        eps = getattr(module, name, None)
        if isinstance(eps, float):
            return weight, eps, shape, weight_shape
    return None


def _split_rms_norm(module, hidden_states=None, *args, **kwargs):
    found = _rms_norm_weight_eps(module, hidden_states, args, kwargs)
    if found is None:
        return None
    weight, eps, shape, _ = found
    return (hidden_states, (shape[-1],), weight, eps), None


def _rms_norm_key(module, hidden_states=None, *args, **kwargs):
    """The call key of an RMSNorm class's call: ``rms_norm.key`` of what
    :func:`_split_rms_norm` makes of it (None where it makes nothing), without making the op's
    arguments or calling the op's key and its layout key (five such calls a step of the
    example GPT)."""
    found = _rms_norm_weight_eps(module, hidden_states, args, kwargs)
    if found is None:
        return None
    weight, _, shape, weight_shape = found
    return (shape, hidden_states.dtype,
            True if hidden_states.is_cpu else hidden_states.device, (shape[-1],),
            (weight.dtype, weight_shape),
            True if hidden_states.is_contiguous() else hidden_states.stride())


_MLP_LAYOUTS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _mlp_layout(module):
    for names in _MLP_LAYOUTS:
        layers = [getattr(module, n, None) for n in names]
        if all(isinstance(m, nn.Linear) for m in layers):
            return layers
    return None


def _gated_mlp_layers(module, x=None, *args, **kwargs):
    """(gate, up, down) when ``module(x)`` is a gated MLP's call by its layers, else None."""
    if x is None or args or kwargs or not isinstance(x, torch.Tensor):
        return None
    layers = _mlp_layout(module)
    if layers is None:
        return None
    gate, up, down = layers
    width = x.shape[-1] if x.dim() else -1
    if not (gate.in_features == up.in_features == width
            and gate.out_features == up.out_features == down.in_features):
        return None   # not gate/up/down by shape (a plain MLP named w1, w2, w3): before any work
    return layers


def _split_gated_mlp(module, *args, **kwargs):
    layers = _gated_mlp_layers(module, *args, **kwargs)
    if layers is None:
        return None
    gate, up, down = layers
    x = args[0]
    return (gate(x), up(x)), _down_projection(down)


def _gated_mlp_key(module, *args, **kwargs):
    """The call key of a gated MLP's call, from its input and layers: the gate and up
    projections (the op's arguments) are computed only where the route runs the op."""
    layers = _gated_mlp_layers(module, *args, **kwargs)
    if layers is None:
        return None
    gate, up, _ = layers
    x = args[0]
    return ("gated_mlp", x.shape, x.dtype, True if x.is_cpu else x.device, layout_key(x),
            gate.out_features, gate.weight.dtype, up.weight.dtype, gate.bias is None,
            up.bias is None)


def _down_projection(down):
    return lambda module, h: down(h)


def _holds_only(module, names: set[str]) -> str | None:
    """The first parameter or buffer of ``module`` (at any depth) that is not under one of its
    attributes ``names``, or None. A rewrite that reads only those would drop it."""
    for full, _ in (*module.named_parameters(), *module.named_buffers()):
        if full.split(".", 1)[0] not in names:
            return full
    return None


def _rms_norm_unfit(module) -> str | None:
    extra = _holds_only(module, {"weight"})
    if extra:
        return f"it holds {extra!r}, which rms_norm does not take"
    # a child without parameters (a Dropout) still does something the rewrite would drop
    child = next((name for name, _ in module.named_children()), None)
    return f"it holds module {child!r}, which rms_norm does not run" if child else None


def _gated_mlp_unfit(module) -> str | None:
    names = next((set(n) for n in _MLP_LAYOUTS if all(isinstance(getattr(module, a, None), nn.Linear)
                                                      for a in n)), set())
    extra = _holds_only(module, names)
    return f"it holds {extra!r} besides its three linear layers" if extra else None


def _is_rms_norm_class(cls: type) -> bool:
    return "rmsnorm" in cls.__name__.lower() and not cls.__module__.startswith("torch.")


_MLP_NAME = re.compile(r"mlp|feedforward|feed_forward|ffn", re.IGNORECASE)


def _is_gated_mlp_class(cls: type) -> bool:
    return bool(_MLP_NAME.search(cls.__name__)) and not cls.__module__.startswith("torch.")


MODULE_PATTERNS: list[tuple[str, Callable[[type], bool], Callable, bool, Callable,
                           Callable | None, tuple | None]] = [
    # (op, class test, split, op is the whole forward, why an instance cannot be rewritten,
    #  the call's key without the split (None: the key of the split's op arguments),
    #  what that key reads of the module: (its parameters, names one of which holds a float),
    #  for the C++ core (None: routed in Python; a gated MLP's key reads its layers))
    ("rms_norm", _is_rms_norm_class, _split_rms_norm, True, _rms_norm_unfit, _rms_norm_key,
     (("weight",), _EPS_NAMES)),
    ("swiglu", _is_gated_mlp_class, _split_gated_mlp, False, _gated_mlp_unfit, _gated_mlp_key,
     None),
]


class _Patch:
    """Everything one ``enable()`` changed, so ``disable()`` can put it back."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self.functional: dict[str, Callable] = {}
        self.classes: dict[type, Callable] = {}
        self.functions: dict[tuple[object, str], Callable] = {}
        self.entry_points: dict[tuple[object, str], Callable] = {}
        self.step_hook = None
        self.init_subclass = None
        self._seen_modules = 0
        self._suspended = 0
        self._wrappers: dict = {}  # what suspended() took down, to put back

    def apply(self) -> None:
        d = self.dispatcher
        sites = {}
        for fname, op in FUNCTIONAL_OPS.items():
            self.functional[fname] = getattr(F, fname)
            reference = originals.original(fname)
            sites[fname] = d.function_site(op, f"F.{fname}", reference)
            wrapper = sites[fname].wrapper
            # pickle finds it where it stands (a module holding F.gelu is saved as F.gelu)
            wrapper.__module__, wrapper.__qualname__ = F.__name__, fname
            torch_fn = originals.torch_function(fname)
            source = torch_fn if inspect.isfunction(torch_fn) else script_shims.SHIMS.get(fname)
            if source is not None:
                # a wrapper held before scripting (``self.act = F.silu``): TorchScript compiles
                # torch's own function, or a stand-in with its signature for a C function (the
                # attributes torch.jit's script-if-tracing wrappers carry; dynamo honours them too)
                setattr(wrapper, "__original_fn", source)
                setattr(wrapper, "__script_if_tracing_wrapper", True)
            setattr(F, fname, wrapper)
        for cls in _all_subclasses(nn.Module):
            self.patch_class(cls)
        self.classes[nn.Linear] = nn.Linear.forward
        nn.Linear.forward = routed_linear_forward(sites["linear"], nn.Linear.forward)
        self._hook_new_classes()
        self.scan_functions()
        self._wrap_entry_points()
        self._watch_second_order()
        self.step_hook = register_optimizer_step_post_hook(
            lambda optimizer, args, kwargs: d.on_step(optimizer)
        )
        d.on_miss = self.scan_functions  # new buckets are a cheap moment to look for new modules

    def undo(self) -> None:
        self.dispatcher.live[0] = False
        for (owner, name), fn in self.entry_points.items():
            if _ours(owner.__dict__.get(name)):
                setattr(owner, name, fn)
        self._put_back()
        for site in self.dispatcher.sites:
            if isinstance(site, ModuleSite):
                site.forget_subclasses()
        if self.step_hook is not None:
            self.step_hook.remove()
        for region in (self.dispatcher.regions, self.dispatcher.optimizer_region):
            if region is not None:
                region.close()
        if self.init_subclass is not None:
            if self.init_subclass is _NO_OWN_INIT_SUBCLASS:
                del nn.Module.__init_subclass__
            else:
                nn.Module.__init_subclass__ = self.init_subclass
        self.dispatcher.on_miss = None

    def _put_back(self) -> dict:
        """Put torch's functions, the classes' forwards and the rope functions back; returns
        ``{(namespace, name): (original, what stood there)}``. What someone else set meanwhile
        (another library's patch of ``F.gelu``, say) stays."""
        swapped: dict = {}
        for fname, fn in self.functional.items():
            if _ours(current := getattr(F, fname)):
                swapped[(F, fname)] = (fn, current)
                setattr(F, fname, fn)
        for cls, forward in self.classes.items():
            if _ours(current := cls.__dict__.get("forward")):
                swapped[(cls, "forward")] = (forward, current)
                cls.forward = forward
        for (namespace, name), fn in self.functions.items():
            if _ours(current := getattr(namespace, name, None)):
                swapped[(namespace, name)] = (fn, current)
                _set(namespace, name, fn)
        return swapped

    @contextlib.contextmanager
    def suspended(self):
        """Nothing routed meanwhile (in any thread): torch and the classes as they were."""
        with _lock:
            self._suspended += 1
            if self._suspended == 1:
                self._wrappers = self._put_back()
        try:
            yield
        finally:
            with _lock:
                self._suspended -= 1
                if self._suspended == 0 and _active is self:
                    self._reinstall(self._wrappers)

    def _reinstall(self, swapped: dict) -> None:
        """Undo :meth:`_put_back`, except where something else was set meanwhile or a class
        was put back on its own forward for good (``ModuleSite.give_up``)."""
        gave_up = {site.cls for site in self.dispatcher.sites
                   if isinstance(site, ModuleSite) and site.failed}
        for (namespace, name), (original, wrapper) in swapped.items():
            if getattr(namespace, name, None) is original and namespace not in gave_up:
                _set(namespace, name, wrapper)

    def _watch_second_order(self) -> None:
        # kept with the patched functions: TorchScript, which knows torch.autograd.grad as a
        # builtin by identity, sees torch's own while it compiles (see suspended)
        for owner, name in second_order.ENTRY_POINTS:
            fn = self.functions[(owner, name)] = owner.__dict__[name]
            _set(owner, name, second_order.watching(fn, self.dispatcher.note_second_order))

    def _wrap_entry_points(self) -> None:
        for owner, name in UNROUTED_ENTRY_POINTS:
            fn = owner.__dict__.get(name)
            if fn is None:
                continue
            self.entry_points[(owner, name)] = fn
            put_back = (owner, name) in PUT_BACK_ENTRY_POINTS
            setattr(owner, name, self._unrouted_during(fn, self.suspended if put_back
                                                        else unrouted_on_this_thread))

    @staticmethod
    def _unrouted_during(fn: Callable, unrouted_scope: Callable) -> Callable:
        @functools.wraps(fn)
        def unrouted(*args, **kwargs):
            with unrouted_scope():
                return fn(*args, **kwargs)

        unrouted.__rtxops_wrapper__ = True  # type: ignore[attr-defined]
        return unrouted

    def patch_class(self, cls: type) -> None:
        if cls in self.classes or "forward" not in cls.__dict__:
            return
        for op, matches, split, whole, unfit, key_of, core_reads in MODULE_PATTERNS:
            if matches(cls):
                site = self.dispatcher.module_site(op, cls, split, whole, unfit, key_of, core_reads)
                self.classes[cls] = cls.forward
                cls.forward = site.wrapper
                return

    def _hook_new_classes(self) -> None:
        patch = self
        own = nn.Module.__dict__.get("__init_subclass__")
        self.init_subclass = own if own is not None else _NO_OWN_INIT_SUBCLASS

        def __init_subclass__(cls, **kwargs):
            super(nn.Module, cls).__init_subclass__(**kwargs)
            patch.patch_class(cls)

        nn.Module.__init_subclass__ = classmethod(__init_subclass__)

    def scan_functions(self) -> None:
        """Patch ``apply_rotary_pos_emb``-style functions in modules loaded since the last scan.
        Runs on a route miss, inside a call of the job's: it never fails, and it reads module
        namespaces without attribute access, which would load a lazily imported module."""
        try:
            self._scan_functions()
        except Exception:  # noqa: BLE001 - the call that missed must go on
            log.exception("rtxops: looking for rope functions failed")

    def _scan_functions(self) -> None:
        count = len(sys.modules)
        if count == self._seen_modules:   # (most misses: no module loaded since the last one)
            fresh = []
        else:
            modules = list(sys.modules.values())
            fresh = modules[self._seen_modules:] if count >= self._seen_modules else modules
            self._seen_modules = count
        main = sys.modules.get("__main__")
        for module in ([main] if main is not None else []) + fresh:
            try:  # no attribute access: a lazily imported module would load
                namespace = object.__getattribute__(module, "__dict__")
            except AttributeError:  # a module-like object without one (cffi's Lib)
                continue
            if not isinstance(module, types.ModuleType) or not isinstance(namespace, dict):
                continue
            module_name = namespace.get("__name__")
            for name in ROPE_FUNCTION_NAMES:
                fn = namespace.get(name)
                if callable(fn) and (module, name) not in self.functions and \
                        getattr(fn, "__module__", None) == module_name and _takes_q_k_cos_sin(fn):
                    self.functions[(module, name)] = fn
                    site = self.dispatcher.function_site("rope", f"fn:{module.__name__}.{name}", fn,
                                                         matched_by_name=True)
                    _set(module, name, site.wrapper)


def _takes_q_k_cos_sin(fn: Callable) -> bool:
    """Whether ``fn`` can be called as ``fn(q, k, cos, sin)``, the rope op's signature (GPT-J's
    ``(tensor, sin, cos)`` and others of the same name cannot)."""
    try:
        signature = inspect.signature(fn)
        signature.bind(1, 2, 3, 4)
    except (TypeError, ValueError):
        return False
    names = list(signature.parameters)[:4]
    return len(names) == 4 and "sin" in names[3] and "cos" in names[2]


_NO_OWN_INIT_SUBCLASS = object()


def _set(namespace, name: str, value) -> None:
    setattr(namespace, name, value)


def _all_subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.append(sub)
                todo.append(sub)
    return out


def _ours(value) -> bool:
    """Whether ``value`` is one of rtxops' wrappers (of a function, a forward, an entry point)."""
    return getattr(value, "__rtxops_wrapper__", False) is True
