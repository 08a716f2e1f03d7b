"""Memory readings: process RSS (CPU, per step) and the CUDA allocator (per call / per step)."""
from __future__ import annotations

import os
import threading

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_statm: tuple[int, int] | None = None  # (pid, fd): /proc/self names the process that opened it
_statm_lock = threading.Lock()


def rss_bytes() -> int:
    """Resident set size of this process: /proc/self/statm, kept open and re-read (1-2 µs, where
    opening it each step took ~11), or psutil where there is no /proc."""
    statm = _statm
    if statm is None or statm[0] != os.getpid():  # first call, or a forked child
        statm = _open_statm()
    if statm is not None:
        try:
            return int(os.pread(statm[1], 128, 0).split()[1]) * _PAGE
        except (OSError, ValueError, IndexError):
            _forget_statm(statm)  # closed under us (say): opened again next time
    import psutil

    return psutil.Process().memory_info().rss


def _forget_statm(statm: tuple[int, int]) -> None:
    global _statm
    with _statm_lock:
        if _statm is statm:
            _statm = None


def _after_fork_in_child() -> None:
    """The parent's file reads the parent, and its lock may have been held by another thread."""
    global _statm, _statm_lock
    _statm_lock = threading.Lock()
    if _statm is not None:
        try:
            os.close(_statm[1])
        except OSError:
            pass
        _statm = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _open_statm() -> tuple[int, int] | None:
    global _statm
    with _statm_lock:
        pid = os.getpid()
        if _statm is not None and _statm[0] == pid:  # another thread opened it meanwhile
            return _statm
        if _statm is not None:  # the parent's, inherited: it reads the parent
            try:
                os.close(_statm[1])
            except OSError:
                pass
            _statm = None
        try:
            _statm = (pid, os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            return None
        return _statm


def cuda_stats(device: int | None = None) -> dict[str, float]:
    """Allocator figures for one CUDA device; empty before the job initialized CUDA (asking
    would initialize it)."""
    if not torch.cuda.is_initialized():
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
