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
    rss_bytes()  # the parent's /proc/self/statm is open before the fork
    go_read, go_write = os.pipe()
    out_read, out_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: waits for the parent to grow, then reports its reading and psutil's
        try:
            os.read(go_read, 1)
            os.write(out_write, f"{rss_bytes()} {psutil.Process().memory_info().rss}".encode())
        finally:
            os._exit(0)
    block = bytearray(512 << 20)  # the parent grows by 512 MB after the fork, the child does not
    os.write(go_write, b"x")
    mine, theirs = (int(x) for x in os.read(out_read, 100).split())
    os.waitpid(pid, 0)
    assert rss_bytes() - theirs > 256 << 20  # the parent's figure would be far off
    assert abs(mine - theirs) < 8 << 20
    del block
