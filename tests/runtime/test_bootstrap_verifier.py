"""The runtime gets its plan verifier injected (``RTXOPS_PLAN_VERIFIER=module:function``): it
imports no governance itself, and without a verifier it refuses every signed plan (fail closed)."""
from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest

import rtxops.runtime
from rtxops.runtime import bootstrap
from rtxops.runtime.errors import PlanError


def test_the_runtime_imports_no_governance():
    root = Path(rtxops.runtime.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            for n in names:
                assert "governance" not in n, f"{path.relative_to(root)} imports {n}"


def test_the_injected_factory_makes_the_verifier(monkeypatch):
    calls = []

    def factory(keyring, job):
        def verify(files, running_version, directory=None):
            calls.append((keyring, job(), files, running_version, directory))
            return b"{}"

        verify.warm = lambda: calls.append("warm")
        return verify

    module = types.ModuleType("fake_verifiers")
    module.factory = factory
    monkeypatch.setitem(sys.modules, "fake_verifiers", module)
    monkeypatch.setenv("RTXOPS_KEYRING", "/keys/ring.json")
    monkeypatch.setenv("RTXOPS_JOB_ID", "job-9")
    monkeypatch.setenv("RTXOPS_DETERMINISTIC", "1")
    monkeypatch.setenv("RTXOPS_PLAN_VERIFIER", "fake_verifiers:factory")
    verify = bootstrap._plan_verifier()
    assert calls == []  # nothing imported or made before first use
    verify.warm()
    assert verify({"plan.json": b"x"}, 3) == b"{}"
    assert calls == ["warm", ("/keys/ring.json", {"id": "job-9", "deterministic": True},
                              {"plan.json": b"x"}, 3, None)]


def test_without_a_verifier_every_plan_is_refused(monkeypatch):
    monkeypatch.setenv("RTXOPS_KEYRING", "/keys/ring.json")
    monkeypatch.delenv("RTXOPS_PLAN_VERIFIER", raising=False)
    with pytest.raises(PlanError, match="no plan verifier"):
        bootstrap._plan_verifier()({}, 0)
    monkeypatch.delenv("RTXOPS_KEYRING")
    assert bootstrap._plan_verifier() is None  # the poller refuses: "this job has no plan verifier"


def test_child_environment_passes_the_verifier():
    env = bootstrap.child_environment({}, plan_verifier="m:f")
    assert env["RTXOPS_PLAN_VERIFIER"] == "m:f"


@pytest.mark.parametrize("raw,deterministic", [("true", True), ("yes", True), ("0", False), ("off", False)])
def test_the_job_facts_read_the_determinism_switch_as_people_write_it(monkeypatch, raw, deterministic):
    """``RTXOPS_DETERMINISTIC=true`` was taken as off: only ``1`` counted."""
    import torch

    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    monkeypatch.setenv("RTXOPS_DETERMINISTIC", raw)
    assert bootstrap._job_facts()["deterministic"] is deterministic


@pytest.mark.parametrize("raw,checked", [("false", False), ("off", False), ("1", True), ("", True)])
def test_the_first_call_check_switch_reads_the_words_people_write(tmp_path, raw, checked):
    """``RTXOPS_VERIFY_FIRST_CALL=false`` left the check on: only ``0`` turned it off."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("RTXOPS_")}
    env = bootstrap.child_environment(env)
    env.update(RTXOPS_TELEMETRY="off", RTXOPS_VERIFY_FIRST_CALL=raw)
    probe = "from rtxops.runtime import patching; print('CHECKED', patching.active().verify_first_call)"
    r = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert f"CHECKED {checked}" in r.stdout, r.stdout + r.stderr
