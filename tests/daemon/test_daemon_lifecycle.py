"""A real daemon process (``rtxops daemon --port 0 --home H``): jobs submitted over HTTP and through the
CLI run, their logs and exit codes are stored, cancel kills them, and SIGTERM stops the daemon
cleanly (jobs see SIGTERM, exit status 0, the store flushed and readable afterwards)."""
from __future__ import annotations

import json
import os
import stat

from rtxops.telemetry.store import ReadOnlyStore

from .live import cli, gone, marked, otlp_batch, script, until

TALK = """
    import sys, time
    print("out one", flush=True)
    print("err one", file=sys.stderr, flush=True)
    time.sleep(0.3)
    print("out two", flush=True)
    sys.exit(int(sys.argv[1]))
"""

# Prints "ready", then waits for SIGTERM; on SIGTERM says so, takes `delay` seconds, exits 0.
PATIENT = """
    import signal, sys, time
    delay = float(sys.argv[1])
    def on_term(signum, frame):
        print("got SIGTERM", flush=True)
        time.sleep(delay)
        print("bye", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
"""


def test_token_file_and_http_submit_logs_and_exit_codes(daemon, tmp_path):
    token_file = daemon.home / "token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert len(daemon.token) >= 32

    talk = script(tmp_path, "talk.py", TALK)
    ok = daemon.submit(["python", talk, "0"], name="talker")
    bad = daemon.submit(["python", talk, "3"])
    assert ok["id"].startswith("j-") and ok["id"] != bad["id"] and ok["name"] == "talker"
    assert "token" not in ok, "the job's process-tracking token is never shown"

    ok, bad = daemon.wait(ok["id"]), daemon.wait(bad["id"])
    assert ok["state"] == "succeeded" and ok["exit_code"] == 0
    assert bad["state"] == "failed" and bad["exit_code"] == 3
    assert bad["attempts"][0]["outcome"] == "crashed" and "code 3" in bad["attempts"][0]["detail"]

    lines = daemon.logs(ok["id"])
    assert [ln["text"] for ln in lines if ln["stream"] == "stdout"] == ["out one", "out two"]
    assert [ln["text"] for ln in lines if ln["stream"] == "stderr"] == ["err one"]
    assert [ln["seq"] for ln in lines] == list(range(1, len(lines) + 1))
    assert all(ln["job_id"] == ok["id"] and ln["rank"] == 0 and ln["attempt"] == 1 for ln in lines)
    page = daemon.client().get(f"/v1/jobs/{ok['id']}/logs", params={"after": lines[0]["seq"]}).json()
    assert page["done"] and page["state"] == "succeeded"
    assert [ln["text"] for ln in page["lines"]] == [ln["text"] for ln in lines[1:]]
    assert daemon.texts(bad["id"], "stdout") == ["out one", "out two"]

    kinds = [e["kind"] for e in daemon.client().get(f"/v1/jobs/{bad['id']}/events").json()["events"]]
    assert kinds[:3] == ["submitted", "started", "exited"]
    listed = daemon.client().get("/v1/jobs").json()
    assert listed["total"] == 2 and [j["id"] for j in listed["jobs"]] == [bad["id"], ok["id"]]


