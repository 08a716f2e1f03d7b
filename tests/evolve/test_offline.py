"""The offline tuner against a real store file and real worker processes: budget, trials, spans,
tuning rows, the decision, sweep files for the replay simulator, the gate keeping broken variants
out, and a crashing kernel failing only its own trial."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from rtxops.evolve import replay
from rtxops.evolve.offline import TuneError, tune, write_sweeps
from rtxops.runtime.registry import Registry, load_builtin
from rtxops.telemetry import store_evolve
from rtxops.telemetry.store import Store

from .plugins_broken import CRASH_EXIT

ROOT = Path(__file__).resolve().parents[2]
GELU = "float32/cpu/tanh=0,hidden=64,rows=16"
FAST = {"reps": 5, "warmup": 1}


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_builtin(Registry())


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, registry):
    """One successive-halving run on gelu: 5 candidates, a budget of 4 trials."""
    tmp = tmp_path_factory.mktemp("offline")
    store = Store(tmp / "rtxops.duckdb")
    events: list[dict] = []
    report = tune(store, registry, op="gelu", bucket=GELU, budget=4, **FAST,
                  variants=["eager", "algebraic", "chunked"], on_progress=events.append,
                  sweep_out=tmp / "sweep.json")
    yield store, report, events, tmp / "sweep.json"
    store.close()


def test_the_budget_counts_every_trial_the_baseline_included(tuned):
    store, report, _, _ = tuned
    (b,) = report["buckets"]
    assert b["candidates"] == 5 and b["gate_passed"] == 5
    rows = store_evolve.trials(store, op="gelu")
    assert len(rows) == b["trials"] == 4  # the reference and the 3 arms the strategy asked for
    assert {r["mode"] for r in rows} == {"offline"}
    assert sorted(r["strategy"] for r in rows) == ["baseline"] + ["successive_halving"] * 3
    baseline = next(r for r in rows if r["strategy"] == "baseline")
    assert baseline["variant"] == "reference"
    for r in rows:
        assert r["status"] == "ok" and r["samples"] == FAST["reps"] and r["median_ns"] > 0
        detail = json.loads(r["detail"])
        assert r["p95_ns"] >= r["median_ns"] and detail["reps"] == FAST["reps"]
        assert detail["calls_per_rep"] >= 1  # how long a repetition was, kept with the trial


def test_each_trial_is_an_rtx_trial_span(tuned):
    store, _, _, _ = tuned
    spans = store.query("""SELECT attributes->>'rtx.trial.id' AS id, attributes->>'rtx.trial.mode' AS mode,
                                  variant, start_ns, end_ns
                           FROM spans WHERE name = 'rtx.trial'""")
    rows = {r["trial_id"]: r for r in store_evolve.trials(store)}
    assert sorted(s["id"] for s in spans) == sorted(rows)
    for s in spans:
        assert s["mode"] == "offline" and s["variant"] == rows[s["id"]]["variant"]
        assert s["end_ns"] > s["start_ns"]


def test_measured_arms_land_in_the_tuning_database_under_the_full_key(tuned, registry):
    store, report, _, _ = tuned
    rows = store_evolve.tuning_rows(store, op="gelu")
    measured = {(a["variant"], json.dumps(a["config"], sort_keys=True, separators=(",", ":")))
                for a in report["buckets"][0]["arms"]}
    assert {(r["variant"], r["config"]) for r in rows} == measured
    for r in rows:
        assert r["source"] == "offline" and r["status"] == "ok" and r["median_ns"] > 0
        assert r["bucket"] == GELU and r["device"].startswith("cpu:") and r["torch_version"]
        assert r["source_hash"] == registry.variant("gelu", r["variant"]).source_hash


def test_the_decision_compares_the_best_arm_with_the_reference(tuned):
    store, report, _, _ = tuned
    (b,) = report["buckets"]
    (d,) = store_evolve.decisions(store)
    assert d["kind"] == "offline_best" and d["job_id"] is None
    assert d["incumbent_variant"] == "reference" and d["candidate_variant"] == b["best"]["variant"]
    evidence = json.loads(d["evidence"])
    assert sorted(evidence["trial_ids"]) == sorted(r["trial_id"] for r in store_evolve.trials(store))
    assert evidence["strategy"] == "successive_halving" and evidence["budget"] == 4
    medians = {(a["variant"], json.dumps(a["config"])): a["median_ns"] for a in b["arms"]}
    best = medians[(b["best"]["variant"], json.dumps(b["best"]["config"]))]
    if b["best"]["variant"] == "reference":  # nothing beat it: no statistics to show
        assert d["gain"] is None and "reference is the fastest" in d["reason"]
    else:
        assert best < medians[("reference", "{}")]
        assert d["gain"] is not None and d["ci_low"] <= d["gain"] <= d["ci_high"]
        assert 0 < d["p_value"] <= 1 and evidence["samples"] == FAST["reps"]


def test_progress_reaches_done_and_never_goes_back(tuned):
    _, _, events, _ = tuned
    assert events[0]["stage"] == "gate" and events[-1]["stage"] == "done"
    trials = [e["trials"] for e in events]
    assert trials == sorted(trials) and trials[-1] == 4
    assert all(e["op"] == "gelu" and e["bucket"] == GELU and e["budget"] == 4 for e in events)


def test_the_sweep_file_replays(tuned):
    store, report, _, path = tuned
    assert report["sweep_files"] == [str(path)]
    arms = replay.load_sweep(path)
    trials = {f'{r["variant"]} {json.dumps(json.loads(r["config"]), sort_keys=True)}': r
              for r in store_evolve.trials(store)}
    assert set(arms) == set(trials) and "reference {}" in arms
    for label, values in arms.items():  # each arm ran once: its values are its trial's
        assert len(values) == FAST["reps"]
        assert statistics.median(values) == trials[label]["median_ns"]
    # replay on each arm's median: the round trip is under test here, not this machine's noise
    result = replay.replay({k: [statistics.median(v)] for k, v in arms.items()}, ["exhaustive"],
                           budget=8, seeds=3)
    assert result["strategies"]["exhaustive"]["reached"] == 1.0
    assert result["strategies"]["exhaustive"]["worst_trials"] <= 4


def test_several_buckets_get_one_sweep_file_each(tmp_path):
    sweeps = [{"op": op, "bucket": GELU, "arms": [{"variant": "reference", "config": {},
                                                   "values": [1.0 + i, 2.0]}]}
              for i, op in enumerate(("gelu", "gelu"))]
    report = {"buckets": [{"sweep": s} for s in sweeps]}
    paths = write_sweeps(report, tmp_path / "sweep.json")
    assert paths == [str(tmp_path / "sweep-0.json"), str(tmp_path / "sweep-1.json")]
    assert [replay.load_sweep(p)["reference {}"] for p in paths] == [[1.0, 2.0], [2.0, 2.0]]
    assert write_sweeps(report | {"buckets": report["buckets"][:1]}, tmp_path / "one.json") == \
        [str(tmp_path / "one.json")]


def test_a_bucket_with_no_measured_arm_writes_no_sweep(tmp_path):
    """Such a sweep was written, and replay refused it ("has no arms")."""
    measured = {"op": "gelu", "bucket": GELU, "arms": [{"variant": "reference", "config": {},
                                                         "values": [1.0, 2.0]}]}
    empty = {"op": "gelu", "bucket": GELU + "x", "arms": []}
    report = {"buckets": [{"sweep": empty}, {"sweep": measured}]}
    assert write_sweeps(report, tmp_path / "sweep.json") == [str(tmp_path / "sweep.json")]
    assert replay.load_sweep(tmp_path / "sweep.json") == {"reference {}": [1.0, 2.0]}
    assert write_sweeps({"buckets": [{"sweep": empty}]}, tmp_path / "none.json") == []
    assert not (tmp_path / "none.json").exists()


def test_broken_variants_fail_the_gate_and_a_crash_fails_only_its_trial(tmp_path, monkeypatch):
    monkeypatch.setenv("RTXOPS_VARIANT_MODULES", "tests.evolve.plugins_broken")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the worker processes import the plugin too
    registry = load_builtin(Registry())
    store = Store(tmp_path / "rtxops.duckdb")
    try:
        report = tune(store, registry, op="gelu", bucket=GELU, strategy="exhaustive", budget=10,
                      **FAST, variants=["broken_nan", "broken_raise", "crashes", "algebraic"])
        (b,) = report["buckets"]
        assert set(b["gate_failures"]) == {"broken_nan", "broken_raise"}
        gates = {r["variant"]: r for r in store.query("SELECT * FROM gate_results")}
        assert not gates["broken_nan"]["passed"] and "NaN" in gates["broken_nan"]["reason"]
        assert not gates["broken_raise"]["passed"]
        assert "broken on purpose" in gates["broken_raise"]["reason"]
        assert gates["crashes"]["passed"] and gates["algebraic"]["passed"]

        trials = {r["variant"]: r for r in store_evolve.trials(store)}
        assert set(trials) == {"reference", "algebraic", "crashes"}  # the rejected never ran
        # budget 10, 3 arms to try; the crash sent each arm to a process of its own, so a best
        # algebraic was never beside the reference: it gets a run with it
        joint = 2 if b["best"]["variant"] == "algebraic" else 0
        assert len(store_evolve.trials(store)) == b["trials"] == 3 + joint
        if joint:
            assert b["decision"]["reason"] != "the best arm and the reference were never measured in one run"
        crash = trials["crashes"]
        assert crash["status"] == "failed" and crash["median_ns"] is None
        assert f"exited with {CRASH_EXIT}" in json.loads(crash["detail"])["reason"]
        assert trials["algebraic"]["status"] == trials["reference"]["status"] == "ok"
        tuning = {r["variant"]: r for r in store_evolve.tuning_rows(store, op="gelu")}
        assert tuning["crashes"]["status"] == "failed" and tuning["algebraic"]["status"] == "ok"
        assert b["best"]["variant"] in ("reference", "algebraic")
        assert "crashes" not in {a["variant"] for a in b["sweep"]["arms"]}
    finally:
        store.close()


def test_bad_input_is_refused_before_any_work(tmp_path, registry):
    store = Store(tmp_path / "rtxops.duckdb")
    try:
        cases = [
            (dict(op="nope"), "unknown op 'nope'"),
            (dict(bucket=GELU), "--bucket needs --op"),
            (dict(op="gelu", bucket="float32-cpu"), "not of the form"),
            (dict(op="gelu", bucket="float32/cpu/hidden=64,rows=8"), "must give each of tanh, hidden, rows"),
            (dict(op="gelu", bucket=GELU, strategy="annealing"), "unknown strategy 'annealing'"),
            (dict(op="gelu", bucket=GELU, budget=0), "at least 1"),
            (dict(op="gelu", bucket=GELU, variants=["warp_drive"]), "unknown variant 'warp_drive'"),
            (dict(variants=["eagr"]), "unknown variant 'eagr': no op has one of that name"),
            (dict(op="gelu", bucket=GELU.replace("/cpu/", "/cuda/")),
             "a CUDA bucket and this machine has no CUDA device"),
            (dict(), "no recorded op buckets"),
            (dict(op="gelu"), "no recorded gelu buckets"),
        ]
        for kwargs, message in cases:
            with pytest.raises(TuneError, match=message):
                tune(store, registry, **kwargs)
        assert store_evolve.trials(store) == [] and store_evolve.tuning_rows(store) == []
    finally:
        store.close()


def test_a_budget_of_one_says_only_the_reference_was_measured(tmp_path, registry):
    """The baseline takes the whole budget: the decision must not claim the reference beat
    candidates that never ran."""
    store = Store(tmp_path / "rtxops.duckdb")
    try:
        report = tune(store, registry, op="gelu", bucket=GELU, budget=1, **FAST, variants=["eager"])
        (b,) = report["buckets"]
        assert b["trials"] == 1
        (decision,) = store_evolve.decisions(store)
        assert decision["reason"] == "only the reference was measured (the budget held no candidate)"
    finally:
        store.close()


def test_a_bucket_given_with_its_dims_in_another_order_is_tuned_under_the_runtimes_key(tmp_path, registry):
    """`--bucket` was keyed as typed: results for `rows=16,hidden=64,...` were never found by the
    loop (which keys `tanh=0,hidden=64,rows=16`) and fed its priors as another bucket's."""
    from rtxops.evolve.offline import targets

    store = Store(tmp_path / "rtxops.duckdb")
    try:
        assert targets(store, registry, "gelu", "float32/cpu/rows=16,hidden=064,tanh=0") == [("gelu", GELU)]
    finally:
        store.close()


