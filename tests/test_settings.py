"""``RTXOPS_*`` settings: each one the code reads is documented, and a malformed value is refused
with its name (a bare ``int()`` message, a DuckDB parser traceback from the store's writer thread,
or a negative export interval that spun the export thread, before)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from rtxops import settings
from rtxops.telemetry.store import Store

from .test_cli_errors import rtxops

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"RTXOPS_[A-Z][A-Z0-9_]*[A-Z0-9]")


def test_every_variable_the_code_reads_is_documented_and_every_documented_one_is_read():
    readers = [*(ROOT / "rtxops").rglob("*.py"), ROOT / "examples" / "demo.sh"]
    in_code = {m for p in readers for m in NAME.findall(p.read_text())}
    in_code.discard("RTXOPS_EVOLVE")   # (also the prefix of RTXOPS_EVOLVE_<FIELD>)
    documented = set(NAME.findall((ROOT / "docs" / "settings.md").read_text()))
    fields = {n for n in in_code if n.startswith("RTXOPS_EVOLVE_")}   # the loop's config fields
    assert in_code - fields - documented == set(), "read but not in docs/settings.md"
    assert documented - in_code - {"RTXOPS_EVOLVE"} == set(), "documented but never read"


@pytest.mark.parametrize("name,raw,read,said", [
    ("RTXOPS_RECORDER_CAPACITY", "abc", settings.recorder_capacity, "is not a whole number"),
    ("RTXOPS_RECORDER_CAPACITY", "0", settings.recorder_capacity, "at least 1"),
    ("RTXOPS_EXPORT_INTERVAL_S", "-1", settings.export_interval_s, "above 0"),
    ("RTXOPS_EXPORT_INTERVAL_S", "nan", settings.export_interval_s, "above 0"),
    ("RTXOPS_EXPORT_INTERVAL_S", "2s", settings.export_interval_s, "not a number of seconds"),
    ("RTXOPS_STORE_THREADS", "0", settings.store_connection, "at least 1"),
    ("RTXOPS_STORE_MEMORY", "lots", settings.store_connection, "not a size"),
    ("RTXOPS_STORE_WAL", "256", settings.store_wal, "not a size"),
    ("RTXOPS_PLAN_POLL_S", "-1", settings.plan_poll_s, "or 0 for no polling"),
    ("RTXOPS_PLAN_POLL_S", "2s", settings.plan_poll_s, "not a number of seconds"),
    ("RTXOPS_DETERMINISTIC", "always", settings.check_runtime, "give 1 or 0"),
    ("RTXOPS_VERIFY_FIRST_CALL", "no-thanks", settings.check_runtime, "give 1 or 0"),
    ("RTXOPS_PLAN_POLL_S", "soon", settings.check_runtime, "not a number of seconds"),
    ("RTXOPS_CUDA_TIME_EVERY", "0", settings.check_runtime, "at least 1"),
])
def test_a_malformed_value_is_refused_with_its_name(monkeypatch, name, raw, read, said):
    monkeypatch.setenv(name, raw)
    with pytest.raises(settings.SettingError, match=re.escape(f"{name}={raw!r}") + ".*" + said):
        read()


@pytest.mark.parametrize("raw,expected", [("2/10", (2, 10)), ("0", (0, 100)), ("5", (5, 100)),
                                          ("1/1", (1, 1))])
def test_call_samples_read_per_and_steps(monkeypatch, raw, expected):
    monkeypatch.setenv("RTXOPS_CALL_SAMPLES", raw)
    assert settings.call_samples("RTXOPS_CALL_SAMPLES") == expected


@pytest.mark.parametrize("raw", ["x/y", "-3", "2/0", "2/", "/10"])
def test_malformed_call_samples_are_refused(monkeypatch, raw):
    monkeypatch.setenv("RTXOPS_CALL_SAMPLES", raw)
    with pytest.raises(settings.SettingError, match="RTXOPS_CALL_SAMPLES"):
        settings.call_samples("RTXOPS_CALL_SAMPLES")


@pytest.mark.parametrize("size", ["96MB", "1GiB", "512KB", "0.5GB", "2 gb", "100b"])
def test_every_size_accepted_is_one_duckdb_takes(monkeypatch, size):
    monkeypatch.setenv("RTXOPS_STORE_MEMORY", size)
    duckdb.connect(":memory:", config=settings.store_connection()).close()


@pytest.mark.parametrize("size", ["lots", "96", "MB", "-1GB", "1.GB", "1 GB extra"])
def test_sizes_refused_are_ones_duckdb_refuses_too_or_means_otherwise(monkeypatch, size):
    monkeypatch.setenv("RTXOPS_STORE_MEMORY", size)
    with pytest.raises(settings.SettingError):
        settings.store_connection()


def test_a_store_with_a_malformed_wal_setting_refuses_to_open_and_keeps_no_lock(tmp_path, monkeypatch):
    """It opened, then its writer thread died on DuckDB's parser error: every write hung."""
    monkeypatch.setenv("RTXOPS_STORE_WAL", "big")
    with pytest.raises(settings.SettingError, match="RTXOPS_STORE_WAL"):
        Store(tmp_path / "s.duckdb")
    monkeypatch.delenv("RTXOPS_STORE_WAL")
    with Store(tmp_path / "s.duckdb") as store:   # nothing holds the file
        assert store.stats()["commits"] == 0


