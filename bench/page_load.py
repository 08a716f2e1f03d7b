"""First page load of every dashboard page in Chromium on localhost: fill a store with ``--spans``
synthetic spans (default 1 M), start a real daemon on it, open each page ``--runs`` times, each
in a fresh browser context (cold cache: plotly.js is fetched and parsed every time), and read the
Navigation Timing ``loadEventEnd`` and the time until every chart was drawn. Prints JSON
(``--out`` writes it). Target: first page load < 1 s.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rtxops.telemetry.store import Store

sys.path.insert(0, str(Path(__file__).parent))
from dashboard_api import start_daemon  # noqa: E402
from store_query import fill  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
PAGES = {"overview": "/", "kernels": "/kernels?job=job-1", "evolve": "/evolve",
         "memory": "/memory", "governance": "/governance", "jobs": "/jobs", "job": "/jobs/job-1"}
TARGET_MS = 1000
CHARTS_DRAWN = "[...document.querySelectorAll('[data-chart]')].every(e => e.dataset.points !== undefined)"


def summary(values: list[float]) -> dict:
    values = sorted(values)
    return {"median_ms": round(statistics.median(values)), "max_ms": round(values[-1])}


def measure(browser, url: str, runs: int) -> dict:
    loads, drawn = [], []
    for _ in range(runs):
        context = browser.new_context()
        page = context.new_page()
        page.goto(url, wait_until="load")
        page.wait_for_function(CHARTS_DRAWN, timeout=60_000)
        loads.append(page.evaluate("performance.getEntriesByType('navigation')[0].loadEventEnd"))
        drawn.append(page.evaluate("performance.now()"))
        context.close()
    return {"load": summary(loads), "charts_drawn": summary(drawn), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spans", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="rtxops-bench-") as tmp:
        home = Path(tmp)
        store = Store(home / "rtxops.duckdb")
        filled = fill(store, args.spans, time.time_ns())
        store.close()
        proc, url, _ = start_daemon(home)
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
                measure(browser, url + "/", 1)                 # the daemon's first requests
                pages = {name: measure(browser, url + path, args.runs) for name, path in PAGES.items()}
                browser.close()
        finally:
            proc.terminate()
            proc.wait(60)
    worst = max(p["load"]["max_ms"] for p in pages.values())
    result = {"bench": "page_load", "python": platform.python_version(), "cpus": os.cpu_count(),
              "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
              "spans": args.spans, "fill": filled, "target": {"first_load_ms": TARGET_MS},
              "cache": "cold (a fresh browser context per load)", "max_load_ms": worst,
              "all_under_target": worst < TARGET_MS, "pages": pages}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
