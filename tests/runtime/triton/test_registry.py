"""Registration of the Triton variants: CUDA-only, never chosen on CPU for real work, selectable on
the interpreter in tests; the config used and Triton's cache hits reach the readings."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from rtxops.runtime import patching
from rtxops.runtime.ops.triton import AUTO, ops as triton_ops
from rtxops.runtime.readings import CallStats
from rtxops.runtime.registry import default_registry

from ..helpers import bucket_id, plan_for


class KernelReadings(CallStats):
    """CallStats that also keeps builds and the resolved kernel configs."""

    def __init__(self) -> None:
        super().__init__()
        self.builds: list[tuple[int, int, bool]] = []
        self.kernel_configs: list[tuple[int, str]] = []

    def build(self, slot: int, duration_ns: int, cache_hit: bool) -> None:
        super().build(slot, duration_ns, cache_hit)
        self.builds.append((slot, duration_ns, cache_hit))

    def kernel_config(self, slot: int, config: str) -> None:
        self.kernel_configs.append((slot, config))


def rms_args():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 48, generator=g), [48], torch.randn(48, generator=g), 1e-6


def test_every_op_but_linear_and_attention_has_a_cuda_only_triton_variant():
    registry = default_registry()
    assert set(triton_ops()) == {"rms_norm", "layer_norm", "softmax", "swiglu", "gelu",
                                 "cross_entropy", "rope"}
    for op in triton_ops():
        v = registry.variant(op, "triton")
        assert v.family == "triton" and v.devices == frozenset({"cuda"})
        assert v.config_space and all(AUTO == choices[0] for choices in v.config_space.values())
        assert all(v.check_config(c) is None for c in v.configs())
        assert len(v.source_hash) == 64 and v.source_hash == registry.variant(op, "triton").source_hash
    hashes = {registry.variant(op, "triton").source_hash for op in triton_ops()}
    assert len(hashes) == len(triton_ops())


@pytest.mark.parametrize("op", ["rms_norm", "cross_entropy"])
def test_supported_on_cuda_buckets_and_on_cpu_only_with_the_interpreter_flag(op, monkeypatch):
    spec, variant = default_registry().op(op), default_registry().variant(op, "triton")
    args, kwargs = spec.example_inputs(spec.to_bucket(_key(op)), 0)
    cpu = spec.to_bucket(spec.bucket(*args, **kwargs))
    cuda = spec.to_bucket((cpu.torch_dtype, "cuda", *(v for _, v in cpu.dims)))
    assert variant.supports(cuda) and variant.supports(cpu)
    monkeypatch.delenv("RTXOPS_TRITON_INTERPRET")
    assert variant.supports(cuda) and not variant.supports(cpu)
    monkeypatch.setenv("RTXOPS_TRITON_INTERPRET", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not variant.supports(cpu)


def _key(op):
    return {"rms_norm": (torch.float32, "cpu", 48, 4),
            "cross_entropy": (torch.float32, "cpu", 40, 4, 1, 0)}[op]


def test_a_plan_naming_triton_on_cpu_runs_the_reference_without_the_flag(monkeypatch):
    monkeypatch.delenv("RTXOPS_TRITON_INTERPRET")
    x, shape, w, eps = rms_args()
    plan = plan_for(1, ("rms_norm", bucket_id("rms_norm", x, shape, w, eps), "triton"))
    readings = KernelReadings()
    dispatcher = patching.enable(plan, readings=readings)
    out = F.rms_norm(x, shape, w, eps)
    patching.disable()
    assert torch.equal(out, F.rms_norm(x, shape, w, eps))
    assert {s.variant for s in dispatcher.slots} == {"reference"}
    assert readings.kernel_configs == []


def test_selected_on_the_interpreter_it_reports_the_config_it_resolved():
    x, shape, w, eps = rms_args()
    config = {"num_warps": 2}
    plan = plan_for(1, ("rms_norm", bucket_id("rms_norm", x, shape, w, eps), "triton", config))
    readings = KernelReadings()
    dispatcher = patching.enable(plan, readings=readings)
    for _ in range(3):
        out = F.rms_norm(x.requires_grad_(), shape, w, eps)
        out.sum().backward()
    patching.disable()
    torch.testing.assert_close(out, F.rms_norm(x, shape, w, eps))
    slot = next(s for s in dispatcher.slots if s.variant == "triton")
    assert not dispatcher.disabled and readings.calls[slot.id] >= 2
    assert len(readings.kernel_configs) == 1 and readings.kernel_configs[0][0] == slot.id
    resolved = json.loads(readings.kernel_configs[0][1])
    assert resolved["num_warps"] == 2 and resolved["rows_per_program"] >= 1  # auto resolved
    assert json.loads(slot.config)["rows_per_program"] == AUTO


class FakeKernel:
    """Stands in for a compiled JITFunction: launching it fires Triton's hooks as configured."""

    __name__ = "_fake_kernel"

    def __init__(self, watch, compiles: list[bool]) -> None:
        self.watch, self.compiles = watch, compiles

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            for disk_hit in self.compiles:
                self.watch.on_jit_cache_miss(key="k", repr="_fake_kernel[num_warps=4](x)",
                                             fn=None, compile={}, is_manual_warmup=False,
                                             already_compiled=False)
                times = type("Times", (), {"total": 1500})()
                self.watch.on_compile(src=None, metadata={}, metadata_group={}, times=times,
                                      cache_hit=disk_hit)
            return "launched"
        return launch


