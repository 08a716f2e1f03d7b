"""A variant's source hash (the tuning DB's and the gate's key) covers the code it runs: the op
file a compiled variant's math lives in, and the helper modules a variant uses. An edit to any of
them makes stored results stale."""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from rtxops.runtime.registry import default_registry


def test_compiled_variants_of_different_ops_hash_differently():
    registry = default_registry()
    ops = ("gelu", "silu", "softmax", "rms_norm")
    assert len({registry.variant(op, "compiled").source_hash for op in ops}) == len(ops)


def test_an_edit_to_a_helper_module_changes_the_hash(monkeypatch):
    registry = default_registry()
    chunked, compiled = registry.variant("gelu", "chunked"), registry.variant("gelu", "compiled")
    before = chunked.source_hash, compiled.source_hash
    real = inspect.getsource

    def edited(obj):
        text = real(obj)
        return text + "\n# edited\n" if getattr(obj, "__name__", "") in (
            "rtxops.runtime.ops._chunked", "rtxops.runtime.ops.gelu") else text

    monkeypatch.setattr(inspect, "getsource", edited)
    assert chunked.source_hash != before[0]  # _chunked.py
    assert compiled.source_hash != before[1]  # gelu.py, where the compiled math is


@pytest.mark.parametrize("op, variant", [("attention", "math"), ("rms_norm", "eager"),
                                         ("rope", "fused_qk")])
def test_an_edit_to_a_helper_that_a_helper_calls_changes_the_hash(monkeypatch, op, variant):
    """``build`` returns a function of its own module that calls ``_layout``: the walk did not
    follow functions of a module it had hashed already, so an edit to ``_layout.py`` left
    these variants' gate verdicts and tuning rows current."""
    chosen = default_registry().variant(op, variant)
    before = chosen.source_hash
    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: real(obj) + (
        "\n# edited\n" if getattr(obj, "__name__", "") == "rtxops.runtime.ops._layout" else ""))
    assert chosen.source_hash != before


@pytest.mark.parametrize("op,helper", [("rms_norm", "_common.py"), ("gelu", "_compiled.py")])
def test_an_edit_to_a_triton_helper_changes_the_kernel_hash(monkeypatch, op, helper):
    """Imports are followed through: triton/gelu.py imports ops/gelu.py, which imports
    _compiled.py (the hash read direct imports only: an edit two imports away left the tuning
    and gate rows current)."""
    triton = default_registry().variant(op, "triton")
    before = triton.source_hash
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: real(self) + (
        b"# edited" if self.name == helper else b""))
    assert triton.source_hash != before


def test_the_reference_variant_hashes_its_ops_reference_code(monkeypatch):
    """The reference's build closed over the op spec, which the hash does not follow: every op's
    reference hashed registry.py alone, so an edit to an op's reference left its tuning rows
    (which priors read) and gate verdicts current."""
    registry = default_registry()
    ops = ("gelu", "silu", "softmax", "rms_norm", "rope", "swiglu")
    before = {op: registry.variant(op, "reference").source_hash for op in ops}
    assert len(set(before.values())) == len(ops)
    real = inspect.getsource

    def edited(obj):
        text = real(obj)
        return text + "\n# edited\n" if getattr(obj, "__name__", "") == "rtxops.runtime.ops.rope" else text

    monkeypatch.setattr(inspect, "getsource", edited)
    assert registry.variant("rope", "reference").source_hash != before["rope"]
    assert registry.variant("gelu", "reference").source_hash == before["gelu"]
