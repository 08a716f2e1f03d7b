"""Process RSS as the runtime reads it each step: current, and the reading process's own."""
from __future__ import annotations

import os

import psutil

from rtxops.runtime.memory import rss_bytes


def test_rss_follows_allocations_and_matches_psutil():
    before = rss_bytes()
    block = bytearray(64 << 20)  # zero-filled: every page touched
    during = rss_bytes()
    assert during - before >= 48 << 20
    assert abs(during - psutil.Process().memory_info().rss) < 8 << 20
    del block


def test_a_forked_child_reads_its_own_rss():
    rss_bytes()  # the parent's file is open before the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: grows by 256 MB, reports what it reads and what psutil says
        try:
            block = bytearray(256 << 20)
            os.write(write, f"{rss_bytes()} {psutil.Process().memory_info().rss}".encode())
            del block
        finally:
            os._exit(0)
    os.close(write)
    mine, theirs = (int(x) for x in os.read(read, 100).split())
    os.waitpid(pid, 0)
    assert abs(theirs - rss_bytes()) > 64 << 20  # the parent's figure would be far off
    assert abs(mine - theirs) < 8 << 20
