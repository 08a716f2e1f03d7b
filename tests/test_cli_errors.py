"""Mistakes a user makes at the command line get one clear line and exit 2, never a traceback
(each of these printed one), and are found before any long work starts."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def rtxops(*args: str, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RTXOPS_")}
    return subprocess.run([sys.executable, "-m", "rtxops.cli", *args], capture_output=True,
                          text=True, timeout=120, env={**base, "COLUMNS": "200", **(env or {})},
                          cwd=cwd)


@pytest.mark.parametrize("case", ["ledger export onto a file", "home is a file", "port out of range",
                                  "jobs limit 0", "sweep-out in a missing folder",
                                  "run with a misspelt policies folder",
                                  "daemon with a misspelt policies folder",
                                  "submit with a hang timeout that is not a number",
                                  "run with a name too long and no daemon",
                                  "daemon with an unreadable keyring", "run with an unreadable keyring",
                                  "prune with a malformed store setting",
                                  "dry-run prune with a malformed store setting"])
def test_a_clear_error_and_no_traceback(tmp_path, case):
    afile = tmp_path / "afile"
    afile.write_text("x")
    home = str(tmp_path / "home")
    (tmp_path / "home").mkdir()
    if "keyring" in case:
        (tmp_path / "home" / "keyring.json").write_text("garbage")
    if "prune" in case:
        from rtxops.telemetry.store import Store

        Store(tmp_path / "home" / "rtxops.duckdb").close()
    args, env, said = {
        "ledger export onto a file": (["ledger", "export", str(afile), "--home", home], None, "File exists"),
        "home is a file": (["run", "--", sys.executable, "-c", "pass"], {"RTXOPS_HOME": str(afile)},
                           "File exists"),
        "port out of range": (["daemon", "--port", "99999", "--home", home], None, "65535"),
        "jobs limit 0": (["jobs", "--limit", "0", "--home", home], None, "--limit"),
        "sweep-out in a missing folder": (["tune", "--op", "gelu", "--home", home, "--sweep-out",
                                           str(tmp_path / "missing" / "s.json")], None,
                                          "not a file in an existing folder"),
        # before any job starts (it ran, and was killed when the first plan needed the policies)
        "run with a misspelt policies folder": (
            ["run", "--", sys.executable, "-c", "print('the job ran')"],
            {"RTXOPS_HOME": home, "RTXOPS_POLICIES": str(tmp_path / "polcies")},
            "is not a folder holding policy files"),
        "daemon with a misspelt policies folder": (
            ["daemon", "--port", "0", "--home", home], {"RTXOPS_POLICIES": str(tmp_path / "polcies")},
            "is not a folder holding policy files"),
        "submit with a hang timeout that is not a number": (
            ["submit", "--hang-timeout", "nan", "--home", home, "--", "true"], None,
            "--hang-timeout nan: give a number of seconds above 0"),
        # (a daemon refused it; the one `rtxops run` starts in its own process took it)
        "run with a name too long and no daemon": (
            ["run", "--name", "n" * 300, "--", sys.executable, "-c", "print('the job ran')"],
            {"RTXOPS_HOME": home}, "name: at most 200 characters"),
        # (a traceback, and the store's write-ahead log left behind)
        "daemon with an unreadable keyring": (["daemon", "--port", "0", "--home", home], None,
                                              "keyring.json is unreadable"),
        "run with an unreadable keyring": (
            ["run", "--", sys.executable, "-c", "print('the job ran')"], {"RTXOPS_HOME": home},
            "keyring.json is unreadable"),
        "prune with a malformed store setting": (
            ["telemetry", "prune", "--older-than", "30d", "--home", home],
            {"RTXOPS_STORE_WAL": "bogus"}, "RTXOPS_STORE_WAL"),
        # (a dry run reads the store: the WAL setting is not its business, the memory limit is)
        "dry-run prune with a malformed store setting": (
            ["telemetry", "prune", "--older-than", "30d", "--dry-run", "--home", home],
            {"RTXOPS_STORE_MEMORY": "bogus"}, "RTXOPS_STORE_MEMORY"),
    }[case]
    r = rtxops(*args, env=env, cwd=tmp_path)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and said in " ".join((r.stdout + r.stderr).split()), r.stderr
    assert "the job ran" not in r.stdout and "left no summary" not in r.stderr, r.stdout + r.stderr


def test_reports_on_a_mistyped_home_say_so(tmp_path):
    """`ledger verify --home /nonexistent` said "ledger intact: 0 entries" (exit 0); `keys list`
    on an empty keyring printed nothing."""
    r = rtxops("ledger", "verify", "--home", str(tmp_path / "nonexistent"))
    assert r.returncode == 2 and "no rtxops home at" in " ".join(r.stderr.split()), r.stdout + r.stderr
    r = rtxops("keys", "list", "--home", str(tmp_path / "nonexistent"))
    assert r.returncode == 0 and "no keys trusted in" in " ".join(r.stdout.split()), r.stdout + r.stderr


def test_a_stale_pid_file_naming_another_process_is_not_taken_for_the_daemon(tmp_path):
    """A daemon killed -9 leaves its pid file; the pid may now be another process, even another
    home's daemon: `daemon stop` must not signal it."""
    home = tmp_path / "home"
    home.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "rtxops", "daemon"])
    try:
        (home / "daemon.pid").write_text(f"{other.pid}\n")
        r = rtxops("daemon", "status", "--home", str(home))
        assert r.returncode == 1 and "holds it" not in r.stdout, r.stdout
        r = rtxops("daemon", "stop", "--home", str(home))
        assert r.returncode == 1 and "no daemon serving" in " ".join(r.stderr.split()), r.stderr
        assert other.poll() is None, "another process was signalled"
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("args", [["telemetry", "stats"], ["tune", "--show"],
                                  ["telemetry", "export", "--format", "otlp-json", "-o", "x.json"]])