def test_kernels_printing_to_stdout_are_gated_on_their_values(tmp_path, monkeypatch):
    """The worker's JSON lines share stdout with the kernels: a print without a newline ran into
    a result's line (a correct kernel stored as failed for good), a printed number broke the
    reader (no verdict for any arm)."""
    from rtxops.evolve.candidates import Arm
    from rtxops.evolve.screen import screen
    from rtxops.evolve.tuning import TuningDB

    monkeypatch.setenv("RTXOPS_VARIANT_MODULES", "tests.evolve.plugins_broken")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the worker processes import the plugin too
    registry = load_builtin(Registry())
    store = Store(tmp_path / "rtxops.duckdb")
    try:
        tuning = TuningDB(store, registry)
        arms = [Arm("chatty", "{}"), Arm("prints_number", "{}"), Arm("eager", "{}")]
        passed, failed = screen(tuning, "gelu", GELU, arms, timeout_s=120)
        assert failed == {} and set(passed) == set(arms)
        assert all(tuning.gate("gelu", GELU, arm)["passed"] for arm in arms)
    finally:
        store.close()


def test_memory_running_out_in_the_gate_is_no_verdict_on_the_kernel(tmp_path, monkeypatch):
    """A failed allocation (a busy machine, a ulimit) was stored as the kernel's verdict and never
    asked again under the same versions; a kernel that raises on its own still is."""
    from rtxops.evolve.candidates import Arm
    from rtxops.evolve.screen import screen
    from rtxops.evolve.tuning import TuningDB

    monkeypatch.setenv("RTXOPS_VARIANT_MODULES", "tests.evolve.plugins_broken")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    registry = load_builtin(Registry())
    with Store(tmp_path / "rtxops.duckdb") as store:
        tuning = TuningDB(store, registry)
        oom, broken = Arm("out_of_memory", "{}"), Arm("broken_raise", "{}")
        passed, failed = screen(tuning, "gelu", GELU, [oom, broken], timeout_s=120)
        assert not passed and "can't allocate memory" in failed[oom]
        assert tuning.gate("gelu", GELU, oom) is None                  # asked again next time
        assert tuning.gate("gelu", GELU, broken)["passed"] is False    # stored for good