def test_cli_submit_jobs_logs_cancel_and_stop(daemon, tmp_path):
    home, mark = str(daemon.home), daemon.mark
    r = cli("daemon", "status", "--home", home, mark=mark)
    assert r.returncode == 0 and daemon.url in r.stdout and str(daemon.pid) in r.stdout, r.stdout + r.stderr
    # the home given before the subcommand (as the README writes it) is the subcommand's home
    r = cli("daemon", "--home", home, "status", mark=mark, cwd=tmp_path)
    assert r.returncode == 0 and daemon.url in r.stdout, r.stdout + r.stderr
    r = cli("daemon", "--home", home, "status", "--home", str(tmp_path), mark=mark)
    assert r.returncode == 2 and "two homes given" in r.stderr, r.stdout + r.stderr

    patient = script(tmp_path, "patient.py", PATIENT)
    r = cli("submit", "--home", home, "--name", "patient", "--", "python", patient, "0", mark=mark,
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    assert job_id.startswith("j-")
    r = cli("submit", "--home", home, "--", "python", "-c", "import sys; print('four'); sys.exit(4)",
            mark=mark)
    assert r.returncode == 0, r.stderr
    quick = r.stdout.strip()

    until(lambda: "ready" in daemon.texts(job_id), 60, what="the job to print ready")
    r = cli("logs", job_id, "--home", home, mark=mark)
    assert r.returncode == 0 and r.stdout.splitlines() == ["ready"], r.stdout + r.stderr
    r = cli("logs", job_id, "--rank", "0", "--home", home, mark=mark)
    assert r.returncode == 0 and r.stdout.splitlines() == ["ready"], r.stdout + r.stderr
    r = cli("logs", job_id, "--rank", "7", "--home", home, mark=mark)  # not silence: a wrong rank
    assert r.returncode == 1 and "has no rank 7: it runs rank 0" in r.stderr, r.stdout + r.stderr
    r = cli("logs", quick, "--follow", "--home", home, mark=mark)  # follows until the job ends
    assert r.returncode == 0 and r.stdout.splitlines() == ["four"], r.stdout + r.stderr

    r = cli("jobs", "--home", home, mark=mark)
    assert r.returncode == 0, r.stderr
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[1:-1]]
            for line in r.stdout.splitlines() if "│" in line and "j-" in line}
    assert rows[job_id][1:3] == ["patient", "running"], r.stdout
    assert rows[quick][2] == "failed" and rows[quick][5] == "4", r.stdout

    pid = daemon.job(job_id)["attempts"][0]["pid"]
    r = cli("cancel", job_id, "--home", home, mark=mark)
    assert r.returncode == 0 and r.stdout.split() == [job_id, "cancelling"], r.stdout + r.stderr
    job = daemon.wait(job_id, 30)
    assert job["state"] == "cancelled" and job["reason"] == "cancelled by request"
    assert job["attempts"][0]["outcome"] == "cancelled"
    assert gone(pid)
    r = cli("logs", job_id, "--follow", "--home", home, mark=mark)
    assert r.stdout.splitlines() == ["ready", "got SIGTERM", "bye"], "the job saw SIGTERM"

    r = cli("cancel", "j-00000000", "--home", home, mark=mark)
    assert r.returncode == 1 and "404" in r.stderr and "j-00000000" in r.stderr

    r = cli("daemon", "--home", home, "stop", mark=mark, cwd=tmp_path)
    assert r.returncode == 0 and f"stopped daemon {daemon.pid}" in r.stdout, r.stdout + r.stderr
    assert daemon.proc.wait(10) == 0
    r = cli("daemon", "status", "--home", home, mark=mark)
    assert r.returncode == 1 and "no daemon serving" in r.stdout
    r = cli("submit", "--home", home, "--", "python", "-c", "pass", mark=mark)
    assert r.returncode == 1 and "no daemon is running" in r.stderr


def test_sigterm_stops_jobs_gracefully_exits_0_and_flushes_the_store(daemon, tmp_path):
    patient = script(tmp_path, "patient.py", PATIENT)
    job = daemon.submit(["python", patient, "2.5"], grace_s=20)
    until(lambda: "ready" in daemon.texts(job["id"]), 60, what="the job to print ready")
    pid = daemon.job(job["id"])["attempts"][0]["pid"]
    request, span_ids = otlp_batch(40, seed=1, job_id="sigterm-ingest")
    assert daemon.ingest(request).status_code == 200
    probe = daemon.client()

    daemon.proc.send_signal(15)
    # while the job takes its time to stop, the daemon says it is not ready and takes no new jobs
    ready = until(lambda: (r := probe.get("/readyz")).status_code == 503 and r.json(), 10,
                  what="/readyz to answer 503")
    assert ready == {"ready": False, "problems": ["the daemon is stopping"]}
    refused = probe.post("/v1/jobs", json={"command": ["python", "-c", "pass"]})
    assert refused.status_code == 503 and "shutting down" in refused.json()["detail"]
    assert daemon.proc.wait(60) == 0, daemon.output()

    assert gone(pid) and marked(daemon.mark) == []
    assert not (daemon.home / "daemon.pid").exists() and not (daemon.home / "daemon.url").exists()
    events = [json.loads(line) for line in daemon.output().splitlines() if line.startswith("{")]
    assert [e.get("event") for e in events][-1] == "stopped"

    store = ReadOnlyStore(daemon.home / "rtxops.duckdb")  # the daemon released it: flushed and closed
    try:
        row = store.query("SELECT state, record FROM jobs WHERE job_id = ?", [job["id"]])[0]
        record = json.loads(row["record"])
        assert row["state"] == "cancelled" and record["reason"] == "daemon shut down"
        assert record["attempts"][0]["outcome"] == "cancelled"
        texts = [r["text"] for r in store.query(
            "SELECT text FROM job_logs WHERE job_id = ? ORDER BY seq", [job["id"]])]
        assert texts == ["ready", "got SIGTERM", "bye"], "the job saw SIGTERM and stopped in its grace"
        exited = [json.loads(r["detail"]) for r in store.query(
            "SELECT detail FROM job_events WHERE job_id = ? AND kind = 'exited'", [job["id"]])]
        assert [e["outcome"] for e in exited] == ["cancelled"]
        stored = {r["span_id"] for r in store.query(
            "SELECT span_id FROM spans WHERE job_id = 'sigterm-ingest'")}
        assert stored == span_ids
    finally:
        store.close()
    assert not os.path.exists(daemon.home / "rtxops.duckdb.wal"), "checkpointed on the way out"


