"""The dispatcher: routes each call of a patched site to the variant its plan names.

Hot path (per call): the op's ``key`` function (an exact, cheap signature of the call), one dict
lookup, the routed callable. Everything else (the bucket, support checks, resolving the plan,
building variants, first-call verification, disabling a broken variant) happens on a route miss,
once per (site, call signature) and plan version.
"""
from __future__ import annotations

import contextlib
import copyreg
import functools
import inspect
import itertools
import json
import logging
import sys
import threading
import traceback
import weakref
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any, Callable, Iterable, NamedTuple

import torch
import torch.utils.checkpoint

from .. import settings
from .bucket import Bucket
from .errors import PlanError
from .memory import rss_bytes
from .ops._layout import layout_kind
from .originals import naming_itself
from .timing import BackwardTimer, CudaEventTimer
from .plan import Plan, default_plan
from .readings import CallStats, Readings, Slot
from .registry import Registry, default_registry
from .spec import REFERENCE, OpSpec, Tolerance, Variant

try:   # built from _native/dispatch_core.cpp by `make install` (_native/build.py)
    from ._dispatch_core import Core as _Core
except ImportError:   # not built (no compiler, another torch): the routing runs in Python
    _Core = None
try:
    if not settings.switch("RTXOPS_DISPATCH_CORE", True):
        _Core = None
except settings.SettingError as e:   # (`rtxops run` refuses it before the job starts)
    print(f"rtxops: {e}; the C++ dispatch core stays on", file=sys.stderr)

log = logging.getLogger("rtxops.runtime")
# The wrappers ask ``torch.compiler.is_compiling() and _traced_here()`` on every call, spelled
# ``_is_dynamo_compiling() or (_compiler._is_compiling_flag and _traced_here())``: one Python call
# where is_compiling() makes two. Dynamo folds is_dynamo_compiling() to True as it traces, so the
# flag (which it would guard on) is read only outside its traces; torch holds the flag through a
# compile session (and an export) beyond what dynamo itself traces.
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_compiler = torch.compiler
_tracing_state = torch._C._get_tracing_state
_functorch_active = torch._C._are_functorch_transforms_active
_dispatch_modes = torch._C._len_torch_dispatch_stack   # FakeTensorMode and the like
_has_torch_function = torch._C._has_torch_function
_function_mode_enabled = torch._C._is_torch_function_mode_enabled
_handle_torch_function = torch.overrides.handle_torch_function
_disabled_torch_function = torch._C._disabled_torch_function_impl
_background_compiles: set[int] = set()  # threads running a background torch.compile (regions.py)

# Raised through a variant by the code around the call, not by the variant: a non-reentrant
# activation checkpoint stops its recomputation by raising from inside the last op it needs
_NOT_A_FAILURE: tuple[type[BaseException], ...] = tuple(
    cls for cls in (getattr(torch.utils.checkpoint, "_StopRecomputationError", None),) if cls)

EXPLORE_PERIOD = 1000  # explore shares are laid out over this many calls, deterministically
# one backward timed per route every this many steps: a sampled call's hooks cost ~40 µs (1.3 ms
# a sampled step of the example GPT, 0.16 ms a step amortized at every 8th step). The arms of an
# exploring bucket are sampled every EXPLORE_BACKWARD_EVERY steps: the evolve loop weighs them
# by it (loop.BACKWARD_MIN_CALLS); a settled route's backward only feeds telemetry
BACKWARD_EVERY = 64
EXPLORE_BACKWARD_EVERY = 8
# a step reports the process's RSS as read at most this long ago: right after a step the read
# of /proc/self/statm took 25-40 µs on a 2-core VM (2-3 µs when idle), at every step
RSS_EVERY_NS = 100_000_000
SECOND_ORDER_REASON = ("the job differentiates gradients (create_graph=True), which this "
                       "variant's backward (torch.compile's) cannot")
REGION_OP = "region"   # the op of the slots regions record (see Dispatcher.region_clock)
COMPILED_FAMILY = "compiled"  # variants built with torch.compile (ops/_compiled.py)
# call keys a site remembers routes for; past it the older half is forgotten (a miss finds the
# route again in bucket_routes). A call key holds the call's scalar arguments, so a job that
# anneals one (label smoothing, dropout) makes a new key every call: without a bound the table
# grew by ~2 KB a call. Jobs cycling through more shapes than this miss on every call
ROUTES_PER_SITE = 4096


class _LeadOptimizer:
    """Which optimizer's ``step()`` ends a training step. A job may step several (a GAN's
    generator and discriminator, one per parameter group kind): the first one seen leads, and
    another one takes over when it steps twice while the lead does not (the lead was replaced,
    or steps less often), so steps are neither counted twice nor stop being counted."""

    def __init__(self) -> None:
        self._ref: weakref.ref | None = None
        self._others: dict[int, int] = {}   # id -> steps since the lead's last

    def leads(self, optimizer: Any) -> bool:
        lead = self._ref() if self._ref is not None else None
        if lead is not None and lead is not optimizer:
            n = self._others[id(optimizer)] = self._others.get(id(optimizer), 0) + 1
            if n < 2:
                return False
        if lead is not optimizer:
            try:
                self._ref = weakref.ref(optimizer)
            except TypeError:          # an optimizer-like object without weak references
                self._ref = lambda: optimizer
        self._others.clear()
        return True


def _strided(args: tuple, kwargs: dict) -> tuple | None:
    """The layout kind of a call's first argument when it is a tensor that is not contiguous."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(first, torch.Tensor) and not first.is_contiguous():
        return layout_kind(first)
    return None


def _traced_here() -> bool:
    """Whether a call that sees torch's ``is_compiling()`` flag is traced on this thread. The flag
    is process-wide: a background compile (regions.py) sets it for the job's thread too, whose
    calls must still run routed (and recorded). Dynamo folds ``is_dynamo_compiling()`` to True
    when it traces, so nothing after it is traced or guarded on."""
    return (_is_dynamo_compiling() or not _background_compiles
            or threading.get_ident() in _background_compiles)


def _handed_over(public: Callable, torch_own: Callable | None, args: tuple, kwargs: dict) -> Any:
    """The call handed to the arguments' ``__torch_function__`` (or a mode's) under ``public``,
    the name it was made by: torch's own handlers compare ``func`` with
    ``torch.nn.functional.X`` when they run (``CausalBias``, expanded weights, fx quantization
    patterns), and that is the wrapper while rtxops is on. ``torch_own``: torch's Python function,
    which hands the call over itself (its arguments named as its handlers expect) under the
    name its module holds, the wrapper. Whatever the handler calls meanwhile on this thread runs
    unrouted, as torch's own."""
    with unrouted_on_this_thread():
        if torch_own is not None:
            return torch_own(*args, **kwargs)
        if _nested_among(args, kwargs):
            # torch's jagged tensors compare with the C function itself (nested/_internal/ops.py)
            return public.__wrapped__(*args, **kwargs)
        return _handle_torch_function(public, (*args, *kwargs.values()), *args, **kwargs)


def _nested_among(args: tuple, kwargs: dict) -> bool:
    nested = sys.modules.get("torch.nested._internal.nested_tensor")
    kind = getattr(nested, "NestedTensor", None)
    return kind is not None and any(isinstance(a, kind) for a in (*args, *kwargs.values()))


class _ThisThread(threading.local):
    unrouted = 0   # how deep this thread is in tracers that must see torch's own ops

    def __reduce__(self):   # a wrapper cloudpickled (see _Live): a fresh one over there
        return (_ThisThread, ())


_this_thread = _ThisThread()
# threads in an unrouted scope now: a routed call reads this cell, and this thread's own depth only
# while it is not 0 (a thread-local read cost a call ~7 µs with its caches cold, as between a
# step's ops: bench/dispatch_cold.py)
_unrouted_threads = [0]
_unrouted_lock = threading.Lock()


@contextlib.contextmanager
def unrouted_on_this_thread():
    """Nothing routed on this thread meanwhile (an fx or TorchScript trace, which must record
    torch's own ops); other threads, the job's among them (a background compile traces beside
    it), stay routed."""
    with _unrouted_lock:
        _unrouted_threads[0] += 1
    _this_thread.unrouted += 1
    try:
        yield
    finally:
        _this_thread.unrouted -= 1
        with _unrouted_lock:
            _unrouted_threads[0] -= 1


