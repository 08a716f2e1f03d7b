"""Whole-region variant: the model's forward compiled with ``torch.compile`` in the background while
eager steps go on, swapped in at a step boundary when ready, and kept only if it is faster.

So the first step never waits for a compiler, and the converged step is never slower than the
better of eager-with-variants and the compiled model. Steps:

1. *discover* — during the first optimizer step a global module pre-hook notes the outermost
   modules called; after the step the one holding most trainable parameters is the model and
   the hooks go;
2. *compile* — on the next call of the model its inputs are cloned and a background thread runs
   the compiled forward and backward on them once, on a shadow of the model whose parameters
   share its storage but not its autograd version counters (so the job's optimizer stepping
   meanwhile cannot fail the pass; ``torch.autograd.grad``: no ``.grad`` is touched);
3. *trial* — once compiled, ``trial_steps`` more eager steps are timed (with no compiler running
   beside them: the baseline), then the candidates and eager take turns as ``model.forward``,
   swapped at step boundaries, in blocks of half as many steps, :data:`TRIAL_ROUNDS` each: the
   host's speed drifts over a trial by more than what tells them apart, and turns put each
   beside the others. The fastest of eager and the candidates (the median of their turns'
   steps) stays; each swap is reported as an ``rtx.swap`` with digest
   ``region:model:<candidate|eager>``.

The candidates: ``compiled`` (torch.compile as configured); for a CPU model whose step called
``F.scaled_dot_product_attention`` with small score matrices (at most
:data:`MATH_ATTENTION_MAX_SCORES` entries a call), also ``compiled_math_attention``, the same
compile with SDPA's math backend (``softmax(q k^T) v`` as matrix products that Inductor fuses
around). torch picks its flash kernel on the CPU whatever the shapes, and at short sequences its
fixed cost per call outweighs what it saves (2-5 % of the example GPT's compiled step,
``bench/compile_options.py``); at long ones the math backend's (L, S) score matrix loses, and
costs memory. So both are measured, not guessed. On CUDA the flash and memory-efficient kernels
are what a job wants and only ``compiled`` runs.

Caveats (documented, not hidden): the background pass runs the model once more, on the shadow
(its buffers are copies: BatchNorm's running statistics are the job's own), but dropout draws from
the global generator when the compile gets to it: a seeded job is not repeatable. Jobs under
``torch.distributed`` are left alone (a background pass could desynchronise collectives). A call
with an input that requires grad (a gradient penalty's interpolates, a GAN discriminator fed the
generator's output) runs eager: torch.compile's backward cannot be differentiated again; a job
that differentiates gradients taken with respect to parameters (Hessian-vector products) sends
the region to eager for good (:meth:`RegionCompiler.differentiated_through_parameters`). While
it compiles, torch's ``is_compiling()`` flag is process-wide: the job's own thread sees it set.
"""
from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import inspect
import itertools
import logging
import statistics
import threading
import time
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from . import originals
from .dispatcher import _NOT_A_FAILURE, background_compile

log = logging.getLogger("rtxops.runtime")
EXIT_WAIT_S = 120.0   # how long a job that ends during the background compile waits for it

DISCOVER, WAIT_INPUTS, COMPILING, BASELINE, TRIAL, COMPILED, EAGER, FAILED = (
    "discover", "wait_inputs", "compiling", "baseline", "trial", "compiled", "eager", "failed")
SETTLED = (COMPILED, EAGER, FAILED)
LIVE_WARM_UP_TRIES = 5   # warm-up passes on a live model its optimizer may step in between  # no compiler runs and no trial is timed any more
MATH_ATTENTION = "compiled_math_attention"   # the candidate compiled with SDPA's math backend
TRIAL_ROUNDS = 3   # blocks each candidate, and eager, gets in the trial
MATH_ATTENTION_MAX_SCORES = 1 << 22   # score entries (batch x heads x L x S) a call may have for it


