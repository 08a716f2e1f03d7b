"""Candidate arms: a config space larger than the cap is sampled so every value of every key is
tried, not cut after its first configs in sorted order."""
from __future__ import annotations

import pytest

from rtxops.evolve.candidates import candidates
from rtxops.runtime.registry import default_registry


@pytest.mark.parametrize("op,bucket", [
    ("cross_entropy", "float32/cuda/vocab=1000,rows=8,reduction=1,smoothing=0"),
    ("rms_norm", "float32/cuda/hidden=64,rows=8"),
])
def test_a_large_config_space_is_sampled_across_every_value(op, bucket):
    registry = default_registry()
    spec, variant = registry.op(op), registry.variant(op, "triton")
    arms = [a for a in candidates(registry, op, spec.parse_bucket(bucket)) if a.variant == "triton"]
    assert len(arms) == 8 < len(list(variant.configs()))
    assert arms[0].config == variant.default_config
    for key, values in variant.config_space.items():
        assert {a.config[key] for a in arms} == set(values), key
    assert len(set(arms)) == len(arms)
    # the same arms every time (the gate's and the tuning DB's keys)
    assert arms == [a for a in candidates(registry, op, spec.parse_bucket(bucket)) if a.variant == "triton"]


def test_a_space_within_the_cap_is_taken_whole():
    registry = default_registry()
    arms = candidates(registry, "gelu", registry.op("gelu").parse_bucket("float32/cpu/tanh=0,hidden=64,rows=8"))
    chunked = [a.config["chunk_elems"] for a in arms if a.variant == "chunked"]
    assert sorted(chunked) == sorted(registry.variant("gelu", "chunked").config_space["chunk_elems"])