def test_a_job_with_a_malformed_telemetry_setting_is_not_submitted(tmp_path):
    done = tmp_path / "ran"
    for name, raw in (("RTXOPS_EXPORT_INTERVAL_S", "-1"), ("RTXOPS_CALL_SAMPLES", "x")):
        r = rtxops("run", "--", sys.executable, "-c", f"open({str(done)!r}, 'w')",
                   env={"RTXOPS_HOME": str(tmp_path / "home"), name: raw})
        assert r.returncode == 2 and f"{name}={raw!r}" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and not done.exists()
    r = rtxops("run", "--direct", "--", sys.executable, "-c", "pass",
               env={"RTXOPS_HOME": str(tmp_path / "home"), "RTXOPS_STORE_MEMORY": "lots"})
    assert r.returncode == 2 and "RTXOPS_STORE_MEMORY='lots'" in r.stderr, r.stderr


def test_a_daemon_with_a_malformed_setting_does_not_start(tmp_path):
    for name, raw in (("RTXOPS_JOB_LOG_MAX_BYTES", "-1"), ("RTXOPS_STORE_THREADS", "many"),
                      ("RTXOPS_EVOLVE", "maybe")):     # (it was taken for on)
        r = rtxops("daemon", "--port", "0", "--home", str(tmp_path / "home"), env={name: raw})
        assert r.returncode == 2 and f"{name}={raw!r}" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_detached_daemon_with_a_malformed_evolve_setting_says_so_before_it_starts(tmp_path):
    """`daemon --detach` said only "did not come up; see daemon.log", after making the home."""
    for name, raw, said in (("RTXOPS_EVOLVE", "maybe", "RTXOPS_EVOLVE='maybe'"),
                            ("RTXOPS_EVOLVE_WINDOW_STEP", "5", "RTXOPS_EVOLVE_WINDOW_STEPS")):
        r = rtxops("daemon", "--detach", "--port", "0", "--home", str(tmp_path / "home"),
                   env={name: raw})
        assert r.returncode == 2 and said in " ".join(r.stderr.split()), r.stderr
        assert not (tmp_path / "home").exists()


def test_job_telemetry_reads_its_settings_before_it_opens_the_store(tmp_path, monkeypatch):
    """A malformed setting read after the store opened left the file locked by the job."""
    from rtxops.telemetry.job import readings_for_job

    monkeypatch.setenv("RTXOPS_TELEMETRY", "duckdb")
    monkeypatch.setenv("RTXOPS_STORE", str(tmp_path / "s.duckdb"))
    monkeypatch.setenv("RTXOPS_RECORDER_CAPACITY", "lots")
    with pytest.raises(settings.SettingError, match="RTXOPS_RECORDER_CAPACITY='lots' is not a whole number"):
        readings_for_job(None)
    assert not (tmp_path / "s.duckdb").exists()


@pytest.mark.parametrize("raw,on", [("1", True), ("yes", True), ("On", True), ("0", False),
                                    ("false", False), ("off", False), ("", False)])
def test_a_switch_reads_the_words_people_write(monkeypatch, raw, on):
    """``RTXOPS_FUSE_OPTIMIZER=false`` switched the fused optimizer on: anything but 0 was on."""
    monkeypatch.setenv("RTXOPS_FUSE_OPTIMIZER", raw)
    assert settings.switch("RTXOPS_FUSE_OPTIMIZER") is on


def test_compile_model_takes_a_switch_or_a_mode_and_refuses_other_words(monkeypatch):
    for raw, expected in (("1", (True, None)), ("yes", (True, None)), ("off", (False, None)),
                          ("max-autotune", (True, "max-autotune"))):
        monkeypatch.setenv("RTXOPS_COMPILE_MODEL", raw)
        assert settings.compile_model() == expected
    monkeypatch.setenv("RTXOPS_COMPILE_MODEL", "fast")   # was passed to torch.compile as a mode
    with pytest.raises(settings.SettingError, match="RTXOPS_COMPILE_MODEL='fast'"):
        settings.compile_model()


