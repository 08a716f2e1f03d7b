"""The GPU bench scripts on a CPU machine: gpu_kernels.py parses its arguments (--dry-run shrinks
every shape); each script loads and says there is no GPU."""
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


def test_the_gpu_scripts_load_on_a_cpu_machine_and_say_there_is_no_gpu():
    """Each GPU script imports what it uses (an import error shows here, not on a GPU lease)."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    for script in ("gpu_check.py", "gpu_dispatch.py"):
        r = subprocess.run([sys.executable, str(root / "bench" / script)], cwd=root,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and json.loads(r.stdout) == {"error": "no CUDA device"}, r.stderr
