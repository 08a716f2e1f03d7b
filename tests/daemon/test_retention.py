"""The daemon's retention against a real daemon process: it prunes what is older than
``--retention`` by itself, ``rtxops telemetry prune`` goes through it (or to the file when no
daemon runs), and malformed ages are refused with the reason."""
from __future__ import annotations

import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rtxops.daemon.retention import DEFAULT, retention_from
from rtxops.telemetry import otlp, synthetic
from rtxops.telemetry.store import ReadOnlyStore, Store

from .live import cli, until

DAY_NS = 86400 * 10**9


def spans_of(store_path, job_id: str) -> int:
    s = ReadOnlyStore(store_path)
    try:
        return s.query("SELECT count(*) AS n FROM spans WHERE job_id = ?", [job_id])[0]["n"]
    finally:
        s.close()


def write(store: Store, n: int, start_ns: int, job_id: str) -> None:
    body = synthetic.otlp_request(n, seed=3, job_id=job_id, start_ns=start_ns).SerializeToString()
    store.write(otlp.convert(body, otlp.PROTOBUF, start_ns))


def pruned(daemon) -> float:
    text = daemon.client().get("/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == "rtxops_store_rows_pruned":
            return family.samples[0].value
    raise AssertionError("no rtxops_store_rows_pruned metric")


def test_the_daemon_prunes_by_itself_and_the_cli_prunes_through_it_or_the_file(daemons, tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    now = time.time_ns()
    with Store(home / "rtxops.duckdb") as s:
        write(s, 300, now - 20 * DAY_NS, "twenty-days")
        write(s, 300, now - 3 * DAY_NS, "three-days")
        write(s, 300, now - 60 * 10**9, "a-minute")

    d = daemons.start(home, args=("--retention", "10d"))
    until(lambda: pruned(d) > 0, what="the daemon's first prune")
    # through the daemon: a dry run counts, a prune deletes; both need the token
    r = d.client(token=None).post("/v1/telemetry/prune", json={"older_than": "2d"})
    assert r.status_code == 401
    dry = cli("telemetry", "prune", "--older-than", "2d", "--dry-run", "--json", "--home", str(home),
              mark=daemons.mark)
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["rows"]["spans"] == 300
    shown = cli("telemetry", "prune", "--older-than", "2d", "--home", str(home), mark=daemons.mark)
    assert shown.returncode == 0, shown.stderr
    assert "deleted" in shown.stdout and "300" in shown.stdout
    bad = cli("telemetry", "prune", "--older-than", "10 minutes", "--home", str(home), mark=daemons.mark)
    assert bad.returncode == 2 and "not an age" in bad.stderr
    r = d.client().post("/v1/telemetry/prune", json={"older_than": "23h"})
    assert r.status_code == 422 and "1d or more" in r.json()["detail"]
    assert d.terminate() == 0

    store_path = home / "rtxops.duckdb"
    assert spans_of(store_path, "twenty-days") == 0     # the daemon's own prune (10d)
    assert spans_of(store_path, "three-days") == 0      # the CLI's, through the daemon (2d)
    assert spans_of(store_path, "a-minute") == 300

    # no daemon: the CLI prunes the file itself
    with Store(store_path) as s:
        write(s, 200, now - 5 * DAY_NS, "five-days")
    direct = cli("telemetry", "prune", "--older-than", "4d", "--json", "--home", str(home),
                 mark=daemons.mark)
    assert direct.returncode == 0, direct.stderr
    assert json.loads(direct.stdout)["rows"]["spans"] == 200
    assert spans_of(store_path, "five-days") == 0 and spans_of(store_path, "a-minute") == 300


def test_a_malformed_retention_stops_the_daemon_before_it_starts(daemons, tmp_path):
    for value in ("forever", "10m"):
        r = cli("daemon", "--home", str(tmp_path / "h"), "--port", "0", "--retention", value,
                mark=daemons.mark)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "retention" in r.stderr
    assert not (tmp_path / "h" / "rtxops.duckdb").exists()


def test_retention_settings(monkeypatch):
    monkeypatch.delenv("RTXOPS_RETENTION", raising=False)
    assert retention_from(None) == retention_from(DEFAULT) == 30 * 86400
    monkeypatch.setenv("RTXOPS_RETENTION", "OFF")
    assert retention_from(None) is None
    assert retention_from("2d") == 2 * 86400      # the option wins over the environment
    monkeypatch.setenv("RTXOPS_RETENTION", "soon")
    with pytest.raises(ValueError, match="retention: not an age"):
        retention_from(None)


def test_a_dry_run_without_a_daemon_counts_and_writes_nothing(daemons, tmp_path):
    """It opened the store for writing: an older store was migrated for good (an older rtxops
    then refused it) by a command that promises to delete nothing."""
    import duckdb

    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    now = time.time_ns()
    path = home / "rtxops.duckdb"
    with Store(path) as s:
        write(s, 100, now - 5 * DAY_NS, "five-days")
    con = duckdb.connect(str(path))
    con.execute("DELETE FROM schema_version WHERE version = (SELECT max(version) FROM schema_version)")
    con.close()
    before = path.read_bytes()
    r = cli("telemetry", "prune", "--older-than", "4d", "--dry-run", "--home", str(home), mark=daemons.mark)
    assert r.returncode == 1 and "older than this rtxops" in r.stderr, r.stderr
    assert path.read_bytes() == before
    with Store(path):   # brought up to date, as a daemon would
        pass
    r = cli("telemetry", "prune", "--older-than", "4d", "--dry-run", "--json", "--home", str(home),
            mark=daemons.mark)
    assert r.returncode == 0 and json.loads(r.stdout)["rows"]["spans"] == 100, r.stderr
    assert spans_of(path, "five-days") == 100


def test_a_file_that_is_no_store_is_left_as_it_is(daemons, tmp_path):
    """A user's own DuckDB file under RTXOPS_STORE got rtxops' twenty tables from a prune; a
    file that is not DuckDB at all, a traceback."""
    import duckdb

    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    path = home / "rtxops.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE my_data AS SELECT 42 AS answer")
    con.close()
    mode = path.stat().st_mode
    for args in ([], ["--dry-run"]):
        r = cli("telemetry", "prune", "--older-than", "4d", *args, "--home", str(home), mark=daemons.mark)
        assert r.returncode == 1 and "not an rtxops store" in r.stderr, r.stderr
    con = duckdb.connect(str(path), read_only=True)
    assert con.execute("SELECT table_name FROM duckdb_tables()").fetchall() == [("my_data",)]
    con.close()
    assert path.stat().st_mode == mode
    path.write_bytes(b"this is not a database" * 1000)
    r = cli("telemetry", "prune", "--older-than", "4d", "--home", str(home), mark=daemons.mark)
    said = " ".join(r.stderr.split())
    assert r.returncode == 1 and "not a valid DuckDB database file" in said, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 3, r.stderr