def test_a_job_with_a_malformed_switch_is_not_started_and_false_means_off(tmp_path):
    done = tmp_path / "ran"
    for name, raw in (("RTXOPS_FUSE_OPTIMIZER", "maybe"), ("RTXOPS_COMPILE_MODEL", "fast"),
                      ("RTXOPS_REROUTE_MLP", "enabled")):
        r = rtxops("run", "--direct", "--", sys.executable, "-c", f"open({str(done)!r}, 'w')",
                   env={"RTXOPS_HOME": str(tmp_path / "home"), name: raw})
        assert r.returncode == 2 and f"{name}={raw!r}" in r.stderr, r.stderr
        assert not done.exists()
    script = ("from rtxops.runtime import patching; d = patching.active(); "
              "print('fused', d.optimizer_region is not None, 'reroute', d.reroute_partial)")
    r = rtxops("run", "--direct", "--no-summary", "--", sys.executable, "-c", script,
               env={"RTXOPS_HOME": str(tmp_path / "home"), "RTXOPS_FUSE_OPTIMIZER": "false",
                    "RTXOPS_REROUTE_MLP": "no", "RTXOPS_TELEMETRY": "off"})
    assert r.returncode == 0 and "fused False reroute False" in r.stdout, (r.stdout, r.stderr)


def test_a_plugin_module_that_is_not_there_is_refused_before_anything_starts(tmp_path):
    """A misspelt RTXOPS_VARIANT_MODULES left the job running without rtxops (saying so only in
    its output), and the daemon's evolve loop unbuilt (saying so only in its log)."""
    done = tmp_path / "ran"
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "failing_pkg").mkdir()
    (tmp_path / "failing_pkg" / "__init__.py").write_text("raise RuntimeError('broken plugin')\n")
    for raw, said in (("no_such_rtxops_plugin", "no module 'no_such_rtxops_plugin'"),
                      ("json.no_such_module", "no module 'json.no_such_module'"),
                      ("os, nope.nope", "'nope.nope' cannot be imported"),
                      ("a_folder", "'a_folder' is a folder"),
                      ("failing_pkg.kernels", "'failing_pkg.kernels' cannot be imported: RuntimeError: broken plugin")):
        r = rtxops("run", "--direct", "--", sys.executable, "-c", f"open({str(done)!r}, 'w')",
                   env={"RTXOPS_HOME": str(tmp_path / "home"), "RTXOPS_VARIANT_MODULES": raw},
                   cwd=tmp_path)
        flat = " ".join(r.stderr.split())
        assert r.returncode == 2 and f"RTXOPS_VARIANT_MODULES: {said}" in flat, r.stderr
        assert "Traceback" not in r.stderr and not done.exists()
    for detach in ((), ("--detach",)):
        r = rtxops("daemon", *detach, "--port", "0", "--home", str(tmp_path / "home"),
                   env={"RTXOPS_VARIANT_MODULES": "no_such_rtxops_plugin"})
        assert r.returncode == 2 and "'no_such_rtxops_plugin'" in r.stderr, r.stderr


