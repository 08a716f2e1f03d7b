"""Process RSS as the runtime reads it at step boundaries: current, the reading process's own,
one file held open however many threads and forks read it, and read at most every RSS_EVERY_NS."""
from __future__ import annotations

import mmap
import os
import select
import threading
import time

import psutil

from rtxops.runtime import dispatcher, memory, patching
from rtxops.runtime.memory import rss_bytes

from .._bounded import joined, reaped


def test_rss_follows_allocations_and_matches_psutil():
    # fresh pages of its own, each written: a bytearray could reuse memory the allocator held
    # resident from earlier tests (RSS grew 40 MB for 64 in one CI run)
    block = mmap.mmap(-1, 64 << 20)
    before = rss_bytes()
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    during = rss_bytes()
    assert during - before >= 48 << 20
    assert abs(during - psutil.Process().memory_info().rss) < 8 << 20
    block.close()


def _statm_fds() -> int:
    fds = os.listdir("/proc/self/fd")
    return sum(1 for fd in fds if os.path.realpath(f"/proc/self/fd/{fd}").endswith("/statm"))


def _in_child(body) -> str:
    """Run ``body()`` (returns a str) in a forked child; its answer, or its error."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            answer = body()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            answer = f"error {e!r}"
        os.write(write, answer.encode())
        os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 60)
        assert ready, "the child did not answer in 60 s"
        return os.read(read, 4096).decode()
    finally:
        os.close(read)
        reaped(pid)


def test_a_forked_child_reads_its_own_rss():
    rss_bytes()  # the parent's /proc/self/statm is open before the fork
    block = bytearray(256 << 20)  # the parent is 256 MB bigger than the child will be

    def child() -> str:
        block.clear()  # the child drops its copy: its RSS is now far from the parent's
        return f"{rss_bytes()} {psutil.Process().memory_info().rss} {_statm_fds()}"

    answer = _in_child(child)
    assert not answer.startswith("error"), answer
    mine, theirs, fds = (int(x) for x in answer.split())
    assert rss_bytes() - theirs > 128 << 20  # the parent's figure would be far off
    assert abs(mine - theirs) < 8 << 20
    assert fds == 1  # the parent's file was closed in the child, not kept beside its own
    del block


def test_threads_reading_first_together_open_one_file():
    memory._after_fork_in_child()  # as in a new process: nothing open yet
    before = _statm_fds()
    start = threading.Barrier(8)

    def read() -> None:
        start.wait(60)
        rss_bytes()

    threads = [threading.Thread(target=read) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        joined(t)
    assert _statm_fds() == before + 1


def test_steps_report_an_rss_read_at_most_every_interval(monkeypatch):
    """Right after a step the read cost 25-40 µs: a step reports the last reading while it is
    younger than RSS_EVERY_NS, and a new one once it is older."""
    reads: list[int] = []

    def counted() -> int:
        reads.append(len(reads) + 1)
        return len(reads) << 20

    monkeypatch.setattr(dispatcher, "rss_bytes", counted)
    d = patching.enable()
    reported: list[int] = []
    d.readings.step = lambda step, end_ns, plan_version, rss: reported.append(rss)
    try:
        for _ in range(20):
            d.on_step()
        assert reads == [1]
        assert reported == [1 << 20] * 20
        time.sleep(dispatcher.RSS_EVERY_NS / 1e9 * 1.5)
        d.on_step()
        assert reads == [1, 2] and reported[-1] == 2 << 20
    finally:
        patching.disable()
