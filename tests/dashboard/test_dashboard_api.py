"""The dashboard's JSON API against the live daemon: pagination bounds, 404 for unknown ids, 422
for bad parameters, injection attempts that stay data, read-only routes, no 5xx under fuzzing."""
from __future__ import annotations

import time

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from rtxops.telemetry import store_views as V

INJECTIONS = ["' OR '1'='1", "x'; DROP TABLE trials; --", "%", "_", "\\", "\" OR 1=1 --",
              "silu') UNION SELECT * FROM jobs --"]


@pytest.fixture(scope="module")
def api(live):
    with live.client() as c:
        yield c


def test_pagination_bounds(api, live):
    for bad in ({"limit": 0}, {"limit": 501}, {"offset": -1}, {"limit": "ten"}):
        assert api.get("/api/evolve/trials", params=bad).status_code == 422, bad
    ids = []
    for offset in (0, 2, 4):
        page = api.get("/api/evolve/trials", params={"limit": 2, "offset": offset}).json()
        assert page["total"] == len(live.trial_ids) and page["limit"] == 2 and page["offset"] == offset
        assert len(page["items"]) == max(0, min(2, len(live.trial_ids) - offset))
        ids += [t["trial_id"] for t in page["items"]]
    assert sorted(ids) == sorted(live.trial_ids)
    jobs = api.get("/api/jobs", params={"limit": 1, "offset": 1}).json()
    assert jobs["total"] == 1 and jobs["items"] == []
    kernels = api.get("/api/kernels", params={"job": live.job_id, "limit": 3}).json()
    assert len(kernels["items"]) == 3 and kernels["total"] > 3


@pytest.mark.parametrize("path", [
    "/api/jobs/no-such-job", "/api/jobs/no-such-job/logs", "/api/jobs/no-such-job/events",
    "/api/evolve/trials/no-such-trial", "/api/governance/bundles/sha256:0000",
    "/api/kernels/breakdown?job=no-such-job", "/jobs/no-such-job", "/governance/bundles/x",
    "/static/../pyproject.toml", "/static/vendor/other.js",
])
def test_unknown_ids_are_404(api, path):
    assert api.get(path).status_code == 404


@pytest.mark.parametrize("path,params", [
    ("/api/steps", {"window_s": "abc"}), ("/api/steps", {"window_s": 5}),
    ("/api/steps", {"until_ns": 5}), ("/api/steps", {"points": 1}),
    ("/api/jobs", {"state": "bogus"}), ("/api/kernels", {"job": "x" * 1025}),
    ("/api/kernels/breakdown", {}), ("/api/kernels/breakdown", {"job": "j", "span_s": 0}),
    ("/api/jobs/x/logs", {"stream": "stdin"}), ("/api/jobs/x/logs", {"limit": 5001}),
    ("/api/jobs/x/logs", {"after": -1}), ("/kernels", {"at_ns": "soon"}),
    ("/jobs", {"state": "<script>"}),
])
def test_bad_query_parameters_are_422(api, path, params):
    r = api.get(path, params=params)
    assert r.status_code == 422, (path, params, r.text)
    assert r.json()["detail"]


@pytest.mark.parametrize("attempt", INJECTIONS)
def test_injection_attempts_in_filters_are_plain_data(api, live, attempt):
    for path, name in (("/api/jobs", "search"), ("/api/evolve/trials", "op"),
                       ("/api/evolve/trials", "bucket"), ("/api/evolve/decisions", "kind"),
                       ("/api/evolve/tuning", "device"), ("/api/kernels", "op"), ("/api/steps", "job")):
        r = api.get(path, params={name: attempt})
        assert r.status_code == 200, (path, name, r.text)
        body = r.json()
        assert body.get("total", 0) == 0 and not body.get("items") and not body.get("series")
    logs = api.get(f"/api/jobs/{live.job_id}/logs", params={"search": attempt}).json()
    assert logs["lines"] == []
    assert live.store.query("SELECT count(*) AS n FROM trials")[0]["n"] == len(live.trial_ids)


def test_the_api_is_read_only(api, live):
    spec = api.get("/openapi.json").json()
    api_paths = {p: ops for p, ops in spec["paths"].items() if p.startswith("/api/")}
    assert len(api_paths) >= 15
    assert {m for ops in api_paths.values() for m in ops} == {"get"}
    for path in ("/api/jobs", "/api/evolve/trials", "/"):
        assert api.post(path, json={}).status_code == 405
        assert api.delete(path).status_code == 405