def test_a_job_waiting_for_the_gate_slot_takes_the_verdicts_another_just_stored(tmp_path, monkeypatch):
    """Two jobs open the same hot bucket: the second chose its arms to gate before it waited for
    the slot, and gated them all again."""
    import threading

    from rtxops.evolve import screen as screen_module
    from rtxops.evolve.candidates import Arm
    from rtxops.evolve.tuning import TuningDB

    gated, real_gate = [], screen_module._gate

    def counting(tuning, op, bucket, arms, timeout_s):
        gated.append([a.variant for a in arms])
        return real_gate(tuning, op, bucket, arms, timeout_s)

    monkeypatch.setattr(screen_module, "_gate", counting)
    store = Store(tmp_path / "rtxops.duckdb")
    try:
        tuning = TuningDB(store, load_builtin(Registry()))
        arms, slot, results = [Arm.of("eager"), Arm.of("algebraic")], threading.Semaphore(1), []
        jobs = [threading.Thread(target=lambda: results.append(screen_module.screen(
            tuning, "gelu", GELU, arms, 120, worker_slot=slot))) for _ in range(2)]
        for job in jobs:
            job.start()
        for job in jobs:
            job.join(180)
        assert [g for g in gated if g] == [["eager", "algebraic"]]
        assert all(set(passed) == set(arms) and not failed for passed, failed in results)
    finally:
        store.close()


