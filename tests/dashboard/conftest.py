"""One real daemon (uvicorn on 127.0.0.1, in this process so the fixture can add evolve rows to
its store) that ran one short real training job which swapped plans mid-run, and one Chromium for
every browser test. All tests here share them (xdist group ``dashboard``)."""
from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rtxops.daemon.home import Home
from rtxops.daemon.server import Daemon

from ..daemon.live import TERMINAL, until

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
HOSTILE_NAME = "<img src=x onerror=alert(1)>gpt"
HOSTILE_LINE = "<script>alert('log')</script> & <b>not bold</b>"
# the job prints a hostile line, then runs the example GPT (long enough to swap; cancelled after)
JOB_CODE = (f"print({HOSTILE_LINE!r}, flush=True); import runpy, sys; "
            "sys.argv = ['train_gpt.py', '--steps', '100000', '--layers', '1', '--seq', '32']; "
            f"runpy.run_path({str(ROOT / 'examples' / 'train_gpt.py')!r}, run_name='__main__')")
PLAN = {"version": 1, "defaults": {"silu": "tanh"}}


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.xdist_group("dashboard"))


@dataclass
class Live:
    daemon: Daemon
    url: str
    job_id: str
    swap_step: int
    trial_op: str
    trial_bucket: str
    trial_ids: list[str]

    @property
    def store(self):
        return self.daemon.store

    def client(self, token: bool = False) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.daemon.token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


def _trial_rows(op: str, bucket: str, job_id: str) -> list[list]:
    now = time.time_ns()
    rows = []
    for i, (variant, config, median) in enumerate(
            [("eager", "{}", 21_000.0), ("tanh", "{}", 17_500.0), ("chunked", '{"rows": 64}', 19_000.0)]):
        rows.append([f"trial-{uuid.uuid4().hex[:8]}-{i}", job_id, op, bucket, variant, config, "online",
                     "grid", now - (30 - i) * 10**9, now - (20 - i) * 10**9, 40, median, median * 1.2,
                     0.03, 1 << 20, "done", "<b>not bold</b>"])
    return rows


@pytest.fixture(scope="session")
def live(tmp_path_factory) -> Live:
    home = tmp_path_factory.mktemp("dashboard") / "home"
    daemon = Daemon(Home.resolve(home), port=0, job_grace_s=5).start_in_thread()
    try:
        c = httpx.Client(base_url=daemon.url, timeout=60,
                         headers={"Authorization": f"Bearer {daemon.token}"})
        r = c.post("/v1/jobs", json={"command": ["python", "-c", JOB_CODE], "name": HOSTILE_NAME,
                                     "cwd": str(ROOT), "grace_s": 5,
                                     "env": {"RTXOPS_PLAN_POLL_S": "0.1"}})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]

        def last_step() -> int:
            job = c.get(f"/v1/jobs/{job_id}").json()
            assert job["state"] not in TERMINAL, f"the job ended early: {job}"
            return job["last_step"] or 0

        until(lambda: last_step() >= 3, 120, every=0.2, what="the job's first steps")
        r = c.post("/v1/plans", params={"job": job_id}, json=PLAN)
        assert r.status_code == 201, r.text

        def swapped() -> list:
            refused = [r for r in daemon.board.reports if r.get("job_id") == job_id]
            assert not refused, f"the job refused the plan: {refused}"
            last_step()  # the job still runs
            return daemon.store.query("SELECT step FROM swaps WHERE job_id = $j", {"j": job_id})

        try:
            swaps = until(swapped, 120, every=0.2, what="the job's rtx.swap span")
        except AssertionError as e:  # say where the job was: its last output lines
            lines = c.get(f"/v1/jobs/{job_id}/logs").json().get("lines", [])[-15:]
            raise AssertionError(f"{e}; job {c.get(f'/v1/jobs/{job_id}').json()}; last output: "
                                 + "\n".join(line["text"] for line in lines)) from None
        swap_step = swaps[0]["step"]
        # enough steps after the swap for a before/after comparison, with a telemetry export
        until(lambda: daemon.store.query(
            "SELECT count(*) AS n FROM step_times WHERE job_id = $j AND step > $s",
            {"j": job_id, "s": swap_step + 20})[0]["n"] > 0, 60, every=0.2, what="steps after the swap")
        assert c.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
        until(lambda: c.get(f"/v1/jobs/{job_id}").json()["state"] in TERMINAL, 60, every=0.2,
              what="the job to stop")
        c.close()
        kernel = daemon.store.query(
            "SELECT op, bucket FROM kernel_spans WHERE job_id = $j AND op = 'silu' LIMIT 1",
            {"j": job_id})[0]
        rows = _trial_rows(kernel["op"], kernel["bucket"], job_id)
        daemon.store.run_write(lambda cur: [cur.execute(
            "INSERT INTO trials VALUES (" + ", ".join("?" * 17) + ")", row) for row in rows]
        ).result(30)
        yield Live(daemon, daemon.url, job_id, swap_step, kernel["op"], kernel["bucket"],
                   [row[0] for row in rows])
    finally:
        daemon.shutdown()


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> Path:
    """Where screenshots go: ``$RTXOPS_TEST_ARTIFACTS/dashboard`` or a pytest temporary dir."""
    root = os.environ.get("RTXOPS_TEST_ARTIFACTS")
    path = Path(root) / "dashboard" if root else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


class Watched:
    """A page with its console errors, uncaught exceptions and dialogs recorded."""

    def __init__(self, page) -> None:
        self.page = page
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))

    def open(self, url: str) -> None:
        """Load ``url`` and wait until every chart on it was drawn (or found empty)."""
        response = self.page.goto(url)
        assert response is not None and response.status == 200, f"{url}: {response and response.status}"
        self.page.wait_for_function(
            "[...document.querySelectorAll('[data-chart]')].every(e => e.dataset.points !== undefined)",
            timeout=30_000)

    def points(self, selector: str) -> int:
        return int(self.page.get_attribute(selector, "data-points"))


@pytest.fixture
def web(browser, live):
    context = browser.new_context(base_url=live.url, viewport={"width": 1400, "height": 900})
    watched = Watched(context.new_page())
    yield watched
    context.close()
