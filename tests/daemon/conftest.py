from __future__ import annotations

import pytest

from .live import Daemons


@pytest.fixture
def daemons(tmp_path):
    """Start real daemons (``daemons.start(home)``); every process they or their jobs started is
    gone after the test, and a process the test itself left running fails it."""
    ds = Daemons(tmp_path)
    yield ds
    leftovers = ds.cleanup()
    assert not leftovers, f"processes outlived the test: {leftovers}"


@pytest.fixture
def daemon(daemons):
    """One real daemon on its own RTXOPS_HOME under tmp_path."""
    return daemons.start()