def test_filters_and_windows_select_the_right_rows(api, live):
    mine = api.get("/api/steps", params={"job": live.job_id}).json()
    assert [s["job_id"] for s in mine["series"]] == [live.job_id]
    assert [m["step"] for m in mine["markers"] if m["kind"] == "swap"] == [live.swap_step]
    assert api.get("/api/steps", params={"job": live.job_id, "until_ns": 10**18}).json()["series"] == []
    one = api.get("/api/evolve/trials", params={"variant": "tanh"}).json()
    assert one["total"] == 1 and one["items"][0]["variant"] == "tanh"
    # silu runs before the swap only in the job's first step: a window wide enough for a slow
    # start on a loaded machine (the default is 30 s on each side)
    brk = api.get("/api/kernels/breakdown", params={"job": live.job_id, "span_s": 3600}).json()
    assert brk["swap"]["step"] == live.swap_step
    assert {r["op"] for r in brk["before"]} >= {"silu"} and {r["op"] for r in brk["after"]} >= {"silu"}


def test_no_server_errors_under_fuzzing(live):
    """schemathesis over every /api operation, valid and invalid inputs, aimed at real ids too."""
    schema = schemathesis.openapi.from_url(live.url + "/openapi.json").include(path_regex="^/api/")
    server_errors, seen = [], set()
    aimed = {"job_id": live.job_id, "trial_id": live.trial_ids[0]}

    def check(case) -> None:
        response = case.call(timeout=60)
        seen.add((case.operation.path, response.status_code))
        if response.status_code >= 500:
            server_errors.append((case.formatted_path, case.query, response.status_code,
                                  response.text[:500]))

    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15
    for op in operations:
        strategy = op.as_strategy() | op.as_strategy(schemathesis.GenerationMode.NEGATIVE)
        for name, value in aimed.items():
            if "{" + name + "}" in op.path:
                strategy |= op.as_strategy(path_parameters={name: value})

        @given(case=strategy)
        @settings(max_examples=12, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        def fuzz(case):
            check(case)

        fuzz()
    assert not server_errors, server_errors
    assert ("/api/jobs/{job_id}", 200) in seen and ("/api/steps", 422) in seen


def test_kernel_table_pages_agree_with_the_store_kernel_stats(live):
    """The dashboard's paged kernel table computes what Store.kernel_stats does, page by page."""
    now = time.time_ns()
    since, until = now - 3600 * 10**9, now + 60 * 10**9
    expected = live.store.kernel_stats(since_ns=since, until_ns=until)
    got, offset = [], 0
    while True:
        total, rows = V.kernel_table(live.store, job_id=None, op=None, since_ns=since,
                                     until_ns=until, limit=7, offset=offset)
        assert total == len(expected)
        if not rows:
            break
        got += rows
        offset += 7
    key = ("job_id", "op", "bucket", "variant", "config", "phase")
    assert len(got) > 7
    by_key = {tuple(r[k] for k in key): r for r in got}
    for want in expected:
        row = by_key[tuple(want[k] for k in key)]
        assert {k: row[k] for k in want} == want
    for (job, op, bucket, _, _, phase), row in by_key.items():
        latest = max(r["last_ns"] for k, r in by_key.items() if (k[0], k[1], k[2], k[5]) == (job, op, bucket, phase))
        assert row["current"] == (row["last_ns"] == latest)


def test_the_trace_download_is_a_chrome_trace_of_the_window(api, live):
    """Times are relative to ``otherData.origin_unix_ns`` (it was overwritten by the window's
    details, leaving times no tool could place), and the job's steps are all there."""
    r = api.get("/api/trace", params={"job": live.job_id, "span_s": 3600})
    assert r.status_code == 200 and "attachment" in r.headers["content-disposition"]
    doc = r.json()
    other = doc["otherData"]
    assert other["rtxops.job"] == live.job_id and other["rtxops.truncated"] is False
    steps = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "rtx.step"]
    first = V.window_rows(live.store, job_id=live.job_id, since_ns=0, until_ns=2**62, limit=1)[0]
    assert other["origin_unix_ns"] == first["start_ns"]
    assert steps and min(e["ts"] for e in steps) >= 0