def test_a_home_whose_daemon_died_is_not_served_by_the_daemon_now_at_its_port(daemons, tmp_path):
    """Home A's daemon was killed; its URL and pid files stayed, and home B's daemon has its port
    now. Nothing for home A talks to B, and `stop` signals no process it did not ask."""
    import subprocess
    import signal as signals

    b = daemons.start(tmp_path / "homeB")
    home_a = tmp_path / "homeA"
    home_a.mkdir()
    stranger = subprocess.Popen(["sleep", "60"])  # the dead daemon's pid, reused
    try:
        (home_a / "daemon.url").write_text(b.url + "\n")
        (home_a / "daemon.pid").write_text(f"{stranger.pid}\n")
        (home_a / "token").write_text(b.token + "\n")
        status = cli("daemon", "status", "--home", str(home_a), mark=b.mark)
        assert status.returncode == 1 and "no daemon serving" in status.stdout, status.stdout
        stop = cli("daemon", "stop", "--home", str(home_a), mark=b.mark)
        assert stop.returncode == 1 and "Traceback" not in stop.stderr, stop.stderr
        assert stranger.poll() is None  # not signalled
        assert b.running()
        serving = cli("daemon", "status", "--home", str(b.home), mark=b.mark)
        assert serving.returncode == 0 and f"pid {b.pid}" in serving.stdout, serving.stdout
    finally:
        stranger.send_signal(signals.SIGKILL)
        stranger.wait()


