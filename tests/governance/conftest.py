from __future__ import annotations

import pytest

from .helpers import Keys, plan_bundle


@pytest.fixture(scope="session")
def keys(tmp_path_factory):
    return Keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="session")
def good_plan(keys, tmp_path_factory):
    """A valid plan bundle, version 5, signed by the trusted daemon key (copy it before changing)."""
    return plan_bundle(tmp_path_factory.mktemp("bundles") / "plan-v5", keys.signer(), 5)
