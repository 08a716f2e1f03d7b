"""What the in-process benches share: the example GPT (examples/train_gpt.py's defaults) as a
trainer, their block options, paired block ratios and JSON output."""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import train_gpt  # noqa: E402

from _report import report


class Trainer:
    """The GPT, its AdamW and its data; ``forward`` may be swapped (a compiled model, say)."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = train_gpt.GPT(2048, 128, 2, 4, 64)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        self.data = torch.Generator().manual_seed(seed + 1)
        self.forward: Callable = self.model

    def steps(self, n: int) -> list[float]:
        """Train ``n`` more steps; their wall times in seconds."""
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            tokens = torch.randint(0, 2048, (8, 65), generator=self.data)
            loss = self.forward(tokens[:, :-1], tokens[:, 1:])
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            out.append(time.perf_counter() - t0)
        return out


def stepper(seed: int = 0) -> Callable[[int], list[float]]:
    """``steps(n)`` of a new :class:`Trainer`."""
    return Trainer(seed).steps


def paired_ratios(blocks: dict[str, list[float]], a: str, b: str) -> list[float]:
    """Each ``b`` block over the mean of the ``a`` blocks on either side (``a`` runs first and
    last): adjacent blocks share the host's slow spells."""
    ref = blocks[a]
    return [x / ((ref[i] + ref[i + 1]) / 2) for i, x in enumerate(blocks[b])]


def median_interval(values: list[float], level: float = 0.95, resamples: int = 4000,
                    seed: int = 0) -> tuple[float, float]:
    """Bootstrap percentile interval of the median of ``values``."""
    rnd = random.Random(seed)
    meds = sorted(statistics.median(rnd.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - level) / 2
    return meds[int(tail * resamples)], meds[min(resamples - 1, int((1 - tail) * resamples))]


def block_options(doc: str, block: int, skip: int, extra=None) -> argparse.Namespace:
    """``--pairs``, ``--block``, ``--skip`` and ``--out`` (and what ``extra(parser)`` adds), parsed."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    if extra is not None:
        extra(p)
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("--block", type=int, default=block, help="steps per block")
    p.add_argument("--skip", type=int, default=skip, help="steps dropped at the start of a block")
    p.add_argument("--out")
    return p.parse_args()


def emit(bench: str, method: str, a: argparse.Namespace, figures: dict) -> None:
    """Print the result as JSON (and write it to ``--out``)."""
    report({"bench": bench, "python": platform.python_version(), "cpus": os.cpu_count(),
                       "torch": torch.__version__, "method": method, "pairs": a.pairs,
                       "block_steps": a.block, "skipped_steps": a.skip, **figures}, a.out)
