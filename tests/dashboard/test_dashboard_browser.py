"""The dashboard in Chromium against a real daemon that ran a real training job which swapped
plans: every page loads cleanly, charts have data, the swap is marked, kernel → trials works,
user-controlled strings stay text. Screenshots go to the ``artifacts`` directory."""
from __future__ import annotations

from urllib.parse import parse_qs, urlparse

import pytest

from .conftest import HOSTILE_LINE, HOSTILE_NAME


def pages(job_id: str) -> dict[str, str]:
    return {"overview": "/", "kernels": f"/kernels?job={job_id}", "evolve": "/evolve",
            "memory": "/memory", "governance": "/governance", "jobs": "/jobs",
            "job": f"/jobs/{job_id}"}


@pytest.mark.parametrize("name", list(pages("x")))
def test_page_loads_without_console_errors(web, live, artifacts, name):
    web.open(pages(live.job_id)[name])
    web.page.screenshot(path=str(artifacts / f"{name}.png"), full_page=True)
    assert web.errors == [] and web.dialogs == []
    assert web.page.locator("main h1").count() == 1
    assert web.page.locator("#live").inner_text() == "live"     # every chart's JSON loaded


def test_charts_render_with_data_points(web, live):
    web.open(f"/?job={live.job_id}")
    assert web.points("#steps-chart") >= 2
    assert web.page.locator("#steps-chart .scatterlayer .trace .points path").count() >= 2
    web.open(f"/kernels?job={live.job_id}&op=silu")
    assert web.points("#kernel-series-chart") >= 1
    assert web.points("#breakdown-chart") >= 2                  # one bar each side per op
    assert web.page.locator("#breakdown-chart .barlayer .point").count() >= 2
    web.open(f"/memory?job={live.job_id}")
    assert web.points("#memory-chart") >= 2                     # RSS on CPU
    assert web.errors == []


def test_swap_marker_appears_after_the_promoted_plan(web, live):
    web.open(f"/?job={live.job_id}")
    assert int(web.page.get_attribute("#steps-chart", "data-markers")) >= 1
    labels = web.page.locator("#steps-chart .annotation-text").all_text_contents()
    assert any(text.startswith("swap") and text.endswith("→1") for text in labels), labels
    assert web.page.locator("#steps-chart .shapelayer path").count() >= 1
    # the speed-up table names the job that swapped
    assert live.job_id in web.page.locator("#speedups").inner_text()


def test_a_kernel_links_to_its_trials(web, live, artifacts):
    web.open(f"/kernels?job={live.job_id}&op={live.trial_op}")
    row = web.page.locator("table.kernels tbody tr", has_text=live.trial_bucket).first
    row.locator("a.trials-link").click()
    web.page.wait_for_url("**/evolve?**")
    web.page.wait_for_function("document.querySelector('#trials-chart')?.dataset.points !== undefined")
    query = parse_qs(urlparse(web.page.url).query)
    assert query == {"op": [live.trial_op], "bucket": [live.trial_bucket]}
    table = web.page.locator("table.trials").inner_text()
    assert all(t in table for t in live.trial_ids)
    assert web.points("#trials-chart") == len(live.trial_ids)
    web.page.screenshot(path=str(artifacts / "kernel-to-trials.png"), full_page=True)
    assert web.errors == []


def test_user_controlled_strings_are_shown_as_text(web, live):
    web.open("/jobs")
    assert web.page.locator("#job-list").get_by_text(HOSTILE_NAME).count() >= 1
    assert web.page.locator("#job-list img").count() == 0
    web.open(f"/jobs/{live.job_id}")
    assert HOSTILE_LINE in web.page.locator("#log").inner_text()
    assert web.page.locator("#log script, #log b").count() == 0
    web.open(f"/evolve?op={live.trial_op}")
    assert "<b>not bold</b>" in web.page.locator("table.trials").inner_text()
    web.open(f"/?job={live.job_id}")
    assert web.dialogs == [] and web.errors == []


def test_log_search_and_trace_link(web, live):
    web.open(f"/jobs/{live.job_id}?search=ALERT('LOG')")
    assert web.page.locator("#log").inner_text().strip() == HOSTILE_LINE
    web.open(f"/?job={live.job_id}")
    href = web.page.get_attribute("a.trace", "href")
    with live.client() as c:
        trace = c.get(href).json()
    steps = [e for e in trace["traceEvents"] if e.get("cat") == "rtx.step"]
    assert steps and {e["name"] for e in trace["traceEvents"] if e.get("cat") == "rtx.swap"}


