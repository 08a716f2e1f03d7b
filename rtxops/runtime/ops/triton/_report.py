"""What a Triton build tells telemetry: the config it resolved to, and whether each kernel launch
hit Triton's caches.

Triton calls ``knobs.runtime.jit_cache_hook`` only when a launch misses its in-memory kernel cache,
then ``knobs.compilation.listener`` with ``cache_hit`` (the on-disk cache) and the compile times.
A launch that triggers neither was an in-memory hit. :class:`CompileWatch` chains both hooks
(keeping any hook already installed) and files what they saw under the launch in progress.
Interpreted kernels (``TRITON_INTERPRET=1``) are never compiled, so they report no compiles.
"""
from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any, Callable

import torch

MEMORY_HIT, DISK_HIT, COMPILED = "memory_hit", "disk_hit", "compiled"


@dataclass(frozen=True)
class KernelEvent:
    """One launch that compiled or loaded a kernel (cache misses in memory), or a resolved config."""

    op: str
    variant: str
    bucket: str
    config: str  # the requested config, canonical JSON (what the dispatcher's slot names)
    resolved: str  # the config actually used, canonical JSON
    kernel: str = ""
    cache: str = ""  # "", MEMORY_HIT, DISK_HIT or COMPILED
    duration_ns: int = 0


def canonical(config: dict) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


@dataclass
class _Launch:
    misses: list[str] = field(default_factory=list)  # kernels that missed the in-memory cache
    compiles: list[tuple[bool, int]] = field(default_factory=list)  # (disk hit, ns)


class CompileWatch:
    """Chains Triton's JIT-cache hook and compilation listener; one process-wide instance."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._installed = False
        self._prev_cache_hook: Callable | None = None
        self._prev_listener: Callable | None = None

    def install(self) -> None:
        if self._installed:
            return
        from triton import knobs

        self._prev_cache_hook = knobs.runtime.jit_cache_hook
        self._prev_listener = knobs.compilation.listener
        knobs.runtime.jit_cache_hook = self.on_jit_cache_miss
        knobs.compilation.listener = self.on_compile
        self._installed = True

    def on_jit_cache_miss(self, *, key: Any, repr: str, fn: Any, compile: Any,
                          is_manual_warmup: bool, already_compiled: bool) -> bool | None:
        launch = getattr(self._local, "launch", None)
        if launch is not None:
            launch.misses.append(repr.split("[", 1)[0])
        if self._prev_cache_hook is not None:  # its answer (skip compiling) is Triton's contract
            return self._prev_cache_hook(key=key, repr=repr, fn=fn, compile=compile,
                                         is_manual_warmup=is_manual_warmup,
                                         already_compiled=already_compiled)
        return None

    def on_compile(self, *, src: Any, metadata: dict, metadata_group: dict, times: Any,
                   cache_hit: bool) -> None:
        launch = getattr(self._local, "launch", None)
        if launch is not None:
            total_us = getattr(times, "total", 0)  # triton.knobs.CompileTimes, microseconds
            launch.compiles.append((bool(cache_hit), int(total_us) * 1000))
        if self._prev_listener is not None:
            self._prev_listener(src=src, metadata=metadata, metadata_group=metadata_group,
                                times=times, cache_hit=cache_hit)

    def launch(self, run: Callable[[], Any]) -> tuple[Any, _Launch]:
        """Run one kernel launch and return its result and what the hooks saw during it."""
        seen = _Launch()
        self._local.launch = seen
        try:
            return run(), seen
        finally:
            self._local.launch = None


WATCH = CompileWatch()


class Reporter:
    """Attached to one build (variant, config, bucket): launches its kernels under the watch and
    reports the resolved config (once) and every compile to the running dispatcher's readings."""

    def __init__(self, op: str, variant: str, bucket: str, config: dict, resolved: dict) -> None:
        self.base = KernelEvent(op, variant, bucket, canonical(config), canonical(resolved))
        self._config_reported = False

    def launch(self, kernel: Any, grid: tuple, *args: Any, **kwargs: Any) -> Any:
        if not self._config_reported:
            self._config_reported = True
            emit(self.base)
        if kernel_is_interpreted(kernel):
            return kernel[grid](*args, **kwargs)
        index = _cuda_index(args)
        if index is not None and index != torch.cuda.current_device():
            # Triton launches on the current device (and its stream): a model split over GPUs
            # in one process (device_map="auto") has tensors on another one
            with torch.cuda.device(index):
                return self._launch(kernel, grid, args, kwargs)
        return self._launch(kernel, grid, args, kwargs)

    def _launch(self, kernel: Any, grid: tuple, args: tuple, kwargs: dict) -> Any:
        WATCH.install()
        t0 = perf_counter_ns()
        out, seen = WATCH.launch(lambda: kernel[grid](*args, **kwargs))
        if seen.misses or seen.compiles:
            disk_hit = bool(seen.compiles) and all(hit for hit, _ in seen.compiles)
            compile_ns = sum(ns for _, ns in seen.compiles) or perf_counter_ns() - t0
            cache = DISK_HIT if disk_hit else COMPILED if seen.compiles else MEMORY_HIT
            name = seen.misses[0] if seen.misses else getattr(kernel, "__name__", "")
            emit(_with(self.base, kernel=name, cache=cache, duration_ns=compile_ns))
        return out


def _cuda_index(args: tuple) -> int | None:
    """The CUDA device of the launch's first tensor, or None (a CPU tensor, or none)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.index if a.is_cuda else None
    return None


def kernel_is_interpreted(kernel: Any) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def _with(event: KernelEvent, **changes: Any) -> KernelEvent:
    return KernelEvent(**{**event.__dict__, **changes})


EVENTS: deque[KernelEvent] = deque(maxlen=4096)  # recent events, for bench scripts and tests


def emit(event: KernelEvent) -> None:
    """Keep ``event`` and hand it to the active dispatcher's readings (off the hot path: builds
    and compiles only).

    A compile becomes ``readings.build(slot, ns, cache_hit)`` on every slot of this
    (op, variant, config, bucket); the resolved config goes to ``readings.kernel_config(slot,
    json)`` when the readings sink has that method.
    """
    EVENTS.append(event)
    from ...patching import active  # runtime internals import ops: import late

    dispatcher = active()
    if dispatcher is None:
        return
    readings = dispatcher.readings
    for slot in list(dispatcher.slots):
        if (slot.op, slot.variant, slot.config, slot.bucket) != (
                event.op, event.variant, event.config, event.bucket):
            continue
        if event.cache:
            readings.build(slot.id, event.duration_ns, event.cache != COMPILED)
        else:
            kernel_config = getattr(readings, "kernel_config", None)
            if kernel_config is not None:
                kernel_config(slot.id, event.resolved)
