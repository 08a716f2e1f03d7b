"""The supervisor under conditions found in a review: a job's pid reused by an unrelated session
after a daemon restart, a log store slower than the drain wait, a large log backlog, and an empty
token file."""
from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
from pathlib import Path

from rtxops.daemon import logtail, proctree, supervisor as supervisor_mod
from rtxops.daemon.auth import require_token
from rtxops.daemon.home import Home
from rtxops.daemon.jobs import Attempt, InMemoryJobSink, Job, JobSpec, JobState, Outcome
from rtxops.daemon.supervisor import Supervisor

from .test_supervisor import events, until


def test_a_reused_pid_leading_another_session_is_not_adopted_nor_killed(tmp_path):
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        ticks = until(lambda: proctree.read_proc(stranger.pid)).start_ticks
        # a saved job whose attempt had this pid once, in an earlier life of the number
        old = Job(id="j-0ld0", spec=JobSpec(command=("python", "train.py"), runtime=False),
                  state=JobState.RUNNING, created_at_ns=1, updated_at_ns=1, token="j-0ld0.beef",
                  log_dir=str(tmp_path / "logs"),
                  attempts=[Attempt(number=1, started_at_ns=1, pid=stranger.pid, start_ticks=ticks - 999)])
        sup = Supervisor(InMemoryJobSink(), tmp_path / "work", recovered_jobs=[old], tick_s=0.02)
        try:
            job = sup.job(old.id)
            assert job.state is JobState.LOST and not job.adopted, job.reason
            sup.cancel(old.id)
            time.sleep(0.3)
            assert stranger.poll() is None  # still running: it was never the job's
        finally:
            sup.shutdown(grace_s=0.5)
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


class SlowOnceSink(InMemoryJobSink):
    """Storing the first batch of lines takes ``delay_s`` (a busy store)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def log_lines(self, *args, **kwargs):
        delay, self.delay_s = self.delay_s, 0.0
        time.sleep(delay)
        return super().log_lines(*args, **kwargs)


def test_a_slow_log_store_never_loses_the_last_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(supervisor_mod, "LOG_DRAIN_S", 0.3)
    sup = Supervisor(SlowOnceSink(1.5), tmp_path / "work", tick_s=0.02, log_poll_s=0.02)
    try:
        job = sup.submit(JobSpec(command=("sh", "-c", "echo first; sleep 0.3; echo last-words; exit 3"),
                                 runtime=False, grace_s=0.5))
        assert sup.wait(job.id, 20).state is JobState.FAILED
        # the drain wait ran out: the files stay for the tail, which stores the rest
        assert events(sup, job.id, "logs_pending")
        until(lambda: [ln.text for ln in sup.logs(job.id)] == ["first", "last-words"], timeout=10)
    finally:
        sup.shutdown(grace_s=0.5)


def test_a_large_backlog_is_read_in_bounded_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(logtail, "READ_CHUNK_BYTES", 1000)
    path = tmp_path / "out"
    expected = [f"line {i:05d} " + "x" * (i % 37) for i in range(2000)]
    path.write_text("".join(t + "\n" for t in expected) + "unterminated")
    batches: list[int] = []
    got: list[str] = []

    def on_lines(stream, lines):
        batches.append(sum(len(t) + 1 for _, _, t in lines))
        got.extend(t for _, _, t in lines)

    tail = logtail.LogTail({"stdout": path}, on_lines, poll_s=0.01).start()
    assert tail.stop(10)
    assert got == expected + ["unterminated"]  # lines across chunk edges come out whole
    assert len(batches) > 50 and max(batches) <= 1000 + logtail.MAX_LINE_BYTES


def test_an_empty_token_file_gets_a_real_token_and_an_empty_token_checks_nothing(tmp_path):
    home = Home(tmp_path / "home").ensure()
    home.token_file.write_text("  \n")
    assert home.token() is None  # a client finds no token
    token = home.token(create=True)  # the daemon makes one
    assert token and home.token() == token
    assert os.stat(home.token_file).st_mode & 0o777 == 0o600
    with pytest.raises(ValueError, match="empty bearer token"):
        require_token("")


def _make_token(root, barrier, out):
    barrier.wait(30)
    out.put(Home(root).token(create=True))


def test_two_daemons_starting_at_once_on_a_new_home_keep_one_token(tmp_path):
    """Each wrote its own: the one that won the store served with a token not in the file (the
    loser wrote last), and every CLI write got 401."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    for i in range(20):
        root = tmp_path / f"home{i}"
        barrier, out = ctx.Barrier(2), ctx.Queue()
        starts = [ctx.Process(target=_make_token, args=(root, barrier, out)) for _ in range(2)]
        for p in starts:
            p.start()
        try:
            for p in starts:
                p.join(30)
            tokens = {out.get(timeout=10), out.get(timeout=10)}
        finally:   # a child stuck on a lock it inherited must not hold the worker's exit
            for p in starts:
                if p.is_alive():
                    p.kill()
                    p.join()
        assert tokens == {Home(root).token()}, i
        assert sorted(p.name for p in root.iterdir()) == ["jobs", "plans", "token"]


