"""Timing readings. CPU: ``perf_counter_ns`` around the call. CUDA: events recorded around the call
and resolved later, off the hot path, without a device synchronize."""
from __future__ import annotations

from collections import deque
from time import perf_counter_ns
from typing import Callable

import torch

# whether the current stream is capturing a CUDA graph (torch's raw getter; a build without
# CUDA has a stand-in there that raises)
_capturing: Callable[[], bool] = (
    torch._C._cuda_isCurrentStreamCapturing if torch.backends.cuda.is_built() else lambda: False)


def _current_stream_reader() -> Callable[[int], torch.cuda.Stream]:
    """``torch.cuda.current_stream(index)`` (``-1``: the current device) without its per-call
    device checks (an environment read among them: the largest part of a routed call's host time
    in a profile on an H200), from torch's raw getters, with one Stream object kept per stream."""
    get_device = getattr(torch._C, "_cuda_getDevice", None)
    get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
    if get_device is None or get_stream is None:   # a build without CUDA
        return lambda index=-1: torch.cuda.current_stream(None if index < 0 else index)
    streams: dict[tuple, torch.cuda.Stream] = {}

    def current(index: int = -1) -> torch.cuda.Stream:
        data = get_stream(get_device() if index < 0 else index)
        stream = streams.get(data)
        if stream is None:
            if len(streams) >= 256:   # a job making streams by the thousand
                streams.clear()
            stream = streams[data] = torch.cuda.Stream(
                stream_id=data[0], device_index=data[1], device_type=data[2])
        return stream

    return current


class CudaEventTimer:
    """Device time of calls on CUDA: an event pair around a call, resolved later by :meth:`drain`
    (at step boundaries) once the GPU has passed them, never with a synchronize.

    ``every``: routes made by :meth:`wrap` time their first call and then one call in ``every``
    with events; each call in between is still recorded, with the device time of its route's last
    timed call (the event records and queries are driver calls, most of a routed call's host cost
    on a GPU). With ``memory`` on, the allocator's delta and peak around each call are reported
    too, and every call is timed."""

    def __init__(self, readings, max_pending: int = 65536, memory: bool = True,
                 every: int = 1) -> None:
        self.readings = readings
        self._pending: deque = deque()
        self.max_pending = max_pending
        self.memory = memory
        self.every = 1 if memory else max(1, every)
        self.dropped = 0
        # resolved events, reused per device (an event belongs to the device it was first
        # recorded on): two new events a call cost host time on every call
        self._free: dict[int, list] = {}
        self._last_ns: dict[int, int] = {}   # slot -> device time of its last timed call
        self._current_stream = _current_stream_reader()

    def _event(self, device_index: int):
        free = self._free.get(device_index)
        return free.pop() if free else torch.cuda.Event(enable_timing=True)

    def wrap(self, fn: Callable, slot: int) -> Callable:
        begin, end, every = self.begin, self.end, self.every

        def timed(*args, **kwargs):
            # on the device of the call's first tensor: one the job did not make current (a
            # model spread over GPUs in one process) runs its kernels on that device's stream
            first = args[0] if args else None
            begun = begin(first.get_device() if isinstance(first, torch.Tensor) else -1)
            out = fn(*args, **kwargs)
            end(slot, begun)
            return out

        if every == 1:
            return timed
        queue, countdown = self._queue, [0]

        def sampled(*args, **kwargs):
            if countdown[0] == 0:
                countdown[0] = every - 1
                return timed(*args, **kwargs)
            countdown[0] -= 1
            host_ns = perf_counter_ns()
            out = fn(*args, **kwargs)
            if not _capturing():   # (see begin)
                queue((slot, host_ns, None, None, -1))
            return out

        return sampled

    def begin(self, device: torch.device | int | None = None) -> tuple | None:
        """Mark the start of a timed stretch on ``device``'s current stream (a device or its
        index; None, -1 or a device without index: the current device's); hand the result to
        :meth:`end`. None while a CUDA graph is being captured:
        the call runs no kernel then (its replays never pass here), and timing events recorded
        into a capture are refused by CUDA or never complete for :meth:`drain`."""
        if _capturing():
            return None
        if not isinstance(device, int):
            device = -1 if device is None or device.index is None else device.index
        stream = self._current_stream(device)
        start = self._event(stream.device_index)
        host_ns = perf_counter_ns()
        before = None
        if self.memory:
            torch.cuda.reset_peak_memory_stats(stream.device_index)
            before = torch.cuda.memory_allocated(stream.device_index)
        start.record(stream)
        return host_ns, start, before, stream

    def end(self, slot: int, begun: tuple) -> None:
        """Mark the end of the stretch :meth:`begin` started, as one call of ``slot``."""
        if begun is None:   # (captured into a CUDA graph: not a call that ran)
            return
        host_ns, start, before, stream = begun
        device_index = stream.device_index
        end = self._event(device_index)
        end.record(stream)
        if before is not None:
            self.readings.memory(slot, torch.cuda.memory_allocated(device_index) - before,
                                 torch.cuda.max_memory_allocated(device_index) - before)
        if not self._queue((slot, host_ns, start, end, device_index)):
            self._free.setdefault(device_index, []).extend((start, end))

    def _queue(self, entry: tuple) -> bool:
        """Queue a call for :meth:`drain`; False, and counted as dropped, when the queue is full."""
        if len(self._pending) < self.max_pending:
            self._pending.append(entry)
            return True
        self.dropped += 1
        self.readings.dropped(1)
        return False

    def drain(self) -> int:
        """Report every finished pair in order; stop at the first unfinished one. Returns count."""
        n = 0
        pending, last = self._pending, self._last_ns
        while pending:
            slot, host_ns, start, end, device_index = pending[0]
            if start is None:   # a call between timed ones: its route's last timed figure
                pending.popleft()
                self.readings.record(slot, host_ns, last.get(slot, 0))
            elif end.query():
                pending.popleft()
                last[slot] = ns = int(start.elapsed_time(end) * 1e6)
                self.readings.record(slot, host_ns, ns)
                self._free.setdefault(device_index, []).extend((start, end))
            else:
                break
            n += 1
        return n


