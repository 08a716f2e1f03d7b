"""The daemon's HTTP API against a real daemon process: the token on every mutating endpoint and on
ingest, 404 and 422 answers, health/readiness, Prometheus metrics that move, and a schemathesis fuzz
of the OpenAPI schema that must find no 5xx."""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import schemathesis
from google.rpc import code_pb2, status_pb2
from hypothesis import HealthCheck, Phase, given, settings
from prometheus_client.parser import text_string_to_metric_families

from .live import Daemons, otlp_batch


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One daemon for the cheap API tests of this module (each test only looks at what it changed)."""
    ds = Daemons(tmp_path_factory.mktemp("api"))
    yield ds.start()
    leftovers = ds.cleanup()
    assert not leftovers, f"processes outlived the tests: {leftovers}"


def test_mutating_endpoints_and_ingest_refuse_a_missing_or_wrong_token(shared):
    sleeper = shared.submit(["python", "-c", "import time; time.sleep(600)"])  # with the token: 201
    request, _ = otlp_batch(20, seed=7, job_id="auth-check")
    calls = {
        "submit": ("POST", "/v1/jobs", {"json": {"command": ["python", "-c", "pass"]}}, 201),
        "cancel": ("POST", f"/v1/jobs/{sleeper['id']}/cancel", {}, 200),
        "publish": ("POST", "/v1/plans", {"params": {"job": "auth-check"}, "json": {"version": 1}}, 201),
        "report": ("POST", "/v1/plans/report",
                   {"json": {"job": "auth-check", "version": 1, "reason": "refused in a test"}}, 204),
        "ingest": ("POST", "/v1/traces", {"content": request.SerializeToString(),
                                          "headers": {"Content-Type": "application/x-protobuf"}}, 200),
        "prune": ("POST", "/v1/telemetry/prune", {"json": {"older_than": "30d", "dry_run": True}}, 200),
    }
    jobs_before = shared.client().get("/v1/jobs").json()["total"]
    spans_before = shared.client().get("/v1/telemetry/stats").json().get("ingest spans", 0)
    no_scheme = httpx.Client(base_url=shared.url, headers={"Authorization": shared.token}, timeout=30.0)
    strangers = [shared.client(token=None), shared.client(token="not-the-token"), no_scheme]
    for stranger in strangers:
        for name, (method, path, kw, _) in calls.items():
            r = stranger.request(method, path, **kw)
            assert r.status_code == 401, (name, stranger.headers.get("authorization"), r.text)
            assert r.headers["www-authenticate"] == "Bearer", name
            if name == "ingest":  # OTLP answers with a google.rpc.Status in the request's encoding
                status = status_pb2.Status.FromString(r.content)
                assert status.code == code_pb2.UNAUTHENTICATED, status
            else:
                assert r.json() == {"detail": "missing or wrong bearer token"}, name
    no_scheme.close()

    # nothing changed
    c = shared.client()
    assert c.get("/v1/jobs").json()["total"] == jobs_before
    assert shared.job(sleeper["id"])["state"] in ("pending", "running")
    assert c.get("/v1/plans/current", params={"job": "auth-check"}).status_code == 404
    assert not [r for r in c.get("/v1/plans/reports").json()["reports"] if r["job_id"] == "auth-check"]
    assert c.get("/v1/telemetry/stats").json().get("ingest spans", 0) == spans_before

    # the same requests with the token go through (the scheme in any case: RFC 7235)
    answers = {}
    lower = httpx.Client(base_url=shared.url, headers={"Authorization": f"bearer {shared.token}"},
                         timeout=30.0)
    for name, (method, path, kw, expected) in calls.items():
        answers[name] = r = (lower if name == "publish" else c).request(method, path, **kw)
        assert r.status_code == expected, (name, r.text)
    lower.close()
    assert c.get("/v1/jobs").json()["total"] == jobs_before + 1
    assert shared.wait(answers["submit"].json()["id"])["state"] == "succeeded"
    assert shared.wait(sleeper["id"], 30)["state"] == "cancelled"
    assert c.get("/v1/plans/current", params={"job": "auth-check"}).json()["version"] == 1
    assert [r["reason"] for r in c.get("/v1/plans/reports").json()["reports"]
            if r["job_id"] == "auth-check"] == ["refused in a test"]
    assert c.get("/v1/telemetry/stats").json()["ingest spans"] == spans_before + 20
    # reading needs no token
    assert shared.client(token=None).get(f"/v1/jobs/{sleeper['id']}").status_code == 200


def test_a_request_addressed_to_another_host_is_refused(shared):
    """Reads need no token on the daemon's own machine: a page on another site could read job
    logs and span exports after pointing its own name at 127.0.0.1 (DNS rebinding). A loopback
    daemon answers loopback names only."""
    port = shared.url.rsplit(":", 1)[1]
    for host, status in ((f"127.0.0.1:{port}", 200), (f"localhost:{port}", 200),
                         (f"[::1]:{port}", 200), ("localhost", 200),
                         (f"attacker.example:{port}", 421), ("attacker.example", 421),
                         (f"127.0.0.1.attacker.example:{port}", 421)):
        r = httpx.get(shared.url + "/api/jobs", headers={"Host": host}, timeout=10)
        assert r.status_code == status, (host, r.text)


def test_unknown_job_is_404(shared):
    c = shared.client()
    for method, path in (("GET", "/v1/jobs/j-00000000"), ("GET", "/v1/jobs/j-00000000/logs"),
                         ("GET", "/v1/jobs/j-00000000/events"), ("POST", "/v1/jobs/j-00000000/cancel")):
        r = c.request(method, path)
        assert r.status_code == 404, (method, path, r.text)
        assert "j-00000000" in r.json()["detail"]


@pytest.mark.parametrize("body,reason", [
    ({}, ["command", "Field required"]),
    ({"command": []}, ["command", "at least 1 item"]),
    ({"command": "python train.py"}, ["command", "valid list"]),
    ({"command": [""]}, ["command: expected a non-empty list of strings"]),
    ({"command": ["python"], "bogus": 1}, ["bogus", "Extra inputs are not permitted"]),
    ({"command": ["python"], "restarts": -1}, ["restarts", "greater than or equal to 0"]),
    ({"command": ["python"], "nproc_per_node": 65}, ["nproc_per_node", "less than or equal to 64"]),
    ({"command": ["python"], "env": {"A": 1}}, ["env", "valid string"]),
    ({"command": ["python", "-c", "pass"], "nproc_per_node": 2}, ["`python SCRIPT ARGS`"]),
    ({"command": ["python", "a\0b"]}, ["command: an argument contains a NUL character"]),
    ({"command": ["python"], "env": {"A=B": "1"}}, ["env: 'A=B' cannot be passed to a process"]),
    ({"command": ["python"], "cwd": "/tmp\0x"}, ["cwd: contains a NUL character"]),
    (b"{not json", ["JSON decode error"]),
], ids=["no-command", "empty-command", "command-string", "empty-program", "extra-field", "negative-restarts",
        "too-many-ranks", "env-not-string", "torchrun-python-c", "nul-in-argument", "equals-in-env-name",
        "nul-in-cwd", "not-json"])
def test_bad_submit_bodies_are_422_with_the_reason(shared, body, reason):
    c = shared.client()
    before = c.get("/v1/jobs").json()["total"]
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = c.post("/v1/jobs", **kw)
    assert r.status_code == 422, r.text
    detail = json.dumps(r.json()["detail"])
    assert all(part in detail for part in reason), detail
    assert c.get("/v1/jobs").json()["total"] == before, "no job was created"


def _metrics(daemon) -> dict[tuple[str, tuple], float]:
    r = daemon.client().get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_health_readiness_and_metrics_that_move_after_a_job_and_ingest(shared):
    c = shared.client(token=None)
    health = c.get("/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    ready = c.get("/readyz")
    assert ready.status_code == 200 and ready.json() == {"ready": True, "problems": []}

    before = _metrics(shared)
    for name in ("rtxops_ingest_spans_total", "rtxops_ingest_batches_total",
                 "rtxops_ingest_requests_rejected_total", "rtxops_plan_swaps_total"):
        assert (name, ()) in before, sorted(before)
    succeeded = ("rtxops_jobs", (("state", "succeeded"),))
    assert succeeded in before and ("rtxops_job_restarts_total", (("reason", "crash"),)) in before

    job = shared.submit(["python", "-c", "print('hello')"])
    assert shared.wait(job["id"])["state"] == "succeeded"
    for seed in (1, 2):
        request, _ = otlp_batch(50, seed=seed, job_id="metrics")
        assert shared.ingest(request).status_code == 200
    r = shared.client().post("/v1/traces", content=b"x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415

    after = _metrics(shared)
    assert after[succeeded] == before[succeeded] + 1
    assert after[("rtxops_ingest_spans_total", ())] == before[("rtxops_ingest_spans_total", ())] + 100
    assert after[("rtxops_ingest_batches_total", ())] == before[("rtxops_ingest_batches_total", ())] + 2
    rejected = ("rtxops_ingest_requests_rejected_total", ())
    assert after[rejected] == before[rejected] + 1
    assert after[("rtxops_store_queue_batches", ())] == 0


def test_openapi_fuzz_finds_no_server_errors(daemon):
    """Every operation in /openapi.json, schema-valid and schema-violating inputs, with the token.

    Nothing is excluded. One thing is bounded: POST /v1/jobs starts real processes, so a fuzzed
    command's program is moved under a directory that does not exist (``exec`` fails at once)
    instead of running whatever the fuzzer typed (``rm``, ``yes``, or torchrun with 64 ranks and
    1000 restarts). Every field is still fuzzed and validated; the job is accepted or refused, and
    an accepted one fails to start, as a mistyped command would."""
    finished = daemon.submit(["python", "-c", "print('done')"])
    daemon.wait(finished["id"])
    schema = schemathesis.openapi.from_url(daemon.url + "/openapi.json")
    auth = {"Authorization": f"Bearer {daemon.token}"}
    server_errors, seen = [], set()

    def check(case) -> None:
        if case.headers:  # the schema lists the Authorization header; the real token goes instead
            case.headers = {k: v for k, v in case.headers.items() if k.lower() != "authorization"}
        if case.operation.path == "/v1/jobs" and case.method == "POST" and isinstance(case.body, dict):
            command = case.body.get("command")
            if isinstance(command, list) and command and isinstance(command[0], str) and command[0]:
                command[0] = "/nonexistent/rtxops-fuzz/" + command[0].replace("/", "_")
        response = case.call(headers=auth, timeout=60)
        seen.add((case.method, case.operation.path, response.status_code))
        if response.status_code >= 500:
            server_errors.append((case.method, case.formatted_path, case.query, case.body,
                                  response.status_code, response.text[:500]))

    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15
    for op in operations:
        strategy = op.as_strategy() | op.as_strategy(schemathesis.GenerationMode.NEGATIVE)
        if "{job_id}" in op.path:  # also aim at a job that exists, not only at 404s
            strategy |= op.as_strategy(path_parameters={"job_id": finished["id"]})

        @given(case=strategy)
        @settings(max_examples=40, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        def fuzz(case):
            check(case)

        fuzz()
    assert not server_errors, server_errors
    assert ("POST", "/v1/jobs", 201) in seen and ("POST", "/v1/jobs", 422) in seen
    assert ("GET", "/v1/jobs/{job_id}/logs", 200) in seen and ("GET", "/v1/jobs/{job_id}", 404) in seen


def test_parquet_exports_leave_no_open_files_behind(shared):
    fds = lambda: len(os.listdir(f"/proc/{shared.pid}/fd"))  # noqa: E731
    c = shared.client()
    assert c.get("/v1/telemetry/export", params={"format": "parquet"}).status_code == 200
    before = fds()
    for _ in range(30):
        r = c.get("/v1/telemetry/export", params={"format": "parquet"})
        assert r.status_code == 200 and r.content[:4] == b"PAR1"
    assert fds() - before < 5  # one leaked descriptor per export before


def test_log_long_polls_never_starve_the_other_endpoints(shared):
    job = shared.submit(["python", "-c", "import time; time.sleep(600)"])
    url = f"/v1/jobs/{job['id']}/logs"
    # more long-polls than anyio's 40 worker threads: past MAX_LONG_POLLS they answer at once
    with ThreadPoolExecutor(48) as pool:
        polls = [pool.submit(httpx.get, shared.url + url, params={"wait_s": 8, "after": 10**9},
                             timeout=30) for _ in range(48)]
        time.sleep(1.0)
        started = time.monotonic()
        assert shared.client().get("/healthz").status_code == 200
        assert time.monotonic() - started < 3
        # past the slots an empty answer is paced (a follower polls again at once: it spun)
        started = time.monotonic()
        r = shared.client().get(url, params={"wait_s": 2, "after": 10**9})
        assert r.status_code == 200 and r.json()["lines"] == [] and time.monotonic() - started >= 0.9
        answers = [p.result() for p in polls]
    assert all(r.status_code == 200 for r in answers)
    shared.client().post(f"/v1/jobs/{job['id']}/cancel")


def test_long_polls_arriving_together_past_the_slots_answer_without_queueing(shared):
    """Polls past MAX_LONG_POLLS answer at once (paced); arriving together, they all saw a free
    slot and the ones past it queued for one: a 3-second poll took 6 seconds or more."""
    from rtxops.daemon.api_jobs import MAX_LONG_POLLS

    job = shared.submit(["python", "-c", "import time; time.sleep(600)"])
    url = f"{shared.url}/v1/jobs/{job['id']}/logs"
    ready = threading.Barrier(2 * MAX_LONG_POLLS)

    def poll():
        ready.wait(30)
        started = time.monotonic()
        r = httpx.get(url, params={"wait_s": 3, "after": 10**9}, timeout=60)
        return r.status_code, time.monotonic() - started

    with ThreadPoolExecutor(2 * MAX_LONG_POLLS) as pool:
        answers = list(pool.map(lambda _: poll(), range(2 * MAX_LONG_POLLS)))
    assert all(code == 200 for code, _ in answers)
    assert max(took for _, took in answers) < 5.5, sorted(round(t, 1) for _, t in answers)
    shared.client().post(f"/v1/jobs/{job['id']}/cancel")


def test_a_job_id_as_long_as_ingest_takes_is_taken_by_every_endpoint_that_names_a_job(shared):
    """Ingest takes job ids up to MAX_JOB_ID characters (the dashboard too); the daemon's own
    endpoints stopped at 200 and answered 422 for such a job. A refusal's version is bounded
    as plans' are."""
    from rtxops.telemetry.otlp import MAX_JOB_ID

    c = shared.client()
    job = "j" * MAX_JOB_ID
    request, _ = otlp_batch(3, seed=11, job_id=job)
    r = c.post("/v1/traces", content=request.SerializeToString(),
               headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 200, r.text
    for path in ("/v1/plans/current", "/v1/plans/bundle", "/v1/evolve/decisions",
                 "/v1/evolve/trials", "/v1/evolve/hotspots"):
        assert c.get(path, params={"job": job}).status_code in (200, 404), path
    assert c.get("/v1/telemetry/export", params={"format": "otlp-json", "job": job}).status_code == 200
    r = c.post("/v1/plans/report", json={"job": job, "version": 3, "reason": "long id"})
    assert r.status_code == 204, r.text
    assert c.post("/v1/plans/report", json={"job": job + "j", "version": 3, "reason": "r"}).status_code == 422
    for version in (10**30, -2):
        r = c.post("/v1/plans/report", json={"job": "versions", "version": version, "reason": "r"})
        assert r.status_code == 422, (version, r.text)
    assert not [x for x in c.get("/v1/plans/reports").json()["reports"] if x["job_id"] == "versions"]


def test_text_that_is_not_unicode_is_refused_and_breaks_nothing(shared):
    """A lone surrogate is a valid JSON escape but no Unicode text: 422 wherever it is sent (also
    where the error echoes it), no job made, and the job list still answers."""
    c = shared.client()
    jobs_before = c.get("/v1/jobs").json()["total"]
    for path, body in (("/v1/jobs", '{"command": ["python", "-c", "pass", "\\ud800"]}'),
                       ("/v1/jobs", '{"command": ["python", "-c", "pass"], "name": "\\udfff"}'),
                       ("/v1/jobs", '{"command": ["python"], "env": {"A": "\\ud800"}}'),
                       ("/v1/plans/report", '{"job": "\\ud800", "version": 1, "reason": "r"}'),
                       ("/v1/plans", '{"version": 1, "defaults": {"\\ud800": "x"}}'),
                       ("/v1/evolve/tune", '{"op": "\\ud800"}')):
        r = c.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 422, (path, body, r.status_code, r.text)
        assert "\\ud8" in r.text or "\\udf" in r.text or "surrogate" in r.text, r.text
    r = c.get("/v1/jobs")
    assert r.status_code == 200 and r.json()["total"] == jobs_before


def test_a_jobs_environment_values_are_not_shown(shared):
    """Reads need no token: the names of a job's environment show, its values (credentials,
    often) do not."""
    job = shared.submit(["python", "-c", "pass"], env={"WANDB_API_KEY": "s3cr3t-value"})
    for path in (f"/v1/jobs/{job['id']}", "/v1/jobs"):
        r = shared.client(token=None).get(path)
        assert r.status_code == 200 and "s3cr3t-value" not in r.text
    assert shared.client().get(f"/v1/jobs/{job['id']}").json()["spec"]["env"] == {"WANDB_API_KEY": "***"}


def test_an_export_of_an_unknown_job_is_404(shared):
    r = shared.client().get("/v1/telemetry/export", params={"format": "otlp-json", "job": "no-such-job"})
    assert r.status_code == 404 and "no job 'no-such-job'" in r.json()["detail"]


def test_the_cli_streams_a_json_export_from_the_daemon_into_a_whole_file(shared, tmp_path):
    """Through a running daemon the export streams (no whole document in the daemon); the file
    holds every span of the job, and an export that fails leaves no file behind."""
    from rtxops.daemon.client import DaemonClient, DaemonError

    job = f"export-{time.time_ns()}"
    request, ids = otlp_batch(300, seed=11, job_id=job)
    c = shared.client()
    r = c.post("/v1/traces", content=request.SerializeToString(),
               headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 200, r.text
    client = DaemonClient(shared.url, shared.token)
    out = tmp_path / "o.json"
    assert client.export("otlp-json", job, out) == out.stat().st_size
    doc = json.loads(out.read_text())
    assert {s["spanId"] for rs in doc["resourceSpans"] for ss in rs["scopeSpans"]
            for s in ss["spans"]} == ids
    missing = tmp_path / "m.json"
    with pytest.raises(DaemonError) as refused:
        client.export("chrome-trace", "no-such-job", missing)
    # a sentence, not the response's JSON
    assert str(refused.value) == "404: no job 'no-such-job' in the store", str(refused.value)
    assert not missing.exists() and not (tmp_path / "m.json.part").exists()


def test_the_api_docs_page_needs_no_internet(shared):
    """/docs was FastAPI's Swagger page, whose scripts come from cdn.jsdelivr.net: blank on a
    machine without internet access. It is now one self-contained page."""
    r = shared.client(token=None).get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<script" not in r.text and "cdn." not in r.text and "https://" not in r.text
    for path in ("/v1/jobs", "/v1/traces", "/v1/plans", "/v1/telemetry/export", "/healthz"):
        assert f"<code>{path}</code>" in r.text, path
    assert shared.client(token=None).get("/openapi.json").status_code == 200


def test_a_refused_request_reads_as_a_sentence_at_the_cli(shared):
    """`rtxops submit --nproc-per-node 0` printed pydantic's raw error list."""
    from rtxops.daemon.client import DaemonClient, DaemonError

    client = DaemonClient(shared.url, shared.token)
    with pytest.raises(DaemonError) as e:
        client.submit(command=["python", "-c", "pass"], nproc_per_node=0)
    message = str(e.value)
    assert message.startswith("422: nproc_per_node: ") and "greater than or equal to 1" in message
    assert "{" not in message and "'type'" not in message


def test_cancelling_an_unknown_tuning_task_is_404_and_needs_the_token(shared):
    assert shared.client(token=None).post("/v1/evolve/tune/nope/cancel").status_code == 401
    r = shared.client().post("/v1/evolve/tune/nope/cancel")
    assert r.status_code == 404 and "no tuning task 'nope'" in r.json()["detail"]


def test_rtxops_run_gives_the_job_its_callers_environment_with_a_daemon_running(shared, tmp_path):
    """A job sees the variables of the shell that ran `rtxops run` whether a daemon was up or
    not (CUDA_VISIBLE_DEVICES, credentials); the daemon's own settings still apply on top."""
    import subprocess

    from .live import RTXOPS, clean_env

    own_bin = tmp_path / "bin"   # a program of the caller's PATH (the daemon's PATH replaced it)
    own_bin.mkdir()
    (own_bin / "my-tool").write_text("#!/bin/sh\necho tool\n")
    (own_bin / "my-tool").chmod(0o755)
    env = clean_env(shared.mark, RTXOPS_HOME=str(shared.home), MY_SETTING="hello",
                    CUDA_VISIBLE_DEVICES="1")
    env["PATH"] = f"{own_bin}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    r = subprocess.run([*RTXOPS, "run", "--no-summary", "--", "sh", "-c",
                        'echo "[$MY_SETTING][$CUDA_VISIBLE_DEVICES][${RTXOPS_DAEMON:+daemon}]"; my-tool; '
                        'command -v python'],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    said, tool, python = r.stdout.split()
    assert said == "[hello][1][daemon]" and tool == "tool"
    assert os.path.dirname(python) == os.path.dirname(sys.executable)   # rtxops's interpreter first
    job = shared.client(token=None).get("/v1/jobs", params={"limit": 1}).json()["jobs"][0]
    assert "hello" not in json.dumps(job)       # neither values nor names are shown
    assert job["spec"]["base_env"].endswith("variables of the submitting shell")
    assert os.stat(shared.home / "rtxops.duckdb").st_mode & 0o077 == 0


def test_run_and_submit_name_what_is_not_utf8_with_a_daemon_running(shared, tmp_path):
    """Python keeps bytes that are not UTF-8 (a Latin-1 folder name in OLDPWD, a file name) as
    surrogate escapes, which JSON cannot carry: `rtxops run`/`submit` printed a UnicodeEncodeError
    traceback when a daemon was up (and worked without one)."""
    import subprocess

    from .live import RTXOPS, clean_env

    env = clean_env(shared.mark, RTXOPS_HOME=str(shared.home))
    before = shared.client().get("/v1/jobs").json()["total"]
    latin1 = os.fsdecode(b"/home/u/caf\xe9")
    cases = [(["run", "--no-summary", "--", "echo", "hi"], {"OLDPWD": latin1},
              "environment variable OLDPWD holds bytes that are not UTF-8 ('/home/u/caf\\xe9')"),
             (["submit", "--", "cat", os.fsdecode(b"/tmp/f\xff")], {},
              "command argument 1 holds bytes that are not UTF-8 ('/tmp/f\\xff')")]
    for args, extra, said in cases:
        r = subprocess.run([*RTXOPS, *args], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path, env={**env, **extra})
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert said in " ".join(r.stderr.split()) and "Traceback" not in r.stderr, r.stderr
    assert shared.client().get("/v1/jobs").json()["total"] == before


@pytest.mark.parametrize("path, body", [
    ("/v1/jobs", b'{"command": ["sh"], "grace_s": 1e400}'),
    ("/v1/jobs", b'{"command": ["sh"], "hang_timeout_s": NaN}'),
    ("/v1/plans/report", b'{"job": "x", "version": 1e400, "reason": "r"}'),
])
def test_a_refused_non_finite_number_is_a_422_not_a_server_error(shared, path, body):
    r = shared.client().post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["detail"]


def test_submit_takes_a_first_step_timeout_and_refuses_a_missing_cwd(shared, tmp_path):
    c = shared.client()
    job = c.post("/v1/jobs", json={"command": ["python", "-c", "pass"], "hang_timeout_s": 5,
                                   "first_step_timeout_s": 120}).json()
    assert job["spec"]["first_step_timeout_s"] == 120
    r = c.post("/v1/jobs", json={"command": ["python", "-c", "pass"], "first_step_timeout_s": 5})
    assert r.status_code == 422 and "needs hang_timeout_s" in r.text
    r = c.post("/v1/jobs", json={"command": ["python"], "cwd": str(tmp_path / "nowhere")})
    assert r.status_code == 422 and "is not a directory" in r.text


def test_a_json_body_past_the_limit_is_refused_before_it_is_parsed(shared):
    """FastAPI parses a body before the token check: an unauthenticated 5 MB body is a 413, not
    parsed; ingest keeps its own larger limit."""
    body = b'{"command": ["python"], "name": "' + b"x" * (5 << 20) + b'"}'
    r = shared.client(token=None).post("/v1/jobs", content=body,
                                       headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text[:200]
    request, _ = otlp_batch(12_000, seed=9, job_id="big-ingest")
    assert len(request.SerializeToString()) > 4 << 20
    assert shared.ingest(request).status_code == 200


def test_job_events_come_in_pages_and_a_huge_log_cursor_is_refused(shared):
    """Every event of a job came in one answer (a job's hang restarts store every rank's
    stacks: unbounded); a log cursor past DuckDB's integers was a 500."""
    job = shared.submit(["python", "-c", "print('hi')"])
    shared.wait(job["id"])
    c = shared.client()
    whole = c.get(f"/v1/jobs/{job['id']}/events", params={"limit": 10000}).json()
    assert len(whole["events"]) >= 3 and whole["next_offset"] is None
    pages, offset = [], 0
    while offset is not None:
        page = c.get(f"/v1/jobs/{job['id']}/events", params={"limit": 2, "offset": offset}).json()
        assert len(page["events"]) <= 2
        pages += page["events"]
        offset = page["next_offset"]
    assert pages == whole["events"]
    assert c.get(f"/v1/jobs/{job['id']}/events", params={"limit": 10001}).status_code == 422
    r = c.get(f"/v1/jobs/{job['id']}/logs", params={"after": 10 ** 40})
    assert r.status_code == 422, r.text
