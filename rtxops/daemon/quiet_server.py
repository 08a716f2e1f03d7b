"""uvicorn's server, idle without waking ten times a second.

uvicorn's main loop sleeps 0.1 s between looks at ``should_exit``: an idle daemon took ~2 ms of CPU
a second for it, and on a small machine that comes out of the jobs' steps. :class:`QuietServer`
looks once a second (the ``Date`` header it keeps is per second anyway), and setting
``should_exit``, from any thread or a signal handler, wakes it at once.
"""
from __future__ import annotations

import asyncio
import contextlib

import uvicorn

IDLE_TICK_S = 1.0
_TICKS_PER_S = 10   # uvicorn's on_tick counts tenths of a second (its date header: every 10th)


class QuietServer(uvicorn.Server):
    """A ``uvicorn.Server`` whose idle main loop wakes every :data:`IDLE_TICK_S`, or when told to
    exit."""

    def __init__(self, config: uvicorn.Config) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exit_set: asyncio.Event | None = None
        self._should_exit = False
        self.ticks = 0   # main-loop wake-ups (tests)
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        loop, event = self._loop, self._exit_set
        if value and loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):   # the loop has closed: nothing to wake
                loop.call_soon_threadsafe(event.set)

    async def main_loop(self) -> None:
        # both set before the first look at should_exit: a setter that comes later wakes the wait
        self._exit_set = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + _TICKS_PER_S) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit_set.wait(), IDLE_TICK_S)
            self.ticks += 1