class BackwardTimer:
    """Times the backward of one call through hooks on the autograd nodes the call made, never on
    its tensors (a custom Function there would make its outputs views that in-place ops and
    functorch refuse): a pre-hook on its outputs' nodes (the gradient arrives: backward starts)
    and post-hooks on the nodes whose gradients leave the call (backward ends). The call's nodes
    are those numbered between two probes taken around it (autograd numbers the nodes each thread
    makes in order). Used on sampled calls only."""

    MAX_NODES = 256  # a call that made more is not timed (walking its graph would cost too much)

    def __init__(self, slot: int, readings) -> None:
        self.slot, self.readings = slot, readings
        self.start = 0
        self.pending = 0
        self.low = 0

    def before(self) -> None:
        """Call right before the timed call (with grad enabled)."""
        self.low = _sequence_now()

    def after(self, out) -> None:
        """Call right after it, with its output: hooks its backward, if it has one."""
        high = _sequence_now()
        low = self.low
        heads = {id(n): n for t in _tensors(out) if (n := t.grad_fn) is not None
                 and low < n._sequence_nr() < high}
        exits = _exit_nodes(list(heads.values()), low, high, self.MAX_NODES)
        if not exits:
            return
        for node in heads.values():
            node.register_prehook(self._started)
        self.pending = len(exits)
        for node in exits:
            node.register_hook(self._ended)

    def _started(self, grad_outputs) -> None:
        if not self.start:
            self.start = perf_counter_ns()

    def _ended(self, grad_inputs, grad_outputs) -> None:
        self.pending -= 1
        if self.pending == 0 and self.start:
            self.readings.backward(self.slot, self.start, perf_counter_ns() - self.start)


_PROBE = torch.zeros(1, requires_grad=True)


def _sequence_now() -> int:
    """The number autograd gives the next node this thread makes (a throwaway view's node)."""
    return _PROBE.view(1).grad_fn._sequence_nr()


def _tensors(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor) and t.requires_grad]
    return []


def _exit_nodes(heads: list, low: int, high: int, limit: int) -> list | None:
    """The nodes among ``heads`` and those they lead to, numbered in (low, high), whose gradients
    flow on to a node outside that range; None past ``limit`` nodes."""
    seen: set[int] = set()
    stack, exits = list(heads), []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if len(seen) > limit:
            return None
        leaves = False
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if low < nxt._sequence_nr() < high:
                stack.append(nxt)
            else:
                leaves = True
        if leaves:
            exits.append(node)
    return exits
