"""The waiter each attempt runs under: it stays out of the job's session and token (the job's
signals never reach it), starts no rtxops runtime, leaves the exit status in a file and exits
as the job did."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from rtxops.daemon import launch, proctree
from rtxops.daemon.jobs import JobState

from .test_supervisor import PY, mark, script, sink, spec, sup, until  # noqa: F401 (fixtures)


def test_the_waiter_is_outside_the_jobs_tree_and_gets_none_of_its_signals(sup, tmp_path):
    body = script(tmp_path, "waits.py", """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
        print("ready", flush=True)
        time.sleep(600)
    """)
    job = sup.submit(spec(PY, body))
    until(lambda: [ln.text for ln in sup.logs(job.id)] == ["ready"])
    attempt = sup.job(job.id).attempt
    waiter = proctree.read_proc(attempt.pid).ppid
    assert proctree.read_proc(waiter).sid != attempt.pid
    assert waiter not in proctree.members(attempt.pid, sup.job(job.id).token)
    sent = sup.signal(job.id, signal.SIGTERM)
    assert sent == [attempt.pid]
    done = sup.wait(job.id, 20)
    assert done.attempt.exit_code == 7 and done.state is JobState.FAILED
    until(lambda: proctree.read_proc(waiter) is None or not proctree.read_proc(waiter).alive)


def test_the_waiter_starts_no_rtxops_runtime(sup, tmp_path):
    """The job's environment enables the runtime through a sitecustomize: the waiter, a Python
    process with that environment, must not import it (nor torch)."""
    body = script(tmp_path, "idle.py", "import time, torch\nprint('ready', flush=True)\ntime.sleep(600)\n")
    job = sup.submit(spec(PY, body, runtime=True))
    until(lambda: [ln.text for ln in sup.logs(job.id)] == ["ready"], 60)
    waiter = proctree.read_proc(sup.job(job.id).attempt.pid).ppid
    job_maps = Path(f"/proc/{sup.job(job.id).attempt.pid}/maps").read_text()
    assert "libtorch" in job_maps    # the runtime started in the job
    assert "libtorch" not in Path(f"/proc/{waiter}/maps").read_text()
    sup.cancel(job.id)
    assert sup.wait(job.id, 20).state is JobState.CANCELLED


def test_the_waiter_writes_the_status_and_exits_as_the_job_did(tmp_path):
    for code, expect in (("0", 0), ("3", 3), ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -15)):
        status = tmp_path / f"status-{expect}"
        program = f"import sys; sys.exit({code})" if code.isdigit() else code
        with open(tmp_path / "out", "wb") as out, open(tmp_path / "err", "wb") as err:
            waiter, pid = launch.spawn([PY, "-c", program], env={"PATH": "/usr/bin:/bin"}, cwd=None,
                                       stdout=out, stderr=err, status_file=status)
        assert waiter.wait(20) == expect
        assert json.loads(status.read_text()) == {"returncode": expect}
        assert launch.read_status(status) == expect


def test_a_command_that_cannot_start_is_reported_by_the_waiter(tmp_path):
    with open(tmp_path / "out", "wb") as out, open(tmp_path / "err", "wb") as err:
        try:
            launch.spawn([str(tmp_path / "no-such-program")], env={}, cwd=None, stdout=out,
                         stderr=err, status_file=tmp_path / "status")
        except launch.StartFailed as e:
            assert e.exit_code == 127 and "No such file or directory" in e.detail, e.detail
        else:
            raise AssertionError("started a program that does not exist")
        (tmp_path / "script").write_text("not a program")
        try:
            launch.spawn([str(tmp_path / "script")], env={}, cwd=None, stdout=out, stderr=err,
                         status_file=tmp_path / "status")
        except launch.StartFailed as e:
            assert e.exit_code == 126 and "Permission denied" in e.detail, e.detail
        else:
            raise AssertionError("started a file that is not executable")
    assert not (tmp_path / "status").exists()


def test_a_status_the_waiter_cannot_write_is_still_its_exit_status(tmp_path):
    """A full disk or a removed folder: the waiter died with a traceback (exit 1) and the job,
    which had exited 0, was taken for a crash and run again."""
    for code in (0, 3):
        with open(tmp_path / "out", "wb") as out, open(tmp_path / "err", "wb") as err:
            waiter, _ = launch.spawn([PY, "-c", f"import sys; sys.exit({code})"], env={}, cwd=None,
                                     stdout=out, stderr=err, status_file=tmp_path / "gone" / "status")
        assert waiter.wait(20) == code
        assert "cannot write the exit status" in (tmp_path / "err").read_text()


def test_a_job_whose_waiter_is_killed_alone_runs_on(sup, tmp_path):
    """Killing the waiter (pkill, an admin) was taken for the job ending: its leftovers - the
    job itself - were killed. The job runs on, watched as an adopted one."""
    go = tmp_path / "go"
    body = script(tmp_path, "runs_on.py", f"""
        import os, time
        print("up", flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.02)
        print("done", flush=True)
    """)
    job = sup.submit(spec(PY, body))
    until(lambda: [ln.text for ln in sup.logs(job.id)] == ["up"])
    attempt = sup.job(job.id).attempt
    waiter = proctree.read_proc(attempt.pid).ppid
    os.kill(waiter, signal.SIGKILL)
    until(lambda: any(e.kind == "waiter_lost" for e in sup.events(job.id)))
    assert proctree.read_proc(attempt.pid).alive and sup.job(job.id).state is JobState.RUNNING
    go.touch()
    done = sup.wait(job.id, 30)
    assert [ln.text for ln in sup.logs(job.id)] == ["up", "done"]
    assert done.state is JobState.LOST and "exit status unknown" in done.reason
    assert "its waiter" in done.reason and "SIGKILL" in done.reason   # no daemon restart to blame


def test_a_job_and_its_waiter_signalled_together_keep_the_jobs_exit_status(sup, tmp_path):
    """`pkill -f train.py` (or a scheduler's SIGTERM to every process) finds the waiter too, whose
    command line ends with the job's: it died before writing the status, and a job that saved
    its checkpoint and exited 0 was reported lost (its restart budget never applied)."""
    body = script(tmp_path, "saves.py", """
        import signal, sys, time
        def save(*_):
            print("saved", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, save)
        print("up", flush=True)
        time.sleep(600)
    """)
    job = sup.submit(spec(PY, body))
    until(lambda: [ln.text for ln in sup.logs(job.id)] == ["up"])
    attempt = sup.job(job.id).attempt
    waiter = proctree.read_proc(attempt.pid).ppid
    # the waiter outlives these too (`pkill -USR1 -f train.py` for every rank's stacks left the
    # job `lost` whatever it did next)
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT,
                signal.SIGALRM, signal.SIGRTMIN + 3):
        os.kill(waiter, sig)
        time.sleep(0.05)
    os.kill(waiter, signal.SIGTERM)
    os.kill(attempt.pid, signal.SIGTERM)
    done = sup.wait(job.id, 30)
    assert [ln.text for ln in sup.logs(job.id)] == ["up", "saved"]
    assert done.state is JobState.SUCCEEDED and done.attempt.exit_code == 0, done.reason
    assert not any(e.kind == "waiter_lost" for e in sup.events(job.id))