@contextlib.contextmanager
def background_compile():
    """Mark this thread's torch.compile work as a background one (see :func:`_traced_here`).
    Meanwhile the job's routes keep off variants built with torch.compile: dynamo compiles one
    frame at a time, so compiling one would wait for this compile, stalling the job."""
    ident = threading.get_ident()
    _background_compiles.add(ident)
    try:
        yield
    finally:
        _background_compiles.discard(ident)


def _subclass_among(args: tuple, kwargs: dict) -> bool:
    """Whether a tensor subclass with ``__torch_function__`` is among the arguments (called where
    ``_has_torch_function`` said yes, which a torch function mode alone also makes it say:
    ``torch.set_default_device`` sets one for good, and its calls must still be routed)."""
    if not _function_mode_enabled():
        return True
    for a in (*args, *kwargs.values()):
        kind = type(a)
        if kind is not torch.Tensor and isinstance(a, torch.Tensor) and \
                kind.__torch_function__ is not _disabled_torch_function:
            return True
    return False


_SETTINGS = "_rtxops_settings"


def _settings_of(module: torch.nn.Module) -> tuple:
    """The plain values an instance holds besides its tensors and submodules (an ``eps``, an
    ``add_unit_offset`` flag), kept on the instance from its first call: two instances of one
    class that differ in them are checked apart (the check of one said nothing of the other)."""
    settings = tuple(sorted(
        (name, repr(value) if isinstance(value, float) else value)   # (NaN never equals itself)
        for name, value in vars(module).items()
        if not name.startswith("_") and name != "training"
        and isinstance(value, (bool, int, float, str, type(None))))) or ("",)
    module.__dict__[_SETTINGS] = settings   # never empty: the wrapper's ``or`` reads it as cached
    return settings


class Scoped(NamedTuple):
    """A call key within a scope whose routes are checked apart from the others' (autocast on,
    a module's train or eval mode): a route checked in one is never reused in another."""

    key: Any
    scope: Any


# ``Scoped(key, scope)`` made as ``_scoped((key, scope))``: no Python frame (a module's route miss
# makes one of the plain tuple its wrapper looks routes up by; the two are equal, hash alike)
_scoped = functools.partial(tuple.__new__, Scoped)

any_autocast = torch._C._is_any_autocast_enabled


def autocast_scope() -> tuple:
    """The autocast state in force, as (device, dtype) pairs (callers check ``any_autocast()``)."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
                 if torch.is_autocast_enabled(d))


class _Live(int):
    """The dispatcher's on flag as wrappers read it (``live[0]``): true while rtxops routes.

    cloudpickle ships a ``__main__`` class or function by value, with the wrapper rtxops put in
    its place and everything the wrapper's closure holds (Ray, joblib's loky, submitit). The
    flag goes as False, the routes as an empty table and the site as a stand-in: the copy in the
    other process runs the original, and nothing of this process's dispatcher goes with it.
    """

    def __reduce__(self):
        return (bool, (False,))


LIVE = _Live(1)


class _RouteTable(dict):
    """Routes by call key (see :class:`_Live`): pickled empty."""

    __slots__ = ()

    def __reduce__(self):
        return (dict, ())


class _SiteLeftBehind:
    """What a site pickles as (see :class:`_Live`): a pickled wrapper never routes, so never
    calls it."""


class _CoreLeftBehind:
    """What a site's C++ core pickles as (see :class:`_Live`): its routes stay in this process."""

    version = 0

    def call(self, *args, **kwargs):
        raise RuntimeError("a pickled rtxops wrapper does not route")

    insert = call

    def clear(self) -> None:
        pass


if _Core is not None:
    copyreg.pickle(_Core, lambda core: (_CoreLeftBehind, ()))


@dataclass(frozen=True)
class Choice:
    variant: Variant
    config: dict
    weight: float = 1.0

    @property
    def config_json(self) -> str:
        return json.dumps(self.config, sort_keys=True, separators=(",", ":"))


