"""The tuning database: results survive a store (daemon) restart and go stale by themselves when
the torch version, the device or the kernel's source changes."""
from __future__ import annotations

import dataclasses

import pytest

from rtxops.evolve import environment as env_module
from rtxops.evolve import tuning as tuning_module
from rtxops.evolve.candidates import Arm
from rtxops.evolve.tuning import TuningDB
from rtxops.runtime.registry import Registry, load_builtin
from rtxops.telemetry.store import Store

BUCKET = "float32/cpu/tanh=0,hidden=64,rows=16"
ARM = Arm.of("eager")


@pytest.fixture
def registry() -> Registry:
    return load_builtin(Registry())


def record(store, registry, median=1234.0, status="ok"):
    TuningDB(store, registry).record("gelu", BUCKET, ARM, source="offline", trials=5,
                                     median_ns=median, spread=0.02, status=status)


def test_results_survive_a_restart_of_the_store(tmp_path, registry):
    path = tmp_path / "rtxops.duckdb"
    with Store(path) as store:
        record(store, registry)
    with Store(path) as store:  # what a daemon restart does: a new Store on the same file
        row = TuningDB(store, registry).lookup("gelu", BUCKET, ARM)
    assert row is not None and row["median_ns"] == 1234.0 and row["trials"] == 5
    assert row["torch_version"] and row["device"].startswith("cpu:")


def test_a_new_result_replaces_the_old_one_for_the_same_key(tmp_path, registry):
    with Store(tmp_path / "s.duckdb") as store:
        record(store, registry, 1000.0)
        record(store, registry, 900.0, status="regressed")
        rows = store.query("SELECT median_ns, status FROM tuning")
    assert rows == [{"median_ns": 900.0, "status": "regressed"}]


def test_a_run_that_measured_nothing_leaves_a_measured_row_as_it_was(tmp_path, registry):
    """A later `rtxops tune` whose worker timed out turned an `ok` row into `failed` with no
    median: the arm dropped out of the priors for a failure of the run, not of the kernel."""
    with Store(tmp_path / "s.duckdb") as store:
        db = TuningDB(store, registry)
        record(store, registry, 1000.0)
        db.record("gelu", BUCKET, ARM, source="offline", trials=1, median_ns=None,
                  status="failed", reason="evolve worker timed out")
        row = db.lookup("gelu", BUCKET, ARM)
        assert (row["median_ns"], row["trials"], row["status"]) == (1000.0, 5, "ok")
        assert row["reason"] == "a later run measured nothing: evolve worker timed out"
        record(store, registry, 900.0)   # a measurement replaces it, the note with it
        row = db.lookup("gelu", BUCKET, ARM)
        assert (row["median_ns"], row["status"], row["reason"]) == (900.0, "ok", "")
    with Store(tmp_path / "t.duckdb") as store:   # a row that never held a figure takes the failure
        db = TuningDB(store, registry)
        db.record("gelu", BUCKET, ARM, source="offline", trials=1, median_ns=None,
                  status="failed", reason="first")
        db.record("gelu", BUCKET, ARM, source="offline", trials=1, median_ns=None,
                  status="failed", reason="second")
        assert store.query("SELECT status, reason FROM tuning") == [{"status": "failed",
                                                                     "reason": "second"}]


def test_a_regressed_mark_outlives_later_measurements_of_the_same_key(tmp_path, registry, monkeypatch):
    """A canary's rollback marks the arm regressed; a later `rtxops tune` or explore round of the
    same arm updates its figures but must not make it a candidate again."""
    with Store(tmp_path / "s.duckdb") as store:
        db = TuningDB(store, registry)
        db.record("gelu", BUCKET, ARM, source="canary", trials=20, median_ns=1000.0,
                  status="regressed", reason="canary: kernel time +30%")
        record(store, registry, 800.0)  # measured again, offline
        row = db.lookup("gelu", BUCKET, ARM)
        assert (row["median_ns"], row["source"], row["status"], row["reason"]) == \
            (800.0, "offline", "regressed", "canary: kernel time +30%")
        real = env_module.environment("cpu")  # a new torch: a new key, measured afresh
        monkeypatch.setattr(tuning_module, "environment",
                            lambda device: {**real, "torch_version": real["torch_version"] + "+new"})
        record(store, registry, 700.0)
        assert db.lookup("gelu", BUCKET, ARM)["status"] == "ok"