def test_run_direct_refuses_a_home_a_daemon_serves(daemon, tmp_path):
    """The daemon holds the home's store: a --direct job's telemetry could not be written (a
    warning, an empty summary, exit 0). Now refused before the job starts."""
    import subprocess

    from .live import RTXOPS, clean_env

    ran = tmp_path / "ran"
    r = subprocess.run([*RTXOPS, "run", "--direct", "--", "python", "-c", f"open({str(ran)!r}, 'w')"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env=clean_env(daemon.mark, RTXOPS_HOME=str(daemon.home)))
    assert r.returncode == 2 and "holds its store" in " ".join(r.stderr.split()), r.stderr
    assert not ran.exists()


def test_a_daemon_that_does_not_answer_is_named_and_can_be_stopped(daemon, tmp_path):
    """A stopped (SIGSTOP) or hung daemon: status said "no daemon", stop could not stop it, and
    `rtxops run` died with DuckDB's lock error as a traceback."""
    import signal
    import subprocess

    from .live import RTXOPS, clean_env

    home, mark = str(daemon.home), daemon.mark
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        r = cli("daemon", "status", "--home", home, mark=mark)
        assert r.returncode == 1 and f"process {daemon.pid} holds it" in " ".join(r.stdout.split()), r.stdout
        r = subprocess.run([*RTXOPS, "run", "--", "python", "-c", "pass"], capture_output=True,
                           text=True, timeout=120, cwd=tmp_path,
                           env=clean_env(mark, RTXOPS_HOME=home))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"daemon process {daemon.pid} holds it but does not answer" in " ".join(r.stderr.split())
        r = cli("daemon", "stop", "--home", home, mark=mark)
        assert r.returncode == 0 and f"stopped daemon {daemon.pid}" in r.stdout, r.stdout + r.stderr
    finally:
        if daemon.running():
            os.kill(daemon.pid, signal.SIGCONT)


def test_ctrl_c_at_logs_follow_exits_as_interrupted_and_leaves_the_job(daemon, tmp_path):
    """`rtxops logs J -f` stopped with Ctrl-C exited 0, as if the job's output had ended."""
    import signal
    import subprocess
    import time

    from .live import RTXOPS, clean_env

    r = cli("submit", "--home", str(daemon.home), "--", "python", "-c",
            "import time; print('up', flush=True); time.sleep(600)", mark=daemon.mark)
    job_id = r.stdout.strip()
    until(lambda: "up" in daemon.texts(job_id), 60, what="the job's first line")
    follower = subprocess.Popen([*RTXOPS, "logs", job_id, "-f", "--home", str(daemon.home)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=clean_env(daemon.mark))
    assert follower.stdout.readline().strip() == "up"
    time.sleep(0.5)
    follower.send_signal(signal.SIGINT)
    assert follower.wait(30) == 130
    assert daemon.job(job_id)["state"] == "running"


def test_sigterm_does_not_wait_for_a_client_that_stalls_mid_request(daemon):
    """A client that sent a request's headers and no body holds its request open for the
    receiver's 30 s body timeout; SIGTERM stops the daemon within its 5 s grace for requests in
    flight, and the store closes after the server stopped answering (exit 0, file readable)."""
    import socket
    import time
    from urllib.parse import urlsplit

    url = urlsplit(daemon.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                     b"Authorization: Bearer " + daemon.token.encode() + b"\r\n"
                     b"Content-Length: 100000\r\n\r\n" + b"\0" * 10)
        time.sleep(0.5)  # the receiver is now waiting for the body
        started = time.monotonic()
        assert daemon.terminate(60) == 0, daemon.output()
        took = time.monotonic() - started
    assert took < 20, f"SIGTERM took {took:.1f} s with a stalled request open"
    assert '"event": "stopped"' in daemon.output()
    store = ReadOnlyStore(daemon.home / "rtxops.duckdb")
    try:
        assert store.query("SELECT count(*) AS n FROM ingest_batches") == [{"n": 0}]
    finally:
        store.close()


def test_ctrl_c_while_a_followed_job_waits_to_restart_cancels_it(daemon, tmp_path):
    """Ctrl-C at `rtxops run` is sent to the job's processes; when the job has none (it waits
    out a restart's backoff, or to start), the Ctrl-C cancels it rather than going nowhere."""
    import signal
    import subprocess
    import sys
    import textwrap

    from .live import clean_env

    job = daemon.submit(["python", "-c", "import sys; sys.exit(3)"], restarts=3, backoff_s=600)
    until(lambda: daemon.job(job["id"])["state"] == "restarting", 60, what="the restart's backoff")
    follower = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import os, signal, threading
            from rtxops.cli import _follow
            from rtxops.daemon.client import DaemonClient
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
            print("exit", _follow(DaemonClient({daemon.url!r}, {daemon.token!r}), {job["id"]!r},
                                  cancel_on_interrupt=True), flush=True)
        """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=clean_env(daemon.mark))
    out, err = follower.communicate(timeout=60)
    assert "cancelled job" in err and "SIGINT sent" not in err, err
    assert daemon.wait(job["id"], 30)["state"] == "cancelled"
    assert out.strip() == f"exit {128 + signal.SIGINT}"


def test_a_daemon_that_cannot_write_its_address_exits_with_the_reason(daemons, tmp_path):
    """On a full disk the thread that writes daemon.url died with a traceback, and a daemon no
    client could find went on serving (and holding the store)."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "daemon.url").mkdir()          # what cannot be written, as a full disk would refuse it
    r = cli("daemon", "--home", str(home), "--port", "0", mark=daemons.mark, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    logged = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
    assert any(e.get("event") == "cannot_announce" and "daemon.url" in e["error"] for e in logged), r.stderr


def test_a_followed_job_whose_reader_went_away_is_cancelled(daemon, tmp_path):
    """`rtxops run ... | head -2` exited 1 in silence and left the job running unseen."""
    import subprocess

    from .live import RTXOPS, clean_env

    reader = subprocess.Popen(["head", "-2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    run = subprocess.Popen([*RTXOPS, "run", "--no-summary", "--", "python", "-c",
                            "import time\nfor i in range(600): print('tick', i, flush=True); "
                            "time.sleep(0.1)"],
                           stdout=reader.stdin, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                           env=clean_env(daemon.mark, RTXOPS_HOME=str(daemon.home)))
    reader.stdin.close()
    assert reader.stdout.read().split() == [b"tick", b"0", b"tick", b"1"]
    assert run.wait(60) == 141, run.stderr.read()
    job = daemon.client().get("/v1/jobs", params={"limit": 1}).json()["jobs"][0]
    assert daemon.wait(job["id"], 30)["state"] == "cancelled"


def test_job_ids_are_listed_whole_in_80_columns(daemon, tmp_path):
    """Piped, `rtxops jobs` is 80 columns wide: ids came out as "j-dd5c8…", and states as
    "succeed…" (`rtxops jobs | grep succeeded` found none)."""
    import subprocess

    from .live import RTXOPS, clean_env

    job = daemon.submit(["python", "-c", "pass"], name="a rather long name " * 3)
    daemon.wait(job["id"])
    env = {**clean_env(daemon.mark), "COLUMNS": "80"}
    r = subprocess.run([*RTXOPS, "jobs", "--home", str(daemon.home)], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 0 and job["id"] in r.stdout, r.stdout
    assert "succeeded" in r.stdout, r.stdout


def test_a_stale_address_answered_by_another_server_is_no_daemon(tmp_path):
    """A /healthz that answers JSON other than an object (another program now at the port) made
    every command fail with an AttributeError traceback."""
    import http.server
    import threading

    from rtxops.daemon.client import DaemonClient
    from rtxops.daemon.home import Home

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'"ok"'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        home = Home(tmp_path / "home").ensure()
        home.url_file.write_text(f"http://127.0.0.1:{server.server_address[1]}\n")
        assert DaemonClient.find(home) is None
        r = cli("jobs", "--home", str(home.root), mark="none")
        assert r.returncode != 0 and "Traceback" not in r.stderr and "no daemon" in r.stderr, r.stderr
    finally:
        server.shutdown()


def test_a_follower_learns_how_its_job_ended_when_the_daemon_is_stopped(daemon, tmp_path):
    """`rtxops daemon stop` cancels the jobs; `rtxops run` following one that missed the end
    (here: paused meanwhile) waited the whole reconnect time, said the job "may still be running
    unsupervised" and exited 2."""
    import signal
    import subprocess
    import time

    from .live import RTXOPS, clean_env

    run = subprocess.Popen([*RTXOPS, "run", "--no-summary", "--", "python", "-c",
                            "import time\nprint('up', flush=True)\ntime.sleep(600)"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                           env=clean_env(daemon.mark, RTXOPS_HOME=str(daemon.home),
                                         RTXOPS_RECONNECT_S="60"))
    assert run.stdout.readline().strip() == "up"
    run.send_signal(signal.SIGSTOP)
    r = cli("daemon", "stop", "--home", str(daemon.home), mark=daemon.mark)
    assert r.returncode == 0, r.stderr
    run.send_signal(signal.SIGCONT)
    started = time.monotonic()
    code = run.wait(60)
    stderr = " ".join(run.stderr.read().split())
    assert code == 143 and "cancelled" in stderr and "unsupervised" not in stderr, (code, stderr)
    assert time.monotonic() - started < 30


def test_a_job_id_is_never_read_as_a_path(daemon):
    """`rtxops logs 'x/../j-b'` showed j-b's logs: the id went into the URL as it was."""
    import pytest

    from rtxops.daemon.client import DaemonClient, DaemonError

    job = daemon.submit(["python", "-c", "print('mine')"])
    daemon.wait(job["id"])
    client = DaemonClient(daemon.url, daemon.token)
    assert client.job(job["id"])["id"] == job["id"]
    for other in (f"x/../{job['id']}", f"x%2F..%2F{job['id']}", ".."):
        with pytest.raises(DaemonError):
            client.job(other)
