"""What the browser keeps live after the page loaded: the badge says offline while the daemon
cannot be reached or hangs, the job page shows the job ending, and a followed log keeps up with
a chatty job on a page of bounded size."""
from __future__ import annotations

import sys

LIVE_TEXT = "document.getElementById('live').textContent"


def test_the_badge_reads_offline_while_the_daemon_hangs_or_cannot_be_reached(web):
    """The log poller, which has nothing to do on most pages, set "live" every 2 s over the
    refresh's failure; and a fetch without a timeout left a hung daemon "live" for good."""
    page = web.page
    web.open("/")
    assert page.text_content("#live") == "live"
    page.route("**/*", lambda route: None)          # a daemon that never answers
    page.wait_for_function(f"{LIVE_TEXT} === 'offline'", timeout=30_000)
    page.unroute("**/*")
    page.wait_for_function(f"{LIVE_TEXT} === 'live'", timeout=15_000)   # and back
    page.route("**/*", lambda route: route.abort("connectionrefused"))
    page.wait_for_function(f"{LIVE_TEXT} === 'offline'", timeout=15_000)
    seen = []
    for _ in range(16):                              # 8 s: four of the log poller's turns
        seen.append(page.text_content("#live"))
        page.wait_for_timeout(500)
    assert set(seen) == {"offline"}, seen


def test_the_job_page_shows_the_job_ending(web, live):
    """The heading with the job's state was outside the live sections: it read "running" for
    as long as the page was open."""
    with live.client(token=True) as c:
        job = c.post("/v1/jobs", json={"command": ["sh", "-c", "sleep 6; exit 3"],
                                       "name": "ends"}).json()
    web.open(f"/jobs/{job['id']}")
    assert web.page.text_content("#job-title .state") != "failed"
    web.page.wait_for_function("document.querySelector('#job-title .state').textContent === 'failed'",
                               timeout=30_000)


def test_a_followed_log_keeps_up_with_a_chatty_job_and_keeps_its_newest_lines(web, live):
    """1000 lines per 2 s poll: a job printing 30 000 lines at once was a minute behind; every
    line stayed on the page, and "No output yet." stayed under them."""
    code = ("import time; time.sleep(4); print('\\n'.join(f'line {i}' for i in range(30000)), "
            "flush=True); time.sleep(120)")
    with live.client(token=True) as c:
        job = c.post("/v1/jobs", json={"command": [sys.executable, "-c", code], "name": "chatty"}).json()
        try:
            web.open(f"/jobs/{job['id']}")
            page = web.page
            assert page.locator("section:has(#log) > .empty").count() == 1   # nothing printed yet
            page.wait_for_function(
                "document.querySelector('#log > span:last-of-type')?.textContent === 'line 29999'",
                timeout=30_000)
            kept = page.locator("#log > span:not(.trimmed)").count()
            assert 1000 <= kept <= 5000, kept
            assert page.locator("section:has(#log) > .empty").count() == 0
            note = page.text_content("#log > .trimmed")
            assert f"{30000 - kept} earlier lines left out here" in note, note
            lines = page.eval_on_selector_all("#log > span:not(.trimmed)", "s => s.map(e => e.textContent)")
            assert lines == [f"line {i}" for i in range(30000 - kept, 30000)]
        finally:
            c.post(f"/v1/jobs/{job['id']}/cancel")