def compile_kwargs(mode: str | None, model: nn.Module) -> dict:
    """``torch.compile``'s keywords for the region: the job's ``mode`` when it names one; else, for
    a model on the CPU, Inductor's C++ wrapper (the compiled graphs call their kernels from C++
    rather than from generated Python: about 2 % off the example GPT's converged step, for a few
    seconds more of background compile)."""
    if mode:
        return {"mode": mode}
    if _on_cpu(model):
        return {"options": {"cpp_wrapper": True}}
    return {}


def candidate_forward(forward: Callable, candidate: str) -> Callable:
    """``forward`` as ``candidate`` compiles it: for :data:`MATH_ATTENTION` with every
    ``F.scaled_dot_product_attention`` call made SDPA's math decomposition (torch.compile traces
    the mode into the graph), else as it is."""
    if candidate != MATH_ATTENTION:
        return forward

    @functools.wraps(forward)
    def with_math_attention(*args: Any, **kwargs: Any) -> Any:
        with _MathAttention():
            return forward(*args, **kwargs)
    return with_math_attention


class _MathAttention(TorchFunctionMode):
    """SDPA calls as ``aten._scaled_dot_product_attention_math`` (``softmax(q k^T) v`` in matrix
    products). A torch-function mode, not ``sdpa_kernel``: that one flips process-wide flags, so
    compiling on the background thread changed what the job's own eager steps ran meanwhile, and
    dynamo does not guard on them (code after a graph break, compiled for one candidate, ran for
    the other). The mode is the thread's own, and dynamo guards on it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is originals.scaled_dot_product_attention:
            return _sdpa_math(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # SDPA's meaning (False: not attended); the math op itself would add True as 1.0
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, -torch.inf)
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]


def _on_cpu(model: nn.Module) -> bool:
    return all(t.device.type == "cpu" for t in itertools.chain(model.parameters(), model.buffers()))


class RegionCompiler:
    """Compiles the training job's model in the background (see the module docstring).

    ``on_step(step)`` is called at every optimizer-step boundary; ``report(step, outcome)`` is
    called on a swap (``outcome`` is a candidate's name or "eager"). ``timed(fn, model,
    candidate)``, when given, wraps a compiled forward once it is installed, to record its calls
    (per-op telemetry stops there: nothing inside a compiled region is routed).
    ``small_attention()`` says whether the job's step called SDPA, with small score matrices
    only (the math-attention candidate is tried only then)."""

    def __init__(self, report: Callable[[int, str], None], *, mode: str | None = None,
                 trial_steps: int = 20, compile_fn: Callable = torch.compile,
                 timed: Callable[[Callable, nn.Module, str], Callable] | None = None,
                 small_attention: Callable[[], bool] = lambda: False) -> None:
        self.report = report
        self.timed = timed
        self.mode = mode
        self.trial_steps = max(1, trial_steps)
        self.compile_fn = compile_fn
        self.small_attention = small_attention
        self.state = DISCOVER
        self.error: str | None = None
        self.compile_seconds: float | None = None
        self.kept: str | None = None          # the candidate (or "eager") in use once settled
        self.step_medians_ns: dict[str, float] = {}   # the trial's figures, "eager" included
        self._model: weakref.ReferenceType[nn.Module] | None = None
        self._eager_forward: Callable | None = None   # holds the model: released once settled
        self._autocast: list[tuple[str, torch.dtype]] = []   # the job's, at the captured call
        self._own_forward: Callable | None = None
        self._roots: dict[int, weakref.ReferenceType[nn.Module]] = {}
        self._depth = threading.local()
        self._candidates: list[tuple[str, Callable]] = []   # (name, compiled forward), compiled
        self._untried: list[str] = []   # the candidates of the trial's blocks still to run
        self._trial_ns: dict[str, list[int]] = {}   # each candidate's timed steps, all its blocks
        self._trying = "eager"
        self._last_step = 0
        self._dropped = False   # the candidate on trial failed: its steps do not count
        self._calls = 0         # calls of an installed candidate, ever
        self._block_calls = 0   # ... when the trial block under way began
        self._exiting = False
        self._closed = False
        self._through_parameters = False   # the job differentiates gradients w.r.t. parameters
        self._step_ns: list[int] = []
        self._last_ns: int | None = None
        self._baseline_from: int | None = None
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
        # trainable parameters: a frozen teacher called beside its student is not the model
        model = max(roots, key=_trainable, default=None)
        if model is None or not _trainable(model):
            self._fail("no module with trainable parameters was called during the first step")
            return
        self._model = weakref.ref(model)
        self._eager_forward = model.forward
        self._own_forward = model.__dict__.get("forward")   # one the job set on the instance
        self.state = WAIT_INPUTS

        def capture(module, args, kwargs):  # one call's inputs, for the background compile
            if not (module.training and torch.is_grad_enabled()):
                return   # an evaluation between steps: compiled for it, the swap recompiled
            handle.remove()
            if self.state == WAIT_INPUTS and not self._closed:
                self.state = COMPILING
                self._autocast = _autocast_state()   # thread-local: the compile thread's own
                try:
                    clones = ([_clone(a) for a in args], {k: _clone(v) for k, v in kwargs.items()})
                except Exception as e:  # never the job's step: the job stays in eager
                    self._fail(f"cannot copy the model's inputs: {type(e).__name__}: {e}")
                    return
                _compile_settings()   # (on the job's thread: torch reads them from its context)
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
            try:
                self._compile_here(model, args, kwargs)
            except _NotCompiled as e:
                self._fail(str(e))
            except Exception as e:   # else the region stayed "compiling", the model held for good
                self._fail(f"the background compile failed: {type(e).__name__}: {e}")

    def _compile_here(self, model: nn.Module, args: list, kwargs: dict) -> None:
        started = time.perf_counter()
        eager = self._eager_forward
        names = ["compiled"]
        if _on_cpu(model) and self.small_attention():
            names.append(MATH_ATTENTION)
        for name in names:
            try:
                self._candidates.append((name, self._compile_candidate(model, args, kwargs, name,
                                                                       eager)))
            except _NotCompiled:
                raise
            except Exception as e:
                if self._exiting:   # the job is done with it
                    return
                if not self._candidates:   # the job stays eager
                    self._fail(f"torch.compile failed: {type(e).__name__}: {e}")
                    return
                log.info("region: the %s candidate is left out: %s: %s", name, type(e).__name__, e)
        if self._closed or self.state == FAILED:   # (a step boundary gave up meanwhile)
            self._release()
            return
        self.compile_seconds = time.perf_counter() - started
        self.state = BASELINE

    def _compile_candidate(self, model: nn.Module, args: list, kwargs: dict, name: str,
                           eager: Callable) -> Callable:
        kw = compile_kwargs(self.mode, model)
        if kw.get("options"):
            try:
                return self._warm_up(model, args, kwargs, kw, name, eager)
            except _NotCompiled:
                raise
            except Exception as e:
                if self._exiting:
                    raise
                log.info("rtxops: compiling the model with %s failed (%s: %s); compiling it "
                         "with torch.compile's defaults", kw, type(e).__name__, e)
            kw = {}
        return self._warm_up(model, args, kwargs, kw, name, eager)

    def _warm_up(self, model: nn.Module, args: list, kwargs: dict, kw: dict, candidate: str,
                 eager: Callable) -> Callable:
        """The model's forward (``eager``) compiled as ``candidate`` with ``kw``, run forward and
        backward once."""
        shadow = _shadow(model)
        if shadow is None:  # the live model: the job's optimizer may race the pass below
            if any(True for _ in model.buffers()):
                # a pass on them beside the job's steps changes what its backward saved (BatchNorm)
                raise _NotCompiled("the model cannot be copied and holds buffers its forward may "
                                   "change (BatchNorm statistics, say): it is not compiled beside "
                                   "the job's steps; it stays eager")
            compiled = run = self.compile_fn(candidate_forward(eager, candidate), **kw)
            target = model
        else:
            # one compiled code serves every instance (torch.compile guards on the module's
            # tensors, not its identity): warmed up on the shadow, then called with the model
            run = self.compile_fn(candidate_forward(type(model).forward, candidate), **kw)
            compiled = functools.partial(run, model)
            args, target = [shadow, *args], shadow
        for attempt in range(LIVE_WARM_UP_TRIES if shadow is None else 1):
            try:
                with torch.enable_grad(), _autocast(self._autocast):
                    out = run(*args, **kwargs)
                    roots = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
                    params = [p for p in target.parameters() if p.requires_grad]
                    if roots and params:  # compiles the backward too, without touching .grad
                        torch.autograd.grad([t.sum() for t in roots], params[:1], allow_unused=True)
                return compiled
            except RuntimeError as e:
                # the live model's optimizer stepped its parameters between this pass's forward
                # and backward: a race, not the compiler's failure; the pass goes again
                if "modified by an inplace operation" not in str(e) or \
                        attempt == LIVE_WARM_UP_TRIES - 1:
                    raise
        return compiled

    # ---- step boundary -----------------------------------------------------------------------------
    def on_step(self, step: int) -> None:
        try:
            self._on_step(step)
        except Exception as e:  # never the job's death: back to eager, with the reason
            model = self._model() if self._model else None
            if model is not None:
                self._restore_forward(model)
            self._fail(f"{type(e).__name__}: {e}")

    def differentiated_through_parameters(self) -> None:
        """The job builds a graph of gradients taken with respect to parameters (Hessian-vector
        products, MAML): torch.compile's backward cannot be differentiated again, so the model
        runs eager from its next call, and the region ends in eager at the next step boundary.
        (A gradient penalty on the model's inputs is not that: those calls run eager alone.)"""
        self._through_parameters = True

    def _on_step(self, step: int) -> None:
        if self._through_parameters and self.state not in (EAGER, FAILED):
            self._leave_for_second_order(step)
            return
        self._last_step = step
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
            model = self._model_or_fail()
            if model is None:
                return
            self.step_medians_ns = {"eager": statistics.median(self._step_ns[self._baseline_from:])}
            # eager takes its turns too, and only its turns' steps weigh: each candidate is
            # weighed against eager steps timed beside its own (the host's speed drifts by more
            # than the gain: eager timed only before the trial once kept it against a compiled
            # step 20 % faster)
            self._untried = ([name for name, _ in self._candidates] + ["eager"]) * TRIAL_ROUNDS
            self._trial_ns = {}
            self._try_next(model, step)
        elif self.state == TRIAL and (self._dropped or len(self._step_ns) >= self._block_steps() + 2):
            model = self._model_or_fail()
            if model is None:
                return
            if self._dropped:   # the candidate raised and is gone: on with the others
                self._dropped = False
            elif self._trying != "eager" and self._calls == self._block_calls:
                # the job no longer calls the model (it deleted it and trains another): the
                # steps timed another model's eager forward
                self._restore_forward(model)
                self._fail("the model was not called in a whole trial block (the job trains "
                           "another model now)")
                self.report(step, "eager")
                return
            else:   # the first calls after a swap may still specialise
                self._trial_ns.setdefault(self._trying, []).extend(self._step_ns[2:])
                self.step_medians_ns[self._trying] = statistics.median(self._trial_ns[self._trying])
            if self._untried:
                self._try_next(model, step)
                return
            # a tie keeps eager, then the earlier candidate (dicts keep their order)
            best = min(self.step_medians_ns, key=self.step_medians_ns.__getitem__)
            if best == "eager":
                self._restore_forward(model)
                self.state = EAGER
            else:
                if best != self._trying:
                    self._install(model, best)
                self.state = COMPILED
            if best != self._trying:
                self.report(step, best)
            self.kept = best
            self._release()
            log.info("region: kept %s (median step: %s)", best, ", ".join(
                f"{k} {v / 1e6:.2f} ms" for k, v in self.step_medians_ns.items()))

    def _leave_for_second_order(self, step: int) -> None:
        for h in self._hooks:   # still discovering, or waiting for the call to compile
            h.remove()
        self._hooks = []
        model = self._model() if self._model else None
        installed = model is not None and isinstance(model.__dict__.get("forward"), _CompiledForward)
        if model is not None:
            self._restore_forward(model)
        self._fail("the job differentiates gradients with respect to the model's parameters "
                   "(create_graph=True), which torch.compile's backward cannot")
        if installed:
            self.report(step, "eager")

    def _model_or_fail(self) -> nn.Module | None:
        model = self._model() if self._model else None
        if model is None:
            self._fail("the model is gone")
        return model

    def _block_steps(self) -> int:
        """Timed steps of one trial block: half of ``trial_steps`` (eager and the candidates
        take turns)."""
        return max(2, self.trial_steps // 2)

    def _try_next(self, model: nn.Module, step: int) -> None:
        """Swap the next untried candidate (or eager) in and time its steps from here."""
        name = self._untried.pop(0)
        if name == "eager":
            self._restore_forward(model)
        else:
            self._install(model, name)
        self._block_calls = self._calls
        self._step_ns.clear()
        self.state, self._trying = TRIAL, name
        self.report(step, name)

    def _install(self, model: nn.Module, name: str) -> None:
        compiled = dict(self._candidates)[name]
        model.forward = _CompiledForward(model, self._guarded(model, compiled, name))  # undone by del

    def _guarded(self, model: nn.Module, compiled: Callable, name: str) -> Callable:
        """The compiled forward; if it ever raises (a recompile failing on new shapes, say), the
        model goes back to eager for good and this call runs eager: the step goes on."""
        eager = self._eager_forward
        if self.timed is not None:
            try:
                compiled = self.timed(compiled, model, name)
            except Exception as e:  # untimed rather than not compiled
                log.warning("region: the compiled model's calls are not recorded: %s", e)

        def forward(*args, **kwargs):
            self._calls += 1
            if self._through_parameters or _tracing() or _differentiable_input(args, kwargs):
                # a trace (torch.jit.trace, torch.fx) wants the model as written; an input that
                # requires grad may be differentiated twice (a gradient penalty), which
                # torch.compile's backward cannot
                return eager(*args, **kwargs)
            try:
                with _backward_compiled_with_forward(), _autocast_cache_off():
                    return compiled(*args, **kwargs)
            except _NOT_A_FAILURE:         # a checkpoint's early stop, not the compiled model's
                raise
            except Exception as e:
                self._candidate_raised(model, name, e)
            # outside the handler: the failed call's traceback (and its tensors) is gone by now
            return eager(*args, **kwargs)
        return forward

    def _candidate_raised(self, model: nn.Module, name: str, e: Exception) -> None:
        """The compiled forward ``name`` raised: the model runs eager from this call on. During
        the trial the other candidates go on being tried; once settled (or with none left) the
        region ends in eager for good, reported as a swap to eager."""
        self._restore_forward(model)
        reason = f"the compiled model ({name}) raised {type(e).__name__}: {e}"
        self._candidates = [c for c in self._candidates if c[0] != name]
        # one more block of each candidate left is enough: their earlier blocks count too
        self._untried = list(dict.fromkeys(n for n in self._untried if n != name))
        self.step_medians_ns.pop(name, None)
        if self.state == TRIAL and self._candidates and not self._dropped:
            log.warning("region: %s; the trial goes on without it", reason)
            self._dropped = True
            return
        self._fail(reason)
        self.report(self._last_step, "eager")

    def close(self) -> None:
        """Remove the hooks and put the model, and the copies made of it meanwhile, back on
        their own forward."""
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        model = self._model() if self._model else None
        if model is not None:
            self._restore_forward(model)
        _forget_copies()
        self._release()

    def _restore_forward(self, model: nn.Module) -> None:
        """Put the model back on the forward it had: its class's, or one the job set on the
        instance (accelerate's autocast wrapper, say); only if the region's is installed."""
        if isinstance(model.__dict__.get("forward"), _CompiledForward):
            if self._own_forward is None:
                del model.forward
            else:
                model.forward = self._own_forward

    def _release(self) -> None:
        """Let go of what holds the model (its bound forward, the compiled candidates): once
        the region is settled or closed, a model the job deletes is freed (an installed
        forward holds only the model it sits on)."""
        self._candidates, self._eager_forward = [], None

    def _fail(self, reason: str) -> None:
        self.state, self.error = FAILED, reason
        self._release()
        log.warning("region: %s; the job stays in eager", reason)


def model_region(dispatcher, mode: str | None = None, **options: Any) -> RegionCompiler:
    """The whole-model region of a job routed by ``dispatcher`` (``--compile-model``): swaps
    reported as ``region:model:<outcome>`` under the running plan's version, compiled calls
    recorded by :func:`forward_timer`, the math-attention candidate tried when the job's step
    called SDPA with small score matrices (:func:`_small_attention`). ``options`` go to :class:`RegionCompiler` (tests give their own ``compile_fn``)."""
    def report(step: int, outcome: str) -> None:
        v = dispatcher.plan.version
        dispatcher.readings.swap(step, v, v, f"region:model:{outcome}")

    return RegionCompiler(
        report, mode=mode, timed=forward_timer(dispatcher, mode),
        small_attention=lambda: _small_attention(dispatcher),
        **options)


def _small_attention(dispatcher) -> bool:
    """Whether ``dispatcher`` saw SDPA calls, and each of their score matrices (rows = batch x
    heads, times L x S, as their buckets round them) within :data:`MATH_ATTENTION_MAX_SCORES`."""
    from .bucket import Bucket

    buckets = {s.bucket for s in list(dispatcher.slots) if s.op == "attention"}
    try:
        dims = [Bucket.parse("attention", b) for b in buckets]
        return bool(dims) and all(d.dim("rows") * d.dim("seq_q") * d.dim("seq_kv")
                                  <= MATH_ATTENTION_MAX_SCORES for d in dims)
    except (KeyError, ValueError):   # a bucket of another form: not one to guess about
        return False


def forward_timer(dispatcher, mode: str | None = None) -> Callable[[Callable, nn.Module, str], Callable]:
    """The ``timed`` for :class:`RegionCompiler` that records a compiled forward's calls in
    ``dispatcher``'s region slot ``model:<class>``, variant "compiled", config ``{"mode": mode}``
    when a mode is given and ``{"attention": "math"}`` for :data:`MATH_ATTENTION`."""
    def timed(fn: Callable, model: nn.Module, candidate: str = "compiled") -> Callable:
        cls = type(model)
        config = {"mode": mode} if mode else {}
        if candidate == MATH_ATTENTION:
            config["attention"] = "math"
        return dispatcher.time_region(fn, f"model:{cls.__module__}.{cls.__qualname__}", "compiled",
                                      "compiled", model.parameters(), config or None)
    return timed


def _trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


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
    if isinstance(x, tuple) and hasattr(x, "_fields"):   # a namedtuple takes its fields apart
        return type(x)(*(_clone(v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


_AUTOCAST_DEVICES = ("cpu", "cuda")


def _autocast_state() -> list[tuple[str, torch.dtype]]:
    """The calling thread's autocast: (device type, dtype) of each device it is on for."""
    return [(d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]


@contextlib.contextmanager
def _autocast(state: list[tuple[str, torch.dtype]]):
    """Autocast as ``state`` says, on this thread (dynamo guards on it: a model compiled without
    the job's autocast was compiled again, on the job's thread, at the swap), with its cast
    cache off. That cache is one map for every thread, under one mutex: the compile's fake
    tensors went into it, and the job's thread leaving autocast cleared it holding the mutex
    while it waited for the GIL, which the compile's thread held waiting for the mutex (a
    deadlock, seen once in a test run). Dynamo guards on the cache's switch too:
    :func:`_autocast_cache_off` turns it off around the compiled calls on the job's thread."""
    with contextlib.ExitStack() as stack:
        for device, dtype in state:
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=False))
        yield


@contextlib.contextmanager
def _autocast_cache_off():
    """Autocast's cast cache off on this thread while a compiled model runs under autocast: as
    it was compiled (see :func:`_autocast`). Inside the compiled graph the cache plays no part;
    the eager code between its graphs (a graph break) casts the weights at every use."""
    if not torch.is_autocast_cache_enabled() or \
            not any(torch.is_autocast_enabled(d) for d in _AUTOCAST_DEVICES):
        yield
        return
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(True)


def _backward_compiled_with_forward():
    """A recompile (new shapes, say) compiles the backward with the forward, here, where its
    failure sends the call to eager; AOTAutograd compiles it at the first backward otherwise,
    where a failure is raised from the job's ``loss.backward()``. (The switch is functorch's;
    a torch without it compiles lazily.)"""
    config = torch._functorch.config
    if not hasattr(config, "force_non_lazy_backward_lowering"):
        return contextlib.nullcontext()
    return config.patch(force_non_lazy_backward_lowering=True)


def _tracing() -> bool:
    """Whether a TorchScript trace or an FX symbolic trace is running (dynamo refuses both)."""
    return torch._C._get_tracing_state() is not None or torch.fx._symbolic_trace.is_fx_symbolic_tracing()


def _differentiable_input(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in itertools.chain(args, kwargs.values()))


class _NotCompiled(Exception):
    """The model is not compiled, for the reason given (not a failure of the compiler)."""


def _compile_settings() -> None:
    """What a compiled model swapped in under the job's code needs of torch.compile (read when
    anything compiles, so set for the process): a backward that can run twice
    (``retain_graph=True``: donated buffers refuse it), and guards on the modules' hooks (a hook
    the job adds after the swap runs, as in eager)."""
    import torch._dynamo.config
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False
    torch._dynamo.config.skip_nnmodule_hook_guards = False


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
    cannot fail the background backward pass; its buffers are copies (the pass updating the
    model's BatchNorm statistics in place failed the job's own backward, which saved them). None
    when the model cannot be copied or sets its own ``forward`` per instance."""
    if "forward" in model.__dict__:
        return None
    memo: dict[int, Any] = {}
    for t in model.parameters():
        memo[id(t)] = nn.Parameter(t.data, t.requires_grad)
    for t in model.buffers():
        memo[id(t)] = t.detach().clone()
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
        try:   # what inspect.signature(model.forward) says (HF's generate reads it)
            self.__signature__ = inspect.signature(type(model).forward.__get__(model))
        except (TypeError, ValueError):
            pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        model = self._model()
        twin = memo.get(id(model)) if model is not None else None
        if twin is None:            # the forward copied on its own: it stays the live model's
            return self
        _COPIES.add(twin)
        return _ClassForward(twin)

    def __reduce__(self) -> tuple:
        return _class_forward_reduce(self._model())


_COPIES: weakref.WeakSet = weakref.WeakSet()   # model copies given a _ClassForward, while alive


def _forget_copies() -> None:
    """Take the :class:`_ClassForward` off every live copy (rtxops is off: a copy's forward is
    its class's again, as a plain one's is; TorchScript and export read it)."""
    for twin in list(_COPIES):
        if isinstance(twin.__dict__.get("forward"), _ClassForward):
            del twin.forward
    _COPIES.clear()


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
