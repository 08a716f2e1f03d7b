"""Broken ``gelu`` variants for the offline tuner's tests, loaded through
``RTXOPS_VARIANT_MODULES=tests.evolve.plugins_broken``: one returns NaN, one raises, one passes the
correctness gate (a single call) and then kills its process on the third call in it, one raises
from its sixth; two are correct and print to stdout, where the worker's protocol runs."""
from __future__ import annotations

import os

from rtxops.runtime.originals import gelu as _gelu
from rtxops.runtime.spec import Variant

CRASH_EXIT = 17


def _nan(config, bucket):
    return lambda input, approximate="none": _gelu(input, approximate=approximate) * float("nan")


def _raises(config, bucket):
    def gelu(input, approximate="none"):
        raise RuntimeError("this kernel is broken on purpose")
    return gelu


def _crashes(config, bucket):
    calls = {"n": 0}

    def gelu(input, approximate="none"):
        calls["n"] += 1
        if calls["n"] >= 3:
            os._exit(CRASH_EXIT)  # what a segfaulting kernel does to its process
        return _gelu(input, approximate=approximate)
    return gelu


def _flaky(config, bucket):
    calls = {"n": 0}

    def gelu(input, approximate="none"):
        calls["n"] += 1
        if calls["n"] >= 6:   # past a warm-up of two: in the timed repetitions
            raise RuntimeError("this kernel fails now and then, on purpose")
        return _gelu(input, approximate=approximate)
    return gelu


def _out_of_memory(config, bucket):
    def gelu(input, approximate="none"):
        # what torch's CPU allocator raises when the machine is short of memory at the moment
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 4096 bytes.")
    return gelu


def _chatty(config, bucket):
    def gelu(input, approximate="none"):
        print("chatty kernel, no newline", end="", flush=True)   # a correct kernel that talks
        return _gelu(input, approximate=approximate)
    return gelu


def _prints_number(config, bucket):
    def gelu(input, approximate="none"):
        print(128, flush=True)   # valid JSON, not an object
        return _gelu(input, approximate=approximate)
    return gelu


VARIANTS = [
    Variant("gelu", "broken_nan", "eager", _nan, description="returns NaN"),
    Variant("gelu", "broken_raise", "eager", _raises, description="raises"),
    Variant("gelu", "crashes", "eager", _crashes, description="kills its process on the 3rd call"),
    Variant("gelu", "flaky", "eager", _flaky, description="raises from its 6th call in a process"),
    Variant("gelu", "out_of_memory", "eager", _out_of_memory, description="memory runs out"),
    Variant("gelu", "chatty", "eager", _chatty, description="correct; prints without a newline"),
    Variant("gelu", "prints_number", "eager", _prints_number, description="correct; prints 128"),
]
