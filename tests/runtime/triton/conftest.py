"""Triton kernels run on the CPU interpreter here.

``@triton.jit`` picks compiled or interpreted when a kernel module is imported, so
``TRITON_INTERPRET`` is set at collection, before any test builds a Triton variant. The rtxops flag
that lets Triton variants accept CPU tensors is set per test only.
"""
from __future__ import annotations

import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _triton_on_cpu(monkeypatch):
    monkeypatch.setenv("RTXOPS_TRITON_INTERPRET", "1")