def test_governance_shows_the_signed_plan_and_its_verify_report(web, live, artifacts):
    web.open("/governance")
    assert "chain verified" in web.page.locator("#chain-status").inner_text()
    ledger = web.page.locator("#ledger table").inner_text()
    assert live.job_id in ledger                      # the plan published for the job
    web.page.locator("#ledger a.bundle-link").first.click()
    web.page.wait_for_url("**/governance/bundles/**")
    assert web.page.locator("#verify-status").inner_text() == "verified"
    assert web.page.locator("table", has_text="purl").locator("tbody tr").count() >= 1
    web.page.screenshot(path=str(artifacts / "bundle.png"), full_page=True)
    assert web.errors == []


def test_charts_keep_their_zoom_across_refreshes_and_show_utc(browser, live):
    """Every 5 s refresh redrew the charts without a uirevision (a zoom or a legend choice was
    lost), replaced the trials chart with a fresh element, and the charts drew times in the
    browser's zone where the tables print UTC."""
    import datetime

    context = browser.new_context(base_url=live.url, viewport={"width": 1400, "height": 900},
                                  timezone_id="America/New_York")
    try:
        page = context.new_page()
        page.goto(f"/?job={live.job_id}")
        page.wait_for_function("document.querySelector('#steps-chart').dataset.drawn === '1'")
        first = page.evaluate("document.querySelector('#steps-chart').data[0].x[0]")
        t_ns = next(s for s in page.request.get(f"/api/steps?job={live.job_id}").json()["series"])["t_ns"][0]
        utc = datetime.datetime.fromtimestamp(t_ns / 1e9, datetime.timezone.utc)
        assert first.startswith(utc.strftime("%Y-%m-%dT%H:%M")), (first, utc)
        zoomed = page.evaluate("""async () => {
            const el = document.querySelector('#steps-chart');
            const xs = el.data[0].x;
            await Plotly.relayout(el, {'xaxis.range': [xs[0], xs[xs.length - 1]]});
            return el.layout.xaxis.range; }""")
        page.wait_for_timeout(6500)                      # past one refresh
        assert page.evaluate("document.querySelector('#steps-chart').layout.xaxis.range") == zoomed
        page.goto("/evolve")
        page.wait_for_function("document.querySelector('#trials-chart').dataset.drawn === '1'")
        page.evaluate("document.querySelector('#trials-chart').kept = true")
        page.wait_for_timeout(6500)                      # past one refresh
        assert page.evaluate("document.querySelector('#trials-chart').kept === true")
        assert page.evaluate("document.querySelector('#trials-chart').layout.uirevision") == "trials-chart"
    finally:
        context.close()


SLOW_LOG_FETCH = """
  window.__inFlight = 0; window.__mostInFlight = 0;
  const fetchNow = window.fetch;
  window.fetch = async (url, opts) => {
    if (!String(url).includes('/logs?')) return fetchNow(url, opts);
    window.__inFlight += 1;
    window.__mostInFlight = Math.max(window.__mostInFlight, window.__inFlight);
    try { await new Promise((r) => setTimeout(r, 3000)); return await fetchNow(url, opts); }
    finally { window.__inFlight -= 1; }
  };
"""


def test_a_followed_log_answered_slower_than_its_poll_shows_each_line_once(browser, live):
    """Polls every 2 s, answers in 3 s (a slow store, a tunnel): a second poll started while the
    first waited, both read the same position, and every line was shown twice."""
    import collections

    code = "import time\nfor i in range(400):\n    print(f'tick {i}', flush=True); time.sleep(0.1)"
    with live.client(token=True) as c:
        job = c.post("/v1/jobs", json={"command": ["python", "-c", code], "name": "ticker"}).json()
        context = browser.new_context(base_url=live.url)
        try:
            page = context.new_page()
            page.add_init_script(SLOW_LOG_FETCH)
            page.goto(f"/jobs/{job['id']}")
            page.wait_for_timeout(11000)
            shown = [line for line in page.text_content("#log").splitlines() if line.startswith("tick ")]
            most = page.evaluate("window.__mostInFlight")
        finally:
            context.close()
            c.post(f"/v1/jobs/{job['id']}/cancel")
    twice = {line: n for line, n in collections.Counter(shown).items() if n > 1}
    assert len(shown) > 20 and not twice, (len(shown), list(twice.items())[:5])
    assert most == 1


def test_a_refresh_keeps_the_filter_text_the_user_typed(web, live):
    """The 5 s refresh replaced the trials section, the filter form in it, with the server's:
    text typed and not yet submitted was wiped."""
    web.page.goto("/evolve")
    web.page.fill("#trials input[name=op]", "rms_norm")
    web.page.fill("#trials input[name=variant]", "triton")
    web.page.click("h1")                                 # focus leaves the section
    web.page.wait_for_timeout(6500)                      # past one refresh
    assert web.page.input_value("#trials input[name=op]") == "rms_norm"
    assert web.page.input_value("#trials input[name=variant]") == "triton"
