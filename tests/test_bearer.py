"""The Authorization check every endpoint shares."""
from __future__ import annotations

import pytest

from rtxops.bearer import carries_token

TOKEN = b"s3cret"


@pytest.mark.parametrize("header", ["Bearer s3cret", "bearer s3cret", "BEARER s3cret",
                                    "Bearer   s3cret", b"Bearer s3cret"])
def test_the_scheme_is_read_in_any_case_as_rfc_7235_says(header):
    assert carries_token(header, TOKEN)


@pytest.mark.parametrize("header", [None, "", "s3cret", "Bearer", "Bearer ", "Bearer s3cre",
                                    "Bearer s3cretx", "Basic s3cret", "Bearers3cret",
                                    "Bearer s3cret extra", "Bearer\ts3cret", "Bearer sécret"])
def test_anything_else_is_refused(header):
    assert not carries_token(header, TOKEN)