def test_a_changed_torch_version_makes_the_result_stale(tmp_path, registry, monkeypatch):
    with Store(tmp_path / "s.duckdb") as store:
        record(store, registry)
        real = env_module.environment("cpu")
        monkeypatch.setattr(tuning_module, "environment",
                            lambda device: {**real, "torch_version": real["torch_version"] + "+other"})
        assert TuningDB(store, registry).lookup("gelu", BUCKET, ARM) is None
        monkeypatch.setattr(tuning_module, "environment",
                            lambda device: {**real, "device": "cpu:another model"})
        assert TuningDB(store, registry).lookup("gelu", BUCKET, ARM) is None
        monkeypatch.setattr(tuning_module, "environment", lambda device: real)
        assert TuningDB(store, registry).lookup("gelu", BUCKET, ARM) is not None


def test_a_changed_kernel_source_makes_the_result_stale(tmp_path, registry):
    with Store(tmp_path / "s.duckdb") as store:
        record(store, registry)
        eager = registry.variant("gelu", "eager")
        # the same variant name built by code from another file: another source hash
        registry.add_variant(dataclasses.replace(eager, build=test_a_changed_kernel_source_makes_the_result_stale))
        assert registry.variant("gelu", "eager").source_hash != eager.source_hash
        assert TuningDB(store, registry).lookup("gelu", BUCKET, ARM) is None
        registry.add_variant(eager)
        assert TuningDB(store, registry).lookup("gelu", BUCKET, ARM) is not None


def test_gate_verdicts_are_keyed_like_results(tmp_path, registry, monkeypatch):
    with Store(tmp_path / "s.duckdb") as store:
        db = TuningDB(store, registry)
        db.save_gate("gelu", BUCKET, ARM, False, "output 0: NaN/Inf where the reference has none", None)
        assert db.gate("gelu", BUCKET, ARM)["reason"].startswith("output 0: NaN")
        real = env_module.environment("cpu")
        monkeypatch.setattr(tuning_module, "environment",
                            lambda device: {**real, "triton_version": "9.9"})
        assert db.gate("gelu", BUCKET, ARM) is None  # a new triton: the verdict is re-checked


def test_a_changed_reference_asks_for_the_gate_verdict_again(tmp_path, registry):
    """The gate compares an arm with the reference: a fixed reference left old verdicts (a
    candidate refused for differing from a wrong reference stayed refused)."""
    with Store(tmp_path / "s.duckdb") as store:
        db = TuningDB(store, registry)
        db.save_gate("gelu", BUCKET, ARM, False, "output 0 differs", 0.5)
        reference = registry.variant("gelu", "reference")
        registry.add_variant(dataclasses.replace(
            reference, build=test_a_changed_reference_asks_for_the_gate_verdict_again))
        assert registry.variant("gelu", "reference").source_hash != reference.source_hash
        assert db.gate("gelu", BUCKET, ARM) is None
        registry.add_variant(reference)
        assert db.gate("gelu", BUCKET, ARM)["reason"] == "output 0 differs"


def test_an_online_figure_does_not_replace_an_offline_one(tmp_path, registry):
    """Online trials time forward calls inside a job's steps, offline ones forward and backward:
    one window of the first must not overwrite a benchmark of the second."""
    with Store(tmp_path / "s.duckdb") as store:
        db = TuningDB(store, registry)
        record(store, registry, 1000.0)  # offline
        db.record("gelu", BUCKET, ARM, source="online", trials=20, median_ns=300.0)
        row = db.lookup("gelu", BUCKET, ARM)
        assert (row["source"], row["median_ns"]) == ("offline", 1000.0)
        record(store, registry, 900.0)  # a newer offline figure does
        assert db.lookup("gelu", BUCKET, ARM)["median_ns"] == 900.0


