"""A worker that hangs after its kernel started a process of its own: the timeout ends both, and
the caller gets its answer on time (the child held the worker's stdout open: the read waited for
it, and it outlived the worker)."""
from __future__ import annotations

import os
import sys
import textwrap
import time
import uuid

import torch

from rtxops.evolve.runner import WorkerError, run_isolating
from rtxops.runtime.ops.gelu import SPEC

from ..daemon.live import MARK, marked

PLUGIN = """
import subprocess, sys, time
from rtxops.runtime.originals import gelu as _gelu
from rtxops.runtime.spec import Variant

def _hangs(config, bucket):
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a helper process
    time.sleep(1000)
    return _gelu

VARIANTS = [Variant("gelu", "hangs", "eager", _hangs, description="hangs after starting a helper")]
"""


def test_a_timeout_ends_the_worker_and_what_its_kernel_started(tmp_path, monkeypatch):
    (tmp_path / "plugin_hangs.py").write_text(textwrap.dedent(PLUGIN))
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    monkeypatch.setenv("RTXOPS_VARIANT_MODULES", "plugin_hangs")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    bucket = SPEC.to_bucket(SPEC.bucket(torch.empty(64, 256))).id  # the worker loads the plugin
    started = time.monotonic()
    out = run_isolating({"command": "gate", "items": [
        {"op": "gelu", "bucket": bucket, "variant": "hangs", "config": {}}]}, "items", timeout_s=4)
    assert time.monotonic() - started < 20
    assert len(out) == 1 and isinstance(out[0], WorkerError) and "timed out" in str(out[0])
    assert not marked(mark)
    assert out[0].timed_out


def test_a_gate_that_timed_out_stores_no_verdict(tmp_path, monkeypatch):
    """A timeout (a busy machine, a slow compile) was stored as the arm's gate failure: no later
    screening ran it again until torch or the kernel's source changed."""
    from rtxops.evolve.candidates import Arm
    from rtxops.evolve.screen import screen
    from rtxops.evolve.tuning import TuningDB
    from rtxops.runtime.registry import load_builtin
    from rtxops.telemetry.store import Store

    (tmp_path / "plugin_hangs.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.setenv(MARK, uuid.uuid4().hex)
    monkeypatch.setenv("RTXOPS_VARIANT_MODULES", "plugin_hangs")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    bucket = SPEC.to_bucket(SPEC.bucket(torch.empty(64, 256))).id
    monkeypatch.syspath_prepend(str(tmp_path))
    with Store(tmp_path / "s.duckdb") as store:
        tuning = TuningDB(store, load_builtin())   # the plugin's variant too
        arm = Arm("hangs", "{}")
        passed, failed = screen(tuning, "gelu", bucket, [arm], timeout_s=4)
        assert not passed and "timed out" in failed[arm]
        assert tuning.gate("gelu", bucket, arm) is None


COUNTING = """
import atexit
import os
from rtxops.runtime.originals import gelu as _gelu
from rtxops.runtime.spec import Variant

def _counted(name):
    def build(config, bucket):
        with open(os.environ["RTXOPS_TEST_BUILDS"], "a") as f:
            f.write(name + "\\n")
        return _gelu
    return build

def _crashes(config, bucket):
    os._exit(17)   # a segfaulting kernel

def _dies_at_exit(config, bucket):
    atexit.register(os._exit, 18)   # a library whose teardown crashes
    return _gelu

VARIANTS = [Variant("gelu", "first", "eager", _counted("first"), description="counted"),
            Variant("gelu", "crashes", "eager", _crashes, description="kills its worker"),
            Variant("gelu", "last", "eager", _counted("last"), description="counted"),
            Variant("gelu", "dies_at_exit", "eager", _dies_at_exit, description="exits with 18")]
"""


def test_a_worker_killed_mid_gate_keeps_the_verdicts_it_sent_and_reruns_only_the_rest(tmp_path, monkeypatch):
    """Each element the dead worker had not answered runs in a worker of its own; one it had
    answered is not gated a second time (a gate batch that timed out reran every arm, holding
    the gate slot all along)."""
    (tmp_path / "plugin_counting.py").write_text(textwrap.dedent(COUNTING))
    builds = tmp_path / "builds"
    monkeypatch.setenv("RTXOPS_TEST_BUILDS", str(builds))
    monkeypatch.setenv("RTXOPS_VARIANT_MODULES", "plugin_counting")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    bucket = SPEC.to_bucket(SPEC.bucket(torch.empty(64, 256))).id
    out = run_isolating({"command": "gate", "items": [
        {"op": "gelu", "bucket": bucket, "variant": v, "config": {}}
        for v in ("first", "crashes", "last")]}, "items", timeout_s=120)
    assert [r["variant"] if isinstance(r, dict) else "error" for r in out] == ["first", "error", "last"]
    assert out[0]["passed"] and out[2]["passed"] and "exited with 17" in str(out[1])
    assert builds.read_text().split() == ["first", "last"]   # each gated once


def test_an_element_answered_before_its_worker_died_keeps_its_verdict_when_it_ran_alone(tmp_path, monkeypatch):
    """A worker that answered and then died at exit: its answer stands for an element gated
    alone as for one in a batch (alone, it was stored as failed for good)."""
    (tmp_path / "plugin_counting.py").write_text(textwrap.dedent(COUNTING))
    monkeypatch.setenv("RTXOPS_VARIANT_MODULES", "plugin_counting")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    bucket = SPEC.to_bucket(SPEC.bucket(torch.empty(64, 256))).id
    item = {"op": "gelu", "bucket": bucket, "variant": "dies_at_exit", "config": {}}
    alone = run_isolating({"command": "gate", "items": [item]}, "items", timeout_s=120)
    assert isinstance(alone[0], dict) and alone[0]["passed"], alone