def test_a_plugin_module_beside_the_script_or_in_the_working_directory_is_taken(tmp_path):
    """The check looks where the job's Python looks: the installed `rtxops` command has neither
    the working directory nor the script's folder on its own path."""
    command = Path(sys.executable).parent / "rtxops"
    (tmp_path / "jobdir").mkdir()
    for folder in (tmp_path, tmp_path / "jobdir"):
        (folder / "my_kernels.py").write_text("VARIANTS = []\n")
    script = tmp_path / "jobdir" / "train.py"
    script.write_text("import sys; import my_kernels; open(sys.argv[1], 'w')\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("RTXOPS_")}
    for args in (("-c", f"import my_kernels; open({str(tmp_path / 'ran2')!r}, 'w')"),
                 (str(script), str(tmp_path / "ran1"))):
        cwd = tmp_path if args[0] == "-c" else tmp_path / "home"
        cwd.mkdir(exist_ok=True)
        if args[0] != "-c":
            (tmp_path / "my_kernels.py").unlink()   # only beside the script
        r = subprocess.run([str(command), "run", "--direct", "--no-telemetry", "--no-summary", "--",
                            sys.executable, *args], capture_output=True, text=True, timeout=120,
                           cwd=cwd, env={**base, "RTXOPS_VARIANT_MODULES": "my_kernels"})
        assert r.returncode == 0, r.stderr
    assert (tmp_path / "ran1").exists() and (tmp_path / "ran2").exists()


def test_a_variant_allow_list_naming_no_variant_is_refused_with_the_names(tmp_path):
    """``RTXOPS_EVOLVE_VARIANTS=eagr`` was taken: the loop then had no candidate anywhere."""
    for detach in ((), ("--detach",)):
        r = rtxops("daemon", *detach, "--port", "0", "--home", str(tmp_path / "home"),
                   env={"RTXOPS_EVOLVE_VARIANTS": "eager,eagr"})
        assert not (tmp_path / "home" / "daemon.pid").exists()
        flat = " ".join(r.stderr.split())
        assert r.returncode == 2 and "no op has a variant named 'eagr'" in flat, r.stderr
        assert "chunked" in flat and "Traceback" not in flat


def test_the_loop_config_checks_its_allow_list_against_the_registry():
    from rtxops.evolve.config import LoopConfig
    from rtxops.runtime.registry import default_registry

    LoopConfig(variants="eager, chunked,").check_variants(default_registry())
    LoopConfig().check_variants()   # no allow-list: nothing read
    with pytest.raises(ValueError, match="'Eager'"):
        LoopConfig(variants="Eager").check_variants(default_registry())


def test_a_plan_named_by_the_environment_is_checked_as_plan_is(tmp_path):
    """RTXOPS_PLAN pointing nowhere (or at garbage) let the job train on the reference plan."""
    done = tmp_path / "ran"
    garbage = tmp_path / "plan.json"
    garbage.write_text("{not json")
    for plan, said in ((tmp_path / "missing.json", "does not exist"), (garbage, "plan RTXOPS_PLAN=")):
        r = rtxops("run", "--direct", "--", sys.executable, "-c", f"open({str(done)!r}, 'w')",
                   env={"RTXOPS_HOME": str(tmp_path / "home"), "RTXOPS_PLAN": str(plan)})
        flat = " ".join(r.stderr.split())
        assert r.returncode == 2 and f"plan RTXOPS_PLAN={plan}" in flat and said in flat, r.stderr
        assert not done.exists()


def test_a_job_submitted_with_this_shells_environment_is_checked_as_run_checks_it(tmp_path):
    """`rtxops submit --inherit-env` sent a misspelt plugin or plan on to the daemon: the job ran
    without rtxops, or on the reference plan, saying so only in its log."""
    for env, said in (({"RTXOPS_VARIANT_MODULES": "no_such_rtxops_plugin"},
                       "RTXOPS_VARIANT_MODULES: no module 'no_such_rtxops_plugin'"),
                      ({"RTXOPS_PLAN": str(tmp_path / "missing.json")}, "does not exist")):
        r = rtxops("submit", "--inherit-env", "--home", str(tmp_path / "home"), "--",
                   sys.executable, "-c", "pass", env=env, cwd=tmp_path)
        flat = " ".join(r.stderr.split())
        assert r.returncode == 2 and said in flat, r.stderr
        assert "no daemon" not in flat   # refused before any daemon was looked for
    # the daemon's own environment is the job's without --inherit-env: nothing of this one read
    r = rtxops("submit", "--home", str(tmp_path / "home"), "--", sys.executable, "-c", "pass",
               env={"RTXOPS_VARIANT_MODULES": "no_such_rtxops_plugin"}, cwd=tmp_path)
    assert r.returncode != 0 and "RTXOPS_VARIANT_MODULES" not in r.stderr, r.stderr


def test_a_plugin_only_the_jobs_own_python_has_is_taken_and_one_it_lacks_refused(tmp_path):
    """The check looked on rtxops's own path alone: a job run by another environment's Python,
    the plugin installed there, was refused though it would have loaded it."""
    other = tmp_path / "other-env" / "bin"
    site = tmp_path / "other-env" / "site"
    other.mkdir(parents=True)
    site.mkdir()
    (site / "their_kernels.py").write_text("VARIANTS = []\n")
    python = other / "python"   # another environment's interpreter: its own packages on its path
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    done = tmp_path / "ran"
    job = ("-c", f"import their_kernels; open({str(done)!r}, 'w')")
    env = {"RTXOPS_HOME": str(tmp_path / "home"), "PATH": f"{other}{os.pathsep}{os.environ['PATH']}"}
    for modules, code in (("their_kernels", 0), ("their_kernels,not_theirs_either", 2)):
        r = rtxops("run", "--direct", "--no-telemetry", "--no-summary", "--", "python", *job,
                   cwd=tmp_path, env={**env, "RTXOPS_VARIANT_MODULES": modules})
        assert r.returncode == code, r.stderr
    flat = " ".join(r.stderr.split())
    assert f"no module 'not_theirs_either' can be imported (by {python})" in flat, r.stderr
    assert done.exists()
    # a daemon's job runs a bare `python` as rtxops's own (first on the job's PATH): checked so
    r = rtxops("run", "--no-telemetry", "--no-summary", "--", "python", *job, cwd=tmp_path,
               env={**env, "RTXOPS_VARIANT_MODULES": "their_kernels"})
    flat = " ".join(r.stderr.split())
    assert r.returncode == 2 and "no module 'their_kernels' can be imported (give" in flat, r.stderr
