"""Whole-region variant: the model's forward compiled with ``torch.compile`` in the background while
eager steps go on, swapped in at a step boundary when ready, and kept only if it is faster.

So the first step never waits for a compiler, and the converged step is never slower than the
better of eager-with-variants and the compiled model. Steps:

1. *discover* — during the first optimizer step a global module pre-hook notes the outermost
   modules called; after the step the one holding most parameters is the model and the hooks go;
2. *compile* — on the next call of the model its inputs are cloned and a background thread runs
   the compiled forward and backward on them once, on a shadow of the model whose parameters
   share its storage but not its autograd version counters (so the job's optimizer stepping
   meanwhile cannot fail the pass; ``torch.autograd.grad``: no ``.grad`` is touched);
3. *trial* — once compiled, ``trial_steps`` more eager steps are timed (with no compiler running
   beside them), then ``model.forward`` is replaced at a step boundary and as many compiled steps
   are timed; the slower one loses and the outcome is reported as an ``rtx.swap`` with digest
   ``region:model:<compiled|eager>``.

Caveats (documented, not hidden): the background pass runs the model once more, so modules with
side effects in forward (BatchNorm running statistics, dropout's RNG) see one extra call. Jobs
under ``torch.distributed`` are left alone (a background pass could desynchronise collectives).
"""
from __future__ import annotations

import atexit
import copy
import functools
import itertools
import logging
import statistics
import threading
import time
import weakref
from typing import Any, Callable

import torch
from torch import nn

from .dispatcher import _NOT_A_FAILURE, background_compile

log = logging.getLogger("rtxops.runtime")
EXIT_WAIT_S = 120.0   # how long a job that ends during the background compile waits for it

DISCOVER, WAIT_INPUTS, COMPILING, BASELINE, TRIAL, COMPILED, EAGER, FAILED = (
    "discover", "wait_inputs", "compiling", "baseline", "trial", "compiled", "eager", "failed")
SETTLED = (COMPILED, EAGER, FAILED)  # no compiler runs and no trial is timed any more


def compile_kwargs(mode: str | None, model: nn.Module) -> dict:
    """``torch.compile``'s keywords for the region: the job's ``mode`` when it names one; else, for
    a model on the CPU, Inductor's C++ wrapper (the compiled graphs call their kernels from C++
    rather than from generated Python: about 2 % off the example GPT's converged step, for a few
    seconds more of background compile)."""
    if mode:
        return {"mode": mode}
    if all(t.device.type == "cpu" for t in itertools.chain(model.parameters(), model.buffers())):
        return {"options": {"cpp_wrapper": True}}
    return {}