def test_compile_and_cache_hits_reach_the_readings_of_the_matching_slot():
    from rtxops.runtime.ops.triton._report import EVENTS, WATCH, Reporter

    x, shape, w, eps = rms_args()
    bid = bucket_id("rms_norm", x, shape, w, eps)
    readings = KernelReadings()
    dispatcher = patching.enable(plan_for(1, ("rms_norm", bid, "triton")), readings=readings)
    F.rms_norm(x, shape, w, eps)  # registers the slot
    slot = next(s for s in dispatcher.slots if s.variant == "triton")
    default = default_registry().variant("rms_norm", "triton").default_config
    reporter = Reporter("rms_norm", "triton", bid, default, {"num_warps": 4})
    builds_before = len(readings.builds)
    assert reporter.launch(FakeKernel(WATCH, [False]), (1,)) == "launched"  # compiled
    assert reporter.launch(FakeKernel(WATCH, [True]), (1,)) == "launched"  # on-disk cache hit
    assert reporter.launch(FakeKernel(WATCH, []), (1,)) == "launched"  # in-memory hit: silent
    patching.disable()
    assert readings.builds[builds_before:] == [(slot.id, 1_500_000, False),
                                               (slot.id, 1_500_000, True)]
    assert [e.cache for e in list(EVENTS)[-2:]] == ["compiled", "disk_hit"]
    assert list(EVENTS)[-1].kernel == "_fake_kernel"


def test_watch_chains_hooks_installed_before_it():
    from triton import knobs

    from rtxops.runtime.ops.triton._report import CompileWatch

    seen = []
    old_hook, old_listener = knobs.runtime.jit_cache_hook, knobs.compilation.listener
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append("hook") or True
    knobs.compilation.listener = lambda **kw: seen.append("listener")
    try:
        watch = CompileWatch()
        watch.install()
        assert watch.on_jit_cache_miss(key=1, repr="k[]", fn=None, compile={},
                                       is_manual_warmup=False, already_compiled=False) is True
        watch.on_compile(src=None, metadata={}, metadata_group={}, times=None, cache_hit=False)
        assert seen == ["hook", "listener"]
    finally:
        knobs.runtime.jit_cache_hook, knobs.compilation.listener = old_hook, old_listener


def test_a_launch_runs_on_its_tensors_cuda_device(monkeypatch):
    """Triton launches on the current CUDA device: a model split over two GPUs in one process
    (device_map="auto") had its cuda:1 tensors handed to a kernel launched on cuda:0. No GPU
    here: a tensor that says it is on cuda:1, and torch.cuda's device calls, stand in."""
    import contextlib

    import torch

    from rtxops.runtime.ops.triton import _report

    class OnCuda1(torch.Tensor):
        is_cuda = property(lambda self: True)
        device = property(lambda self: torch.device("cuda", 1))

    current = [0]

    @contextlib.contextmanager
    def device(index):
        before, current[0] = current[0], index
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", device)
    launched_on = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched_on.append(current[0])

    reporter = _report.Reporter("rms_norm", "triton", "b", {}, {})
    monkeypatch.setattr(_report.WATCH, "install", lambda: None)
    reporter.launch(Kernel(), (1,), torch.ones(2).as_subclass(OnCuda1), 3)
    reporter.launch(Kernel(), (1,), 3, torch.ones(2))   # a CPU tensor: as it is
    assert launched_on == [1, 0] and current[0] == 0
