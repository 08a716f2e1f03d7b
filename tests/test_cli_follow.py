"""`rtxops run` / `rtxops logs -f` following a job that prints a line a step: caught up, it asks
for new lines a few times a second, not once per line (each answer costs the daemon a store
query beside the job), and every line still comes out, in order."""
from __future__ import annotations

import threading
import time

from rtxops import cli

RATE, SECONDS = 200, 1.5           # lines a second, and for how long the job prints
# (pages of up to 1000 lines, as the daemon answers)


class _PrintingJob:
    """The daemon's answers for a job printing ``RATE`` lines a second (a long-poll waits for
    the next line)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.calls = 0
        self.lock = threading.Lock()

    def _written(self) -> int:
        return min(int((time.monotonic() - self.t0) * RATE), int(RATE * SECONDS))

    def logs(self, job_id: str, after: int = 0, rank=None, wait_s: float = 0) -> dict:
        with self.lock:
            self.calls += 1
        deadline = time.monotonic() + wait_s
        while True:
            written = self._written()
            done = time.monotonic() - self.t0 > SECONDS
            if written > after or done or time.monotonic() >= deadline:
                break
            time.sleep(0.001)
        lines = [{"seq": s, "rank": 0, "stream": "stdout", "text": f"step {s}"}
                 for s in range(after + 1, min(written, after + 1000) + 1)]
        return {"lines": lines, "done": done and written == after, "state": "running"}

    def job(self, job_id: str) -> dict:
        return {"state": "succeeded", "exit_code": 0}


def test_a_follower_caught_up_asks_a_few_times_a_second_and_prints_every_line(capsys):
    job = _PrintingJob()
    cli._follow(job, "j-1")
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"step {s}" for s in range(1, int(RATE * SECONDS) + 1)]
    # about every 0.25 s, and the last answers; unpaced it asked once per line or two (~290)
    assert job.calls <= 12, job.calls
