"""Every Triton kernel against its op's reference on the op's own test cases (forward and
gradients, fp32 and bf16), under every config of its space, and across repeated trials."""
from __future__ import annotations

import importlib
import itertools
import random

import pytest
import torch

from rtxops.runtime.ops.triton import ops as triton_ops
from rtxops.runtime.registry import default_registry

from .compare import assert_matches, build_for, clone_args, run, triton_variant

DTYPES = [torch.float32, torch.bfloat16]
MAX_ELEMS = 4096  # the interpreter runs programs one by one in Python: keep cases tiny
MAX_CONFIGS = 24  # larger spaces are tested on a fixed sample (plus the default config)


def small_cases(op: str, dtype: torch.dtype) -> list:
    cases = importlib.import_module(f"rtxops.runtime.ops.{op}").cases(dtype)
    small = [c for c in cases if max(t.numel() for t in _tensors(c)) <= MAX_ELEMS]
    assert len(small) >= 3, f"{op}: too few small cases"
    return small


def _tensors(case) -> list[torch.Tensor]:
    _, args, kwargs = case
    return [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]


def sample_configs(op: str) -> list[dict]:
    variant = triton_variant(op)
    configs = list(variant.configs())
    if len(configs) <= MAX_CONFIGS:
        return configs
    rng = random.Random(op)
    return [variant.default_config] + rng.sample(configs, MAX_CONFIGS - 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("op", triton_ops())
def test_kernel_matches_reference_on_every_case(op, dtype):
    spec = default_registry().op(op)
    for name, args, kwargs in small_cases(op, dtype):
        assert_matches(spec, build_for(op, args, kwargs), args, kwargs, name)


@pytest.mark.parametrize("op", triton_ops())
def test_every_config_gives_the_reference_result(op):
    spec = default_registry().op(op)
    name, args, kwargs = small_cases(op, torch.float32)[0]
    for config in sample_configs(op):
        assert_matches(spec, build_for(op, args, kwargs, config), args, kwargs, f"{name} {config}")


@pytest.mark.parametrize("op", triton_ops())
def test_repeated_trials_give_identical_results_and_leave_inputs_alone(op):
    name, args, kwargs = small_cases(op, torch.bfloat16)[0]
    fn = build_for(op, args, kwargs)
    args, kwargs = clone_args(args, kwargs)
    before = [t.detach().clone() for t in _tensors((name, args, kwargs))]
    first = run(fn, args, kwargs)
    for _ in range(2):
        again = run(fn, args, kwargs)
        for a, b in zip(itertools.chain(*first), itertools.chain(*again)):
            assert torch.equal(a, b), name
    for t, b in zip(_tensors((name, args, kwargs)), before):
        assert torch.equal(t.detach(), b), f"{name}: an input was modified"
