"""The parent of one attempt of a job: starts it, waits for it, writes its exit status to a file.

A process's exit status goes to its parent alone. Were the daemon the job's parent, a daemon that
died and came back would find the job ended with no way to tell how; this small process outlives
the daemon and leaves the status where the next daemon reads it.

Run by the supervisor as a script, with the standard library only (no site, no rtxops: the
job's environment enables the rtxops runtime, which must not start here)::

    python -I -S _waiter.py STATUS_FILE STDOUT_FD -- ARGV...

It reports on its stdout, one JSON line: ``{"pid": N}`` once the job runs (as the leader of a
session of its own, with the environment this process got, the job's token restored), or
``{"error": ..., "errno": ..., "filename": ...}`` when it cannot start. It stays out of the job's
session and does not carry its token, so the signals the supervisor sends the job's processes
never reach it. Its command line ends with the job's, so ``pkill -f train.py`` (or a scheduler
signalling every process) finds it too: it outlives every signal that would end it and can be
caught (SIGTERM, SIGINT, SIGHUP, SIGUSR1 for faulthandler's stacks, ...), which the job gets as
usual (a handler, unlike SIG_IGN, does not pass to the job). Its exit status mirrors the job's.
"""
import json
import os
import resource
import signal
import subprocess
import sys

TOKEN = "RTXOPS_JOB_TOKEN"
CARRIED_TOKEN = "RTXOPS_WAITER_JOB_TOKEN"   # the job's token, under a name the process scan ignores


def _report(line: dict) -> None:
    try:
        with os.fdopen(1, "w") as out:
            out.write(json.dumps(line) + "\n")
    except OSError:   # the daemon went away before it read this: the status file still tells
        pass


def _write_status(path: str, returncode: int) -> None:
    part = path + ".part"
    try:
        with open(part, "w") as f:
            json.dump({"returncode": returncode}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except OSError as e:   # a full disk, a folder removed: the exit status below still tells
        sys.stderr.write(f"rtxops waiter: cannot write the exit status to {path}: {e}\n")


def _exit_like(returncode: int) -> None:
    if returncode >= 0:
        os._exit(returncode)
    sig = -returncode
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # the job dumped core, if anyone
        if sig != signal.SIGKILL:                            # (its handler cannot be set)
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    except (OSError, ValueError):
        pass
    os._exit(128 + sig)


def _outlive(signum, frame) -> None:
    """The job's exit status is this process's to keep: a signal meant for the job ends it alone."""


def _ending_signals() -> list:
    """The signals whose default action ends a process and that a handler can catch, less the
    ones a fault raises (a handler that returns would run the fault again)."""
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM",
             "SIGVTALRM", "SIGPROF", "SIGXCPU", "SIGXFSZ", "SIGIO", "SIGPWR", "SIGSTKFLT",
             "SIGABRT", "SIGSYS", "SIGTRAP")
    found = [getattr(signal, n) for n in names if hasattr(signal, n)]
    if hasattr(signal, "SIGRTMIN"):
        found += range(signal.SIGRTMIN, signal.SIGRTMAX + 1)
    return found


def main(argv: list[str]) -> None:
    status_path, stdout_fd, separator, command = argv[1], int(argv[2]), argv[3], argv[4:]
    if separator != "--" or not command:
        sys.exit("usage: _waiter.py STATUS_FILE STDOUT_FD -- ARGV...")
    for sig in _ending_signals():
        try:
            signal.signal(sig, _outlive)
        except (OSError, ValueError):   # one the C library keeps for itself
            pass
    env = dict(os.environ)
    token = env.pop(CARRIED_TOKEN, None)
    if token is not None:
        env[TOKEN] = token
    try:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=stdout_fd, stderr=2,
                                 env=env, start_new_session=True)
    except (OSError, ValueError) as e:   # ValueError: what exec cannot take
        _report({"error": getattr(e, "strerror", None) or str(e), "errno": getattr(e, "errno", None),
                 "filename": getattr(e, "filename", None)})
        os._exit(127)
    os.close(stdout_fd)
    _report({"pid": child.pid})
    returncode = child.wait()
    _write_status(status_path, returncode)
    _exit_like(returncode)


if __name__ == "__main__":
    main(sys.argv)