def test_readers_of_a_duckdb_file_that_is_no_rtxops_store_say_so(tmp_path, args):
    """Read-only commands on a DuckDB file without rtxops' tables (or of another schema
    version) printed DuckDB's CatalogException as a traceback."""
    import duckdb

    home = tmp_path / "home"
    home.mkdir()
    con = duckdb.connect(str(home / "rtxops.duckdb"))
    con.execute("CREATE TABLE t (x INTEGER)")
    con.close()
    r = rtxops(*args, "--home", str(home), cwd=tmp_path)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "is not an rtxops store" in r.stderr, r.stderr


def test_a_daemon_on_a_port_in_use_says_so_and_touches_nothing(tmp_path):
    """uvicorn printed its own error line and exited 3, after the home was set up."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        home = tmp_path / "home"
        r = rtxops("daemon", "--port", str(port), "--home", str(home), env={"RTXOPS_EVOLVE": "0"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"port {port}" in r.stderr and "in use" in r.stderr
    assert not home.exists()


@pytest.mark.parametrize("args", [["telemetry", "stats"],
                                  ["telemetry", "export", "--format", "otlp-json", "-o", "x.json"]])
def test_readers_of_a_damaged_store_say_so_in_a_line(tmp_path, args):
    """`telemetry stats` on a store with damaged blocks printed DuckDB's checksum error as a
    traceback."""
    import time

    from rtxops.telemetry import synthetic
    from rtxops.telemetry.store import Store

    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    path = home / "rtxops.duckdb"
    with Store(path) as store:
        store.write(synthetic.kernel_batch(20000, start_ns=time.time_ns() - 10**11, duration_s=60,
                                           jobs=1, ranks=1, seed=1), timeout=60)
    size = path.stat().st_size
    with open(path, "r+b") as f:      # the header blocks kept: the file opens, its data fails
        for offset in range(size // 4, size, 4096 * 8):
            f.seek(offset)
            f.write(bytes(range(256)))
    r = rtxops(*args, "--home", str(home), cwd=tmp_path)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "cannot read" in r.stderr, r.stderr
