"""Timing readings. CPU: ``perf_counter_ns`` around the call. CUDA: events recorded around the call
and resolved later, off the hot path, without a device synchronize."""
from __future__ import annotations

from collections import deque
from time import perf_counter_ns
from typing import Callable

import torch



class CudaEventTimer:
    """Device time of calls on CUDA: an event pair around each call, resolved later by
    :meth:`drain` (at step boundaries) once the GPU has passed them, never with a synchronize.
    With ``memory`` on, the allocator's delta and peak around each call are reported too."""

    def __init__(self, readings, max_pending: int = 65536, memory: bool = True) -> None:
        self.readings = readings
        self._pending: deque = deque()
        self.max_pending = max_pending
        self.memory = memory
        self.dropped = 0

    def wrap(self, fn: Callable, slot: int) -> Callable:
        begin, end = self.begin, self.end

        def timed(*args, **kwargs):
            begun = begin()
            out = fn(*args, **kwargs)
            end(slot, begun)
            return out

        return timed

    def begin(self, device: torch.device | None = None) -> tuple:
        """Mark the start of a timed stretch on ``device``'s current stream (default: the current
        device's); hand the result to :meth:`end`."""
        start = torch.cuda.Event(enable_timing=True)
        host_ns = perf_counter_ns()
        before = None
        if self.memory:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        stream = torch.cuda.current_stream(device)
        start.record(stream)
        return host_ns, start, before, stream

    def end(self, slot: int, begun: tuple) -> None:
        """Mark the end of the stretch :meth:`begin` started, as one call of ``slot``."""
        host_ns, start, before, stream = begun
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        if before is not None:
            self.readings.memory(slot, torch.cuda.memory_allocated() - before,
                                 torch.cuda.max_memory_allocated() - before)
        if len(self._pending) < self.max_pending:
            self._pending.append((slot, host_ns, start, end))
        else:
            self.dropped += 1

    def drain(self) -> int:
        """Report every finished pair in order; stop at the first unfinished one. Returns count."""
        n = 0
        pending = self._pending
        while pending and pending[0][3].query():
            slot, host_ns, start, end = pending.popleft()
            self.readings.record(slot, host_ns, int(start.elapsed_time(end) * 1e6))
            n += 1
        return n


class BackwardTimer:
    """Times the backward of one call: identity marks on its outputs (gradient arrives: backward
    starts) and on its inputs (gradient leaves: backward ends). Used on sampled calls only, since
    each mark is an autograd node."""

    def __init__(self, slot: int, readings) -> None:
        self.slot, self.readings = slot, readings
        self.start = 0
        self.pending = 0

    def mark_input(self, x):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            self.pending += 1
            return _BackwardMark.apply(x, self._ended)
        return x

    def mark_output(self, out):
        if isinstance(out, torch.Tensor):
            return _BackwardMark.apply(out, self._started) if out.requires_grad and self.pending else out
        if isinstance(out, tuple):
            return tuple(self.mark_output(o) for o in out)
        return out

    def _started(self) -> None:
        if not self.start:
            self.start = perf_counter_ns()

    def _ended(self) -> None:
        self.pending -= 1
        if self.pending == 0 and self.start:
            self.readings.backward(self.slot, self.start, perf_counter_ns() - self.start)


class _BackwardMark(torch.autograd.Function):
    """Identity whose backward calls ``when_reached`` as the gradient passes through."""

    @staticmethod
    def forward(ctx, x, when_reached):
        ctx.when_reached = when_reached
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.when_reached()
        return grad, None
