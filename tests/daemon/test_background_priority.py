"""The daemon's background threads (governance warm-up, evolve loop) run at the process's own
priority. A niced thread that holds the GIL while the scheduler keeps it off a busy CPU stalls
every other thread of the daemon: on a loaded 2-core machine a plan publish took over a minute."""
from __future__ import annotations

import os
import threading
import time

from rtxops.evolve.scheduler import EvolveScheduler
from rtxops.governance import sbom
from rtxops.governance.authority import Authority


def _own_priority() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_governance_warm_up_is_not_niced(tmp_path, monkeypatch):
    seen: list[int] = []
    monkeypatch.setattr(sbom, "_environment", lambda: seen.append(_own_priority()))
    authority = Authority(tmp_path / "gov")
    authority._warm.join(30)
    authority.close()
    assert seen == [_own_priority()]


def test_the_evolve_thread_is_not_niced():
    seen: list[int] = []

    class Loop:
        def tick(self) -> None:
            seen.append(_own_priority())

    scheduler = EvolveScheduler(Loop, 0.01).start()
    try:
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        scheduler.stop()
    assert seen and set(seen) == {_own_priority()}