class FunctionSite:
    """A function replaced by a dispatching wrapper (``F.rms_norm``, a module's ``apply_rotary_pos_emb``).

    ``reference`` is the function the caller would have called. A route is a tuple
    ``(fn, slot, on_error)``: the wrapper times ``fn`` and records it under ``slot`` (``-1``: the
    route records itself), and hands exceptions to ``on_error`` (None: they propagate, as the
    reference's own errors must).
    """

    kind = "function"
    needs_reference_check = False

    def __init__(self, dispatcher: Dispatcher, op: OpSpec, name: str, reference: Callable,
                 matched_by_name: bool = False) -> None:
        self.dispatcher, self.op, self.name, self.reference = dispatcher, op, name, reference
        # a job's own function taken for the op by its name (``apply_rotary_pos_emb``), not
        # torch's: only a first call's check proves a variant computes what it computes
        self.matched_by_name = matched_by_name
        self.routes: dict[Any, Any] = _RouteTable()  # call key -> route
        self.bucket_routes: dict[tuple, Any] = {}  # bucket key -> route (shared by call keys)
        self.core = None   # the C++ routing of plain calls (see _make_wrapper)
        self.wrapper = self._make_wrapper()

    def _make_wrapper(self) -> Callable:
        call_key, route_of, ref, miss = self.op.call_key, self.routes.get, self.reference, self._miss
        record_cell, live = self.dispatcher.record_cell, self.dispatcher.live
        here, unrouted_threads = _this_thread, _unrouted_threads
        core = core_call = core_insert = None
        # a job's own function (matched by name) knows no torch functions: it runs as written
        as_written = naming_itself(ref) if self.matched_by_name else None
        # torch's Python function itself (``ref`` is a copy naming itself, see originals.py)
        torch_own = getattr(ref, "__wrapped__", None) if as_written is None and \
            inspect.isfunction(ref) else None

        def dispatching(*args, **kwargs):
            if not live[0] or _is_dynamo_compiling() or (
                    _compiler._is_compiling_flag and _traced_here()):
                # not live: a wrapper held past disable() (``self.act = F.gelu``) is torch's again
                return ref(*args, **kwargs)
            if core_call is not None:   # a call it does not route itself comes to routed()
                return core_call(*args, **kwargs)
            return routed(*args, **kwargs)

        def routed(*args, **kwargs):
            if unrouted_threads[0] and here.unrouted:
                # a tracer's (fx) proxies still take the call, under this name
                if as_written is None and (_has_torch_function(args) or (
                        kwargs and _has_torch_function(kwargs.values()))):
                    return _handed_over(dispatching, torch_own, args, kwargs)
                return ref(*args, **kwargs)
            if (_has_torch_function(args) or (kwargs and _has_torch_function(kwargs.values()))) \
                    and _subclass_among(args, kwargs):
                # a tensor subclass takes the call; no route checked on plain tensors applies
                if as_written is not None:
                    return as_written(*args, **kwargs)
                return _handed_over(dispatching, torch_own, args, kwargs)
            version = 0 if core is None else core.version
            try:
                key = call_key(*args, **kwargs)
                if any_autocast() and key is not None:
                    key = Scoped(key, autocast_scope())
                route = route_of(key)
            except Exception:  # an unhashable argument, or a signature the op does not know
                return ref(*args, **kwargs)
            if route is None:
                if key is None:
                    return ref(*args, **kwargs)
                route = miss(key, args, kwargs)
            fn, slot, on_error = route
            if core is not None and route_of(key) is route:
                # not a route a miss made without keeping it (a TorchScript trace's)
                core_insert(version, fn, slot, on_error, *args, **kwargs)
            t0 = perf_counter_ns()
            try:
                out = fn(*args, **kwargs)
            except _NOT_A_FAILURE:
                raise
            except Exception as e:
                if on_error is None:
                    raise
                return on_error(e, args, kwargs)
            if slot >= 0:
                record_cell[0](slot, t0)
            return out

        if _Core is not None:
            self.core = core = _Core(unrouted_threads, record_cell, routed, _NOT_A_FAILURE)
            core_call, core_insert = core.call, core.insert
        dispatching.__name__ = getattr(ref, "__name__", self.op.name)
        dispatching.__qualname__ = getattr(ref, "__qualname__", dispatching.__name__)
        # pickle finds a function by module and name: there the wrapper stands in for the original
        # (torch.save of a module holding F.gelu), and without rtxops it loads the original
        dispatching.__module__ = getattr(ref, "__module__", None) or __name__
        dispatching.__doc__ = getattr(ref, "__doc__", None)
        dispatching.__wrapped__ = ref  # type: ignore[attr-defined]
        dispatching.__rtxops_wrapper__ = True  # type: ignore[attr-defined]
        return dispatching

    def __reduce__(self):
        return (_SiteLeftBehind, ())

    def _miss(self, key, args: tuple, kwargs: dict) -> Any:
        if _tracing_state() is not None:
            # a TorchScript trace that did not come through torch.jit.trace (patching.py makes
            # that one unrouted), torch.onnx's for one: sizes are traced values, so the trace
            # gets torch's own ops, and no route is kept
            return self.unrouted()
        scope = key.scope if isinstance(key, Scoped) else None
        strided = _strided(args, kwargs)
        if strided is not None:
            # a view of another layout (ops whose key tells layouts apart): routed as its bucket,
            # and each kind of layout checked on its own first call (a variant may answer one as
            # torch does and another not)
            scope = (scope, "strided", strided)
        try:
            bucket_key = self.op.bucket(*args, **kwargs)
        except Exception:  # values the bucket cannot read (FX proxies, nested tensors): as written
            return self.unrouted()
        return self.dispatcher._resolve(self, key, bucket_key, scope=scope)

    def unrouted(self) -> Any:
        """The route of calls the variants do not take: the reference, untimed."""
        return (self.reference, -1, None)

    def reference_fn(self) -> Callable:
        return self.reference

    def timed(self, fn: Callable, slot: int, on_error: Callable | None, whole: bool | None = None) -> Any:
        return (fn, slot, on_error)

    def self_recording(self, fn: Callable) -> Any:
        return (fn, -1, None)

    def explore(self, routes: list, weights: list[float]) -> Any:
        schedule = _explore_schedule(routes, weights)
        record_cell, counter = self.dispatcher.record_cell, [0]

        steady = _steady_index(schedule, routes[0])

        def explore(*args, **kwargs):
            if _recomputable():
                fn, slot, on_error = schedule[steady]
            else:
                n = counter[0] = (counter[0] + 1) % EXPLORE_PERIOD
                fn, slot, on_error = schedule[n]
            t0 = perf_counter_ns()
            try:
                out = fn(*args, **kwargs)
            except _NOT_A_FAILURE:
                raise
            except Exception as e:
                if on_error is None:
                    raise
                return on_error(e, args, kwargs)
            if slot >= 0:
                record_cell[0](slot, t0)
            return out

        explore.schedule = schedule  # type: ignore[attr-defined]
        return self.self_recording(explore)

    def arm_backward(self, make_sampler: Callable, settled: bool = True) -> None:
        """Make the next call of every timed route also time its backward (then disarm); the
        arms of an exploring bucket each time theirs (the evolve loop weighs them by it).
        ``settled`` False: only the arms of exploring buckets."""
        with self.dispatcher._lock:  # another thread's route miss may be adding a route
            arms = [_arms_of(r) for r in self.bucket_routes.values()]
        routes = {id(arm): arm for each in arms if settled or len(each) > 1 for arm in each}
        for route in routes.values():
            fn, slot, on_error = self._parts(route)
            if slot < 0:   # untimed, or armed at a boundary before and not called since
                continue
            armed: list = []
            disarm = lambda armed=armed, route=route: self.replace(armed[0], route)  # noqa: E731
            # slot -1: the sampler records the call itself, around the op alone (the timer's
            # own cost in a forward figure weighed most on the arms with the fewest calls)
            armed.append(self.timed(make_sampler(fn, slot, disarm), -1, on_error,
                                    whole=self._is_whole(route)))
            self.replace(route, armed[0])

    def _parts(self, route: Any) -> tuple:
        return route

    def _is_whole(self, route: Any) -> bool | None:
        return None

    def clear(self) -> None:
        """Forget every route; the next calls resolve again (plan swap, disabled variant)."""
        self.routes.clear()
        self.bucket_routes.clear()
        if self.core is not None:
            self.core.clear()

    def replace(self, old: Any, new: Any) -> None:
        """Put ``new`` wherever ``old`` is installed, directly or as an explore arm."""
        with self.dispatcher._lock:  # as route misses add routes (other threads: no lock to read)
            for table in (self.routes, self.bucket_routes):
                for k, v in list(table.items()):
                    if v is old:
                        table[k] = new
                    else:
                        _replace_in_explore(v, old, new)
            if self.core is not None:
                self.core.clear()

    def run_reference(self, args: tuple, kwargs: dict) -> Any:
        return self.reference(*args, **kwargs)

    def run_variant(self, fn: Callable, args: tuple, kwargs: dict) -> tuple[Any, int]:
        """Run ``fn`` as a route would; return its output and the op's own time in ns."""
        t0 = perf_counter_ns()
        out = fn(*args, **kwargs)
        return out, perf_counter_ns() - t0


def routed_linear_forward(site: FunctionSite, torch_forward: Callable) -> Callable:
    """``nn.Linear.forward`` while rtxops is on: the ``F.linear`` site's routing of the input and
    the module's weight and bias as its parameter table holds them, in this one frame (torch's
    forward reads each through ``Module.__getattr__``, a Python call, then calls the site's
    wrapper, another frame: with a step's caches cold each costs the call a microsecond or more,
    15 calls a step of the example GPT, ``bench/dispatch_cold_sites.py``). A call this frame does
    not route itself (a miss, autocast, a tracer, a tensor subclass, ``F.linear`` replaced by
    someone else) goes to ``F.linear`` as torch's forward sends it; anything else (a subclass, a
    parametrization, a parameter replaced by a plain attribute, dynamo's traces, a compile
    session) runs torch's forward. With the C++ core built, the call goes to the site's core,
    whose misses go to the site's Python path."""
    call_key, route_of, wrapper = site.op.call_key, site.routes.get, site.wrapper
    record_cell, live = site.dispatcher.record_cell, site.dispatcher.live
    unrouted_threads = _unrouted_threads
    core_call = None if site.core is None else site.core.call   # its misses go to the site's Python path
    linear, functional = torch.nn.Linear, torch.nn.functional

    def forward(self, input):
        if type(self) is not linear or _is_dynamo_compiling() or _compiler._is_compiling_flag:
            return torch_forward(self, input)
        own = self.__dict__
        params = own["_parameters"]
        if "weight" not in params or "bias" not in params or "weight" in own or "bias" in own:
            return torch_forward(self, input)
        args = (input, params["weight"], params["bias"])
        if not live[0] or unrouted_threads[0] or functional.linear is not wrapper or \
                any_autocast() or _has_torch_function(args):
            return functional.linear(*args)
        if core_call is not None:
            return core_call(*args)
        try:
            route = route_of(call_key(*args))
        except Exception:  # an unhashable key (an input that is no tensor): the wrapper decides
            route = None
        if route is None:
            return wrapper(*args)
        fn, slot, on_error = route
        t0 = perf_counter_ns()
        try:
            out = fn(*args)
        except _NOT_A_FAILURE:
            raise
        except Exception as e:
            if on_error is None:
                raise
            return on_error(e, args, {})
        if slot >= 0:
            record_cell[0](slot, t0)
        return out

    forward.__wrapped__ = torch_forward  # type: ignore[attr-defined]
    forward.__rtxops_wrapper__ = True  # type: ignore[attr-defined]
    forward.__name__, forward.__qualname__ = torch_forward.__name__, torch_forward.__qualname__
    forward.__module__, forward.__doc__ = torch_forward.__module__, torch_forward.__doc__
    return forward


