"""When the runtime starts in a process of the job: once the process imports torch. A helper
Python the job runs (``python -c 'import json'``) never pays for torch or the runtime, and a
process that only runs forward calls (a DataLoader worker, inference) does not load dynamo
for the telemetry's sake."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from rtxops.runtime.bootstrap import child_environment


def _run(code: str, tmp_path, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTXOPS_")}
    env = child_environment(env, readings_factory="rtxops.telemetry.job:readings_for_job")
    env.update({"RTXOPS_TELEMETRY": "off", "RTXOPS_HOME": str(tmp_path / "home"), **extra})
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return done


def test_a_python_that_never_imports_torch_loads_neither_torch_nor_the_runtime(tmp_path):
    done = _run("""
        import json, sys
        print(sorted(m for m in sys.modules if m.partition(".")[0] in ("torch", "rtxops")))
    """, tmp_path)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_the_runtime_starts_as_torch_is_imported(tmp_path):
    # the script's first line takes a function from torch: it gets the routed one
    done = _run("""
        from torch.nn.functional import gelu
        from rtxops.runtime import patching
        print("ROUTED", patching.active() is not None, hasattr(gelu, "__wrapped__"))
    """, tmp_path)
    assert "ROUTED True True" in done.stdout, done.stdout + done.stderr


def test_a_job_that_imports_rtxops_first_gets_the_runtime_once_that_import_is_done(tmp_path):
    # rtxops' modules import torch: the runtime cannot start half-way through them
    done = _run("""
        from rtxops.runtime import patching
        print("ACTIVE", patching.active() is not None)
    """, tmp_path)
    assert "ACTIVE True" in done.stdout, done.stdout + done.stderr
    assert "runtime not enabled" not in done.stderr


def test_a_thread_the_runtime_starts_may_import_torch_while_it_starts(tmp_path):
    # the plan poller and the export thread run while the importing thread is still in the
    # runtime's start: `import torch` there must not wait for that import to finish
    done = _run("""
        import threading
        import torch
        from rtxops.runtime import patching
        seen = []
        t = threading.Thread(target=lambda: seen.append(__import__("torch").nn is not None))
        t.start(); t.join(30)
        print("THREAD", seen, patching.active() is not None)
    """, tmp_path, RTXOPS_PLAN_POLL_S="0.05", RTXOPS_DAEMON="http://127.0.0.1:9", RTXOPS_JOB_ID="j")
    assert "THREAD [True] True" in done.stdout, done.stdout + done.stderr


def test_exporting_from_a_process_that_never_compiled_does_not_load_dynamo(tmp_path):
    """Forward calls only (no optimizer step, which imports dynamo itself): the export at exit
    read Inductor's counters by importing ``torch._dynamo``, which pulled dynamo and Triton into
    every DataLoader worker and inference process (seconds each, and ~150 MB)."""
    done = _run("""
        import sys
        import torch, torch.nn.functional as F
        from rtxops.runtime import bootstrap
        for _ in range(3):
            F.gelu(torch.randn(4, 8))
        bootstrap.finish()   # the exit work (the last export) now
        print("DYNAMO", "torch._dynamo" in sys.modules, flush=True)
    """, tmp_path, RTXOPS_TELEMETRY="duckdb")
    assert "DYNAMO False" in done.stdout, done.stdout + done.stderr
    assert (tmp_path / "home" / "rtxops.duckdb").exists()


def test_torchs_own_loader_is_left_as_it_was(tmp_path):
    # the start hook sits on torch's loader only while torch is imported: the spec still
    # pickles (multiprocessing sends specs) and the loader compares equal to a fresh one
    done = _run("""
        import pickle, importlib.machinery
        import torch
        pickle.dumps(torch.__spec__)
        print("SAME", torch.__loader__ == importlib.machinery.SourceFileLoader("torch", torch.__file__))
    """, tmp_path)
    assert "SAME True" in done.stdout, done.stdout + done.stderr
