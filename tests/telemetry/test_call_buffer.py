"""The recorder's call buffer: the C one (``_native/call_buffer.c``) and the Python closures it
stands in for behave alike: what is kept, what is handed over and when, what is dropped."""
from __future__ import annotations

import pickle
import time

import pytest

from rtxops.telemetry import recorder


@pytest.fixture(params=["native", "python"])
def make_buffer(request, monkeypatch):
    if request.param == "native":
        if recorder._NativeCallBuffer is None:
            pytest.fail("rtxops/telemetry/_native/call_buffer.c is not built")
    else:
        monkeypatch.setattr(recorder, "_NativeCallBuffer", None)
    return recorder._make_buffer


def test_records_are_kept_in_order_and_taken_once(make_buffer):
    record, _, take, _ = make_buffer(4)
    record(0, 100, 5)
    record(3, 200, 2**62)
    calls, dropped = take()
    assert list(calls) == [0, 100, 5, 3, 200, 2**62] and calls.typecode == "q" and dropped == 0
    calls, dropped = take()
    assert list(calls) == [] and dropped == 0


def test_a_full_buffer_is_emptied_by_on_full_and_nothing_is_lost(make_buffer):
    handed = []
    record, _, take, _ = make_buffer(2, lambda: handed.append(take()))
    for i in range(5):
        record(i, i, 1)
    calls, dropped = take()
    kept = [list(c) for c, _ in handed] + [list(calls)]
    assert [row[0] for rows in kept for row in zip(*[iter(rows)] * 3)] == [0, 1, 2, 3, 4]
    assert dropped == 0 and all(d == 0 for _, d in handed)


def test_calls_that_find_it_full_again_are_dropped_and_counted(make_buffer):
    def broken():
        raise RuntimeError("the consumer is gone")

    record, _, take, _ = make_buffer(2, broken)
    for i in range(5):
        record(i, i, 1)
    calls, dropped = take()
    assert len(calls) // 3 == 2 and dropped == 3


def test_a_record_made_while_on_full_runs_does_not_call_it_again(make_buffer):
    calls_of_on_full = []

    def on_full():
        calls_of_on_full.append(1)
        record(9, 9, 9)   # full, and on_full is running: dropped, no recursion

    record, _, take, _ = make_buffer(1, on_full)
    record(0, 0, 1)
    record(1, 1, 1)
    calls, dropped = take()
    assert calls_of_on_full == [1] and list(calls) == [0, 0, 1] and dropped == 2


def test_the_timer_hands_over_once_every_interval_until_stopped(make_buffer):
    handed = []
    record, _, take, stop_timer = make_buffer(100, lambda: handed.append(take()),
                                              int(0.05 * 1e9))
    record(0, time.perf_counter_ns(), 1)
    record(0, time.perf_counter_ns(), 1)
    assert handed == []
    time.sleep(0.06)
    record(0, time.perf_counter_ns(), 1)   # due: the two before go first
    assert [len(c) // 3 for c, _ in handed] == [2]
    stop_timer()
    time.sleep(0.06)
    record(0, time.perf_counter_ns(), 1)
    assert len(handed) == 1 and len(take()[0]) // 3 == 2


def test_record_refuses_what_is_not_three_integers(make_buffer):
    record, _, take, _ = make_buffer(4)
    with pytest.raises(TypeError):
        record(0, "now", 1)
    with pytest.raises((TypeError, OverflowError)):
        record(0, 2**64, 1)
    assert len(take()[0]) == 0


def test_record_since_records_a_call_that_ends_now(make_buffer):
    record, record_since, take, _ = make_buffer(4)
    before = time.perf_counter_ns()
    start = before - 5000
    record_since(7, start)
    after = time.perf_counter_ns()
    with pytest.raises(TypeError):
        record_since(7, "then")
    with pytest.raises(TypeError):
        record_since(7)
    slot, begun, duration = take()[0]
    assert (slot, begun) == (7, start) and 5000 <= duration <= after - start


def test_a_pickled_record_goes_without_the_calls_or_the_consumer():
    if recorder._NativeCallBuffer is None:
        pytest.fail("rtxops/telemetry/_native/call_buffer.c is not built")
    record, record_since, take, _ = recorder._make_buffer(1 << 16,
                                                          lambda: pytest.fail("must not travel"))
    for i in range(1000):
        record(i, i, i)
    blob = pickle.dumps(record)
    assert len(blob) < 200
    copy = pickle.loads(blob)
    copy(0, 0, 1)     # an empty buffer with no consumer: counted as dropped, never raising
    since = pickle.loads(pickle.dumps(record_since))
    since(0, 0)
    assert len(take()[0]) // 3 == 1000
