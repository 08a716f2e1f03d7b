"""The evolve scheduler builds its loop only once ``wait_for`` allows, then ticks it."""
import threading
import time

from rtxops.evolve.scheduler import EvolveScheduler


class CountingLoop:
    def __init__(self) -> None:
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1


def until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_the_loop_is_built_only_when_a_job_is_warm():
    warm = threading.Event()
    built = []
    scheduler = EvolveScheduler(lambda: built.append(CountingLoop()) or built[-1], 0.02,
                                wait_for=warm.is_set).start()
    try:
        time.sleep(0.3)                      # about 15 readiness checks
        assert built == [] and scheduler.loop is None
        warm.set()
        assert until(lambda: scheduler.loop is not None and scheduler.loop.ticks >= 2)
        assert len(built) == 1
    finally:
        scheduler.stop()


def test_stop_while_waiting_returns_without_building():
    built = []
    scheduler = EvolveScheduler(lambda: built.append(1), 0.05, wait_for=lambda: False).start()
    time.sleep(0.1)
    started = time.monotonic()
    scheduler.stop(timeout=5)
    assert time.monotonic() - started < 1.0 and not scheduler._thread.is_alive()
    assert built == [] and scheduler.loop is None


def test_a_failing_readiness_check_builds_the_loop_anyway():
    def broken() -> bool:
        raise RuntimeError("no supervisor")

    scheduler = EvolveScheduler(CountingLoop, 0.02, wait_for=broken).start()
    try:
        assert until(lambda: scheduler.loop is not None)
    finally:
        scheduler.stop()
