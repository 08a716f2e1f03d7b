"""Runs the evolve loop on a background thread of the daemon, every ``interval_s`` seconds."""
from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger("rtxops.evolve")


def enabled() -> bool:
    """``RTXOPS_EVOLVE=0`` turns the loop off (the daemon then only serves published plans);
    a value that is no on/off word is refused (:class:`~rtxops.settings.SettingError`), not
    taken for on."""
    from rtxops import settings

    return settings.switch("RTXOPS_EVOLVE", default=True)


class EvolveScheduler:
    """Builds the loop on its own thread (the registry imports torch: seconds) and ticks it.

    ``wait_for``: the loop is built only once it returns true (checked every ``interval_s``),
    so the daemon's imports and the loop's first work do not compete with a job's start-up:
    on a small machine any busy thread stalls a starting job's OpenMP threads."""

    def __init__(self, make_loop: Callable[[], object], interval_s: float,
                 wait_for: Callable[[], bool] | None = None) -> None:
        self._make_loop = make_loop
        self._wait_for = wait_for
        self.interval_s = interval_s
        self.loop = None
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rtxops-evolve", daemon=True)

    def start(self) -> EvolveScheduler:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        # The thread is not niced: holding the GIL while kept off the CPU it would stall the
        # daemon's other threads (a priority inversion). Its heavy work (gates, benchmarks) runs
        # in niced worker processes (evolve.runner).
        while self._wait_for is not None and not self._ready():
            if self._stop.wait(self.interval_s):
                return
        try:
            self.loop = self._make_loop()
        except Exception as e:  # the daemon keeps serving without a loop, and says why
            self.error = f"{type(e).__name__}: {e}"
            log.exception("evolve loop not started")
            return
        while not self._stop.wait(self.interval_s):
            try:
                self.loop.tick()
            except Exception:
                log.exception("evolve tick failed")

    def _ready(self) -> bool:
        try:
            return bool(self._wait_for())
        except Exception:
            log.exception("evolve: the readiness check failed; building the loop anyway")
            return True
