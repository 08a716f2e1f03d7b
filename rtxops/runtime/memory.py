"""Memory readings: process RSS (CPU, per step) and the CUDA allocator (per call / per step)."""
from __future__ import annotations

import os

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_statm: tuple[int, int] | None = None  # (pid, fd): /proc/self names the process that opened it


def rss_bytes() -> int:
    """Resident set size of this process: /proc/self/statm, kept open and re-read (1-2 µs, where
    opening it each step took ~11), or psutil where there is no /proc."""
    global _statm
    pid = os.getpid()
    try:
        if _statm is None or _statm[0] != pid:  # first call, or a forked child
            _statm = (pid, os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC))
        return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


def cuda_stats(device: int | None = None) -> dict[str, float]:
    """Allocator figures for one CUDA device; empty without CUDA."""
    if not torch.cuda.is_available():
        return {}
    s = torch.cuda.memory_stats(device)
    allocated = s.get("allocated_bytes.all.current", 0)
    reserved = s.get("reserved_bytes.all.current", 0)
    return {
        "allocated": allocated,
        "reserved": reserved,
        "peak": s.get("allocated_bytes.all.peak", 0),
        "fragmentation": 1 - allocated / reserved if reserved else 0.0,
        "alloc_retries": s.get("num_alloc_retries", 0),
        "ooms": s.get("num_ooms", 0),
    }
