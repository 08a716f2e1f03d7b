"""Start-up cost of ``rtxops run``: time from launch until a training script's first line runs
(after its ``import torch``), plain Python vs ``rtxops run`` with no daemon around (so the daemon
starts in-process). Prints JSON (``--out`` writes it)."""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import report

SCRIPT = "import time, torch\nprint(f'READY {time.time()}', flush=True)\n"


def first_line_s(cmd: list[str], env: dict) -> float:
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    for line in proc.stdout:
        if line.startswith("READY "):
            ready = float(line.split()[1])
            break
    else:
        raise RuntimeError(f"{cmd} printed no READY line")
    proc.wait()
    return ready - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "job.py"
        script.write_text(SCRIPT)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RTXOPS_")}
        env["RTXOPS_HOME"] = str(Path(tmp) / "home")
        plain, rtx = [], []
        for _ in range(a.runs):
            plain.append(first_line_s([sys.executable, str(script)], env))
            rtx.append(first_line_s([sys.executable, "-m", "rtxops.cli", "run", "--no-summary", "--",
                                     sys.executable, str(script)], env))
    out = {
        "bench": "startup",
        "runs": a.runs,
        "plain_first_line_s": statistics.median(plain),
        "rtxops_run_first_line_s": statistics.median(rtx),
        "added_s": statistics.median(rtx) - statistics.median(plain),
        "samples": {"plain": plain, "rtxops": rtx},
        "target_added_s_max": 1.5,
    }
    report(out, a.out)


if __name__ == "__main__":
    main()
