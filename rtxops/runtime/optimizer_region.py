"""Optimizer-step region: the job's ``torch.optim`` optimizer switched to torch's fused
implementation at a step boundary, timed against the default, kept only if faster.

torch runs Adam, AdamW, SGD and Adagrad as a loop of small ops per parameter unless the script
asks for ``fused=True`` (on CPU it never defaults to it). The fused kernel does the same update
in one pass over all parameters; its rounding may differ from the loop's in the last bit.
Switching needs no new optimizer: every step reads ``fused`` and ``foreach`` from the param
groups, and the fused kernels want the step counters on the parameters' device (moved here).

Steps, one optimizer at a time: wait until ``ready()`` (the model region has settled, so no
compiler runs beside the timing), time ``trial_steps`` steps as they are, switch, skip two steps,
time as many fused ones; the slower one loses. Each switch is reported with
``report(step, outcome)`` (outcome "fused" or "default"), as an ``rtx.swap`` with digest
``region:optimizer:<outcome>``. A job stepping two optimizers is left alone (a step boundary
then times only part of the step).

With ``clock(optimizer, variant)`` given (``Dispatcher.region_clock``), every ``optimizer.step()``
is recorded as a call of the optimizer's region slot, variant "fused" or "default": the
optimizer's time shows in telemetry, before and after the switch.
"""
from __future__ import annotations

import functools
import inspect
import logging
import statistics
import time
import weakref
from typing import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

log = logging.getLogger("rtxops.runtime")

WAIT, BASELINE, TRIAL, FUSED, DEFAULT, UNSUPPORTED = (
    "wait", "baseline", "trial", "fused", "default", "unsupported")
_SETTLE_STEPS = 2  # the first fused steps allocate and may still be slow


