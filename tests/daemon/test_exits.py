"""Exit decoding, OOM evidence, torchrun rank prefixes, backoff."""
from __future__ import annotations

import signal

import pytest

from rtxops.daemon.exits import OomCounters, classify_exit, signal_name
from rtxops.daemon.jobs import LAUNCHER_RANK, JobSpec, Outcome
from rtxops.daemon.launch import command_line, is_python
from rtxops.daemon.logtail import split_rank


def test_exit_codes_and_signals_are_decoded():
    assert classify_exit(0).outcome is Outcome.SUCCEEDED
    crash = classify_exit(3)
    assert (crash.outcome, crash.exit_code, crash.signal) == (Outcome.CRASHED, 3, None)
    shell = classify_exit(128 + signal.SIGSEGV)
    assert shell.exit_code == 139 and "SIGSEGV" in shell.detail
    segv = classify_exit(-signal.SIGSEGV)
    assert (segv.outcome, segv.signal, segv.exit_code) == (Outcome.CRASHED, "SIGSEGV", None)
    assert "segmentation fault" in segv.detail
    assert signal_name(77) == "SIG77"


def test_sigkill_is_oom_only_with_evidence():
    maybe = classify_exit(-signal.SIGKILL)
    assert maybe.outcome is Outcome.CRASHED and "possibly the OOM killer" in maybe.detail
    oom = classify_exit(-signal.SIGKILL, ["/proc/vmstat oom_kill +1"])
    assert oom.outcome is Outcome.OOM and oom.signal == "SIGKILL" and "/proc/vmstat oom_kill +1" in oom.detail
    worker = classify_exit(1, ["memory.events oom_kill +2"])
    assert worker.outcome is Outcome.CRASHED and "OOM killer fired" in worker.detail


def test_oom_counters_report_only_what_moved():
    before = OomCounters((("/proc/vmstat", 4), ("cg/memory.events", 0)))
    after = OomCounters((("/proc/vmstat", 5), ("cg/memory.events", 0), ("new", 9)))
    assert after.moved_since(before) == ["/proc/vmstat oom_kill +1"]
    assert isinstance(OomCounters.read().values, tuple)


def test_torchrun_prefixes_give_the_rank():
    assert split_rank(b"[rank1]:hello", torchrun=True) == (1, b"hello")
    assert split_rank(b"Setting OMP_NUM_THREADS", torchrun=True) == (LAUNCHER_RANK, b"Setting OMP_NUM_THREADS")
    assert split_rank(b"[rank1]:hello", torchrun=False) == (0, b"[rank1]:hello")


def test_torchrun_command_lines(tmp_path):
    assert is_python("/x/.venv/bin/python3.11") and not is_python("/bin/bash")
    two = dict(nproc_per_node=2)
    argv = command_line(JobSpec(command=["python", "-u", "train.py", "--steps", "3"], **two), tmp_path)
    assert argv[:3] == ["python", "-m", "torch.distributed.run"] and argv[-3:] == ["train.py", "--steps", "3"]
    assert "--standalone" in argv and argv[argv.index("--nproc-per-node") + 1] == "2"
    module = command_line(JobSpec(command=["python", "-m", "pkg.train", "a"], **two), tmp_path)
    assert module[-3:] == ["-m", "pkg.train", "a"]
    other = command_line(JobSpec(command=["./train.sh", "a"], **two), tmp_path)
    assert other[-3:] == ["--no-python", "./train.sh", "a"]
    assert command_line(JobSpec(command=["python", "t.py"]), tmp_path) == ["python", "t.py"]


def test_backoff_is_exponential_and_capped():
    s = JobSpec(command=["x"], backoff_s=0.5, backoff_max_s=3)
    assert [s.backoff(n) for n in range(5)] == [0.5, 1.0, 2.0, 3, 3]
    assert s.backoff(10_000) == 3
    # `--backoff 600` (the API takes up to an hour) was cut to the 60 s default cap
    assert [JobSpec(command=["x"], backoff_s=600).backoff(n) for n in range(2)] == [600, 600]
    with pytest.raises(ValueError, match="first_step_timeout_s needs hang_timeout_s"):
        JobSpec(command=["x"], first_step_timeout_s=1)


def test_faulthandler_fallback_signals_only_processes_that_handle_sigusr1(tmp_path):
    import subprocess
    import sys
    import time

    from rtxops.daemon import proctree, stacks

    handled = tmp_path / "handled.py"
    handled.write_text("import faulthandler, signal, time\n"
                       "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
                       "def waiting_here():\n    time.sleep(60)\n"
                       "print('up', flush=True)\nwaiting_here()\n")
    plain = tmp_path / "plain.py"
    plain.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    procs = [subprocess.Popen([sys.executable, str(p)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for p in (handled, plain)]
    try:
        for p in procs:
            assert p.stdout.readline() == b"up\n"
        found = stacks.capture([proctree.read_proc(p.pid) for p in procs], use_py_spy=False, settle_s=0.3)
        assert found.method == "faulthandler"
        assert "faulthandler" in found.stacks[procs[0].pid]
        assert "no SIGUSR1 handler" in found.errors[procs[1].pid]
        time.sleep(0.1)
        assert procs[1].poll() is None, "a process without a handler is not signalled"
        procs[0].kill()
        assert b"most recent call first" in procs[0].communicate(timeout=5)[1]
    finally:
        for p in procs:
            p.kill()
            p.communicate()
