"""``rtxops run`` when it is stopped or its job cannot run: SIGTERM stops the job too (it runs in a
session of its own), Ctrl-C reaches a ``--direct`` job once, the reason a job failed is shown, and
user text is printed as it is (no Rich markup)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.daemon.live import clean_env, marked, until

RTXOPS = [sys.executable, "-m", "rtxops.cli", "run"]

JOB = """
import os, signal, sys, time
hits = []
signal.signal(signal.SIGINT, lambda s, f: hits.append(s))
print("job pid", os.getpid(), flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end and not hits:
    time.sleep(0.01)
time.sleep(0.5)  # a second SIGINT would land here
print("SIGINTs", len(hits), flush=True)
"""


@pytest.fixture
def mark():
    m = uuid.uuid4().hex
    yield m
    left = marked(m)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes outlived the test: {left}"


def start(tmp_path: Path, mark: str, *args: str, group: bool = False) -> tuple[subprocess.Popen, int]:
    (tmp_path / "job.py").write_text(JOB)
    env = clean_env(mark, RTXOPS_HOME=str(tmp_path / "home"))
    p = subprocess.Popen([*RTXOPS, "--no-summary", *args, "--", sys.executable, "job.py", "60"],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, stdin=subprocess.DEVNULL, process_group=0 if group else None)
    line = ""
    while "job pid" not in line:
        line = p.stdout.readline()
        assert line or p.poll() is None, p.stderr.read()
    return p, int(line.split()[2])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_to_rtxops_run_stops_its_job(tmp_path, mark, signum):
    p, job = start(tmp_path, mark)
    p.send_signal(signum)
    assert p.wait(60) == 128 + signum
    until(lambda: job not in marked(mark), timeout=15, what="the job to end")
    assert "cancelled job" in p.stderr.read()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_to_a_direct_run_reaches_its_job(tmp_path, mark, signum):
    """SIGHUP (a closed terminal, a scheduler) ended `rtxops run --direct` and left its job."""
    p, job = start(tmp_path, mark, "--direct")
    p.send_signal(signum)
    assert p.wait(60) == 128 + signum
    until(lambda: job not in marked(mark), timeout=15, what="the job to end")


def test_ctrl_c_reaches_a_direct_job_once(tmp_path, mark):
    p, job = start(tmp_path, mark, "--direct", group=True)
    os.killpg(p.pid, signal.SIGINT)  # what a terminal does: the whole foreground group
    out, _ = p.communicate(timeout=60)
    assert "SIGINTs 1" in out and p.returncode == 0


def test_a_sigint_sent_to_rtxops_alone_reaches_the_direct_job_when_repeated(tmp_path, mark):
    p, job = start(tmp_path, mark, "--direct", group=True)
    p.send_signal(signal.SIGINT)  # the job shares the group: this one could have reached it too
    time.sleep(0.3)
    assert p.poll() is None
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=60)
    assert "SIGINTs 1" in out


def test_the_reason_a_job_failed_is_shown(tmp_path, mark):
    env = clean_env(mark, RTXOPS_HOME=str(tmp_path / "home"))
    r = subprocess.run([*RTXOPS, "--", "no-such-command-here"], capture_output=True, text=True,
                       env=env, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 127
    assert "failed: cannot start 'no-such-command-here'" in " ".join(r.stderr.split())


def test_user_text_is_printed_as_it_is(tmp_path, mark):
    env = clean_env(mark, RTXOPS_HOME=str(tmp_path / "home"))
    for path in ("/tmp/[x]/p.json", "/tmp/[/x]/p.json"):
        r = subprocess.run([*RTXOPS, "--plan", path, "--", "true"], capture_output=True, text=True,
                           env=env, timeout=60, stdin=subprocess.DEVNULL)
        assert r.returncode == 2 and f"plan {path} does not exist" in r.stderr, r.stderr
