from __future__ import annotations

import os

# One OpenMP thread per process (the test processes and every job they start inherit it): the
# suite runs two workers that each start training jobs, and on a 2-core machine OpenMP threads
# spinning at barriers against each other made 12 ms steps take 900 ms. Set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from rtxops.runtime import patching

# in-process daemons (``rtxops run`` without a daemon) run no evolve loop unless a test asks
os.environ.setdefault("RTXOPS_EVOLVE", "0")


@pytest.fixture(autouse=True)
def _runtime_off_and_seeded():
    """Every test starts and ends with torch unpatched and a fixed seed."""
    patching.disable()
    torch.manual_seed(0)
    yield
    patching.disable()
