"""bench/gpu_kernels.py parses its arguments on a CPU machine; --dry-run shrinks every shape."""
from __future__ import annotations

import importlib.util
from pathlib import Path


def test_dry_run_uses_tiny_shapes_and_no_compile():
    path = Path(__file__).resolve().parents[3] / "bench" / "gpu_kernels.py"
    spec = importlib.util.spec_from_file_location("gpu_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    full = module.parse_args([])
    assert (full.seq, full.hidden, full.vocab) == (8192, 4096, 128256) and not full.no_compile
    dry = module.parse_args(["--dry-run", "--out", "x.json"])
    assert dry.seq <= 8 and dry.hidden <= 96 and dry.vocab <= 200 and dry.no_compile
