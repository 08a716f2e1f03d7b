from __future__ import annotations

import os

import pytest
import torch

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