def _insert_module_route(core_insert: Callable, version: int, route: Callable, module, args: tuple,
                         kwargs: dict) -> None:
    """Give a module class's route to its site's C++ core, which calls what it holds as the
    forward is called: the class's own forward timed as the route times it (``whole``), else the
    route itself, which splits the call and times the op."""
    if getattr(route, "whole", None) is True:
        fn, slot, _ = route.parts   # (the route hands no errors on: the class's own)
        core_insert(version, fn, slot, None, module, *args, **kwargs)
    else:
        core_insert(version, lambda module, *args, **kwargs: route(module, None, args, kwargs), -1,
                    None, module, *args, **kwargs)


class ModuleSite(FunctionSite):
    """A module class whose forward is hand-written math for an op (an RMSNorm, a gated MLP).

    ``split(module, *args, **kwargs)`` returns ``(canonical_args, post)``: the op's arguments and
    ``post(module, out)`` that finishes the forward (None when the op is the whole forward), or None
    when the call does not fit. Routes take ``(module, parts, args, kwargs)``. Each class is checked
    against its own forward on the first call of every bucket whose output is not all zeros (a
    dummy forward on zeros proves nothing), after ``unfit(module)`` found nothing the rewrite
    would drop (a parameter the op does not take); one mismatch puts the class back on its own
    forward for good.
    """

    kind = "module"
    matched_by_name = True   # a class taken for the op by its pattern (see FunctionSite)

    def __init__(self, dispatcher, op, name, cls: type, split: Callable, whole_forward: bool,
                 unfit: Callable | None = None, key_of: Callable | None = None,
                 core_reads: tuple[tuple[str, ...], tuple[str, ...]] | None = None) -> None:
        self.cls, self.split, self.whole_forward = cls, split, whole_forward
        # ``(parameter names, float names)``: all that ``key_of`` reads of the module besides its
        # class, ``training`` and settings, for the C++ core to describe a call by (see
        # _native/dispatch_core.cpp); None: the calls are routed in Python
        self.core_reads = core_reads if key_of is not None else None
        # ``key_of(module, *args, **kwargs)``: the call's key without running the split, for a
        # split that computes (a gated MLP's gate and up projections). Then routes get parts
        # None and split when they run the op: a route that runs the class's own forward (or a
        # first call that puts the class back) has computed nothing besides, and nothing saved
        # for backward that a checkpoint's recompute would not save again
        self.key_of = key_of
        self.unfit = unfit or (lambda module: None)
        self.original_forward = cls.forward
        self.failed: str | None = None
        self.subclasses_back: dict[type, str] = {}   # subclasses given up alone, and why
        self._dormant = [False]  # a cell the wrapper reads: run the class's own forward, untimed
        super().__init__(dispatcher, op, name, self.original_forward, matched_by_name=True)
        self._update_dormant()

    def clear(self) -> None:
        super().clear()
        self._update_dormant()

    def _update_dormant(self) -> None:
        """A class whose forward only contains the op (a gated MLP) is rewritten as the op only
        when the running plan routes that op, or the job asked for it (``reroute_partial``):
        the rewrite drops whatever else its forward does (side effects, an activation chosen per
        instance), which one first call per bucket cannot see."""
        plan, d = self.dispatcher.plan, self.dispatcher
        # a class put back for good stays so through a forward held from before (accelerate's
        # hooks keep ``module._old_forward``): it was checked again on every call
        routed = self.op.name in plan.defaults or any(e.op == self.op.name for e in plan.entries)
        self._dormant[0] = self.failed is not None or (
            not self.whole_forward and not d.reroute_partial and not routed)

    def _make_wrapper(self) -> Callable:
        call_key, route_of, original, split, miss = (
            self.op.call_key, self.routes.get, self.original_forward, self.split, self._miss,
        )

        cls, dormant, live, here = self.cls, self._dormant, self.dispatcher.live, _this_thread
        unrouted_threads = _unrouted_threads
        key_of = self.key_of
        core = core_call = core_insert = None

        def forward(module, *args, **kwargs):
            if dormant[0] or not live[0] or _is_dynamo_compiling() or (
                    _compiler._is_compiling_flag and _traced_here()):
                return original(module, *args, **kwargs)
            if core_call is not None:   # a call it does not route itself comes to routed()
                return core_call(module, *args, **kwargs)
            return routed(module, *args, **kwargs)

        def routed(module, *args, **kwargs):
            if (unrouted_threads[0] and here.unrouted) or (
                    (_has_torch_function(args) or (kwargs and _has_torch_function(kwargs.values())))
                    and _subclass_among(args, kwargs)):
                return original(module, *args, **kwargs)
            version = 0 if core is None else core.version
            try:
                if key_of is None:
                    parts = split(module, *args, **kwargs)
                    key = None if parts is None else call_key(*parts[0])
                else:
                    parts, key = None, key_of(module, *args, **kwargs)
            except Exception:  # inputs the op's key cannot read (nested tensors): as written
                return original(module, *args, **kwargs)
            if key is not None:
                # train and eval (and autocast) are checked apart: a forward may differ between
                # them (dropout); so is a subclass that inherits the forward (it may set what
                # that forward reads differently). A plain tuple equal to Scoped(key, scope),
                # ``training`` read from the instance's dict: ``module.training`` looks through
                # the class's bases first; with the scope made through ``_scoped`` that cost a
                # call 1-2 µs more with a step's caches cold (side by side in one process)
                own, sub = module.__dict__, type(module)
                training = own.get("training")
                key = (key, (module.training if training is None else training,
                             autocast_scope() if any_autocast() else None,
                             None if sub is cls else sub, own.get(_SETTINGS) or _settings_of(module)))
            route = route_of(key)
            if route is None:
                if key is None:
                    return original(module, *args, **kwargs)
                key = _scoped(key)   # (the miss reads its scope)
                if parts is None:
                    with torch.no_grad():   # the op's arguments, for their bucket only
                        canonical = split(module, *args, **kwargs)
                    if canonical is None:
                        return original(module, *args, **kwargs)
                    route = miss(key, canonical[0], {})
                else:
                    route = miss(key, parts[0], {})
            if core is not None and route_of(key) is route:
                _insert_module_route(core_insert, version, route, module, args, kwargs)
            return route(module, parts, args, kwargs)

        if _Core is not None and self.core_reads is not None:
            self.core = core = _Core(unrouted_threads, self.dispatcher.record_cell, routed,
                                     _NOT_A_FAILURE, module_reads=self.core_reads)
            core_call, core_insert = core.call, core.insert
        forward.__wrapped__ = original  # type: ignore[attr-defined]
        forward.__rtxops_wrapper__ = True  # type: ignore[attr-defined]
        return forward

    @property
    def needs_reference_check(self) -> bool:
        return not self.whole_forward

    def reference_fn(self) -> Callable:
        """The class's own forward when the op is the whole forward, else the op's reference."""
        return self.original_forward if self.whole_forward else self.op.reference

    def self_recording(self, fn: Callable) -> Callable:
        return fn

    def unrouted(self) -> Callable:
        original = self.original_forward
        return lambda module, parts, args, kwargs: original(module, *args, **kwargs)

    def explore(self, routes: list, weights: list[float]) -> Callable:
        schedule, counter = _explore_schedule(routes, weights), [0]
        steady = _steady_index(schedule, routes[0])

        def explore(module, parts, args, kwargs):
            if _recomputable():
                return schedule[steady](module, parts, args, kwargs)
            n = counter[0] = (counter[0] + 1) % EXPLORE_PERIOD
            return schedule[n](module, parts, args, kwargs)

        explore.schedule = schedule  # type: ignore[attr-defined]
        return explore

    def _parts(self, route: Any) -> tuple:
        return getattr(route, "parts", (None, -1, None))

    def _is_whole(self, route: Any) -> bool | None:
        return getattr(route, "whole", None)

    def timed(self, fn: Callable, slot: int, on_error: Callable | None,
              whole: bool | None = None) -> Callable:
        record_cell = self.dispatcher.record_cell
        if whole is None:
            whole = fn is self.original_forward
        if whole:
            def whole_forward(module, parts, args, kwargs):
                t0 = perf_counter_ns()
                out = fn(module, *args, **kwargs)
                if slot >= 0:
                    record_cell[0](slot, t0)
                return out
            whole_forward.parts, whole_forward.whole = (fn, slot, on_error), True  # type: ignore[attr-defined]
            return whole_forward

        split, original = self.split, self.original_forward

        def route(module, parts, args, kwargs):  # time only the op, not the rest of the forward
            if parts is None:
                parts = split(module, *args, **kwargs)
                if parts is None:   # (key_of took it for the op's)
                    return original(module, *args, **kwargs)
            canonical, post = parts
            t0 = perf_counter_ns()
            try:
                out = fn(*canonical)
            except _NOT_A_FAILURE:
                raise
            except Exception as e:
                if on_error is None:
                    raise
                return on_error(e, (module, parts, args, kwargs), {})
            if slot >= 0:
                record_cell[0](slot, t0)
            return out if post is None else post(module, out)

        route.parts, route.whole = (fn, slot, on_error), False  # type: ignore[attr-defined]
        return route

    def run_reference(self, a: tuple, k: dict) -> Any:
        module, _, args, kwargs = a
        return self.original_forward(module, *args, **kwargs)

    def parts_of(self, a: tuple) -> tuple:
        """The op's part of the call ``a`` (``(canonical args, post)``), split now if the wrapper
        did not (``key_of``)."""
        module, parts, args, kwargs = a
        if parts is None:
            parts = self.split(module, *args, **kwargs)
            if parts is None:
                raise TypeError(f"the call does not fit {self.op.name} ({self.name}'s split)")
        return parts

    def run_variant(self, fn: Callable, a: tuple, k: dict) -> tuple[Any, int]:
        module = a[0]
        canonical, post = self.parts_of(a)
        t0 = perf_counter_ns()
        out = fn(*canonical)
        elapsed = perf_counter_ns() - t0
        return (out if post is None else post(module, out)), elapsed

    def give_up(self, reason: str, module: torch.nn.Module | None = None) -> None:
        """Put the class back on its original forward for good; only ``module``'s class when that
        is a subclass inheriting the forward (the class's own instances were checked apart)."""
        sub = type(module) if module is not None else self.cls
        if sub is not self.cls and "forward" not in sub.__dict__:
            sub.forward = self.original_forward   # in the subclass's own namespace: no wrapper
            self.subclasses_back[sub] = reason
            log.warning("rtxops: %s (subclass of %s) stays on its own forward: %s",
                        sub.__qualname__, self.name, reason)
            return
        self.failed = reason
        if self.cls.__dict__.get("forward") is self.wrapper:
            self.cls.forward = self.original_forward
        self.clear()
        log.warning("rtxops: %s stays on its own forward: %s", self.name, reason)

    def forget_subclasses(self) -> None:
        """Take the forwards :meth:`give_up` gave subclasses off again (``disable()``)."""
        for sub in self.subclasses_back:
            if sub.__dict__.get("forward") is self.original_forward:
                del sub.forward
        self.subclasses_back.clear()