def test_a_canary_marks_an_offline_row_without_replacing_its_figure(tmp_path, registry):
    with Store(tmp_path / "s.duckdb") as store:
        db = TuningDB(store, registry)
        record(store, registry, 1000.0)  # offline
        db.record("gelu", BUCKET, ARM, source="canary", trials=20, median_ns=3000.0,
                  status="regressed", reason="canary: kernel time +200%")
        row = db.lookup("gelu", BUCKET, ARM)
        assert (row["source"], row["median_ns"], row["status"]) == ("offline", 1000.0, "regressed")
        assert row["reason"] == "canary: kernel time +200%"


def test_a_gate_verdict_of_earlier_gate_rules_is_checked_again(tmp_path, registry):
    """The gate once passed any backward below its absolute tolerance: a "passed" stored then
    must not stand in for a check under the rules that would fail it."""
    from rtxops.telemetry import store_evolve

    with Store(tmp_path / "s.duckdb") as store:
        db = TuningDB(store, registry)
        earlier = db.key("gelu", BUCKET, ARM)   # a verdict stored as the earlier rules keyed it
        store_evolve.save_gate_result(store, earlier, True, "", 0.0, 1)
        assert db.gate("gelu", BUCKET, ARM) is None
        db.save_gate("gelu", BUCKET, ARM, True, "", 0.0)
        assert db.gate("gelu", BUCKET, ARM)["passed"] is True


def test_paging_through_rows_of_one_arm_under_many_versions_gives_each_once(tmp_path):
    """Rows of one arm under other versions tie on op, bucket, median, variant and config: pages
    cut between ties repeated some rows and left out others (``rtxops tune --show`` pages)."""
    from rtxops.telemetry import store_evolve

    with Store(tmp_path / "t.duckdb") as store:
        for i in range(40):
            store_evolve.upsert_tuning(store, {
                "op": "gelu", "bucket": BUCKET, "variant": "eager", "config": "{}",
                "device": "cpu:x", "torch_version": f"2.{i}", "triton_version": "",
                "source_hash": "h"}, {"source": "offline", "trials": 1, "status": "failed",
                                      "reason": "r", "updated_ns": i})
        seen = [r["torch_version"] for offset in range(0, 40, 7)
                for r in store_evolve.tuning_rows(store, limit=7, offset=offset)]
    assert sorted(seen) == sorted(f"2.{i}" for i in range(40))


def test_a_jobs_live_results_are_keyed_by_the_torch_and_device_it_reported(tmp_path, registry):
    """Online trials and canary marks were keyed by the daemon's torch and device: jobs on
    other GPU models or in another venv shared one key (a CUDA bucket on a daemon that sees no
    GPU was keyed by the daemon's CPU)."""
    from rtxops.telemetry import otlp, store_evolve
    from rtxops.telemetry import schema as S

    from ..telemetry.otlp_helpers import request, span

    cuda = "float32/cuda/tanh=0,hidden=64,rows=16"
    resource = {S.JOB_ID: "job-g", S.TORCH_VERSION: "9.9.9", S.TRITON_VERSION: "4.0",
                S.HW_GPU_MODEL: "NVIDIA H200", S.HW_CPU_MODEL: "some cpu"}
    body = request([span("rtx.step", {S.STEP_NUMBER: 1})], resource).SerializeToString()
    with Store(tmp_path / "s.duckdb") as store:
        store.write(otlp.convert(body, otlp.PROTOBUF, 1), timeout=30)
        reported = store_evolve.job_resource(store, "job-g")
        db = TuningDB(store, registry)
        db.record("gelu", cuda, ARM, source="online", trials=5, median_ns=10.0, resource=reported)
        db.record("gelu", BUCKET, ARM, source="online", trials=5, median_ns=20.0, resource=reported)
        assert db.lookup("gelu", cuda, ARM, reported)["median_ns"] == 10.0
        assert db.lookup("gelu", cuda, ARM) is None            # not this machine's result
        rows = {r["median_ns"]: r for r in store.query("SELECT * FROM tuning")}
        assert store_evolve.job_resource(store, "no-such-job") == {}
    assert (rows[10.0]["torch_version"], rows[10.0]["triton_version"], rows[10.0]["device"]) == (
        "9.9.9", "4.0", "cuda:NVIDIA H200")
    assert rows[20.0]["device"] == "cpu:some cpu"
