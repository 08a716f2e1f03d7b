"""Test variants of ``gelu`` with known speed and correctness, loaded by the job and the daemon
through ``RTXOPS_VARIANT_MODULES=tests.evolve.plugins_speed``."""
from __future__ import annotations

import os
import time


from rtxops.runtime.originals import gelu as _gelu
from rtxops.runtime.spec import Variant



def _slow3x(config, bucket):
    def gelu(input, approximate="none"):
        for _ in range(2):
            _gelu(input.detach(), approximate=approximate)
        return _gelu(input, approximate=approximate)
    return gelu


def _toggle(config, bucket):
    """As fast as the reference until the file named by RTXOPS_TEST_SLOW_FILE exists, then half a
    millisecond slower a call, ~20x (a kernel that regresses after promotion: a driver update,
    thermal throttling). Five more gelus, 6x the compute, measured +38 % on a loaded machine,
    a regression the canary's 20 steps could not tell from the noise."""
    path = os.environ.get("RTXOPS_TEST_SLOW_FILE", "")
    state = {"calls": 0, "slow": False}

    def gelu(input, approximate="none"):
        state["calls"] += 1
        if not state["slow"] and path and state["calls"] % 16 == 0:
            state["slow"] = os.path.exists(path)
        if state["slow"]:
            time.sleep(0.0005)
        return _gelu(input, approximate=approximate)
    return gelu


def _wrong(config, bucket):
    return lambda input, approximate="none": _gelu(input, approximate=approximate) * 1.1


def _nan(config, bucket):
    return lambda input, approximate="none": _gelu(input, approximate=approximate) * float("nan")


VARIANTS = [
    Variant("gelu", "slow3x", "test", _slow3x, description="the reference, three times"),
    Variant("gelu", "toggle", "test", _toggle, description="fast until told to be slow"),
    Variant("gelu", "wrong", "test", _wrong, description="10 % off"),
    Variant("gelu", "nan", "test", _nan, description="all NaN"),
]