def test_the_verdict_compares_the_best_arm_with_the_reference_within_one_run(tmp_path, registry,
                                                                             monkeypatch):
    """Worker runs differ by more than kernels do. Here every run after the first is 10 % faster
    throughout: the arm measured only in the second run, as fast as the reference, looked 10 %
    better against the reference of the first run, and was reported better. It now gets a run
    beside the reference, and the verdict pairs their repetitions."""
    from rtxops.evolve import offline

    runs: list[list[str]] = []

    def worker(request, key, timeout_s, on_progress):
        runs.append([a["variant"] for a in request["arms"]])
        out = []
        for i, arm in enumerate(request["arms"]):
            level = 1000.0 if arm["variant"] == "reference" or len(runs) > 1 else 1100.0
            values = [level * (0.9 if len(runs) > 1 else 1.0) * (1 + 0.002 * ((r * 7 + i) % 5))
                      for r in range(20)]
            out.append({"status": "ok", "values": values, "median_ns": statistics.median(values),
                        "p95_ns": max(values), "spread": 0.01, "peak_bytes": None})
        return out

    monkeypatch.setattr(offline, "run_isolating", worker)
    monkeypatch.setattr(offline, "screen", lambda tuning, op, bucket, arms, timeout_s: (set(arms), {}))
    with Store(tmp_path / "rtxops.duckdb") as store:
        report = tune(store, registry, op="gelu", bucket=GELU, strategy="exhaustive", budget=10,
                      variants=["eager", "algebraic", "chunked"])
    (b,) = report["buckets"]
    assert len(runs) == 3 and len(runs[1]) == 1 and runs[2] == ["reference", runs[1][0]]
    assert b["best"]["variant"] == runs[1][0]
    assert not b["decision"]["better"] and abs(b["decision"]["gain"]) < 0.02, b["decision"]


