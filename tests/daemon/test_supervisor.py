"""The job supervisor with real processes: logs, exit codes, cancel, crashes, hangs, shutdown, torchrun."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from rtxops.daemon import proctree, recent_logs
from rtxops.daemon.errors import JobNotFound, JobSpecError, SupervisorClosed
from rtxops.daemon.exits import OomCounters
from rtxops.daemon.jobs import LAUNCHER_RANK, Attempt, InMemoryJobSink, Job, JobSpec, JobState, Outcome
from rtxops.daemon.supervisor import Supervisor

PY = sys.executable
MARK = "RTXOPS_TEST_MARK"


def marked(mark: str) -> list[int]:
    """Live processes whose environment carries the test's mark."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for p in proctree.scan().values():
        try:
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0") and p.alive:
                    found.append(p.pid)
        except OSError:
            pass
    return found


def gone(pid: int) -> bool:
    p = proctree.read_proc(pid)
    return p is None or not p.alive


def until(predicate, timeout: float = 10.0, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {predicate}")


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def events(sup: Supervisor, job_id: str, kind: str) -> list[tuple[int, dict]]:
    return [(e.ts_ns, json.loads(e.detail)) for e in sup.events(job_id) if e.kind == kind]


@pytest.fixture
def mark() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def sink() -> InMemoryJobSink:
    return InMemoryJobSink()


@pytest.fixture
def sup(tmp_path, sink, mark):
    s = Supervisor(sink, tmp_path / "work", extra_env={MARK: mark}, tick_s=0.02, log_poll_s=0.02)
    yield s
    s.shutdown(grace_s=0.5)
    leftovers = marked(mark)
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"processes outlived the supervisor: {leftovers}"


def spec(*command: str, **kw) -> JobSpec:
    kw.setdefault("runtime", False)
    kw.setdefault("grace_s", 0.5)
    return JobSpec(command=command, **kw)


def test_submit_runs_stores_logs_and_exit_codes(sup, tmp_path):
    body = script(tmp_path, "talk.py", """
        import sys, time
        print("out one")
        print("err one", file=sys.stderr)
        time.sleep(0.5)
        print("out two")
        sys.exit(int(sys.argv[1]))
    """)
    before = time.time_ns()
    ok = sup.submit(spec(PY, body, "0", name="talker"))
    bad = sup.submit(spec(PY, body, "3"))
    assert ok.state in (JobState.PENDING, JobState.RUNNING) and ok.id.startswith("j-") and ok.id != bad.id
    ok, bad = sup.wait(ok.id, 10), sup.wait(bad.id, 10)
    after = time.time_ns()

    assert ok.state is JobState.SUCCEEDED and ok.exit_code == 0 and ok.name == "talker"
    assert bad.state is JobState.FAILED and bad.exit_code == 3
    assert bad.attempt.outcome is Outcome.CRASHED and "code 3" in bad.attempt.detail
    lines = sup.logs(ok.id)
    assert [(ln.stream, ln.text) for ln in lines if ln.stream == "stdout"] == [("stdout", "out one"),
                                                                               ("stdout", "out two")]
    assert [ln.text for ln in lines if ln.stream == "stderr"] == ["err one"]
    assert [ln.seq for ln in lines] == sorted({ln.seq for ln in lines}) and lines[0].seq == 1
    assert all(before <= ln.ts_ns <= after and ln.rank == 0 and ln.attempt == 1 for ln in lines)
    out = [ln for ln in lines if ln.stream == "stdout"]
    assert out[1].ts_ns - out[0].ts_ns >= 200_000_000, "timestamps are taken as lines arrive"
    assert [ln.text for ln in sup.logs(ok.id, after_seq=lines[0].seq)] == [ln.text for ln in lines[1:]]
    assert [j.id for j in sup.jobs()] == [ok.id, bad.id]


def test_job_runs_with_the_runtime_and_daemon_environment(sup, tmp_path):
    body = script(tmp_path, "env.py", """
        import os
        from rtxops.runtime import patching
        print("enabled", patching.active() is not None)
        for k in ("RTXOPS_JOB_ID", "RTXOPS_JOB_ATTEMPT", "RTXOPS_TEST_MARK", "MINE"):
            print(k, os.environ.get(k))
    """)
    job = sup.wait(sup.submit(spec(PY, body, runtime=True, env={"MINE": "yes", "RTXOPS_TELEMETRY": "off"})).id,
                   60)
    assert job.state is JobState.SUCCEEDED, sup.logs(job.id)
    text = {ln.text for ln in sup.logs(job.id)}
    assert {"enabled True", f"RTXOPS_JOB_ID {job.id}", "RTXOPS_JOB_ATTEMPT 1", "MINE yes"} <= text
    assert any(t.startswith("RTXOPS_TEST_MARK ") and t != "RTXOPS_TEST_MARK None" for t in text)


def followed(sup: Supervisor, job_id: str) -> list[str]:
    """The job's lines as a follower gets them, to the job's end."""
    seen, after = [], 0
    while True:
        lines = sup.wait_for_logs(job_id, after_seq=after, timeout=5)
        if not lines:
            return seen
        seen += [ln.text for ln in lines]
        after = lines[-1].seq


def test_follow_returns_new_lines_then_ends(sup, tmp_path):
    body = script(tmp_path, "slow.py", """
        import time
        for i in range(3):
            print("line", i)
            time.sleep(0.15)
    """)
    job = sup.submit(spec(PY, body))
    seen = followed(sup, job.id)
    assert seen == ["line 0", "line 1", "line 2"]
    assert sup.job(job.id).state is JobState.SUCCEEDED


class _CountingSink(InMemoryJobSink):
    def __init__(self) -> None:
        super().__init__()
        self.reads = self.empty_reads = 0

    def read_logs(self, job_id, **kw):
        lines = super().read_logs(job_id, **kw)
        self.reads += 1
        self.empty_reads += not lines
        return lines


def test_a_follower_caught_up_costs_the_sink_no_read_until_a_line_is_stored(tmp_path, mark,
                                                                            monkeypatch):
    monkeypatch.setattr(recent_logs, "MAX_BYTES", 0)   # no line held in memory: the sink answers
    sink = _CountingSink()
    s = Supervisor(sink, tmp_path / "work", extra_env={MARK: mark}, tick_s=0.02, log_poll_s=0.02)
    try:
        body = script(tmp_path, "slow.py", """
            import time
            for i in range(4):
                print("line", i, flush=True)
                time.sleep(0.3)
        """)
        job = s.submit(spec(PY, body))
        seen = followed(s, job.id)
        assert seen == [f"line {i}" for i in range(4)]
        # the wake-ups between lines (state changes, the other stream) read nothing: the empty
        # reads are the last one, once the job has ended, and at most one woken between a line's
        # numbering and its write (before, each wait for a line began with one: 7 in a run)
        assert sink.empty_reads <= 2, (sink.reads, sink.empty_reads)
    finally:
        s.shutdown(grace_s=0.5)


def test_a_follower_of_a_running_job_gets_its_lines_from_memory(tmp_path, mark):
    sink = _CountingSink()
    s = Supervisor(sink, tmp_path / "work", extra_env={MARK: mark}, tick_s=0.02, log_poll_s=0.02)
    try:
        body = script(tmp_path, "chatty.py", """
            import sys, time
            for i in range(30):
                print("line", i, flush=True)
                if i % 10 == 0:
                    print("err", i, file=sys.stderr, flush=True)
                time.sleep(0.01)
        """)
        job = s.submit(spec(PY, body))
        seen = followed(s, job.id)
        assert [t for t in seen if t.startswith("line")] == [f"line {i}" for i in range(30)]
        assert [t for t in seen if t.startswith("err")] == ["err 0", "err 10", "err 20"]
        # (one may come between a line's numbering and its write, when another event wakes
        # the follower; from the sink, 17 in a run)
        assert sink.reads <= 2, sink.reads
        # and what the sink has is what the follower got
        assert [ln.text for ln in sink.read_logs(job.id, after_seq=0)] == seen
    finally:
        s.shutdown(grace_s=0.5)


def test_cancel_kills_the_whole_tree_including_escaped_grandchildren(sup, tmp_path):
    pids = tmp_path / "pids"
    child = script(tmp_path, "child.py", """
        import os, signal, sys, time
        pidfile = sys.argv[1]

        def record():
            with open(pidfile, "a") as f:
                f.write(f"{os.getpid()}\\n")

        def grandchild(new_session, ignore_term):
            if os.fork() == 0:
                if new_session:
                    os.setsid()
                if os.fork() == 0:
                    if ignore_term:
                        signal.signal(signal.SIGTERM, signal.SIG_IGN)
                    record()
                    time.sleep(600)
                os._exit(0)
            os.wait()

        grandchild(False, False)
        grandchild(True, False)
        grandchild(True, True)
        record()
        time.sleep(600)
    """)
    parent = script(tmp_path, "parent.py", f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, {child!r}, {str(pids)!r}])
        time.sleep(600)
    """)
    job = sup.submit(spec(PY, parent, grace_s=0.5, max_crash_restarts=3))
    tree = until(lambda: pids.is_file() and len(pids.read_text().split()) == 4 and pids.read_text().split())
    tree = [int(p) for p in tree] + [sup.job(job.id).attempt.pid]
    assert not any(gone(p) for p in tree)
    assert len({proctree.read_proc(p).sid for p in tree}) == 3, "two grandchildren left the job's session"

    t0 = time.monotonic()
    assert sup.cancel(job.id).state is JobState.CANCELLING
    assert time.monotonic() - t0 < 0.2, "cancel does not block"
    job = sup.wait(job.id, 10)
    assert job.state is JobState.CANCELLED and len(job.attempts) == 1
    assert job.attempt.outcome is Outcome.CANCELLED
    assert [p for p in tree if not gone(p)] == []
    assert sup.cancel(job.id).state is JobState.CANCELLED


def test_crash_is_restarted_within_backoff_then_fails(sup, tmp_path):
    body = script(tmp_path, "crash.py", """
        import sys
        print("crashing")
        sys.exit(2)
    """)
    job = sup.wait(sup.submit(spec(PY, body, max_crash_restarts=2, backoff_s=0.2)).id, 15)
    assert job.state is JobState.FAILED and job.crash_restarts == 2 and len(job.attempts) == 3
    assert "crash restart budget (2) spent" in job.reason
    assert all(a.outcome is Outcome.CRASHED and a.exit_code == 2 for a in job.attempts)
    for n, (prev, nxt) in enumerate(zip(job.attempts, job.attempts[1:])):
        gap = (nxt.started_at_ns - prev.ended_at_ns) / 1e9
        assert 0.2 * 2 ** n - 0.01 <= gap <= 0.2 * 2 ** n + 1.0, (n, gap)
    assert [ln.attempt for ln in sup.logs(job.id)] == [1, 2, 3]
    assert [d["delay_s"] for _, d in events(sup, job.id, "restart_scheduled")] == [0.2, 0.4]


def test_hang_is_detected_stacks_stored_and_restarted(sup, tmp_path):
    body = script(tmp_path, "hang.py", """
        import time
        def stuck_in_here():
            time.sleep(600)
        print("started", flush=True)
        stuck_in_here()
    """)
    timeout = 0.5
    job = sup.submit(spec(PY, body, hang_timeout_s=timeout, max_hang_restarts=1, backoff_s=0.1))
    until(lambda: any(ln.text == "started" for ln in sup.logs(job.id)))
    last_beat = 0
    for step in range(1, 6):
        assert sup.heartbeat(job.id, step, rank=0)
        last_beat = time.time_ns()
        time.sleep(timeout / 4)
    assert sup.job(job.id).state is JobState.RUNNING and sup.job(job.id).last_step == 5

    job = sup.wait(job.id, 15)
    assert job.state is JobState.FAILED and job.hang_restarts == 1 and len(job.attempts) == 2
    assert all(a.outcome is Outcome.HUNG for a in job.attempts)
    assert "hang restart budget (1) spent" in job.reason
    hung = events(sup, job.id, "hung")
    assert len(hung) == 2
    assert (hung[0][0] - last_beat) / 1e9 <= 2 * timeout, "detected within 2 x the hang timeout"
    assert hung[0][1]["ranks_that_stepped"] == [0] and hung[1][1]["ranks_that_stepped"] == []
    started = [ts for ts, _ in events(sup, job.id, "started")]
    assert (hung[1][0] - started[1]) / 1e9 <= 2 * timeout, "an attempt that never steps hangs too"
    dumps = events(sup, job.id, "stacks")
    assert len(dumps) == 2
    for _, d in dumps:
        assert d["method"] in ("py-spy", "faulthandler")
        if d["method"] == "py-spy":
            assert any("stuck_in_here" in text for text in d["stacks"].values()), d


def test_external_sigkill_and_sigsegv_are_decoded(sup, tmp_path):
    sleeper = script(tmp_path, "sleep.py", """
        import time
        print("ready", flush=True)
        time.sleep(600)
    """)
    segv = script(tmp_path, "segv.py", """
        import os, signal
        os.kill(os.getpid(), signal.SIGSEGV)
    """)
    job = sup.submit(spec(PY, sleeper))
    until(lambda: sup.logs(job.id))
    os.kill(sup.job(job.id).attempt.pid, signal.SIGKILL)
    job = sup.wait(job.id, 10)
    assert job.state is JobState.FAILED and job.attempt.signal == "SIGKILL"
    if job.attempt.outcome is Outcome.CRASHED:
        assert "not sent by rtxops" in job.attempt.detail and "possibly the OOM killer" in job.attempt.detail
    else:
        assert job.attempt.outcome is Outcome.OOM and "oom_kill +" in job.attempt.detail

    crashed = sup.wait(sup.submit(spec(PY, segv)).id, 10)
    assert crashed.attempt.outcome is Outcome.CRASHED and crashed.attempt.signal == "SIGSEGV"
    assert "segmentation fault" in crashed.attempt.detail and crashed.exit_code is None


def test_shutdown_stops_every_job_and_leaves_no_process(tmp_path, mark):
    stubborn = script(tmp_path, "stubborn.py", """
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("ready", flush=True)
        time.sleep(600)
    """)
    s = Supervisor(InMemoryJobSink(), tmp_path / "work", extra_env={MARK: mark}, tick_s=0.02)
    jobs = [s.submit(spec(PY, stubborn, grace_s=30)) for _ in range(2)]
    until(lambda: len(marked(mark)) == 6)  # per job: its waiter, itself, its child
    t0 = time.monotonic()
    s.shutdown(grace_s=0.5)
    assert time.monotonic() - t0 < 5, "shutdown's grace wins over the jobs' longer ones"
    assert marked(mark) == []
    assert all(s.job(j.id).state is JobState.CANCELLED for j in jobs)
    detail = s.job(jobs[0].id).attempt.detail
    assert "killed by SIGKILL" in detail and "not sent by rtxops" not in detail, detail
    assert s.job(jobs[0].id).reason == "daemon shut down"
    with pytest.raises(SupervisorClosed):
        s.submit(spec(PY, stubborn))


def test_failed_status_probes_never_fail_a_job(sup, tmp_path, monkeypatch):
    def broken(*a, **kw):
        raise OSError("probe broke")

    monkeypatch.setattr(OomCounters, "read", classmethod(lambda cls: broken()))
    monkeypatch.setattr(proctree, "terminate", broken)
    body = script(tmp_path, "fine.py", "print('fine')\n")
    job = sup.wait(sup.submit(spec(PY, body)).id, 10)
    assert job.state is JobState.SUCCEEDED and job.crash_restarts == 0
    assert {d["probe"] for _, d in events(sup, job.id, "probe_error")} == {"oom_counters", "leftovers"}


def test_unknown_jobs_and_bad_specs(sup):
    for call in (sup.job, sup.cancel, sup.logs, sup.events):
        with pytest.raises(JobNotFound, match="j-nope"):
            call("j-nope")
    assert sup.heartbeat("j-nope", 1) is False
    with pytest.raises(JobSpecError, match="nproc_per_node"):
        spec(PY, "x.py", nproc_per_node=0)
    with pytest.raises(JobSpecError, match="command"):
        spec()
    with pytest.raises(JobSpecError, match="python -m MODULE"):
        sup.submit(spec(PY, "-c", "print(1)", nproc_per_node=2))
    failed = sup.wait(sup.submit(spec("/nonexistent/binary")).id, 5)
    assert failed.state is JobState.FAILED and failed.attempt.outcome is Outcome.START_FAILED
    assert failed.attempt.exit_code == 127 and "/nonexistent/binary" in failed.reason
    # a job that never started leaves no folder behind (removed just after its state is set)
    until(lambda: not Path(failed.log_dir).exists())


def test_recovered_jobs_are_readopted_or_lost(tmp_path, sink, mark):
    logs = tmp_path / "work" / "j-0000adop"
    logs.mkdir(parents=True)
    token = "j-0000adop.feedfacefeedface"
    out = open(logs / "attempt-1.stdout", "wb")
    err = open(logs / "attempt-1.stderr", "wb")
    out.write(b"stored before the restart\n")
    out.flush()
    body = script(tmp_path, "survivor.py", """
        import time
        time.sleep(0.3)
        print("written after the restart", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([PY, body], stdout=out, stderr=err, start_new_session=True,
                            env={**os.environ, MARK: mark, proctree.TOKEN_VARIABLE: token})
    now = time.time_ns()
    alive = Job(id="j-0000adop", spec=spec(PY, body), state=JobState.RUNNING, created_at_ns=now,
                updated_at_ns=now, token=token, log_dir=str(logs), log_seq=1,
                attempts=[Attempt(1, now, pid=proc.pid, start_ticks=proctree.read_proc(proc.pid).start_ticks,
                                  log_offsets={"stdout": len(b"stored before the restart\n")})])
    dead = Job(id="j-0000dead", spec=spec(PY, body), state=JobState.RUNNING, created_at_ns=now,
               updated_at_ns=now, token="j-0000dead.0", log_dir=str(tmp_path / "gone"),
               attempts=[Attempt(1, now, pid=2 ** 22 + 7, start_ticks=1)])
    done = Job(id="j-0000done", spec=spec(PY, body), state=JobState.SUCCEEDED, created_at_ns=now,
               updated_at_ns=now, token="j-0000done.0", log_dir=str(tmp_path / "gone"))
    recovered = [Job.from_dict(json.loads(json.dumps(j.to_dict()))) for j in (alive, dead, done)]
    s = Supervisor(sink, tmp_path / "work", recovered_jobs=recovered, tick_s=0.02, log_poll_s=0.02)
    try:
        assert s.job("j-0000dead").state is JobState.LOST
        assert s.job("j-0000dead").attempt.outcome is Outcome.LOST
        assert s.job("j-0000done").state is JobState.SUCCEEDED
        adopted = s.job("j-0000adop")
        assert adopted.state is JobState.RUNNING and adopted.adopted
        assert s.heartbeat("j-0000adop", 7, rank=0)
        line = until(lambda: s.logs("j-0000adop"))
        assert [(ln.seq, ln.text) for ln in line] == [(2, "written after the restart")]
        s.cancel("j-0000adop")
        job = s.wait("j-0000adop", 10)
        assert job.state is JobState.CANCELLED and job.last_step == 7
        until(lambda: proc.poll() is not None, 5)
        assert proc.returncode == -signal.SIGTERM
    finally:
        s.shutdown(grace_s=0.5)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
        err.close()
    assert marked(mark) == []


def test_two_rank_torchrun_job_stores_each_ranks_lines_and_cancels_every_rank(sup, tmp_path, mark):
    body = script(tmp_path, "ranks.py", """
        import os, sys, time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        print(f"hello from rank {rank} of {dist.get_world_size()} pid {os.getpid()}", flush=True)
        print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
        dist.barrier()
        time.sleep(600)
    """)
    job = sup.submit(spec(PY, body, nproc_per_node=2, grace_s=2))
    until(lambda: len(sup.logs(job.id, rank=1)) == 2 and len(sup.logs(job.id, rank=0)) == 2, 60)
    workers = []
    for rank in (0, 1):
        mine = {(ln.stream, ln.text.rsplit(" pid ", 1)[0]) for ln in sup.logs(job.id, rank=rank)}
        assert mine == {("stdout", f"hello from rank {rank} of 2"), ("stderr", f"stderr of rank {rank}")}
        workers += [int(ln.text.rsplit(" pid ", 1)[1]) for ln in sup.logs(job.id, rank=rank)
                    if ln.stream == "stdout"]
    lines = sup.logs(job.id)
    assert all(ln.rank == LAUNCHER_RANK for ln in lines if not ln.text.startswith(("hello", "stderr of")))
    launcher = sup.job(job.id).attempt.pid
    assert all(proctree.read_proc(w).sid != launcher for w in workers), "torchrun gives workers sessions"

    job = sup.wait(sup.cancel(job.id).id, 20)
    assert job.state is JobState.CANCELLED
    assert all(gone(w) for w in workers + [launcher]) and marked(mark) == []
    assert not list((tmp_path / "work").glob(f"{job.id}/torchrun-*")), "torchrun's own log files removed"


def test_a_process_no_saved_attempt_owns_is_killed_on_recovery(tmp_path, sink, mark):
    """The previous daemon died between starting an attempt and saving it: the process carries
    the job's token, and the recovered job (no attempt) must not leave it running unowned. The
    job itself starts afresh."""
    token = "j-0000lost.feedfacefeedface"
    body = script(tmp_path, "unsaved.py", "import time\ntime.sleep(600)\n")
    proc = subprocess.Popen([PY, body], start_new_session=True,
                            env={**os.environ, MARK: mark, proctree.TOKEN_VARIABLE: token})
    until(lambda: proctree.carries_token(proc.pid, token), 10)
    now = time.time_ns()
    pending = Job(id="j-0000lost", spec=spec(PY, body), state=JobState.PENDING, created_at_ns=now,
                  updated_at_ns=now, token=token, log_dir=str(tmp_path / "logs"))
    s = Supervisor(sink, tmp_path / "work", recovered_jobs=[pending], tick_s=0.02, log_poll_s=0.02)
    try:
        until(lambda: proc.poll() is not None, 10)
        assert proc.returncode == -signal.SIGKILL or proc.returncode == -signal.SIGTERM
        started = until(lambda: s.job("j-0000lost").attempt, 10)
        assert started.number == 1 and started.pid != proc.pid
        assert s.job("j-0000lost").state is JobState.RUNNING
    finally:
        s.shutdown(grace_s=0.5)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_periodic_views_copy_no_job(tmp_path, sink, monkeypatch):
    """The evolve loop (every 2 s), /metrics and the job list page asked for copies of every job
    ever run, under the lock heartbeats from the ingest path wait on: with thousands of finished
    jobs that held the lock for seconds. ``running``, ``tally`` and ``page`` copy at most a page."""
    now = time.time_ns()
    recovered = [Job(id=f"j-{i:08x}", spec=spec(PY, "-c", "pass"), state=JobState.SUCCEEDED,
                     created_at_ns=now + i, updated_at_ns=now + i, token=f"j-{i:08x}.0",
                     log_dir=str(tmp_path / "gone"), crash_restarts=i % 2) for i in range(50)]
    s = Supervisor(sink, tmp_path / "work", recovered_jobs=recovered, tick_s=0.02, log_poll_s=0.02)
    copies = []
    real_copy = Job.copy
    monkeypatch.setattr(Job, "copy", lambda self: copies.append(self.id) or real_copy(self))
    try:
        assert s.running() == {}
        assert s.tally() == ({"succeeded": 50}, 25, 0)
        assert copies == []
        total, page = s.page(offset=5, limit=10)
        assert total == 50 and [j.id for j in page] == [f"j-{i:08x}" for i in range(44, 34, -1)]
        assert len(copies) == 10
    finally:
        s.shutdown(grace_s=0.5)


def test_a_job_stopped_by_a_signal_sent_on_request_is_not_restarted(sup, tmp_path):
    """Ctrl-C at `rtxops run` reaches the job as SIGINT through the daemon: its death from it
    was a crash to restart (the job came back after the user stopped it)."""
    body = script(tmp_path, "busy.py", """
        import time
        print("ready", flush=True)
        time.sleep(600)
    """)
    job = sup.submit(spec(PY, body, max_crash_restarts=2))
    until(lambda: [ln for ln in sup.logs(job.id) if ln.text == "ready"], 30)
    assert sup.signal(job.id, signal.SIGINT, stop=True)
    done = sup.wait(job.id, 30)
    assert done.state is JobState.CANCELLED and done.crash_restarts == 0, (done.state, done.reason)
    assert "stopped by SIGINT" in done.reason and len(done.attempts) == 1
    assert done.attempts[0].signal == "SIGINT" or done.attempts[0].exit_code == 130


def test_a_crash_after_a_signal_the_job_handled_is_restarted(sup, tmp_path):
    """A signal sent without asking to stop (SIGHUP to reload, here) is no stop: the job handles
    it and goes on, and a later crash is restarted as any crash."""
    body = script(tmp_path, "reloads.py", """
        import signal, sys, time
        signal.signal(signal.SIGHUP, lambda *_: print("reloaded", flush=True))
        print("ready", flush=True)
        time.sleep(1.0)
        sys.exit(3)
    """)
    job = sup.submit(spec(PY, body, max_crash_restarts=1))
    until(lambda: [ln for ln in sup.logs(job.id) if ln.text == "ready"], 30)
    sup.signal(job.id, signal.SIGHUP)
    done = sup.wait(job.id, 60)
    assert done.state is JobState.FAILED and done.crash_restarts == 1, (done.state, done.reason)


def test_a_restarted_job_counts_steps_on_from_the_last_one_reported(sup, tmp_path):
    """Steps are named (job, step) in the telemetry, the evolve loop's windows and plans'
    effective steps: a restart must not count from 0 again over the steps before it."""
    body = script(tmp_path, "steps.py", """
        import os, sys, time, torch
        from rtxops.runtime import patching
        lin = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(lin.parameters(), 0.1)
        print("first step", patching.active().step + 1, flush=True)
        for _ in range(3):
            lin(torch.randn(2, 4)).sum().backward()
            opt.step()
        print("last step", patching.active().step, flush=True)
        if os.environ["RTXOPS_JOB_ATTEMPT"] == "1":
            while not os.path.exists(sys.argv[1]):  # its telemetry arrives while it runs
                time.sleep(0.02)
            sys.exit(3)
    """)
    crash = tmp_path / "crash-now"
    job = sup.submit(spec(PY, body, str(crash), runtime=True, max_crash_restarts=1, backoff_s=0.1,
                          env={"RTXOPS_TELEMETRY": "off"}))
    until(lambda: "last step 3" in [ln.text for ln in sup.logs(job.id)], 60)
    assert sup.heartbeat(job.id, 3)  # what the telemetry of its steps tells the daemon
    crash.touch()
    job = sup.wait(job.id, 60)
    assert job.state is JobState.SUCCEEDED and len(job.attempts) == 2, sup.logs(job.id)
    texts = [(ln.attempt, ln.text) for ln in sup.logs(job.id)]
    assert texts == [(1, "first step 1"), (1, "last step 3"), (2, "first step 4"), (2, "last step 6")]


def test_a_restart_counts_on_from_steps_whose_telemetry_was_still_queued(tmp_path, mark):
    """The attempt's last steps were received but not yet committed when it ended (no heartbeat
    from them yet): the restart reads the store, behind those batches, and counts on from them."""
    from rtxops.daemon.job_sink import DuckDBJobSink
    from rtxops.telemetry import synthetic
    from rtxops.telemetry.otlp import PROTOBUF, convert
    from rtxops.telemetry.store import Store, prepared

    store = Store(tmp_path / "rtxops.duckdb")
    s = Supervisor(DuckDBJobSink(store), tmp_path / "work", extra_env={MARK: mark}, tick_s=0.02,
                   log_poll_s=0.02)
    try:
        body = script(tmp_path, "steps.py", """
            import os, sys, time
            from rtxops.runtime import patching
            print("first step", patching.active().step + 1, flush=True)
            if os.environ["RTXOPS_JOB_ATTEMPT"] == "1":
                while not os.path.exists(sys.argv[1]):
                    time.sleep(0.02)
                sys.exit(3)
        """)
        crash = tmp_path / "crash-now"
        job = s.submit(spec(PY, body, str(crash), runtime=True, max_crash_restarts=1, backoff_s=0.1,
                            env={"RTXOPS_TELEMETRY": "off"}))
        until(lambda: "first step 1" in [ln.text for ln in s.logs(job.id)], 60)
        request = synthetic.otlp_request(200, job_id=job.id)  # steps 0-4 of the job
        store.submit(prepared(convert(request.SerializeToString(), PROTOBUF, time.time_ns())))
        crash.touch()
        job = s.wait(job.id, 60)
        assert [ln.text for ln in s.logs(job.id)] == ["first step 1", "first step 5"]
    finally:
        s.shutdown(grace_s=0.5)
        store.close()


def test_a_cancel_while_a_restart_reads_the_store_starts_no_new_attempt(tmp_path, mark):
    import threading

    reading = threading.Event()

    class SlowStore(InMemoryJobSink):
        def last_step(self, job_id):
            reading.set()
            time.sleep(1.0)  # a store busy with queued batches
            return 7

    s = Supervisor(SlowStore(), tmp_path / "work", extra_env={MARK: mark}, tick_s=0.02,
                   log_poll_s=0.02)
    try:
        body = script(tmp_path, "crash.py", "import sys; sys.exit(3)")
        job = s.submit(spec(PY, body, max_crash_restarts=3, backoff_s=0.1))
        assert reading.wait(30)
        s.cancel(job.id)
        job = s.wait(job.id, 30)
        assert job.state is JobState.CANCELLED and len(job.attempts) == 1, job.attempts
    finally:
        s.shutdown(grace_s=0.5)


def test_a_working_folder_gone_before_a_restart_is_a_start_failure(sup, tmp_path):
    """The folder is checked at submit; one removed while the job ran makes its restart fail to
    start (exit 127, said so), not a supervisor error."""
    work = tmp_path / "cwd"
    work.mkdir()
    body = script(tmp_path, "leave.py", f"""
        import shutil, sys
        shutil.rmtree({str(work)!r})
        sys.exit(1)
    """)
    with pytest.raises(JobSpecError, match="is not a directory"):
        sup.submit(spec(PY, body, cwd=str(tmp_path / "nowhere")))
    job = sup.wait(sup.submit(spec(PY, body, cwd=str(work), max_crash_restarts=1,
                                   backoff_s=0.1)).id, 20)
    assert job.state is JobState.FAILED and "supervisor error" not in job.reason, job.reason
    assert [a.outcome for a in job.attempts] == [Outcome.CRASHED, Outcome.START_FAILED]


def test_a_restart_cancelled_in_its_backoff_is_not_counted(sup, tmp_path):
    """The restart was counted when scheduled: a job cancelled while waiting out the backoff
    showed one restart more than happened."""
    body = script(tmp_path, "crash.py", """
        import sys
        sys.exit(2)
    """)
    job = sup.submit(spec(PY, body, max_crash_restarts=5, backoff_s=30))
    deadline = time.monotonic() + 15
    while sup.job(job.id).state is not JobState.RESTARTING:
        assert time.monotonic() < deadline, "no restart was scheduled"
        time.sleep(0.02)
    sup.cancel(job.id)
    job = sup.wait(job.id, 15)
    assert job.state is JobState.CANCELLED and len(job.attempts) == 1
    assert job.crash_restarts == 0


def test_a_job_in_its_own_folder_sees_it_as_its_pwd(sup, tmp_path):
    """`rtxops submit` from a folder ran the job there with the daemon's $PWD: scripts writing to
    $PWD wrote into the daemon's folder."""
    folder = tmp_path / "dir with space é"
    folder.mkdir()
    body = script(tmp_path, "pwd.py", """
        import os
        print(os.getcwd() == os.environ["PWD"], os.environ["PWD"])
    """)
    job = sup.wait(sup.submit(spec(PY, body, cwd=str(folder))).id, 15)
    assert [ln.text for ln in sup.logs(job.id)] == [f"True {folder}"]