class RegionCompiler:
    """Compiles the training job's model in the background (see the module docstring).

    ``on_step(step)`` is called at every optimizer-step boundary; ``report(step, outcome)`` is
    called on a swap (``outcome`` is "compiled" or "eager"). ``timed(fn, model)``, when given,
    wraps the compiled forward once it is installed, to record its calls (per-op telemetry stops
    there: nothing inside a compiled region is routed)."""

    def __init__(self, report: Callable[[int, str], None], *, mode: str | None = None,
                 trial_steps: int = 20, compile_fn: Callable = torch.compile,
                 timed: Callable[[Callable, nn.Module], Callable] | None = None) -> None:
        self.report = report
        self.timed = timed
        self.mode = mode
        self.trial_steps = trial_steps
        self.compile_fn = compile_fn
        self.state = DISCOVER
        self.error: str | None = None
        self.compile_seconds: float | None = None
        self._model: weakref.ReferenceType[nn.Module] | None = None
        self._roots: dict[int, weakref.ReferenceType[nn.Module]] = {}
        self._depth = threading.local()
        self._compiled: Callable | None = None
        self._exiting = False
        self._closed = False
        self._step_ns: list[int] = []
        self._last_ns: int | None = None
        self._swap_step = 0
        self._baseline_from: int | None = None
        self._before: list[int] = []
        self._hooks = [
            nn.modules.module.register_module_forward_pre_hook(self._pre),
            nn.modules.module.register_module_forward_hook(self._post, always_call=True),
        ]

    # ---- discovery ---------------------------------------------------------------------------
    def _pre(self, module: nn.Module, args: tuple) -> None:
        depth = getattr(self._depth, "n", 0)
        self._depth.n = depth + 1
        if depth == 0 and threading.current_thread() is threading.main_thread():
            self._roots.setdefault(id(module), weakref.ref(module))

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._depth.n = max(0, getattr(self._depth, "n", 1) - 1)

    def _pick_model(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        roots = [r() for r in self._roots.values()]
        roots = [m for m in roots if m is not None]
        self._roots.clear()
        model = max(roots, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)
        if model is None or not any(True for _ in model.parameters()):
            self._fail("no module with parameters was called during the first step")
            return
        self._model = weakref.ref(model)
        self._eager_forward = model.forward
        self.state = WAIT_INPUTS

        def capture(module, args, kwargs):  # one call's inputs, for the background compile
            handle.remove()
            if self.state == WAIT_INPUTS and not self._closed:
                self.state = COMPILING
                try:
                    clones = ([_clone(a) for a in args], {k: _clone(v) for k, v in kwargs.items()})
                except Exception as e:  # never the job's step: the job stays in eager
                    self._fail(f"cannot copy the model's inputs: {type(e).__name__}: {e}")
                    return
                thread = threading.Thread(target=self._compile, args=(module, *clones),
                                          name="rtxops-region-compile", daemon=True)
                thread.start()
                atexit.register(self._finish_compile, thread)

        handle = model.register_forward_pre_hook(capture, with_kwargs=True)
        self._hooks.append(handle)   # close() takes it off a model not called since

    # ---- background compile ----------------------------------------------------------------------
    def _finish_compile(self, thread: threading.Thread) -> None:
        """At the job's exit, let a compile under way end first: an interpreter that finalizes
        under Inductor's threads aborts ("terminate called without an active exception", exit
        134). It ends soon: Python's executors refuse new work by then, so it fails, unsaid."""
        self._exiting = True
        thread.join(EXIT_WAIT_S)

    def _compile(self, model: nn.Module, args: list, kwargs: dict) -> None:
        with background_compile():
            self._compile_here(model, args, kwargs)

    def _compile_here(self, model: nn.Module, args: list, kwargs: dict) -> None:
        started = time.perf_counter()
        attempts = [compile_kwargs(self.mode, model)]
        if attempts[0].get("options"):
            attempts.append({})  # once more as torch.compile compiles by default
        for i, kw in enumerate(attempts):
            try:
                self._compiled = self._warm_up(model, args, kwargs, kw)
                break
            except Exception as e:
                if self._exiting:   # the job is done with it
                    return
                if i + 1 < len(attempts):
                    log.info("rtxops: compiling the model with %s failed (%s: %s); compiling it "
                             "with torch.compile's defaults", kw, type(e).__name__, e)
                    continue
                self._fail(f"torch.compile failed: {type(e).__name__}: {e}")  # the job stays eager
                return
        self.compile_seconds = time.perf_counter() - started
        self.state = BASELINE

    def _warm_up(self, model: nn.Module, args: list, kwargs: dict, kw: dict) -> Callable:
        """The model's forward compiled with ``kw``, run forward and backward once."""
        shadow = _shadow(model)
        if shadow is None:  # the live model: the job's optimizer may race the pass below
            compiled = run = self.compile_fn(self._eager_forward, **kw)
            target = model
        else:
            # one compiled code serves every instance (torch.compile guards on the module's
            # tensors, not its identity): warmed up on the shadow, then called with the model
            run = self.compile_fn(type(model).forward, **kw)
            compiled = functools.partial(run, model)
            args, target = [shadow, *args], shadow
        with torch.enable_grad():
            out = run(*args, **kwargs)
            roots = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
            params = [p for p in target.parameters() if p.requires_grad]
            if roots and params:  # compiles the backward too, without touching .grad
                torch.autograd.grad([t.sum() for t in roots], params[:1], allow_unused=True)
        return compiled

    # ---- step boundary -----------------------------------------------------------------------------
    def on_step(self, step: int) -> None:
        try:
            self._on_step(step)
        except Exception as e:  # never the job's death: back to eager, with the reason
            model = self._model() if self._model else None
            if model is not None and "forward" in model.__dict__:
                del model.forward
            self._fail(f"{type(e).__name__}: {e}")

    def _on_step(self, step: int) -> None:
        now = time.perf_counter_ns()
        if self._last_ns is not None:
            self._step_ns.append(now - self._last_ns)
            if self.state != BASELINE:
                del self._step_ns[:-4 * self.trial_steps]
        self._last_ns = now
        if self.state == DISCOVER:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                self._fail("a torch.distributed job: whole-model compile is left to the script")
                return
            self._pick_model()
        elif self.state == BASELINE:
            if self._baseline_from is None:  # eager steps from now on run without the compiler
                self._baseline_from = len(self._step_ns)
                return
            if len(self._step_ns) - self._baseline_from < self.trial_steps:
                return
            model = self._model() if self._model else None
            if model is None:
                self._fail("the model is gone")
                return
            self._before = list(self._step_ns[self._baseline_from:])
            self._step_ns.clear()
            model.forward = _CompiledForward(model, self._guarded(model))  # undone by del
            self._swap_step, self.state = step, TRIAL
            self.report(step, "compiled")
        elif self.state == TRIAL and len(self._step_ns) >= self.trial_steps + 2:
            after = self._step_ns[2:]  # the first calls after a swap may still specialise
            if self._before and statistics.median(after) >= statistics.median(self._before):
                model = self._model() if self._model else None
                if model is not None:
                    del model.forward
                self.state = EAGER
                self.report(step, "eager")
            else:
                self.state = COMPILED
            log.info("region: compiled model %s (eager median %.2f ms, compiled %.2f ms)",
                     "kept" if self.state == COMPILED else "reverted",
                     statistics.median(self._before or [0]) / 1e6, statistics.median(after) / 1e6)

    def _guarded(self, model: nn.Module) -> Callable:
        """The compiled forward; if it ever raises (a recompile failing on new shapes, say), the
        model goes back to eager for good and this call runs eager: the step goes on."""
        compiled, eager = self._compiled, self._eager_forward
        if self.timed is not None:
            try:
                compiled = self.timed(compiled, model)
            except Exception as e:  # untimed rather than not compiled
                log.warning("region: the compiled model's calls are not recorded: %s", e)

        def forward(*args, **kwargs):
            try:
                return compiled(*args, **kwargs)
            except _NOT_A_FAILURE:         # a checkpoint's early stop, not the compiled model's
                raise
            except Exception as e:
                if "forward" in model.__dict__:
                    del model.forward
                self._fail(f"the compiled model raised {type(e).__name__}: {e}")
                return eager(*args, **kwargs)
        return forward

    def close(self) -> None:
        """Remove the hooks and put the model back on its own forward."""
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        model = self._model() if self._model else None
        if model is not None and "forward" in model.__dict__:
            del model.forward

    def _fail(self, reason: str) -> None:
        self.state, self.error = FAILED, reason
        log.warning("region: %s; the job stays in eager", reason)


def forward_timer(dispatcher, mode: str | None = None) -> Callable[[Callable, nn.Module], Callable]:
    """The ``timed`` for :class:`RegionCompiler` that records the compiled forward's calls in
    ``dispatcher``'s region slot ``model:<class>``, variant "compiled"."""
    def timed(fn: Callable, model: nn.Module) -> Callable:
        cls = type(model)
        return dispatcher.time_region(fn, f"model:{cls.__module__}.{cls.__qualname__}", "compiled",
                                      "compiled", model.parameters(), {"mode": mode} if mode else None)
    return timed


def _clone(x):
    if isinstance(x, torch.Tensor):
        # same strides as the job's (a slice like tokens[:, :-1] has gaps): torch.compile guards
        # on them, and a mismatch would recompile on the job's thread at the swap
        try:
            copy_ = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
            copy_.copy_(x.detach())
        except RuntimeError:  # overlapping memory (an expand()): a dense copy will do
            copy_ = x.detach().clone()
        return copy_.requires_grad_(x.requires_grad)
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _tensors(v)]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    return []