def test_recorded_buckets_the_tuner_cannot_take_are_skipped_with_the_reason(tmp_path, registry):
    """Without --bucket the tuner took telemetry's bucket strings (any OTLP client's) unchecked:
    one malformed bucket crashed the run for every bucket."""
    from rtxops.evolve.offline import targets

    store = Store(tmp_path / "rtxops.duckdb")

    def record(cur, bucket, total):
        cur.execute("INSERT INTO kernel_minutes (job_id, op, bucket, variant, config, phase, minute, "
                    "calls, total_ns) VALUES ('j1', 'gelu', ?, 'reference', '{}', 'fwd', 1, 10, ?)",
                    [bucket, total])

    try:
        bad = {"not-a-bucket": "not of the form",
               GELU.replace("/cpu/", "/cuda/"): "no CUDA device",
               GELU.replace("hidden=64", "hidden=-64"): "hidden=-64 is no size",
               GELU.replace("hidden=64", "hidden=99999999999"): "hidden=99999999999 is no size",
               GELU.replace("/cpu/", "/xpu/"): "device 'xpu'"}
        for i, bucket in enumerate([GELU, *bad]):
            store.call(lambda cur, b=bucket, t=100 + i: record(cur, b, t), 30)
        skipped: list[dict] = []
        assert targets(store, registry, "gelu", None, skipped) == [("gelu", GELU)]
        assert {s["bucket"] for s in skipped} == set(bad)
        for s in skipped:
            assert bad[s["bucket"]] in s["reason"]
        store.call(lambda cur: cur.execute("DELETE FROM kernel_minutes WHERE bucket = ?", [GELU]), 30)
        with pytest.raises(TuneError, match="no recorded gelu bucket is one the tuner can benchmark"):
            targets(store, registry, "gelu", None)
    finally:
        store.close()