def test_a_job_id_holding_a_slash_opens(api, live):
    """Any OpenTelemetry client names its own job: ``team/run-7`` was a 404 on every job route."""
    from ..daemon.live import otlp_batch

    job = "team/run-7"
    request, _ = otlp_batch(5, seed=3, job_id=job)
    with live.client(token=True) as c:
        r = c.post("/v1/traces", content=request.SerializeToString(),
                   headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 200, r.text
    quoted = "team%2Frun-7"
    assert api.get(f"/api/jobs/{quoted}").json()["job_id"] == job
    assert api.get(f"/api/jobs/{quoted}/logs").json()["job_id"] == job
    assert api.get(f"/api/jobs/{quoted}/events").status_code == 200
    page = api.get(f"/jobs/{quoted}")
    assert page.status_code == 200 and job in page.text
    listed = api.get("/jobs", params={"search": "run-7"}).text
    assert 'href="/jobs/team' in listed


def test_a_job_id_ending_as_a_route_under_a_job_opens(api, live):
    """``team/logs`` asked for as /api/jobs/team/logs went to the logs of a job ``team``: a 404
    for the job its page shows. (A job ``team`` that exists keeps the route.)"""
    from ..daemon.live import otlp_batch

    for seed, job in enumerate(("team/logs", "team/events")):
        request, _ = otlp_batch(3, seed=40 + seed, job_id=job)
        with live.client(token=True) as c:
            r = c.post("/v1/traces", content=request.SerializeToString(),
                       headers={"Content-Type": "application/x-protobuf"})
            assert r.status_code == 200, r.text
        r = api.get(f"/api/jobs/{job.replace('/', '%2F')}")
        assert r.status_code == 200 and r.json()["job_id"] == job, r.text
    assert api.get(f"/api/jobs/{live.job_id}/logs").json()["job_id"] == live.job_id
    assert api.get("/api/jobs/nobody/logs").status_code == 404


def test_listed_job_ids_link_to_their_own_pages(api, live):
    """A 228-character id (OTLP takes any) was listed, then a 422 on its page; `exp/../other`
    linked as `/jobs/exp/../other`, which a browser resolves to another job's page."""
    import html
    import re
    import urllib.parse

    from ..daemon.live import otlp_batch

    long_id, dotted = "j" * 228, "exp/../other"
    with live.client(token=True) as c:
        for seed, job in enumerate((long_id, dotted)):
            request, _ = otlp_batch(3, seed=10 + seed, job_id=job)
            r = c.post("/v1/traces", content=request.SerializeToString(),
                       headers={"Content-Type": "application/x-protobuf"})
            assert r.status_code == 200, r.text
    for job in (long_id, dotted):
        listed = api.get("/jobs", params={"search": job[:20]}).text
        hrefs = [html.unescape(h) for h in re.findall(r'<a href="(/jobs/[^"]+)"', listed)]
        href, = [h for h in hrefs if urllib.parse.unquote(h[len("/jobs/"):]) == job]
        assert "/../" not in href     # (what a browser would resolve away)
        page = api.get(href)
        assert page.status_code == 200 and f"Job {html.escape(job)}" in page.text, href


def test_a_pinned_windows_kernel_page_asks_its_charts_and_links_about_that_window(api, live):
    """The before/after chart dropped `until_ns` (it asked about the window ending now, found no
    swap there for a job that ran earlier, and said 'No data'), and so did the "over time" links."""
    import html
    import re

    until = time.time_ns() + 60 * 10**9
    page = api.get("/kernels", params={"job": live.job_id, "window_s": 3600, "until_ns": until}).text
    src = html.unescape(re.search(r'id="breakdown-chart"[^>]*data-src="([^"]*)"', page).group(1))
    assert f"until_ns={until}" in src and "window_s=3600" in src
    links = [html.unescape(h) for h in re.findall(r'class="series-link" href="([^"]*)"', page)]
    assert links and all(f"until_ns={until}" in h for h in links)


def test_the_drops_window_is_counted_back_from_now(api):
    """It was counted back from the window's end, which runs a minute ahead of now: "last 15
    min" covered 14, and a 5-minute window said 6."""
    for window_s, said in ((300, 300), (900, 900), (3600, 900)):
        assert api.get("/api/ingest", params={"window_s": window_s}).json()["drops_window_s"] == said