def _shadow(model: nn.Module) -> nn.Module | None:
    """A copy of ``model`` whose parameters share the model's storage (no memory is copied) but
    not its autograd version counters (``.data``), so the job's optimizer updating them in place
    cannot fail the background backward pass; buffers are the model's own tensors. None when the
    model cannot be copied or sets its own ``forward`` per instance."""
    if "forward" in model.__dict__:
        return None
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        memo[id(t)] = nn.Parameter(t.data, t.requires_grad) if isinstance(t, nn.Parameter) else t
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # noqa: BLE001 - locks, handles…: fall back to the live model
        return None


class _CompiledForward:
    """The compiled forward, set on the model instance. A copy of the model (``deepcopy``: an
    EMA or teacher model) gets its class's own forward: the compiled code runs the live model's
    parameters. So does a pickle of it (``torch.save(model)``), which then loads without rtxops."""

    def __init__(self, model: nn.Module, forward: Callable) -> None:
        self._model = weakref.ref(model)
        self._forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        model = self._model()
        twin = memo.get(id(model)) if model is not None else None
        if twin is None:            # the forward copied on its own: it stays the live model's
            return self
        return _ClassForward(twin)

    def __reduce__(self) -> tuple:
        return _class_forward_reduce(self._model())


class _ClassForward:
    """A model copy's forward: its class's own, holding the copy weakly (a strong reference from
    its own ``__dict__`` would keep a deleted copy's parameters until a garbage collection)."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self._model()
        return type(model).forward(model, *args, **kwargs)

    def __reduce__(self) -> tuple:
        return _class_forward_reduce(self._model())


def _class_forward_reduce(model: nn.Module | None) -> tuple:
    # a pickle loads without rtxops: the class's forward bound by functools.partial
    if model is None:
        raise TypeError("the forward of a model that is gone cannot be pickled")
    return functools.partial, (type(model).forward, model)
