"""First page load of every dashboard page in Chromium on localhost: fill a store with ``--spans``
synthetic spans (default 1 M), start a real daemon on it, open each page ``--runs`` times, each
in a fresh browser context (cold cache: plotly.js is fetched and parsed every time), and read the
Navigation Timing ``loadEventEnd`` (the page with its tables; plotly.js loads after it) and the
time until every chart was drawn. Prints JSON
(``--out`` writes it). Target: first page load < 1 s.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from _report import report
from rtxops.telemetry.store import Store

sys.path.insert(0, str(Path(__file__).parent))
from dashboard_api import start_daemon
from store_query import fill

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


def visit(page, url: str) -> tuple[float, float]:
    """Load ``url``; (ms to the load event, ms until every chart was drawn)."""
    page.goto(url, wait_until="load")
    page.wait_for_function(CHARTS_DRAWN, timeout=60_000)
    return (page.evaluate("performance.getEntriesByType('navigation')[0].loadEventEnd"),
            page.evaluate("performance.now()"))


def measure(browser, url: str, runs: int) -> dict:
    """``runs`` cold loads (a fresh context each), each followed by a warm one (same context:
    plotly.js from the HTTP cache)."""
    cold, warm = ([], []), ([], [])
    for _ in range(runs):
        context = browser.new_context()
        page = context.new_page()
        for into, (load, drawn) in ((cold, visit(page, url)), (warm, visit(page, url))):
            into[0].append(load)
            into[1].append(drawn)
        context.close()
    return {"cold": {"load": summary(cold[0]), "charts_drawn": summary(cold[1])},
            "warm": {"load": summary(warm[0]), "charts_drawn": summary(warm[1])}, "runs": runs}


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
                for path in PAGES.values():                    # a running daemon has its
                    httpx.get(url + path, timeout=60)          # templates compiled already
                pages = {name: measure(browser, url + path, args.runs) for name, path in PAGES.items()}
                browser.close()
        finally:
            proc.terminate()
            proc.wait(60)
    worst = max(p["cold"]["load"]["max_ms"] for p in pages.values())
    result = {"bench": "page_load", "python": platform.python_version(), "cpus": os.cpu_count(),
              "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
              "spans": args.spans, "fill": filled, "target": {"first_load_ms": TARGET_MS},
              "max_cold_load_ms": worst,
              "max_cold_charts_drawn_ms": max(p["cold"]["charts_drawn"]["max_ms"] for p in pages.values()),
              "max_warm_charts_drawn_ms": max(p["warm"]["charts_drawn"]["max_ms"] for p in pages.values()),
              "cold_load_under_target": worst < TARGET_MS, "pages": pages}
    report(result, args.out)


if __name__ == "__main__":
    main()