class Dispatcher:
    """Holds the running plan, the sites, the build cache and what was disabled."""

    def __init__(self, registry: Registry | None = None, readings: Readings | None = None,
                 verify_first_call: bool = True, backward_every: int = BACKWARD_EVERY) -> None:
        self.registry = registry or default_registry()
        self.readings: Readings = readings if readings is not None else CallStats()
        # the hot path reads the sink through this cell
        self.record_cell = [self.readings.record_since]
        self.live = [LIVE]  # False once disabled: wrappers still held somewhere call torch's own
        self.verify_first_call = verify_first_call
        # time one backward per route every N steps (0: never); exploring arms at least every
        # EXPLORE_BACKWARD_EVERY steps
        self.backward_every = backward_every
        self.cuda_timer: CudaEventTimer | None = None
        # per-call CUDA memory readings reset torch's peak counter before each routed call, which
        # the job's own max_memory_allocated() would then report: only when asked for
        self.call_memory = False
        self.cuda_time_every = 1   # see CudaEventTimer: one call in N timed with events
        # route classes whose forward only contains an op (gated MLPs) on every plan, not only
        # on plans that route that op (see ModuleSite._update_dormant)
        self.reroute_partial = False
        # regions' device time; no memory readings: resetting the allocator's peak on every step
        # would overwrite the job's own max_memory_allocated()
        self.region_timer: CudaEventTimer | None = None
        self.plan: Plan = default_plan()
        self.pending: Plan | None = None
        self.step = 0
        # steps an earlier attempt of this job ran (RTXOPS_STEP_BASE): counting goes on from
        # there, so a job's (job id, step) names one step across restarts
        self.steps_before = 0
        self._lead = _LeadOptimizer()
        self.sites: list[FunctionSite] = []
        self.slots: list[Slot] = []
        self._slot_ids: dict[tuple, int] = {}
        self._builds: dict[tuple, Callable] = {}
        self.disabled: dict[tuple, str] = {}  # (op, variant, config, bucket, autocast) -> reason
        self.plan_rejections: list[str] = []
        self.on_miss: Callable[[], None] | None = None
        self.regions = None  # a RegionCompiler when the whole model is to be compiled (regions.py)
        self.optimizer_region = None  # a FusedOptimizer when the optimizer may run fused
        self._compiling_elsewhere = False  # a background compile ran at the last step boundary
        self._rss = (0, -RSS_EVERY_NS)   # (bytes, when read) of the last RSS reading
        self.second_order = False  # the job differentiated a gradient (second_order.py)
        self._lock = threading.RLock()

    # ---- sites ----------------------------------------------------------------------------
    def function_site(self, op: str, name: str, reference: Callable,
                      matched_by_name: bool = False) -> FunctionSite:
        site = FunctionSite(self, self.registry.op(op), name, reference, matched_by_name)
        self.sites.append(site)
        return site

    def module_site(self, op: str, cls: type, split: Callable, whole_forward: bool,
                    unfit: Callable | None = None, key_of: Callable | None = None,
                    core_reads: tuple | None = None) -> ModuleSite:
        name = f"module:{cls.__module__}.{cls.__qualname__}"
        site = ModuleSite(self, self.registry.op(op), name, cls, split, whole_forward, unfit, key_of,
                          core_reads)
        self.sites.append(site)
        return site

    # ---- plans ----------------------------------------------------------------------------
    def install_plan(self, plan: Plan) -> None:
        """Validate ``plan`` and queue it for the next optimizer-step boundary.

        Raises :class:`PlanError` (and keeps the running plan) when it is invalid or not newer
        than the running or already-queued plan.
        """
        with self._lock:
            try:
                newest = self.pending.version if self.pending else self.plan.version
                if plan.version <= newest:
                    raise PlanError(
                        f"plan version {plan.version} is not newer than version {newest}; "
                        f"keeping version {self.plan.version}"
                    )
                plan.validate(self.registry)
            except PlanError as e:
                self.plan_rejections.append(str(e))
                raise
            self.pending = plan

    def apply_pending(self, at_once: bool = False) -> bool:
        """Swap in the queued plan now (the step hook calls this) if its effective step has come,
        or ``at_once`` (a plan the job starts with: the step it was published for belongs to the
        run it was tuned in). True when a swap happened."""
        with self._lock:
            plan = self.pending
            if plan is None or (not at_once and plan.effective_step is not None
                                and self.step < plan.effective_step):
                return False
            old, self.plan, self.pending = self.plan, plan, None
            for site in self.sites:
                site.clear()
        self.readings.swap(self.step, old.version, plan.version, plan.digest)
        log.info("plan %s -> %s at step %s", old.version, plan.version, self.step)
        return True

    def on_step(self, optimizer=None) -> None:
        """Optimizer-step boundary (after ``optimizer`` stepped): count the step, apply a queued
        plan, let the regions act, report the step. With several optimizers one of them marks
        the steps (see :class:`_LeadOptimizer`). An optimizer stepped from a backward hook
        (optimizer-in-backward: one per parameter, stepped as its gradient lands) marks the
        boundary at that backward's end: a plan swapped in before would answer a checkpoint's
        recompute later in the same backward with another variant."""
        if torch._C._current_graph_task_id() != -1:
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(self._boundary, optimizer))
            return
        self._boundary(optimizer)

    def _boundary(self, optimizer) -> None:
        leads = optimizer is None or self._lead.leads(optimizer)
        if leads:
            self.step += 1
        if self.optimizer_region is not None and optimizer is not None:
            # first: its clock on the optimizer's step stops before the bookkeeping below; it
            # sees every optimizer (it leaves a job stepping several alone)
            self.optimizer_region.on_step(self.step, optimizer)
        if not leads:
            return
        ran_under = self.plan.version   # the step that ends here ran under this plan
        swapped = self.pending is not None and self.apply_pending()
        compiling = bool(_background_compiles)
        if compiling != self._compiling_elsewhere:
            # a background compile began or ended: routes are made again (choices() holds
            # torch.compile variants back meanwhile, also those routed before it began)
            with self._lock:
                self._compiling_elsewhere = compiling
                if not swapped:
                    for site in self.sites:
                        site.clear()
        if self.regions is not None:
            self.regions.on_step(self.step)
        every = self.backward_every
        if every:
            settled = self.step % every == 0
            if settled or self.step % min(every, EXPLORE_BACKWARD_EVERY) == 0:
                for site in self.sites:
                    site.arm_backward(self._backward_sampler, settled)
        for timer in (self.cuda_timer, self.region_timer):
            if timer is not None:
                timer.drain()
        now = perf_counter_ns()
        if now - self._rss[1] >= RSS_EVERY_NS:
            self._rss = (rss_bytes(), now)
        self.readings.step(self.step, now, ran_under, self._rss[0])

    def set_reroute_partial(self, on: bool) -> None:
        """Route gated-MLP-like classes on every plan (``RTXOPS_REROUTE_MLP=1``), or only on plans
        that route their op (the default)."""
        with self._lock:
            self.reroute_partial = on
            for site in self.sites:
                site.clear()

    def drain_timers(self) -> None:
        """Report the CUDA-timed calls still pending (at exit: their events done by a
        synchronize, which only the end of the job may wait for)."""
        timers = [t for t in (self.cuda_timer, self.region_timer) if t is not None]
        try:
            if timers and torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            for timer in timers:
                timer.drain()
        except Exception as e:   # a CUDA error the job left behind (sticky: every CUDA call
            # raises it again): the rest of the telemetry and the summary still go out
            log.warning("rtxops: the last CUDA-timed calls are not reported: %s", _describe(e))

    def set_readings(self, readings: Readings) -> None:
        """Send readings elsewhere; routes are rebuilt so the hot path calls the new sink."""
        with self._lock:
            self.readings = readings
            self.record_cell[0] = readings.record_since
            for timer in (self.cuda_timer, self.region_timer):
                if timer is not None:
                    timer.readings = readings
            for slot in self.slots:
                readings.register_slot(slot)
            for site in self.sites:
                site.clear()

    # ---- regions: code rtxops runs whole, with no per-op routing inside ------------------------
    def region_clock(self, site: str, variant: str, family: str, tensors: Iterable[torch.Tensor],
                     config: dict | None = None) -> tuple[Callable[[], Any], Callable[[Any], None]]:
        """``(start, stop)`` timing stretches of a region (op ``region``: the compiled model, the
        optimizer's step) as calls of its own slot, so its time stays in the telemetry where the
        per-op spans stop. ``stop(start())`` records one call; host time on CPU, CUDA events on
        CUDA. The bucket is the tensors' dtype, device and element count."""
        bucket, device = region_bucket(tensors)
        config_json = json.dumps(config or {}, sort_keys=True, separators=(",", ":"))
        with self._lock:
            slot = self._new_slot((site, variant, config_json, bucket), REGION_OP, variant,
                                  config_json, bucket, site, family)
            if device.type == "cuda" and self.region_timer is None:
                self.region_timer = CudaEventTimer(self.readings, memory=False)
        if device.type == "cuda":
            timer = self.region_timer
            return lambda: timer.begin(device), lambda begun: timer.end(slot, begun)
        cell = self.record_cell

        def stop(t0: int) -> None:
            cell[0](slot, t0)

        return perf_counter_ns, stop

    def time_region(self, fn: Callable, site: str, variant: str, family: str,
                    tensors: Iterable[torch.Tensor], config: dict | None = None) -> Callable:
        """``fn`` with each call recorded as one call of a region (see :meth:`region_clock`); a
        clock that fails stops recording, never the call."""
        start, stop = self.region_clock(site, variant, family, tensors, config)
        broken: list[Exception] = []

        def timed(*args, **kwargs):
            begun = None
            if not broken:
                try:
                    begun = start()
                except Exception as e:
                    broken.append(e)
                    log.warning("rtxops: %s is no longer timed: %s", site, _describe(e))
            out = fn(*args, **kwargs)
            if begun is not None:
                try:
                    stop(begun)
                except Exception as e:
                    broken.append(e)
                    log.warning("rtxops: %s is no longer timed: %s", site, _describe(e))
            return out

        return timed

    # ---- resolution (route miss) ----------------------------------------------------------
    def choices(self, op: OpSpec, bucket: Bucket, autocast: tuple | None = None,
                refused: list[Choice] | None = None) -> list[Choice]:
        """The (variant, config, weight) arms the running plan asks for in ``bucket`` (under
        ``autocast``, the autocast state in force: a variant disabled there only may run outside).
        Arms a job differentiating gradients cannot run are replaced by the reference and
        appended to ``refused``."""
        entry = self.plan.entry(op.name, bucket.id)
        if entry is not None:
            arms = [(entry.variant, dict(entry.config), 1.0 - sum(a.weight for a in entry.explore))]
            arms += [(a.variant, dict(a.config), a.weight) for a in entry.explore]
        else:
            arms = [(self.plan.defaults.get(op.name, REFERENCE), {}, 1.0)]
        out = []
        for name, config, weight in arms:
            variant = self.registry.variant(op.name, name)
            choice = Choice(variant, {**variant.default_config, **config}, weight)
            usable = variant.supports(bucket) and (
                op.name, name, choice.config_json, bucket.id, autocast) not in self.disabled
            if usable and variant.family == COMPILED_FAMILY and _background_compiles:
                usable = False  # until the compile is over (see on_step)
            if usable and self.second_order and not variant.double_backward:
                usable = False
                if refused is not None:
                    refused.append(choice)
            if not usable:
                choice = Choice(self.registry.variant(op.name, REFERENCE), {}, weight)
            out.append(choice)
        return out

    def _resolve(self, site: FunctionSite, key, bucket_key: tuple | None, scope: Any = None) -> Any:
        """Route miss: find (or make) the route of ``bucket_key`` (within ``scope``: autocast's
        state, a module's train or eval mode) and file it under ``key``."""
        if self.on_miss is not None:
            self.on_miss()
        with self._lock:
            if bucket_key is None:
                route = site.unrouted()
            else:
                shared = bucket_key if scope is None else (bucket_key, scope)
                route = site.bucket_routes.get(shared)
                if route is None:
                    bucket = site.op.to_bucket(bucket_key)
                    # a variant that fails under autocast (torch upcasts some ops there) is
                    # disabled under that autocast state only
                    ac = autocast_scope() if any_autocast() else None
                    refused: list[Choice] = []
                    arms = [self._route(site, bucket, c, ac)
                            for c in self.choices(site.op, bucket, ac, refused)]
                    for choice in refused:
                        self._refuse_second_order(site, bucket, choice, ac)
                    if len(arms) == 1:
                        route = arms[0][0]
                    else:
                        route = site.explore([r for r, _ in arms], [w for _, w in arms])
                    site.bucket_routes[shared] = route
            if len(site.routes) >= ROUTES_PER_SITE:
                for old in list(itertools.islice(site.routes, ROUTES_PER_SITE // 2)):
                    del site.routes[old]
            site.routes[key] = route
            return route

    def _slot(self, site: FunctionSite, choice: Choice, bucket: Bucket) -> int:
        return self._new_slot((site.name, choice.variant.name, choice.config_json, bucket.id),
                              site.op.name, choice.variant.name, choice.config_json, bucket.id,
                              site.name, choice.variant.family)

    def _new_slot(self, key: tuple, op: str, variant: str, config: str, bucket: str, site: str,
                  family: str) -> int:
        slot = self._slot_ids.get(key)
        if slot is None:
            slot = self._slot_ids[key] = len(self.slots)
            info = Slot(slot, op, variant, config, bucket, site, family)
            self.slots.append(info)
            self.readings.register_slot(info)
        return slot

    def _route(self, site: FunctionSite, bucket: Bucket, choice: Choice, autocast: tuple | None = None):
        slot = self._slot(site, choice, bucket)
        if choice.variant.name == REFERENCE:
            fn = site.reference_fn()
            fast = self._timed_on_device(site, fn, slot, None, bucket)
            if site.needs_reference_check:
                return self._probation(site, fn, fast, slot, None, choice), choice.weight
            return fast, choice.weight
        disable_key = (bucket.op, choice.variant.name, choice.config_json, bucket.id, autocast)
        try:
            fn = self._cached_build(choice, bucket, slot)
        except Exception as e:
            self._disable(site, disable_key, slot, f"build failed: {_describe(e)}")
            # routed as the reference is: a class whose own forward may not be the op's math (a
            # gated MLP that is no swiglu) gets its check against that forward
            route, _ = self._route(site, bucket, _reference(self, site), autocast)
            return route, choice.weight

        reference_slot = self._slot(site, _reference(self, site), bucket)

        def on_error(exc: BaseException, args: tuple, kwargs: dict):
            # the reference raising too means the call itself is wrong: torch's own error, and
            # the variant stays enabled
            out = self._timed_reference(site, reference_slot, args, kwargs)
            if _functorch_active():
                # under torch.func (grad, vmap): an autograd.Function variant may not support
                # the transform; the variant itself is fine for the job's other calls
                return out
            self._disable(site, disable_key, slot, f"raised {_describe(exc)}")
            return out

        fast = self._timed_on_device(site, fn, slot, on_error, bucket)
        if not self.verify_first_call and not site.matched_by_name:
            # a class or function rewritten as the op (found by its name or its layers') is
            # always checked: its first call is the one proof that it computes that op
            return fast, choice.weight
        return self._probation(site, fn, fast, slot, disable_key, choice,
                               reference_slot), choice.weight

    def _timed_on_device(self, site: FunctionSite, fn: Callable, slot: int, on_error, bucket: Bucket):
        """A route timed on the host (CPU), or with CUDA events resolved at step boundaries."""
        if bucket.device != "cuda":
            return site.timed(fn, slot, on_error)
        if self.cuda_timer is None:
            self.cuda_timer = CudaEventTimer(self.readings, memory=self.call_memory,
                                             every=self.cuda_time_every)
        whole = isinstance(site, ModuleSite) and fn is site.original_forward
        return site.timed(self.cuda_timer.wrap(fn, slot), -1, on_error, whole=whole or None)

    def _timed_reference(self, site: FunctionSite, slot: int, args: tuple, kwargs: dict) -> Any:
        t0 = perf_counter_ns()
        out = site.run_reference(args, kwargs)
        self.readings.record(slot, t0, perf_counter_ns() - t0)
        return out

    def _cached_build(self, choice: Choice, bucket: Bucket, slot: int) -> Callable:
        k = (bucket.op, choice.variant.name, choice.config_json, bucket.id)
        fn = self._builds.get(k)
        if fn is not None:
            self.readings.build(slot, 0, True)
            return fn
        t0 = perf_counter_ns()
        fn = self._builds[k] = choice.variant.build(choice.config, bucket)
        self.readings.build(slot, perf_counter_ns() - t0, False)
        return fn

    def _probation(self, site, fn, fast, slot, disable_key, choice,
                   reference_slot: int | None = None) -> Any:
        """First call of a route that is not the site's own code: run it and the site's reference,
        compare, then keep the fast route, or disable the variant and answer with the reference."""
        # on the default plan the reference standing in for a class's own forward must give its
        # very values: the default plan changes nothing (once a plan routes other ops, the class's
        # own forward runs those variants too, and the op's tolerance applies)
        default_plan = not self.plan.entries and not self.plan.defaults
        tol = _exact if choice.variant.name == REFERENCE and default_plan else site.op.tolerance

        unchecked = [0]   # first calls whose values could not be compared

        def first_call(*args, **kwargs):
            # Route and reference are compared without autograd, from the same random state;
            # then the one that answers runs again, as every later call will, from that state.
            # So the call saves for backward what the chosen one saves (as when activation
            # checkpointing recomputes it) and draws the random numbers it draws.
            rewrite = isinstance(site, ModuleSite) and fn is not site.original_forward
            unfit = site.unfit(args[0]) if rewrite else None
            if unfit:   # not the variant's fault: only the class goes back on its own forward
                site.give_up(unfit, args[0])
                return site.run_reference(args, kwargs)
            rng = _RandomState()
            unreadable = raised = False
            with torch.no_grad():
                try:
                    got, _ = site.run_variant(fn, args, kwargs)
                except _NOT_A_FAILURE:
                    raise
                except Exception as e:
                    problem, raised = f"raised {_describe(e)}", True
                    unreadable = _functorch_active()   # see on_error in _route
                else:
                    rng.restore()
                    expected = site.run_reference(args, kwargs)
                    try:
                        problem = _compare(got, expected, tol)
                        # a rewrite checked on all-zero output (a dummy forward) proves nothing
                        unreadable = not problem and rewrite and not _any_nonzero(expected)
                    except Exception:  # values that cannot be read (meta, fake, vmapped):
                        unreadable = True  # the reference answers; a later call is checked
            rng.restore()

            def unread():
                unchecked[0] += 1
                if unchecked[0] >= UNCHECKED_CALLS_KEPT:
                    # never readable (under torch.func.vmap): each call ran the reference twice
                    # and the route once; the reference alone answers these calls from now on
                    site.replace(route, site.unrouted())
                return site.run_reference(args, kwargs)

            if unreadable:
                return unread()
            if not problem:
                t0 = perf_counter_ns()
                try:
                    got, elapsed = site.run_variant(fn, args, kwargs)
                except _NOT_A_FAILURE:
                    raise
                except Exception as e:
                    problem, raised = f"raised {_describe(e)}", True
                    rng.restore()
                    if _functorch_active():   # with autograd, under torch.func: see on_error
                        return unread()
                else:
                    self.readings.record(slot, t0, elapsed)
                    site.replace(route, fast)
                    return got
            # the reference first: if it raises too, the call itself is wrong (the job's error,
            # torch's message), and the route stays on probation for the next call
            t_ref = perf_counter_ns()
            expected = site.run_reference(args, kwargs)
            if reference_slot is not None:
                self.readings.record(reference_slot, t_ref, perf_counter_ns() - t_ref)
            if isinstance(site, ModuleSite) and not (raised and _is_the_op(site, args, expected, tol)):
                # (a variant that raised on a class that is the op is the variant's fault alone:
                # it is disabled below, and the class stays routed for the variants that work)
                site.give_up(f"{choice.variant.name}: {problem}", args[0])
                if rewrite and _agrees_with_op(site, fn, args, tol):
                    return expected   # the class's forward is not the op; the variant is fine
            if disable_key is not None:
                self._disable(site, disable_key, slot, f"first call differs from reference: {problem}")
            else:
                self.readings.error(slot, problem)
            return expected

        route = site.self_recording(first_call)
        return route

    def note_second_order(self, through_parameters: bool = True) -> None:
        """A backward pass builds a graph of its gradients (``create_graph=True``): from now on
        the routes take only variants whose backward differentiates again (see
        :meth:`_refuse_second_order`); one taken with respect to parameters also sends the
        compiled model region back to eager."""
        if _functorch_active():
            return   # torch.func's grad asks for a graph on every call (so that it nests)
        if through_parameters and self.regions is not None:
            self.regions.differentiated_through_parameters()
        if self.second_order:
            return
        with self._lock:
            if self.second_order:
                return
            self.second_order = True
            for s in self.sites:
                s.clear()
        log.warning("rtxops: the job differentiates gradients (create_graph=True): variants whose "
                    "backward cannot be differentiated again (torch.compile's) are not used from "
                    "now on; a graph that already holds one fails in its double backward")

    def _refuse_second_order(self, site: FunctionSite, bucket: Bucket, choice: Choice,
                             autocast: tuple | None) -> None:
        """A plan's arm the job cannot run since it differentiates gradients: reported as
        disabled (once per arm), so that the evolve loop stops exploring it there."""
        key = (bucket.op, choice.variant.name, choice.config_json, bucket.id, autocast)
        if key not in self.disabled:
            self.disabled[key] = SECOND_ORDER_REASON
            self.readings.error(self._slot(site, choice, bucket), SECOND_ORDER_REASON)

    def _disable(self, site: FunctionSite, key: tuple, slot: int, reason: str) -> None:
        with self._lock:
            self.disabled[key] = reason
            for s in self.sites:
                if s.op.name == key[0]:
                    s.clear()
        log.warning("rtxops: disabled %s/%s %s on %s%s: %s", key[0], key[1], key[2], key[3],
                    f" under autocast {key[4]}" if key[4] else "", reason)
        self.readings.error(slot, reason)

    def _backward_sampler(self, fn: Callable, slot: int, disarm: Callable[[], None]) -> Callable:
        readings, record_cell = self.readings, self.record_cell

        def forward(args, kwargs):
            t0 = perf_counter_ns()
            out = fn(*args, **kwargs)
            record_cell[0](slot, t0)
            return out

        def sampled(*args, **kwargs):
            disarm()
            if not torch.is_grad_enabled() or _functorch_active() or _dispatch_modes():
                return forward(args, kwargs)
            timer = BackwardTimer(slot, readings)
            try:
                timer.before()
            except Exception:  # noqa: BLE001 - a timer never fails the call: this one goes untimed
                return forward(args, kwargs)
            out = forward(args, kwargs)
            try:
                timer.after(out)
            except Exception:  # noqa: BLE001
                log.debug("rtxops: a backward timer could not hook its call", exc_info=True)
            return out

        return sampled

    # ---- introspection --------------------------------------------------------------------
    def site_named(self, name: str) -> FunctionSite:
        return next(s for s in self.sites if s.name == name)


def region_bucket(tensors: Iterable[torch.Tensor]) -> tuple[str, torch.device]:
    """(bucket id, device) of a region over ``tensors``: ``"float32/cpu/numel=N"`` after the
    first tensor's dtype and device."""
    first, numel = None, 0
    for t in tensors:
        first = t if first is None else first
        numel += t.numel()
    if first is None:
        return "none/cpu/numel=0", torch.device("cpu")
    return f"{str(first.dtype).removeprefix('torch.')}/{first.device.type}/numel={numel}", first.device


def _reference(dispatcher: Dispatcher, site: FunctionSite) -> Choice:
    return Choice(dispatcher.registry.variant(site.op.name, REFERENCE), {})


def _explore_schedule(routes: list, weights: list[float]) -> list:
    """Routes laid out over EXPLORE_PERIOD calls by weight, interleaved (no RNG on the hot path):
    a 10 % share is every tenth call, not a hundred calls in a row."""
    schedule: list = []
    for route, w in zip(routes, weights):
        schedule += [route] * max(0, round(w * EXPLORE_PERIOD))
    schedule = (schedule + [routes[0]] * EXPLORE_PERIOD)[:EXPLORE_PERIOD]
    return [schedule[(i * 7919) % EXPLORE_PERIOD] for i in range(EXPLORE_PERIOD)]


_saved_tensors_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def _recomputable() -> bool:
    """Whether this call may run again in a backward pass that must see what it saved: inside
    activation checkpointing's forward (its saved-tensor hooks; the user's own too), reentrant
    checkpointing's (it runs its forward with grad off), or its recompute (a backward pass
    running). Such calls do not explore: the recompute would take another arm, which saves
    other tensors (torch raises CheckpointError) or computes the gradient of another variant
    than the loss's. (A forward under no_grad that is not recomputed does not explore either:
    no arm's training cost is measured there.)"""
    if not torch.is_grad_enabled():
        return True
    if _saved_tensors_hooks is not None and _saved_tensors_hooks(False) is not None:
        return True
    return _graph_task_id is not None and _graph_task_id() != -1


def _steady_index(schedule: list, main) -> int:
    """Where the schedule holds the main arm (a place, not the route: a route replaced after
    its first call is replaced there too)."""
    return next((i for i, r in enumerate(schedule) if r is main), 0)


def _arms_of(route) -> list:
    """The routes an exploring route takes turns between, or ``[route]``."""
    fn = route[0] if isinstance(route, tuple) else route
    schedule = getattr(fn, "schedule", None)
    return [route] if schedule is None else list({id(r): r for r in schedule}.values())


def _replace_in_explore(route, old, new) -> None:
    fn = route[0] if isinstance(route, tuple) else route
    schedule = getattr(fn, "schedule", None)
    if schedule is not None:
        for i, r in enumerate(schedule):
            if r is old:
                schedule[i] = new


def _flat_tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _flat_tensors(o)]
    return []


class _RandomState:
    """torch's random state (CPU, and CUDA once initialized), to run code again from it."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def _exact(dtype: torch.dtype) -> Tolerance:
    return Tolerance(0.0, 0.0)


UNCHECKED_CALLS_KEPT = 16   # first calls a route may fail to be checked on before the reference takes them


def _agrees_with_op(site: ModuleSite, fn: Callable, a: tuple, tol: Callable) -> bool:
    """Whether variant ``fn`` gives the op's reference values on the op's part of the call ``a``
    (a class whose forward differs from the op is then the class's own matter)."""
    try:
        with torch.no_grad():
            canonical = site.parts_of(a)[0]
            return _compare(fn(*canonical), site.op.reference(*canonical), tol) is None
    except Exception:
        return False


def _is_the_op(site: ModuleSite, a: tuple, expected: Any, tol: Callable) -> bool:
    """Whether the op's reference on the op's part of the call ``a`` (finished as the class's
    forward finishes it) gives the class's own output ``expected``."""
    module = a[0]
    try:
        with torch.no_grad():
            canonical, post = site.parts_of(a)
            out = site.op.reference(*canonical)
            return _compare(out if post is None else post(module, out), expected, tol) is None
    except Exception:
        return False


def _any_nonzero(out: Any) -> bool:
    return any(bool(t.detach().any()) for t in _flat_tensors(out))


def _compare(got: Any, expected: Any, tol: Callable) -> str | None:
    """Why ``got`` is not ``expected`` within the op's tolerance, or None when it is."""
    gs, es = _flat_tensors(got), _flat_tensors(expected)
    if len(gs) != len(es):
        return f"returned {len(gs)} tensors, reference {len(es)}"
    with torch.no_grad():
        for g, e in zip(gs, es):
            if g.shape != e.shape or g.dtype != e.dtype:
                return f"returned {tuple(g.shape)} {g.dtype}, reference {tuple(e.shape)} {e.dtype}"
            if _layout(g) != _layout(e):  # the job may .view() the output as torch laid it out
                return f"returned strides {g.stride()}, reference {e.stride()}"
            if not e.is_floating_point():
                if not torch.equal(g, e):
                    return "integer output differs"
                continue
            g32, e32 = g.detach().float(), e.detach().float()
            bad = torch.isnan(g32) & ~torch.isnan(e32)
            if bad.any():
                return f"{int(bad.sum())} NaN values where the reference has none"
            t = tol(e.dtype)
            if not torch.allclose(g32, e32, atol=t.atol, rtol=t.rtol, equal_nan=True):
                diff = (g32 - e32).abs().nan_to_num(0).max().item()
                return f"max abs difference {diff:.3g} beyond atol={t.atol} rtol={t.rtol}"
    return None


def _layout(t: torch.Tensor) -> tuple:
    """The strides of the dimensions longer than 1 (the others' strides mean nothing)."""
    return tuple(s for s, n in zip(t.stride(), t.shape) if n > 1)


def _describe(e: BaseException) -> str:
    frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    where = f" at {frame.filename}:{frame.lineno}" if frame else ""
    return f"{type(e).__name__}: {e}{where}"
