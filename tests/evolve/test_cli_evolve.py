"""``rtxops tune``, ``rtxops evolve replay|status`` as a user runs them, and the daemon's
``/v1/evolve`` API: in-process tuning from recorded telemetry, tuning through a real daemon, exit
codes, and the API's 401/404/422 answers."""
from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from tests.daemon.live import PY, Daemons, clean_env, cli, marked, until

GELU = "float32/cpu/tanh=0,hidden=64,rows=16"
JOB = """
import torch, torch.nn.functional as F
w = torch.nn.Parameter(torch.randn(64, 64))
opt = torch.optim.SGD([w], lr=0.01)
x = torch.randn(16, 64)
for _ in range(4):
    F.rms_norm(F.gelu(x @ w), (64,)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.fixture
def daemons(tmp_path):
    ds = Daemons(tmp_path)
    yield ds
    assert not ds.cleanup(), "processes outlived the test"


def _sweep(path: Path, arms: list[tuple[str, list[float]]]) -> Path:
    path.write_text(json.dumps({"arms": [{"variant": v, "config": {}, "values": vals}
                                         for v, vals in arms]}))
    return path


# ---- replay --------------------------------------------------------------------------------------
def test_replay_finds_the_known_best_with_every_strategy(tmp_path, daemons):
    # 8 arms, the best last (so exhaustive needs all 8 trials), the others ≥ 20 % slower
    arms = [(f"v{i}", [1200.0 + 50 * i, 1210.0 + 50 * i, 1190.0 + 50 * i]) for i in range(7)]
    sweep = _sweep(tmp_path / "sweep.json", arms + [("best", [1000.0, 1001.0, 999.0])])
    r = cli("evolve", "replay", "--sweep", str(sweep), "--seeds", "5", "--json", mark=daemons.mark)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["arms"] == 8 and result["budget"] == 16 and result["seeds"] == 5
    assert set(result["strategies"]) == {"exhaustive", "random", "successive_halving", "thompson"}
    for name, s in result["strategies"].items():
        assert s["reached"] == 1.0, name
        assert 1 <= s["median_trials"] <= s["worst_trials"] <= 8, name
    assert result["strategies"]["exhaustive"]["worst_trials"] == 8

    r = cli("evolve", "replay", "--sweep", str(sweep), "--strategy", "thompson", "--strategy",
            "random", "--budget", "4", "--seeds", "3", mark=daemons.mark)
    assert r.returncode == 0, r.stderr
    assert "thompson" in r.stdout and "random" in r.stdout and "exhaustive" not in r.stdout
    assert "budget 4" in r.stdout


def test_replay_takes_a_trial_as_the_tuners_benchmark_of_the_sweeps_repetitions(tmp_path, daemons):
    """A sweep from `tune --sweep-out` records each arm's repetitions; the tuner's trial is the
    median of `reps` of them. The CLI replayed single values (as noisy as one repetition), so it
    understated every strategy against what `rtxops tune` does (bench/replay.py did it right)."""
    import random

    rng = random.Random(7)
    # the best arm (last: exhaustive meets it last) 10 % ahead, each value +-40 % noise: one
    # value often misleads, a median of 15 rarely
    arms = [{"variant": f"v{i}", "config": {}, "values": [1000 * (1.0 if i == 5 else 1.1) * rng.uniform(0.6, 1.4)
                                                          for _ in range(15)]} for i in range(6)]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"op": "gelu", "bucket": GELU, "reps": 15, "arms": arms}))
    results = {}
    for args in ([], ["--trial-reps", "1"]):
        r = cli("evolve", "replay", "--sweep", str(path), "--strategy", "exhaustive", "--budget", "6", "--seeds", "30",
                "--json", *args, mark=daemons.mark)
        assert r.returncode == 0, r.stderr
        results[tuple(args)] = json.loads(r.stdout)
    assert results[()]["trial_reps"] == 15 and results[("--trial-reps", "1")]["trial_reps"] == 1
    reached = {k: v["strategies"]["exhaustive"]["reached"] for k, v in results.items()}
    assert reached[()] > reached[("--trial-reps", "1")], reached


@pytest.mark.parametrize("content,args,message", [
    ("{not json", [], "cannot read sweep"),
    ('{"arms": 3}', [], "cannot read sweep"),
    ('{"arms": []}', [], "has no arms"),
    ('{"arms": [{"variant": "a", "values": [1.0, -2.0]}]}', [], "needs positive, finite values"),
    ('{"arms": [{"variant": "a", "values": [1.0]}]}', ["--strategy", "annealing"], "unknown strategy"),
    ('{"arms": [{"variant": "a", "values": [1.0]}]}', ["--budget", "0"], "at least 1"),
    ('{"arms": [{"variant": "a", "values": [1.0]}]}', ["--trial-reps", "0"], "at least 1"),
    ('{"reps": 0, "arms": [{"variant": "a", "values": [1.0]}]}', [], "reps must be a whole number"),
    # a trial of a billion values took 8 GB; /dev/zero was read until memory ran out
    ('{"reps": 1000000000, "arms": [{"variant": "a", "values": [1.0]}]}', [], "from 1 to 10000"),
    ('{"arms": [{"variant": "a", "values": [1.0]}]}', ["--trial-reps", "100000"], "--trial-reps to 10000"),
    ('{"arms": [{"variant": "a", "values": [1.0]}]}', ["--budget", "10000000"], "--budget goes to"),
    ("/dev/zero", [], "is not a regular file"),
    (None, [], "cannot read sweep"),
])
def test_replay_refuses_bad_input_with_exit_2(tmp_path, daemons, content, args, message):
    path = tmp_path / "sweep.json"
    if content == "/dev/zero":
        path = Path(content)
    elif content is not None:
        path.write_text(content)
    r = cli("evolve", "replay", "--sweep", str(path), *args, mark=daemons.mark, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr


# ---- tune without a daemon -----------------------------------------------------------------------
def test_tune_in_process_tunes_the_recorded_buckets_and_show_lists_them(tmp_path, daemons):
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    r = cli("run", "--direct", "--no-summary", "--", PY, "job.py", mark=daemons.mark,
            cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr

    # the job recorded gelu and rms_norm buckets; --op picks gelu's (its bucket from telemetry)
    r = cli("tune", "--op", "gelu", "--budget", "2", "--reps", "3", "--warmup", "1", "--variant",
            "eager", "--sweep-out", "sweep.json", "--json", mark=daemons.mark, cwd=tmp_path,
            timeout=180)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    (b,) = report["buckets"]
    assert (b["op"], b["bucket"]) == ("gelu", GELU)
    assert b["trials"] == 2 and b["candidates"] == 1 and b["decision"]["reason"]
    # 3 repetitions cannot decide: said up front, and no gain of "+0.0%" made up
    assert "needs 5 repetitions to decide anything" in r.stderr
    assert b["decision"]["gain"] is None or b["best"]["variant"] == "reference"
    assert {a["variant"] for a in b["arms"]} == {"reference", "eager"}
    assert report["sweep_files"] == [str(tmp_path / "sweep.json")]
    assert len(json.loads((tmp_path / "sweep.json").read_text())["arms"]) == 2

    r = cli("tune", "--show", "--json", mark=daemons.mark, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert {(x["op"], x["bucket"], x["variant"]) for x in rows} == {
        ("gelu", GELU, "reference"), ("gelu", GELU, "eager")}
    assert all(x["source"] == "offline" and x["trials"] == 1 and x["stale"] == "" for x in rows)
    import duckdb  # a row measured under another torch: listed, and said to be stale

    con = duckdb.connect(str(tmp_path / ".rtxops" / "rtxops.duckdb"))
    con.execute("UPDATE tuning SET torch_version = '1.0' WHERE variant = 'reference'")
    con.close()
    r = cli("tune", "--show", "--json", mark=daemons.mark, cwd=tmp_path)
    assert [(x["variant"], x["stale"]) for x in json.loads(r.stdout)] == [("eager", ""),
                                                                          ("reference", "torch")]
    r = cli("tune", "--show", mark=daemons.mark, cwd=tmp_path)
    assert r.returncode == 0 and "1 stale: not used here" in " ".join(r.stdout.split()), r.stdout
    r = cli("tune", "--show", "--op", "rms_norm", mark=daemons.mark, cwd=tmp_path)
    assert r.returncode == 0 and "the tuning database has no rows for op rms_norm\n" in r.stderr
    assert "┃" not in r.stdout            # a line, not an empty table
    r = cli("tune", "--show", "--op", "rms_nrom", mark=daemons.mark, cwd=tmp_path)
    assert r.returncode == 0 and "'rms_nrom' is not an op; known: " in r.stderr
    r = cli("tune", "--show", "--bucket", GELU + "x", mark=daemons.mark, cwd=tmp_path)
    assert r.returncode == 0 and f"no rows for bucket {GELU}x" in r.stderr  # --bucket was not ignored
    r = cli("tune", "--show", "--json", "--bucket", GELU, mark=daemons.mark, cwd=tmp_path)
    assert len(json.loads(r.stdout)) == 2
    r = cli("tune", "--show", mark=daemons.mark, cwd=tmp_path)
    assert r.returncode == 0 and "tuning database (2 rows, 1 stale" in r.stdout and "offline" in r.stdout

    for args, code, message in [
        (["tune", "--op", "nope"], 2, "unknown op 'nope'"),
        (["tune", "--strategy", "annealing"], 2, "unknown strategy"),
        (["tune", "--show", "--home", str(tmp_path / "empty")], 2, "no store at"),
        (["evolve", "status"], 1, "no daemon serving"),
    ]:
        r = cli(*args, mark=daemons.mark, cwd=tmp_path, timeout=120)
        assert r.returncode == code and message in r.stderr, (args, r.returncode, r.stderr)


# ---- the daemon ----------------------------------------------------------------------------------
def test_tune_through_the_daemon_and_the_evolve_api(tmp_path, daemons):
    d = daemons.start(tmp_path / "home")
    api, anonymous = d.client(), d.client(token=None)
    body = {"op": "gelu", "bucket": GELU, "budget": 3, "reps": 3, "warmup": 1,
            "variants": ["algebraic", "eager"]}
    assert anonymous.post("/v1/evolve/tune", json=body).status_code == 401
    assert d.client(token="wrong").post("/v1/evolve/tune", json=body).status_code == 401
    for bad, message in [
        ({**body, "strategy": "annealing"}, "strategy"), ({**body, "budget": 0}, "budget"),
        ({**body, "colour": "red"}, "colour"), ({**body, "op": "nope"}, "unknown op 'nope'"),
        ({"bucket": GELU}, "--bucket needs --op"), ({**body, "bucket": "float32"}, "not of the form"),
        ({**body, "variants": ["warp_drive"]}, "unknown variant"), ({}, "no recorded op buckets"),
    ]:
        r = api.post("/v1/evolve/tune", json=bad)
        assert r.status_code == 422 and message in r.text, (bad, r.status_code, r.text)
    assert api.get("/v1/evolve/tune/nosuchtask").status_code == 404
    for path in ("decisions", "trials", "tuning", "hotspots?job=j"):
        sep = "&" if "?" in path else "?"
        for q in ("limit=0", "limit=1001", "offset=-1", "limit=many"):
            assert api.get(f"/v1/evolve/{path}{sep}{q}").status_code == 422, (path, q)
    assert api.get("/v1/evolve/hotspots").status_code == 422  # which job?
    assert api.get("/v1/evolve/hotspots?job=nojob").json()["hotspots"] == []
    assert api.get("/v1/evolve/status").json() == {"enabled": False, "tune_tasks": []}

    r = cli("tune", "--home", str(d.home), "--op", "gelu", "--bucket", GELU, "--budget", "3",
            "--reps", "3", "--warmup", "1", "--variant", "algebraic", "--variant", "eager",
            "--sweep-out", str(tmp_path / "sweep.json"), mark=daemons.mark, timeout=180)
    assert r.returncode == 0, r.stderr
    assert "rtxops tune: successive_halving" in r.stdout and "3/3 trials" in r.stderr
    assert re.search(r"3 reps, seed \d+", r.stdout), r.stdout   # which arms: the seed says

    trials = api.get("/v1/evolve/trials").json()["trials"]
    assert len(trials) == 3 and {t["mode"] for t in trials} == {"offline"}
    assert {t["variant"] for t in trials} == {"reference", "algebraic", "eager"}
    page = api.get("/v1/evolve/trials?limit=1&offset=1").json()["trials"]
    assert [t["trial_id"] for t in page] == [trials[1]["trial_id"]]
    assert all(t["detail"]["reps"] == 3 for t in trials)  # parsed JSON, not text
    tuning = api.get("/v1/evolve/tuning?op=gelu").json()["tuning"]
    assert {t["variant"] for t in tuning} == {"reference", "algebraic", "eager"}
    (decision,) = api.get("/v1/evolve/decisions").json()["decisions"]
    assert decision["kind"] == "offline_best"
    assert sorted(decision["evidence"]["trial_ids"]) == sorted(t["trial_id"] for t in trials)
    (task,) = api.get("/v1/evolve/status").json()["tune_tasks"]
    assert task["state"] == "done" and task["params"]["budget"] == 3
    full = api.get(f"/v1/evolve/tune/{task['id']}").json()
    assert full["report"]["buckets"][0]["trials"] == 3 and full["error"] is None
    # a task posted without a seed gets a fresh one (a fixed 0 tried the same arms every time)
    posted = [api.post("/v1/evolve/tune", json=body).json() for _ in range(2)]
    assert len({t["params"]["seed"] for t in posted}) == 2, posted
    for t in posted:
        api.post(f"/v1/evolve/tune/{t['id']}/cancel")
    assert until(lambda: all(api.get(f"/v1/evolve/tune/{t['id']}").json()["state"]
                             not in ("queued", "running") for t in posted), timeout=180)

    r = cli("evolve", "replay", "--sweep", str(tmp_path / "sweep.json"), "--seeds", "3",
            mark=daemons.mark)
    assert r.returncode == 0 and "successive_halving" in r.stdout, r.stderr
    r = cli("tune", "--home", str(d.home), "--show", "--json", mark=daemons.mark)
    assert r.returncode == 0 and len(json.loads(r.stdout)) == 3, r.stderr
    bucket = tuning[0]["bucket"]
    for shown, count in ((bucket, 3), (bucket + "x", 0)):   # --bucket was not sent
        r = cli("tune", "--home", str(d.home), "--show", "--json", "--bucket", shown, mark=daemons.mark)
        assert r.returncode == 0 and len(json.loads(r.stdout)) == count, r.stderr
    r = cli("evolve", "status", "--home", str(d.home), "--json", mark=daemons.mark)
    assert r.returncode == 0, r.stderr
    status = json.loads(r.stdout)
    assert status["enabled"] is False and status["decisions"][0]["kind"] == "offline_best"
    r = cli("tune", "--home", str(d.home), "--op", "nope", mark=daemons.mark)
    assert r.returncode == 2 and "unknown op 'nope'" in r.stderr, r.stderr


def test_tuning_tasks_outlive_the_daemon(tmp_path, daemons):
    """A finished task is still answered for after a restart; one the daemon was killed in the
    middle of is reported as interrupted (its workers go with the daemon)."""
    home = tmp_path / "home"
    d = daemons.start(home)
    api = d.client()
    quick = {"op": "gelu", "bucket": GELU, "budget": 2, "reps": 2, "warmup": 0,
             "variants": ["eager"]}
    done = api.post("/v1/evolve/tune", json=quick).json()
    until(lambda: api.get(f"/v1/evolve/tune/{done['id']}").json()["state"] == "done", 120,
          what="the quick task")
    long = {**quick, "budget": 500, "reps": 100_000, "variants": None}
    running = api.post("/v1/evolve/tune", json=long).json()
    until(lambda: api.get(f"/v1/evolve/tune/{running['id']}").json()["progress"], 120,
          what="the long task to measure")
    d.kill9()
    until(lambda: not marked(daemons.mark), 60, what="the tuning workers to go with the daemon")

    api = daemons.start(home).client()
    first = api.get(f"/v1/evolve/tune/{done['id']}").json()
    assert first["state"] == "done" and first["report"]["buckets"][0]["trials"] == 2
    second = api.get(f"/v1/evolve/tune/{running['id']}").json()
    assert second["state"] == "failed" and second["error"].startswith("interrupted")
    assert second["params"]["budget"] == 500
    listed = {t["id"]: t["state"] for t in api.get("/v1/evolve/status").json()["tune_tasks"]}
    assert listed == {done["id"]: "done", running["id"]: "failed"}
    assert api.get("/v1/evolve/tune/nosuchtask").status_code == 404


def test_the_decisions_table_shows_job_ids_whole_at_80_columns():
    """`evolve status` piped (80 columns) folded ids in two: "j-52de9d4" over "a"."""
    import io

    from rich.console import Console

    from rtxops.cli_evolve import _decisions_table

    decisions = [{"kind": "promote", "job_id": "j-52de9d4a", "op": "rms_norm",
                  "bucket": "float32/cpu/hidden=128,rows=512", "candidate_variant": "eager",
                  "candidate_config": "{}", "gain": 0.114,
                  "reason": "gain +11.4% (99% CI +2.5% … +22.3%, p=0.0035, n=16)"}]
    buf = io.StringIO()
    Console(file=buf, width=80).print(_decisions_table(decisions))
    assert "j-52de9d4a" in buf.getvalue(), buf.getvalue()


def test_tune_show_lists_every_row_through_a_daemon_as_without_one(tmp_path, daemons):
    """Through a daemon it asked for one page of 1000 rows and titled the cut list as the whole."""
    import duckdb

    from rtxops.telemetry.store import Store

    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    Store(home / "rtxops.duckdb").close()
    con = duckdb.connect(str(home / "rtxops.duckdb"))
    con.execute("INSERT INTO tuning SELECT 'gelu', 'float32/cpu/hidden=64,rows=8', 'eager', "
                "'{\"chunk\": ' || i || '}', 'cpu', 't', '', 'h', 'offline', 1, i, 0.0, 0, 'ok', '', i "
                "FROM range(1500) r(i)")
    con.close()
    shown = lambda: json.loads(cli("tune", "--show", "--json", "--home", str(home),  # noqa: E731
                                   mark=daemons.mark).stdout)
    assert len(shown()) == 1500
    daemons.start(home)
    rows = shown()
    assert len(rows) == 1500 and len({r["config"] for r in rows}) == 1500


def test_ctrl_c_stops_an_in_process_tune_and_keeps_its_trials(tmp_path, daemons):
    """Ctrl-C in `rtxops tune` with no daemon ended it at once, and nothing it had measured
    reached the tuning database (through a daemon, the trials so far are kept)."""
    import subprocess

    # a real SIGINT to the tuning process, sent once its first trial has been measured
    driver = textwrap.dedent(f"""
        import os, signal, sys
        from rtxops import cli_evolve
        from rtxops.cli import app

        class Interrupting:
            def __init__(self, quiet): pass
            def __enter__(self):
                def update(p):
                    if p.get("trials", 0) >= 1 and not getattr(self, "sent", False):
                        self.sent = True
                        os.kill(os.getpid(), signal.SIGINT)
                return update
            def __exit__(self, *exc): pass

        cli_evolve._progress = Interrupting
        sys.argv = ["rtxops", "tune", "--op", "gelu", "--bucket", {GELU!r}, "--budget", "40",
                    "--reps", "3", "--warmup", "0", "--json"]
        app()
    """)
    env = {**clean_env(daemons.mark), "RTXOPS_HOME": str(tmp_path / "home")}
    r = subprocess.run([PY, "-c", driver], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 130, r.stderr
    assert "tuning cancelled; its trials so far are in the tuning database" in r.stderr
    report = json.loads(r.stdout)
    (b,) = report["buckets"]
    assert 1 <= b["trials"] < 40
    import duckdb

    con = duckdb.connect(str(tmp_path / "home" / "rtxops.duckdb"), read_only=True)
    stored = con.execute("SELECT count(*) FROM tuning WHERE op = 'gelu'").fetchone()[0]
    con.close()
    assert stored >= 1


def test_tune_refuses_a_bucket_on_no_device_it_tunes_or_of_negative_size(tmp_path, daemons):
    """`float32/gpu/...` and `hidden=-64` were run, exit 0, and a failed reference row for the
    junk bucket was stored."""
    for bucket, said in (("float32/gpu/tanh=0,hidden=64,rows=16", "device 'gpu'"),
                         ("float32/CPU/tanh=0,hidden=64,rows=16", "device 'CPU'"),
                         ("float32/cpu/tanh=0,hidden=-64,rows=16", "hidden=-64 is no size")):
        r = cli("tune", "--op", "gelu", "--bucket", bucket, "--budget", "1", "--reps", "1",
                mark=daemons.mark, cwd=tmp_path, timeout=120)
        assert r.returncode == 2 and said in r.stderr, (bucket, r.returncode, r.stderr)
    assert not (tmp_path / ".rtxops" / "rtxops.duckdb").exists() or "has no rows" in cli(
        "tune", "--show", mark=daemons.mark, cwd=tmp_path).stderr


def test_tune_show_finds_a_bucket_written_in_another_dim_order(tmp_path, daemons):
    """Tuning stores a bucket with its dims in the op's order; --show compared the text as
    typed, so the spelling tuning accepted showed 0 rows."""
    typed = "float32/cpu/rows=16,hidden=64,tanh=0"
    r = cli("tune", "--op", "gelu", "--bucket", typed, "--budget", "2", "--reps", "3",
            "--warmup", "0", "--variant", "eager", mark=daemons.mark, cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stderr
    for args in (["--op", "gelu", "--bucket", typed], ["--bucket", typed]):
        r = cli("tune", "--show", "--json", *args, mark=daemons.mark, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert {(x["bucket"], x["variant"]) for x in json.loads(r.stdout)} == {
            (GELU, "reference"), (GELU, "eager")}, args
    r = cli("tune", "--show", "--json", "--variant", "eager", mark=daemons.mark, cwd=tmp_path)
    assert [x["variant"] for x in json.loads(r.stdout)] == ["eager"]   # --variant was ignored
    r = cli("tune", "--show", "--op", "gelu", "--bucket", "float32/cpu/rows=16", mark=daemons.mark,
            cwd=tmp_path)
    assert r.returncode == 2 and "must give each of" in r.stderr, r.stderr


def test_tune_draws_a_fresh_seed_unless_given_one_and_reports_it(tmp_path, daemons):
    """Every run used seed 0: with a small budget, random search and successive halving tried
    the same few arms run after run and never the others."""
    seeds = []
    for args in (["--seed", "5"], []):
        r = cli("tune", "--op", "gelu", "--bucket", GELU, "--budget", "2", "--reps", "3",
                "--warmup", "0", "--variant", "eager", "--strategy", "random", "--json", *args,
                mark=daemons.mark, cwd=tmp_path, timeout=180)
        assert r.returncode == 0, r.stderr
        seeds.append(json.loads(r.stdout)["seed"])
    assert seeds[0] == 5 and isinstance(seeds[1], int) and seeds[1] != 5
    r = cli("tune", "--op", "gelu", "--seed", "-1", mark=daemons.mark, cwd=tmp_path)
    assert r.returncode == 2 and "--seed must be" in r.stderr