class FusedOptimizer:
    """Tries torch's fused implementation of the job's optimizer (see the module docstring).

    ``on_step(step, optimizer)`` is called at every optimizer-step boundary."""

    def __init__(self, report: Callable[[int, str], None], *, trial_steps: int = 20,
                 warmup_steps: int = 3, ready: Callable[[], bool] = lambda: True,
                 clock: Callable[[torch.optim.Optimizer, str], tuple[Callable, Callable]] | None = None
                 ) -> None:
        self.report = report
        self.clock = clock
        self._clocks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._running: tuple[Callable, object] | None = None  # (stop, its token) of the step under way
        self._pre_hook = register_optimizer_step_pre_hook(self._step_starts) if clock else None
        self.trial_steps = trial_steps
        self.warmup_steps = warmup_steps
        self.ready = ready
        self.state = WAIT
        self.reason: str | None = None
        self._optimizer: weakref.ReferenceType | None = None
        self._saved: list[tuple[bool | None, bool | None]] = []
        self._saving = None   # the state_dict hook that writes the job's own settings
        self._steps = 0
        self._last_ns: int | None = None
        self._before: list[int] = []
        self._after: list[int] = []

    def close(self) -> None:
        """Remove the step clock's hook and put the optimizer back as it was (rtxops is off)."""
        self._remove_hook()
        self._restore()

    def _remove_hook(self) -> None:
        if self._pre_hook is not None:
            self._pre_hook.remove()
            self._pre_hook = None

    def _step_starts(self, optimizer, args, kwargs) -> None:
        if self.clock is None:
            return
        try:
            variant = FUSED if any(g.get("fused") for g in optimizer.param_groups) else DEFAULT
            clocks = self._clocks.setdefault(optimizer, {})
            if variant not in clocks:
                clocks[variant] = self.clock(optimizer, variant)
            start, stop = clocks[variant]
            self._running = (stop, start())
        except Exception as e:  # a clock never fails the job's step: this one stops
            self._clock_failed(e)

    def _clock_failed(self, e: Exception) -> None:
        # the hook itself goes at the step boundary: torch is iterating over its hooks now
        self.clock = None
        log.warning("region: the optimizer's steps are not recorded: %s", e)

    def on_step(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        running, self._running = self._running, None
        if running is not None:
            try:
                running[0](running[1])
            except Exception as e:
                self._clock_failed(e)
        if self.clock is None:
            self._remove_hook()
        try:
            self._on_step(step, optimizer)
        except Exception as e:  # never the job's death: back to the default, with the reason
            self._restore()
            self._stop(f"{type(e).__name__}: {e}")

    def _on_step(self, step: int, optimizer) -> None:
        if self.state in (TRIAL, FUSED) and self._optimizer() is optimizer and \
                not all(g.get("fused") for g in optimizer.param_groups):
            # the job loaded a checkpoint (load_state_dict: its own settings, as saved) or added
            # a param group (unfreezing layers): the region's choice stands, else its trial timed
            # default steps as fused ones
            added = optimizer.param_groups[len(self._saved):]
            problem = _params_refused(type(optimizer), [p for g in added for p in g["params"]])
            if problem:
                self._restore()
                self.report(step, DEFAULT)
                self._stop(f"an added param group: {problem}")
                return
            # (the list the checkpoint hook holds: a revert and a checkpoint see the new groups)
            self._saved.extend((g.get("fused"), g.get("foreach")) for g in added)
            _switch_to_fused(optimizer)
        if self.state in (FUSED, DEFAULT, UNSUPPORTED):
            return
        now = time.perf_counter_ns()
        elapsed, self._last_ns = (now - self._last_ns if self._last_ns else None), now
        if self._optimizer is None:
            self._optimizer = weakref.ref(optimizer)
        elif self._optimizer() is not optimizer:
            if self.state == TRIAL:
                self._restore()
                self.report(step, DEFAULT)
            self._stop("the job steps more than one optimizer")
            return
        self._steps += 1
        if self.state == WAIT:
            if self._steps > self.warmup_steps and self.ready():
                why = unsupported_reason(optimizer)
                if why:
                    self._stop(why)
                else:
                    self.state = BASELINE
                    self._last_ns = time.perf_counter_ns()  # the baseline starts after the check
        elif self.state == BASELINE and elapsed is not None:
            self._before.append(elapsed)
            if len(self._before) >= self.trial_steps:
                self._saved = _switch_to_fused(optimizer)
                self._saving = optimizer.register_state_dict_post_hook(
                    functools.partial(_as_saved, saved=self._saved))
                self.state = TRIAL
                self.report(step, FUSED)
        elif self.state == TRIAL and elapsed is not None:
            self._after.append(elapsed)
            after = self._after[_SETTLE_STEPS:]
            if len(after) >= self.trial_steps:
                before, fused = statistics.median(self._before), statistics.median(after)
                if fused >= before:
                    self._restore()
                    self.state = DEFAULT
                    self.report(step, DEFAULT)
                else:
                    self.state = FUSED
                log.info("region: fused optimizer %s (default median %.2f ms, fused %.2f ms)",
                         "kept" if self.state == FUSED else "reverted", before / 1e6, fused / 1e6)

    def _restore(self) -> None:
        opt = self._optimizer() if self._optimizer else None
        if opt is not None and self._saved:
            _switch_back(opt, self._saved)
        self._saved = []
        if self._saving is not None:
            self._saving.remove()
            self._saving = None

    def _stop(self, reason: str) -> None:
        self.state, self.reason = UNSUPPORTED, reason
        log.info("region: the optimizer stays as it is: %s", reason)


def step_clock(dispatcher) -> Callable[[torch.optim.Optimizer, str], tuple[Callable, Callable]]:
    """The ``clock`` for :class:`FusedOptimizer` that records steps in ``dispatcher``'s region
    slot ``optimizer:<class>`` of the variant (family "aten" for torch's fused kernel)."""
    def clock(optimizer, variant: str):
        cls = type(optimizer)
        return dispatcher.region_clock(f"optimizer:{cls.__module__}.{cls.__qualname__}", variant,
                                       "aten" if variant == FUSED else "eager",
                                       (p for g in optimizer.param_groups for p in g["params"]))
    return clock


def unsupported_reason(optimizer) -> str | None:
    """Why ``optimizer`` cannot run fused (None when it can). torch's own checks decide: a
    throwaway optimizer is built with ``fused=True`` over the same parameters (no state is
    touched), and every parameter goes through the device and dtype check of a fused step."""
    cls = type(optimizer)
    if not cls.__module__.startswith("torch.optim.") or "fused" not in optimizer.defaults:
        return f"{cls.__name__} has no fused implementation in torch"
    groups = optimizer.param_groups
    if any(g.get("fused") for g in groups):
        return "the optimizer already runs fused"
    if any(g.get("differentiable") for g in groups):
        return "the optimizer is differentiable"
    params = [p for g in groups for p in g["params"]]
    if any(p.grad is not None and (p.grad.is_sparse or p.grad.layout != torch.strided)
           for p in params):
        return "a parameter has sparse gradients"
    accepted = inspect.signature(cls.__init__).parameters  # AdamW keeps one default it sets itself
    kw = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    try:
        cls(params, **{**kw, "fused": True, "foreach": False})
    except Exception as e:  # noqa: BLE001 - whatever torch refuses
        return f"torch refuses fused=True here: {e}"
    return _params_refused(cls, params)


def _params_refused(cls: type, params: list) -> str | None:
    """Why torch's fused ``cls`` would refuse one of ``params`` (what it checks only on its first
    fused step: device and dtype), or None."""
    from torch.optim.optimizer import _device_dtype_check_for_fused

    try:
        for p in params:
            _device_dtype_check_for_fused(p, cuda_unsupported=cls is torch.optim.Adagrad)
    except Exception as e:  # noqa: BLE001 - whatever torch refuses
        return f"torch refuses fused=True here: {e}"
    return None


def _switch_to_fused(optimizer) -> list[tuple[bool | None, bool | None]]:
    saved = []
    for g in optimizer.param_groups:
        saved.append((g.get("fused"), g.get("foreach")))
        g["fused"], g["foreach"] = True, False
        for p in g["params"]:
            _move_step(optimizer.state.get(p), p.device, torch.float32)
    return saved


def _as_saved(optimizer, state_dict: dict, saved: list[tuple[bool | None, bool | None]]) -> dict:
    """``optimizer.state_dict()`` with the job's own ``fused``/``foreach``: a checkpoint taken
    while rtxops runs the fused kernel loads into a plain optimizer as the job set it up."""
    for group, (fused, foreach) in zip(state_dict["param_groups"], saved):
        group["fused"], group["foreach"] = fused, foreach
    return state_dict


def _switch_back(optimizer, saved: list[tuple[bool | None, bool | None]]) -> None:
    from torch.optim.optimizer import _get_scalar_dtype

    for g, (fused, foreach) in zip(optimizer.param_groups, saved):
        g["fused"], g["foreach"] = fused, foreach
        if not g.get("capturable"):  # the default path keeps step counters on the host
            for p in g["params"]:
                _move_step(optimizer.state.get(p), torch.device("cpu"), _get_scalar_dtype())


def _move_step(state: dict | None, device: torch.device, dtype: torch.dtype) -> None:
    step = state.get("step") if state else None
    if isinstance(step, torch.Tensor):
        state["step"] = step.to(device=device, dtype=dtype)