def test_arms_measured_in_separate_processes_are_not_paired(tmp_path, registry, monkeypatch):
    """After a crash each arm re-runs in a process of its own; the tuner filed them as one run
    and paired the reference with an arm measured in another process (10 % apart here by the
    process alone), so the best arm never got its run beside the reference."""
    from rtxops.evolve import offline

    calls: list[list[str]] = []

    def worker(request, key, timeout_s, on_progress):
        calls.append([a["variant"] for a in request["arms"]])
        out = []
        for i, arm in enumerate(request["arms"]):
            isolated = len(calls) == 1   # the first batch "crashed": one process per arm
            level = 1000.0 * (0.9 if isolated and arm["variant"] != "reference" else 1.0)
            values = [level * (1 + 0.002 * ((r * 7 + i) % 5)) for r in range(20)]
            out.append({"status": "ok", "values": values, "median_ns": statistics.median(values),
                        "p95_ns": max(values), "spread": 0.01, "peak_bytes": None,
                        "worker": 100 + i if isolated else 0})
        return out

    monkeypatch.setattr(offline, "run_isolating", worker)
    monkeypatch.setattr(offline, "screen", lambda tuning, op, bucket, arms, timeout_s: (set(arms), {}))
    with Store(tmp_path / "rtxops.duckdb") as store:
        report = tune(store, registry, op="gelu", bucket=GELU, strategy="exhaustive", budget=10,
                      variants=["algebraic"])
    (b,) = report["buckets"]
    assert calls == [["reference", "algebraic"], ["reference", "algebraic"]]   # the joint run
    assert not b["decision"]["better"] and abs(b["decision"]["gain"]) < 0.02, b["decision"]


def test_a_tuner_killed_midway_keeps_the_tuning_rows_of_what_it_measured(tmp_path, registry,
                                                                          monkeypatch):
    """Tuning rows were written once a bucket was done: a daemon killed (or a double Ctrl-C)
    midway left trials and no tuning rows, though its message said they were kept."""
    from rtxops.evolve import offline

    calls = []

    def worker(request, key, timeout_s, on_progress):
        calls.append(request)
        if len(calls) > 1:
            raise SystemExit("killed")   # the process ends in the second worker run
        values = [1000.0 + r for r in range(5)]
        return [{"status": "ok", "values": values, "median_ns": statistics.median(values),
                 "p95_ns": max(values), "spread": 0.01, "peak_bytes": None}
                for _ in request["arms"]]

    monkeypatch.setattr(offline, "run_isolating", worker)
    monkeypatch.setattr(offline, "screen", lambda tuning, op, bucket, arms, timeout_s: (set(arms), {}))
    monkeypatch.setattr(offline, "BATCH", 1)
    with Store(tmp_path / "rtxops.duckdb") as store:
        with pytest.raises(SystemExit):
            tune(store, registry, op="gelu", bucket=GELU, strategy="exhaustive", budget=10,
                 variants=["eager", "algebraic"])
        first = {a["variant"] for a in calls[0]["arms"]}
        rows = store_evolve.tuning_rows(store, op="gelu")
    assert {r["variant"] for r in rows} == first and len(first) == 2
    assert all(r["status"] == "ok" and r["median_ns"] == 1002.0 for r in rows)