def test_a_token_the_disk_cannot_take_names_its_file_and_leaves_no_temporary_one(tmp_path):
    """On a full disk (here: a file-size limit of 8 bytes, so the write itself fails) the daemon
    said "No space left on device" with no path, and left ``token.<pid>.tmp`` behind."""
    script = textwrap.dedent("""
        import pathlib, resource, signal, sys
        from rtxops.daemon.home import Home
        home = Home(pathlib.Path(sys.argv[1])).ensure()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8, 8))
        try:
            home.token(create=True)
        except OSError as e:
            print(e.filename, e.strerror, sep="|")
    """)
    home = tmp_path / "home"
    out = subprocess.run([sys.executable, "-c", script, str(home)], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    filename, message = out.split("|")
    assert filename == str(home / "token") and "cannot write the daemon's token" in message, out
    assert sorted(p.name for p in home.iterdir()) == ["jobs", "plans"]


def test_a_flood_of_output_is_stored_up_to_the_budget_then_followed_by_size_only(tmp_path, monkeypatch):
    """Past ``max_bytes`` of a stream (checked per chunk read) the tail says so once and stores no
    more lines; it keeps following the file's size, so a restart resumes after what it skipped."""
    monkeypatch.setattr(logtail, "READ_CHUNK_BYTES", 1024)
    path = tmp_path / "attempt-1.stdout"
    path.write_bytes(b"".join(b"line %06d\n" % i for i in range(5000)))  # 60 000 bytes
    got: list[str] = []

    def on_lines(stream, lines):
        got.extend(t for _, _, t in lines)

    tail = logtail.LogTail({"stdout": path}, on_lines, poll_s=0.01, max_bytes=1000).start()
    until(lambda: any("past 1000 bytes" in t for t in got), 10)
    with open(path, "ab") as f:
        f.write(b"more\n" * 1000)
    until(lambda: tail.committed_offsets()["stdout"] == path.stat().st_size, 10)
    assert tail.stop(10)
    assert len(got) == 1 + got.index(next(t for t in got if "past 1000 bytes" in t))  # the note is last
    assert got[0] == "line 000000" and len(got) <= 1 + (1000 + 1024) // 12 + 1


def test_long_lines_are_stored_in_pieces_cut_on_characters_with_their_rank(tmp_path, monkeypatch):
    """A 100 kB line (a tensor printed whole, tqdm's "\\r" updates) is stored in pieces below
    DuckDB's 4 KiB inline strings (whole lines of a mebibyte ran the store out of memory); a
    line is cut between UTF-8 characters, and under torchrun every piece keeps the rank its
    first piece named."""
    path = tmp_path / "out"
    got: list[tuple[int, str]] = []
    path.write_bytes(("x" * 100_000 + "\n" + "€" * 40_000 + "\n").encode())
    tail = logtail.LogTail({"stdout": path}, lambda s, lines: got.extend((r, t) for _, r, t in lines),
                           poll_s=0.01).start()
    assert tail.stop(10)
    assert max(len(t.encode()) for _, t in got) <= logtail.MAX_LINE_BYTES < 4096
    xs = [t for _, t in got if t.startswith("x")]
    assert "".join(xs) == "x" * 100_000 and "".join(t for _, t in got if "€" in t) == "€" * 40_000

    monkeypatch.setattr(logtail, "MAX_LINE_BYTES", 16)
    monkeypatch.setattr(logtail, "READ_CHUNK_BYTES", 7)
    got.clear()
    path.write_bytes(b"[rank1]:" + ("€" * 20).encode() + b"\n[rank0]:short\n"
                     + b"[rank1]:" + b"y" * 12 + b"\n")
    tail = logtail.LogTail({"stdout": path}, lambda s, lines: got.extend((r, t) for _, r, t in lines),
                           poll_s=0.01, torchrun=True).start()
    assert tail.stop(10)
    assert "\ufffd" not in "".join(t for _, t in got)
    assert {r for r, t in got if "€" in t} == {1}
    assert "".join(t for _, t in got if "€" in t) == "€" * 20
    assert [(r, t) for r, t in got if "€" not in t] == [(0, "short"), (1, "y" * 8), (1, "y" * 4)]

    got.clear()                                 # a CRLF whose "\r" falls past the cut
    path.write_bytes(b"a" * 16 + b"\r\nnext\n")
    tail = logtail.LogTail({"stdout": path}, lambda s, lines: got.extend((r, t) for _, r, t in lines),
                           poll_s=0.01).start()
    assert tail.stop(10)
    assert got == [(0, "a" * 16), (0, "next")]


class FullDiskSink(InMemoryJobSink):
    """Refuses every write while ``full`` is set (a store on a full disk)."""

    def __init__(self) -> None:
        super().__init__()
        self.full = False

    def _check(self) -> None:
        if self.full:
            raise OSError(28, "No space left on device")

    def job_saved(self, job):
        self._check()
        return super().job_saved(job)

    def log_lines(self, *args, **kwargs):
        self._check()
        return super().log_lines(*args, **kwargs)

    def event(self, *args, **kwargs):
        self._check()
        return super().event(*args, **kwargs)


def test_what_a_full_store_refused_is_stored_once_it_takes_writes_again(tmp_path, monkeypatch):
    """Log lines, job records and events the store refused were dropped for good: the stored
    record said `running` for a job that had failed, and lines were missing from its log."""
    monkeypatch.setattr(supervisor_mod, "RESAVE_S", 0.1)
    sink = FullDiskSink()
    sup = Supervisor(sink, tmp_path / "work", tick_s=0.02, log_poll_s=0.02)
    go = tmp_path / "go"
    try:
        job = sup.submit(JobSpec(command=("sh", "-c", f"echo one; while [ ! -e {go} ]; do sleep 0.02; "
                                          "done; echo two; echo three; exit 3"), runtime=False,
                                 grace_s=0.5))
        until(lambda: [ln.text for ln in sup.logs(job.id)] == ["one"])
        # the running record is saved apart from the log: the store fills once it has it
        until(lambda: sink.jobs.get(job.id, {}).get("state") == "running")
        sink.full = True
        go.touch()
        assert sup.wait(job.id, 20).state is JobState.FAILED
        assert sink.jobs[job.id]["state"] == "running"     # what the full store kept
        time.sleep(0.3)
        sink.full = False
        until(lambda: sink.jobs[job.id]["state"] == "failed", timeout=10)
        until(lambda: [ln.text for ln in sup.logs(job.id)] == ["one", "two", "three"], timeout=10)
        # and the attempt's output files go once their lines are stored (they stayed for good)
        until(lambda: not list(Path(sup.job(job.id).log_dir).glob("attempt-1.std*")), timeout=10)
        kinds = [e.kind for e in sup.events(job.id)]
        assert kinds.count("exited") == 1 and "logs_pending" in kinds, kinds
        assert kinds.index("logs_stored") > kinds.index("logs_pending"), kinds
    finally:
        sup.shutdown(grace_s=0.5)


def test_a_crash_on_a_full_disk_says_the_disk_is_full(tmp_path, monkeypatch):
    """A job whose output files' disk filled up dies on its next print with nothing in its
    stderr: the crash said only "exited with code 120"."""
    real = supervisor_mod.shutil.disk_usage
    monkeypatch.setattr(supervisor_mod.shutil, "disk_usage",   # the disk of the job's files
                        lambda path: real(path)._replace(free=4096))
    sup = Supervisor(InMemoryJobSink(), tmp_path / "work", tick_s=0.02, log_poll_s=0.02)
    try:
        job = sup.wait(sup.submit(JobSpec(command=("sh", "-c", "exit 120"), runtime=False)).id, 20)
        assert job.state is JobState.FAILED
        assert "exited with code 120" in job.reason and "is full (4096 bytes free)" in job.reason, job.reason
    finally:
        sup.shutdown(grace_s=0.5)


def test_a_hundred_mebibytes_of_progress_updates_are_stored_and_read_back(tmp_path):
    """tqdm writing to a file: "\\r" updates, no newline, 1 MiB pieces. After ~90 MB the store
    (96 MB of memory) failed every commit, the job's logs answered 500, and `rtxops run` died."""
    from rtxops.telemetry import store_jobs
    from rtxops.telemetry.store import Store

    update = "\r" + " 42%|████▏     | 420/1000 [00:42<00:58, 10.00it/s]"
    path = tmp_path / "out"
    with path.open("w") as f:
        for _ in range(100 << 20 >> 16):
            f.write(update * (65536 // len(update.encode())))
    with Store(tmp_path / "s.duckdb") as store:
        seq = [0]

        def on_lines(stream, lines):
            store_jobs.append_logs(store, "job-a", 1, 0, stream,
                                   [(ts, seq[0] + i + 1, text) for i, (ts, _, text) in enumerate(lines)])
            seq[0] += len(lines)
            return seq[0]

        tail = logtail.LogTail({"stdout": path}, on_lines, poll_s=0.01).start()
        assert tail.stop(120)
        # (a piece's trailing "\r" is cut off, as a CRLF's is)
        stored = store.query("SELECT sum(strlen(replace(text, chr(13), ''))) AS n FROM job_logs")[0]["n"]
        assert stored == len(path.read_bytes().replace(b"\r", b""))
        page = store_jobs.read_logs(store, "job-a", after_seq=seq[0] // 2, limit=1000)
        assert len(page) == 1000


def test_a_home_open_to_others_is_made_private(tmp_path):
    """DuckDB writes the store's log (``.wal``) with the umask's mode (0644) whatever the store
    file's mode, and the store holds the jobs' environments: a home another command or the user
    made open (0755) stayed open, and every local user could read the tokens in that log."""
    root = tmp_path / "home"
    root.mkdir()
    os.chmod(root, 0o755)
    Home(root).ensure()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    fresh = Home(tmp_path / "a" / "new-home").ensure()
    assert stat.S_IMODE(fresh.root.stat().st_mode) == 0o700


def test_a_store_in_a_folder_others_may_enter_says_so(tmp_path, caplog):
    import shutil

    from rtxops.telemetry.store import Store

    shared = Path(tempfile.mkdtemp(prefix="rtxops-shared-", dir="/tmp"))   # /tmp: o+x
    try:
        os.chmod(shared, 0o755)
        with caplog.at_level(logging.WARNING, logger="rtxops.telemetry.store"):
            Store(shared / "s.duckdb").close()
            assert "open to other users" in caplog.text
            caplog.clear()
            inner = tmp_path / "inner"            # 0755, inside a folder others cannot enter
            inner.mkdir(mode=0o755)
            Store(inner / "s.duckdb").close()
            Store(tmp_path / "made-here" / "s.duckdb").close()   # a folder the store makes
            assert not caplog.text
    finally:
        shutil.rmtree(shared)
    assert stat.S_IMODE((tmp_path / "made-here").stat().st_mode) == 0o700


def test_a_job_lost_while_no_daemon_watched_has_its_last_lines_stored_and_its_files_removed(tmp_path):
    """A job killed with its waiter while the daemon was down (a reboot, the OOM killer): the
    lines it wrote after the last ones stored (its traceback, often) were never read, and its
    output files stayed for good."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "attempt-1.stdout").write_text("step 1\nstep 2\nTraceback: boom\n")
    (logs / "attempt-1.stderr").write_text("")
    old = Job(id="j-0ld1", spec=JobSpec(command=("python", "train.py"), runtime=False),
              state=JobState.RUNNING, created_at_ns=1, updated_at_ns=1, token="j-0ld1.beef",
              log_dir=str(logs), attempts=[Attempt(number=1, started_at_ns=1, pid=gone.pid)])
    sup = Supervisor(InMemoryJobSink(), tmp_path / "work", recovered_jobs=[old], tick_s=0.02)
    try:
        assert sup.job(old.id).state is JobState.LOST
        until(lambda: [ln.text for ln in sup.logs(old.id)] == ["step 1", "step 2", "Traceback: boom"])
        until(lambda: not logs.exists())
    finally:
        sup.shutdown(grace_s=0.5)


@pytest.mark.parametrize("outcome, restarts, state, attempts", [
    (Outcome.SUCCEEDED, 2, JobState.SUCCEEDED, 1),
    (Outcome.CRASHED, 0, JobState.FAILED, 1),
    (Outcome.CRASHED, 1, JobState.SUCCEEDED, 2),
])
def test_a_job_saved_running_with_its_attempt_ended_is_decided_not_run_again(
        tmp_path, outcome, restarts, state, attempts):
    """The record saved last holds the attempt's end but not the state that follows (the store
    refused that save, or the daemon died between the two): the next daemon decides it as the
    runner would have. It resumed such a job as if a restart were due: a job that had succeeded
    ran again."""
    ran = tmp_path / "ran"
    old = Job(id="j-0d0e", spec=JobSpec(command=("sh", "-c", f"echo x >> {ran}"), runtime=False,
                                         max_crash_restarts=restarts, backoff_s=0.01),
              state=JobState.RUNNING, created_at_ns=1, updated_at_ns=1, token="j-0d0e.beef",
              log_dir=str(tmp_path / "logs"),
              attempts=[Attempt(number=1, started_at_ns=1, pid=2 ** 22 + 7, ended_at_ns=2,
                                outcome=outcome, exit_code=0 if outcome is Outcome.SUCCEEDED else 3)])
    sup = Supervisor(InMemoryJobSink(), tmp_path / "work", recovered_jobs=[old], tick_s=0.02)
    try:
        job = sup.wait(old.id, 20)
        assert job.state is state and len(job.attempts) == attempts, (job.state, job.reason)
        assert (ran.read_text().count("x") if ran.exists() else 0) == attempts - 1
    finally:
        sup.shutdown(grace_s=0.5)


def test_a_job_that_ended_while_its_record_was_refused_keeps_its_exit_status_for_the_next_daemon(tmp_path):
    """The job fails while the store refuses writes, and the daemon dies before it takes them
    again: the saved record says running. The waiter's status file was removed anyway, so the
    next daemon called the job lost (exit status unknown); kept, it reads the real end."""
    sink = FullDiskSink()
    sup = Supervisor(sink, tmp_path / "work", tick_s=0.02, log_poll_s=0.02)
    go = tmp_path / "go"
    try:
        job = sup.submit(JobSpec(command=("sh", "-c", f"while [ ! -e {go} ]; do sleep 0.02; done; exit 3"),
                                 runtime=False, grace_s=0.5))
        until(lambda: sink.jobs.get(job.id, {}).get("state") == "running")
        sink.full = True
        go.touch()
        assert sup.wait(job.id, 20).state is JobState.FAILED
    finally:
        sup.shutdown(grace_s=0.5)   # the daemon goes with its last record unsaved
    saved = Job.from_dict(sink.jobs[job.id])
    assert saved.state is JobState.RUNNING and saved.attempt.outcome is None
    sink.full = False
    nxt = Supervisor(sink, tmp_path / "work", recovered_jobs=[saved], tick_s=0.02, log_poll_s=0.02)
    try:
        again = nxt.wait(job.id, 20)
        assert again.state is JobState.FAILED and again.attempt.exit_code == 3, again.reason
        assert len(again.attempts) == 1
        folder = Path(again.log_dir)   # removed once saved (and the folder with them)
        until(lambda: not folder.exists() or not list(folder.glob("attempt-1.*")))
    finally:
        nxt.shutdown(grace_s=0.5)


def test_lines_stored_after_the_checkpoint_are_all_found_when_pages_fill_by_bytes(tmp_path):
    """A page of stored lines stops at 8 MiB: with lines over ~840 bytes it holds fewer than
    10 000, which was taken for the end of the log. A daemon restarted after a checkpoint then
    stored the lines past that page a second time."""
    from types import SimpleNamespace

    from rtxops.daemon.job_sink import DuckDBJobSink
    from rtxops.daemon.jobs import Attempt
    from rtxops.daemon.supervisor import _Runner
    from rtxops.telemetry.store import Store

    with Store(tmp_path / "s.duckdb") as store:
        sink = DuckDBJobSink(store)
        text = "x" * 1200
        sink.log_lines("job-1", 1, 0, "stdout", [(i, i, text) for i in range(1, 20_001)])
        attempt = Attempt(number=1, started_at_ns=0, log_offsets={"stdout": 1, "stderr": 0},
                          log_seqs={"stdout": 10_560, "stderr": 0})   # stderr wrote nothing
        runner = SimpleNamespace(job_id="job-1", sup=SimpleNamespace(sink=sink),
                                 _probe=lambda name, fn, default, *args: fn(*args))
        found = _Runner._stored_after_checkpoint(runner, attempt)
    assert found == {"stdout": (20_000 - 10_560, 20_000)}


def test_a_readopted_job_reads_only_the_lines_stored_after_its_checkpoint(tmp_path):
    """A stream that never wrote checkpoints seq 0: the scan started there and read the job's
    whole log (7.5 s a million lines, every attempt's) before the adopted job was watched again
    (no cancel, no hang kill)."""
    from types import SimpleNamespace

    from rtxops.daemon.job_sink import DuckDBJobSink
    from rtxops.daemon.jobs import Attempt
    from rtxops.daemon.supervisor import _Runner
    from rtxops.telemetry.store import Store

    with Store(tmp_path / "s.duckdb") as store:
        sink = DuckDBJobSink(store)
        sink.log_lines("job-1", 1, 0, "stdout", [(i, i, "line") for i in range(1, 30_001)])
        sink.log_lines("job-1", 1, 0, "stderr", [(30_001, 30_001, "late")])
        attempt = Attempt(number=1, started_at_ns=0, log_offsets={"stdout": 1, "stderr": 0},
                          log_seqs={"stdout": 29_990, "stderr": 0})
        read_from = []

        def read_logs(job_id, after_seq, limit):
            read_from.append(after_seq)
            return sink.read_logs(job_id, after_seq=after_seq, limit=limit)

        runner = SimpleNamespace(job_id="job-1", sup=SimpleNamespace(sink=SimpleNamespace(read_logs=read_logs)),
                                 _probe=lambda name, fn, default, *args: fn(*args))
        found = _Runner._stored_after_checkpoint(runner, attempt)
    assert found == {"stdout": (10, 30_000), "stderr": (1, 30_001)}
    assert read_from[0] == 29_990 and len(read_from) == 2, read_from


def test_a_leader_its_waiter_has_not_reaped_yet_is_awaited_not_lost():
    """At a daemon's start, a job that had just exited (its waiter about to write the status,
    slowed by a busy disk) was taken for lost at once: a zombie is not alive."""
    import subprocess
    import time

    from rtxops.daemon import proctree
    from rtxops.daemon.jobs import Attempt
    from rtxops.daemon.supervisor import _awaiting_its_waiter

    child = subprocess.Popen(["true"])   # this process is its waiter here
    ticks = proctree.read_proc(child.pid).start_ticks
    attempt = Attempt(number=1, started_at_ns=0, pid=child.pid, start_ticks=ticks)
    deadline = time.monotonic() + 10
    while proctree.read_proc(child.pid).state != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert _awaiting_its_waiter(attempt)
    assert not _awaiting_its_waiter(Attempt(number=1, started_at_ns=0, pid=child.pid, start_ticks=ticks + 1))
    child.wait()
    assert not _awaiting_its_waiter(attempt)


def test_a_base_environment_without_path_keeps_the_default_path():
    """`base_env: {}` (a caller with no PATH) gave the job only the daemon's venv bin: `true`
    was not found, exit 127, where any shell finds it."""
    import os

    from rtxops.daemon import launch
    from rtxops.daemon.jobs import JobSpec

    env = launch.environment(JobSpec(command=["true"], base_env={}, runtime=False), job_id="j",
                             token="t", attempt=1, base=os.environ, extra_env={"PATH": "/venv/bin"})
    assert env["PATH"].split(os.pathsep) == ["/venv/bin", *os.defpath.split(os.pathsep)]


def test_a_caller_that_turned_telemetry_off_keeps_it_off():
    """`RTXOPS_TELEMETRY=off rtxops run …` exported spans all the same: the daemon's
    `RTXOPS_TELEMETRY=otlp` went over the caller's setting."""
    from rtxops.daemon import launch
    from rtxops.daemon.jobs import JobSpec

    extra = {"RTXOPS_TELEMETRY": "otlp", "PATH": "/venv/bin"}
    for own, want in (({"RTXOPS_TELEMETRY": "off"}, "off"), ({}, "otlp"),
                      ({"RTXOPS_TELEMETRY": "duckdb"}, "otlp")):   # (the daemon holds the store)
        env = launch.environment(JobSpec(command=["true"], base_env=own), job_id="j", token="t",
                                 attempt=1, base={}, extra_env=extra)
        assert env["RTXOPS_TELEMETRY"] == want, own


def test_a_job_that_keeps_printing_is_stored_a_batch_per_busy_poll_and_nothing_is_lost(tmp_path):
    path = tmp_path / "out"
    path.write_text("")
    calls: list[int] = []
    got: list[str] = []

    def on_lines(stream, lines):
        calls.append(len(lines))
        got.extend(t for _, _, t in lines)

    tail = logtail.LogTail({"stdout": path}, on_lines, poll_s=0.01, busy_poll_s=0.3).start()
    with open(path, "a") as f:
        deadline = time.monotonic() + 1.2
        i = 0
        while time.monotonic() < deadline:   # a line every 10 ms: one a poll at poll_s
            f.write(f"line {i}\n")
            f.flush()
            i += 1
            time.sleep(0.01)
    assert tail.stop(10)
    assert got == [f"line {n}" for n in range(i)]
    # a write to the store per busy poll (~4 in 1.2 s), not per poll (~100 at poll_s)
    assert len(calls) <= 8, calls
