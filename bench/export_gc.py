"""What the job's telemetry costs in Python garbage collection (issue #3's step overhead).

The example GPT trains with the runtime and telemetry on, exporting as a settled job does (every
10 s), to an exporter that encodes each request and drops it. Two ways, alternated in blocks of
``--seconds``: ``encoded``, the job's way (an exporter that takes requests encoded as the spans
are built: a span lives for a moment), and ``held`` (an exporter that takes SDK spans only: the
spans of an interval wait for the export, as every exporter's did before). Per block: the
collections of each generation (``gc.callbacks``), their time per step, the longest pause and
how many ran on the training thread (a pause there is the step's), and the export thread's CPU
per step. JSON on stdout (``--out`` writes it too).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import threading
import time

from _gpt import stepper
from _report import report
from opentelemetry.sdk.trace.export import SpanExportResult

from rtxops import settings
from rtxops.runtime import patching
from rtxops.telemetry import exporters
from rtxops.telemetry.encode import encode
from rtxops.telemetry.job import start_job_telemetry


class _Held:
    """Takes spans only: encodes them at the export, as an exporter without the encoded path."""

    def export(self, spans):
        encode(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class _Encoded(_Held):
    def encode_request(self, spans):
        return encode(spans)

    def export_encoded(self, body: bytes, spans: int):
        return SpanExportResult.SUCCESS


class _Collections:
    """Every collection's generation, duration and thread, through ``gc.callbacks``."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float, bool]] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seen.append((info["generation"], time.perf_counter() - self._started,
                              threading.current_thread() is threading.main_thread()))


def block(steps, exporter, seconds: float) -> dict:
    collections = _Collections()
    d = patching.enable()
    telemetry = start_job_telemetry(d, exporter, quiet_interval_s=settings.EXPORT_QUIET_INTERVAL_S)
    gc.callbacks.append(collections)
    n, started = 0, time.perf_counter()
    try:
        while time.perf_counter() - started < seconds:
            steps(20)
            n += 20
    finally:
        wall = time.perf_counter() - started
        gc.callbacks.remove(collections)
        patching.disable()
        telemetry.close()
    seen = collections.seen
    return {"steps": n, "ms_per_step": round(wall / n * 1e3, 3),
            "collections": {g: sum(1 for x in seen if x[0] == g) for g in range(3)},
            "gc_ms_per_step": round(sum(x[1] for x in seen) / n * 1e3, 4),
            "longest_pause_ms": round(max((x[1] for x in seen), default=0.0) * 1e3, 1),
            "full_collections_on_the_training_thread": sum(1 for x in seen if x[0] == 2 and x[2]),
            "export_thread_cpu_ms_per_step": round(telemetry.thread.cpu_s / n * 1e3, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="length of a block")
    p.add_argument("--rounds", type=int, default=3, help="blocks of each way, alternated")
    p.add_argument("--out")
    a = p.parse_args()
    exporters.ACTIVE_S = 0.0   # settled from the start: an export every 10 s
    steps = stepper()
    steps(30)  # warm-up
    ways = {"encoded": _Encoded, "held": _Held}
    blocks: dict[str, list[dict]] = {w: [] for w in ways}
    for _ in range(a.rounds):
        for way, exporter in ways.items():
            blocks[way].append(block(steps, exporter(), a.seconds))
    summary = {w: {k: statistics.median(b[k] for b in bs) for k in
                   ("gc_ms_per_step", "longest_pause_ms", "export_thread_cpu_ms_per_step",
                    "ms_per_step")} for w, bs in blocks.items()}
    report({"bench": "export_gc", "cpus": os.cpu_count(),
            "seconds_per_block": a.seconds, "rounds": a.rounds,
            "export_quiet_interval_s": settings.EXPORT_QUIET_INTERVAL_S,
            "objects_tracked": len(gc.get_objects()), "median": summary, "blocks": blocks}, a.out)


if __name__ == "__main__":
    main()
