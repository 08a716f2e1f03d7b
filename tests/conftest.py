from __future__ import annotations

import pytest
import torch

from rtxops.runtime import patching


@pytest.fixture(autouse=True)
def _runtime_off_and_seeded():
    """Every test starts and ends with torch unpatched and a fixed seed."""
    patching.disable()
    torch.manual_seed(0)
    yield
    patching.disable()
