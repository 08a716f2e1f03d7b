"""POST /v1/traces through FastAPI's TestClient: status codes, bodies, and that bad input stores
nothing and leaves the receiver answering."""
from __future__ import annotations

import gzip
import json
import time

import pytest
from fastapi.testclient import TestClient
from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from rtxops.telemetry import synthetic
from rtxops.telemetry.otlp import JSON, PROTOBUF
from rtxops.telemetry.receiver import make_app
from rtxops.telemetry.store import Store

from .otlp_helpers import request, span
from .test_otlp import otlp_json

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PB = {**AUTH, "Content-Type": PROTOBUF}
MAX_BODY = 2 << 20
MAX_PLAIN = 8 << 20


@pytest.fixture
def served(tmp_path):
    store = Store(tmp_path / "r.duckdb")
    app = make_app(store, token=TOKEN, max_body_bytes=MAX_BODY, max_decompressed_bytes=MAX_PLAIN)
    with TestClient(app) as client:
        yield client, store
    store.close()


def stored(store: Store) -> tuple[int, int]:
    return (store.query("SELECT count(*) AS n FROM spans")[0]["n"],
            store.query("SELECT count(*) AS n FROM ingest_batches")[0]["n"])


def good_body(n: int = 20) -> bytes:
    return synthetic.otlp_request(n, seed=n).SerializeToString()


def test_protobuf_and_gzip_and_json_are_stored(served):
    client, store = served
    r = client.post("/v1/traces", content=good_body(20), headers=PB)
    assert r.status_code == 200 and r.headers["content-type"] == PROTOBUF
    assert not ExportTraceServiceResponse.FromString(r.content).HasField("partial_success")
    r = client.post("/v1/traces", content=gzip.compress(good_body(30)),
                    headers={**PB, "Content-Encoding": "gzip"})
    assert r.status_code == 200
    body = json.dumps(otlp_json(request([span(attrs={"rtx.op": "from-json"})]))).encode()
    r = client.post("/v1/traces", content=body, headers={**AUTH, "Content-Type": JSON})
    assert r.status_code == 200 and r.headers["content-type"] == JSON and r.json() == {}
    assert stored(store) == (51, 3)
    assert store.query("SELECT count(*) AS n FROM spans WHERE op = 'from-json'") == [{"n": 1}]


def test_empty_request_is_a_success_with_nothing_stored(served):
    client, store = served
    assert client.post("/v1/traces", content=b"", headers=PB).status_code == 200
    assert stored(store) == (0, 0)


def _chunks(total: int, size: int = 1 << 16):
    sent = 0
    while sent < total:
        yield b"\x0a" * min(size, total - sent)
        sent += size


def _too_many_attributes() -> bytes:
    return request([span(attrs={f"a{i}": i for i in range(100_000)})]).SerializeToString()


def _bad_utf8() -> bytes:
    return request([span(attrs={"k": "PLACEHOLDER"})]).SerializeToString().replace(
        b"PLACEHOLDER", b"PLACEHOLDE\xc3")


def _bad_utf8_name() -> bytes:
    return request([span("PLACEHOLDER")]).SerializeToString().replace(b"PLACEHOLDER", b"\xffLACEHOLDER")


def _short_trace_id() -> bytes:
    return request([span(trace_id=b"\x01" * 8)]).SerializeToString()


def _event_time_past_2_63() -> bytes:
    return request([span(events=[Span.Event(time_unix_nano=2**64 - 1, name="e")])]).SerializeToString()


def _empty_events(link: bool = False) -> bytes:
    """300 spans of 1024 empty events each (2 bytes apiece on the wire, a row each in memory):
    300 kB that gzips to a few hundred bytes. ``link``: one the C decoder leaves to Python."""
    one = span(events=[Span.Event()] * 1024)
    if link:
        one.links.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    return gzip.compress(request([one] * 300).SerializeToString())


def _many_gzip_members() -> bytes:
    return b"".join(gzip.compress(b"") for _ in range(10_000)) + gzip.compress(good_body(5))


BAD = {
    # name: (body, extra headers, status, words expected in the reason)
    "truncated protobuf": (lambda: good_body(50)[:-9], {}, 400, "truncated"),
    "garbage protobuf": (lambda: b"\xff\xff\xff\xff", {}, 400, "not a valid OTLP protobuf"),
    "wrong content type": (good_body, {"Content-Type": "text/plain"}, 415, "unsupported content type"),
    "no content type": (good_body, {"Content-Type": ""}, 415, "unsupported content type"),
    "unsupported encoding": (good_body, {"Content-Encoding": "br"}, 415, "content encoding"),
    "gzip bomb": (lambda: gzip.compress(b"\0" * (200 << 20), 9), {"Content-Encoding": "gzip"}, 413,
                  "decompresses to over"),
    "invalid gzip": (lambda: b"\x1f\x8b\x08\x00garbage", {"Content-Encoding": "gzip"}, 400,
                     "gzip"),
    "not gzip at all": (good_body, {"Content-Encoding": "gzip"}, 400, "not valid gzip"),
    "truncated gzip": (lambda: gzip.compress(good_body(50))[:-20], {"Content-Encoding": "gzip"}, 400,
                       "gzip"),
    "oversized body": (lambda: b"\x0a" * (MAX_BODY + 1), {}, 413, "over the"),
    "oversized chunked body": (lambda: _chunks(MAX_BODY + 100), {}, 413, "over the"),
    "invalid JSON": (lambda: b'{"resourceSpans": [', {"Content-Type": JSON}, 400, "not valid JSON"),
    "JSON not UTF-8": (lambda: b'{"resourceSpans": [{"x": "\xff"}]}', {"Content-Type": JSON}, 400,
                       "UTF-8"),
    "JSON integer of 5000 digits": (lambda: b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"kind": '
                                    + b"1" * 5000 + b"}]}]}]}", {"Content-Type": JSON}, 400,
                                    "holds a number that cannot be read"),
    "10^5 attributes": (_too_many_attributes, {}, 400, "attributes; the limit is"),
    "non-UTF-8 attribute": (_bad_utf8, {}, 400, "UTF-8"),
    "non-UTF-8 span name": (_bad_utf8_name, {}, 400, "UTF-8"),
    "short trace id": (_short_trace_id, {}, 400, "trace_id has 8 bytes"),
    "event time past 2^63": (_event_time_past_2_63, {}, 400, "event time is past the year 2262"),
    "307 200 empty events": (_empty_events, {"Content-Encoding": "gzip"}, 400,
                             "307200 span events; the limit is 262144 a request"),
    "the same with a link": (lambda: _empty_events(link=True), {"Content-Encoding": "gzip"}, 400,
                             "307200 span events; the limit is 262144 a request"),
    "10^4 gzip members": (_many_gzip_members, {"Content-Encoding": "gzip"}, 400, "over 64 members"),
    # listed on the dashboard, then a 422 on every page and route of its own
    "a job id of 1025 characters": (lambda: synthetic.otlp_request(5, seed=3, job_id="j" * 1025)
                                    .SerializeToString(), {}, 400,
                                    "rtx.job.id of 1025 characters; the limit is 1024"),
    "a job id of ..": (lambda: synthetic.otlp_request(5, seed=3, job_id="..").SerializeToString(),
                       {}, 400, "'.' or '..' names no job"),
    "no token": (good_body, {"Authorization": ""}, 401, "bearer token"),
    "wrong token": (good_body, {"Authorization": "Bearer nope"}, 401, "bearer token"),
    "token under another scheme": (good_body, {"Authorization": f"Basic {TOKEN}"}, 401, "bearer token"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_stores_nothing_and_the_server_lives_on(served, case):
    client, store = served
    make, headers, status, reason = BAD[case]
    r = client.post("/v1/traces", content=make(), headers={**PB, **headers})
    assert r.status_code == status, r.content[:300]
    if r.headers["content-type"] == JSON:
        message = r.json()["message"]
    else:
        message = status_pb2.Status.FromString(r.content).message
    assert reason in message
    if status == 401:
        assert r.headers["www-authenticate"] == "Bearer"
    assert stored(store) == (0, 0)
    assert store.stats()["requests_rejected"] == (0 if status == 401 else 1)
    ok = client.post("/v1/traces", content=good_body(5), headers=PB)
    assert ok.status_code == 200 and stored(store) == (5, 1)


@pytest.mark.parametrize("cache_hits", [1, "1"], ids=["typed cache counts", "other cache counts"])
def test_figures_past_2_53_are_kept_in_the_attributes_and_out_of_the_sums(served, cache_hits):
    """One kernel span whose total_ns was past 2^53 got the whole request refused with a final
    400 (a stock SDK does not retry it: its 99 other spans were lost)."""
    client, store = served
    body = request([span("rtx.kernel", {"rtx.op": "gelu", "rtx.count": 1, "rtx.total_ns": 2**53 + 2,
                                        "rtx.cache.hits": cache_hits}),
                    span("http.request", {"rtx.count": -1}),
                    span("rtx.kernel", {"rtx.op": "gelu", "rtx.count": 2, "rtx.total_ns": 500})])
    r = client.post("/v1/traces", content=body.SerializeToString(), headers=PB)
    assert r.status_code == 200, r.content
    rows = {(row["name"], row["count"]): row for row in store.query(
        "SELECT name, count, total_ns, attributes FROM spans")}
    assert len(rows) == 3
    big = rows[("rtx.kernel", 1)]
    assert big["total_ns"] is None and json.loads(big["attributes"])["rtx.total_ns"] == 2**53 + 2
    assert json.loads(rows[("http.request", None)]["attributes"])["rtx.count"] == -1
    assert store.query("SELECT sum(total_ns) AS t FROM kernel_minutes") == [{"t": 500}]


@pytest.mark.parametrize("hits", [3 * 2**61, str(3 * 2**61)], ids=["typed", "other"])
def test_cache_counts_past_2_53_do_not_wrap_the_rollups_sums(served, hits):
    """Two kernel spans with 1.5 * 2^62 cache hits summed to a negative count, and after three
    such requests every compaction of kernel_minutes failed (an INT128 sum into a BIGINT)."""
    client, store = served
    start = time.time_ns() - 600 * 10**9
    for i in range(3):
        body = request([span("rtx.kernel", {"rtx.op": "gelu", "rtx.count": 1, "rtx.total_ns": 100,
                                            "rtx.cache.hits": hits, "rtx.cache.misses": 1},
                             start=start + i)
                        for _ in range(2)])
        assert client.post("/v1/traces", content=body.SerializeToString(), headers=PB).status_code == 200
    store.compact(before_ns=time.time_ns())
    assert store.query("SELECT sum(cache_hits) AS h, sum(cache_misses) AS m, sum(calls) AS c "
                       "FROM kernel_minutes") == [{"h": None, "m": 6, "c": 6}]


def test_unset_resources_and_attribute_values_are_empty_not_refused(served):
    """A ResourceSpans without a resource ("no resource info is known", the proto says) and a
    KeyValue without a value (proto3's empty value) got a final 400: nothing was stored."""
    client, store = served
    req = request([span(attrs={"rtx.op": "gelu", "set": "yes"})])
    req.resource_spans[0].ClearField("resource")
    req.resource_spans[0].scope_spans[0].spans[0].attributes.add(key="unset")
    r = client.post("/v1/traces", content=req.SerializeToString(), headers=PB)
    assert r.status_code == 200, r.content
    body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{
        "traceId": "0" * 31 + "1", "spanId": "0" * 15 + "2", "name": "from-json",
        "startTimeUnixNano": "1", "endTimeUnixNano": "2",
        "attributes": [{"key": "nokey"}, {"key": "k", "value": {"stringValue": "v"}}]}]}]}]})
    r = client.post("/v1/traces", content=body.encode(), headers={**AUTH, "Content-Type": JSON})
    assert r.status_code == 200, r.content
    attrs = {row["name"]: json.loads(row["attributes"]) for row in store.query(
        "SELECT name, attributes FROM spans")}
    assert attrs["rtx.kernel"] == {"set": "yes", "unset": None}
    assert attrs["from-json"] == {"nokey": None, "k": "v"}


def test_resources_under_two_schema_urls_stay_two(served):
    """The resource id hashed the attributes only: the second schema URL's spans were stored
    under the first one's resource row."""
    client, store = served
    req = request([span("schema-1")])
    req.resource_spans.add().CopyFrom(request([span("schema-2")]).resource_spans[0])
    req.resource_spans[0].schema_url = "https://opentelemetry.io/schemas/1.0"
    req.resource_spans[1].schema_url = "https://opentelemetry.io/schemas/2.0"
    assert client.post("/v1/traces", content=req.SerializeToString(), headers=PB).status_code == 200
    rows = store.query("SELECT s.name, r.schema_url FROM spans s JOIN resources r USING (resource_id) "
                       "ORDER BY s.name")
    assert [r["schema_url"][-3:] for r in rows] == ["1.0", "2.0"]


def test_json_errors_are_json(served):
    client, _ = served
    r = client.post("/v1/traces", content=b"[", headers={**AUTH, "Content-Type": JSON})
    assert r.status_code == 400 and r.json()["code"] == 3 and "JSON" in r.json()["message"]


def test_only_post(served):
    client, _ = served
    assert client.get("/v1/traces", headers=AUTH).status_code == 405


def test_the_bearer_scheme_is_taken_in_any_case(served):
    """RFC 7235: the scheme is case-insensitive; a client sending ``bearer`` got 401."""
    client, store = served
    r = client.post("/v1/traces", content=good_body(4),
                    headers={**PB, "Authorization": f"bearer {TOKEN}"})
    assert r.status_code == 200 and stored(store) == (4, 1)


def test_no_token_configured_means_no_check(tmp_path):
    with Store(tmp_path / "open.duckdb") as store, TestClient(make_app(store, token=None)) as client:
        assert client.post("/v1/traces", content=good_body(3),
                           headers={"Content-Type": PROTOBUF}).status_code == 200


def test_large_array_attributes_are_decoded_but_not_kept(served):
    from rtxops.telemetry import _wire

    client, store = served
    _wire._arrays.clear()
    for i, n in enumerate((5, 5000)):  # a histogram-sized array, and a large one
        values = [{"intValue": str(10**12 + i * 10**6 + k)} for k in range(n)]
        one = {"traceId": "00" * 15 + "01", "spanId": f"{i + 1:016x}", "name": "rtx.step",
               "startTimeUnixNano": "1", "endTimeUnixNano": "2",
               "attributes": [{"key": "hist", "value": {"arrayValue": {"values": values}}}]}
        body = json.dumps({"resourceSpans": [{"resource": {"attributes": []},
                                              "scopeSpans": [{"spans": [one]}]}]})
        r = client.post("/v1/traces", content=body, headers={**AUTH, "Content-Type": JSON})
        assert r.status_code == 200
    assert len(_wire._arrays) == 1  # the small one only (every large one stayed in memory before)
    rows = store.query("SELECT attributes FROM spans ORDER BY span_id")
    assert [len(json.loads(r["attributes"])["hist"]) for r in rows] == [5, 5000]


def test_a_batch_the_writer_does_not_take_in_time_is_withdrawn_not_written_later(tmp_path):
    """A writer held up past the commit timeout: 503 with Retry-After, and the batch never lands
    afterwards (the client's retry must not store it twice); the retry then stores it once."""
    import threading

    store = Store(tmp_path / "w.duckdb")
    app = make_app(store, token=TOKEN, commit_timeout_s=0.5)
    release = threading.Event()
    held = store.run_write(lambda cur: release.wait(30))
    try:
        with TestClient(app) as client:
            r = client.post("/v1/traces", content=good_body(20), headers=PB)
            assert r.status_code == 503 and r.headers["retry-after"] == "5"
            assert "nothing of it was written" in status_pb2.Status.FromString(r.content).message
            release.set()
            held.result(10)
            assert stored(store) == (0, 0)
            assert store.stats()["spans_refused"] == 20
            r = client.post("/v1/traces", content=good_body(20), headers=PB)
            assert r.status_code == 200
            assert stored(store) == (20, 1)
    finally:
        release.set()
        store.close()


def test_a_request_cancelled_while_its_batch_waits_withdraws_the_batch(tmp_path):
    """uvicorn cancels requests still running at the end of its shutdown grace: their clients
    see no answer and retry, so a batch still queued must not be committed afterwards."""
    import asyncio
    import threading

    from rtxops.telemetry.otlp import convert
    from rtxops.telemetry.receiver import _committed

    store = Store(tmp_path / "c.duckdb")
    release, busy = threading.Event(), threading.Event()
    held = store.run_write(lambda cur: (busy.set(), release.wait(30)))
    try:
        assert busy.wait(10)  # the writer is held: the batch below queues behind it
        batch = store.submit(convert(good_body(5), PROTOBUF, 0))
        outcome: list = []

        async def cancelled_wait():
            task = asyncio.ensure_future(_committed(batch, 30))
            await asyncio.sleep(0.1)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                outcome.append("cancelled")

        # a loop of its own, on a thread of its own (the test session may run one here)
        runner = threading.Thread(target=lambda: asyncio.run(cancelled_wait()))
        runner.start()
        runner.join(30)
        assert outcome == ["cancelled"] and batch.cancelled()
        release.set()
        held.result(10)
        assert stored(store) == (0, 0)
    finally:
        release.set()
        store.close()


def test_a_slow_upload_to_an_idle_store_is_committed_not_refused(tmp_path):
    """The commit deadline counts from the request's arrival, but a batch the idle writer takes
    at once is not refused because its upload used up the deadline (its retry would be as slow)."""
    import time

    store = Store(tmp_path / "s.duckdb")
    app = make_app(store, token=TOKEN, commit_timeout_s=0.5)
    body = good_body(20)

    def slowly():
        yield body[:100]
        time.sleep(0.8)
        yield body[100:]

    try:
        with TestClient(app) as client:
            r = client.post("/v1/traces", content=slowly(), headers=PB)
            assert r.status_code == 200, r.content
        assert stored(store) == (20, 1)
    finally:
        store.close()


def test_a_retried_request_is_acknowledged_and_stored_once(tmp_path):
    """A client that did not get its answer in time sends the same body again: it was committed
    the first time, so the retry gets a 200 and stores nothing, also after a restart; another
    body, or the same spans sent otherwise encoded, are not taken for a retry."""
    path = tmp_path / "retry.duckdb"
    body = good_body(20)
    store = Store(path)
    try:
        with TestClient(make_app(store, token=TOKEN)) as client:
            for _ in range(2):
                assert client.post("/v1/traces", content=body, headers=PB).status_code == 200
            assert stored(store) == (20, 1)
            assert store.stats()["batches_repeated"] == 1 and store.stats()["spans_repeated"] == 20
            assert client.post("/v1/traces", content=good_body(21), headers=PB).status_code == 200
            assert stored(store) == (41, 2)
    finally:
        store.close()
    store = Store(path)                      # the daemon restarted while the client waited
    try:
        with TestClient(make_app(store, token=TOKEN)) as client:
            assert client.post("/v1/traces", content=body, headers=PB).status_code == 200
            assert stored(store) == (41, 2) and store.stats()["batches_repeated"] == 1
            r = client.post("/v1/traces", content=gzip.compress(body),
                            headers={**PB, "Content-Encoding": "gzip"})
            assert r.status_code == 200 and stored(store) == (61, 3)
    finally:
        store.close()


def test_repeats_queued_together_are_stored_once_and_all_acknowledged(tmp_path):
    """A retry queued behind its first attempt (both in one commit group): one is stored, both
    futures resolve once the first is committed."""
    import dataclasses
    import threading

    from rtxops.telemetry.otlp import convert

    store = Store(tmp_path / "g.duckdb")
    release, busy = threading.Event(), threading.Event()
    held = store.run_write(lambda cur: (busy.set(), release.wait(30)))
    try:
        assert busy.wait(10)
        batch = dataclasses.replace(convert(good_body(7), PROTOBUF, 0), digest=b"d" * 16)
        futures = [store.submit(batch) for _ in range(3)]
        other = store.submit(dataclasses.replace(batch, digest=b"e" * 16))
        release.set()
        held.result(10)
        for f in (*futures, other):
            assert f.result(10) is None
        assert stored(store) == (14, 2)
        assert store.stats()["batches_repeated"] == 2
        assert store.stats()["queue_batches"] == 0 and store.stats()["queue_spans"] == 0
    finally:
        release.set()
        store.close()


def test_the_listener_hears_a_batch_the_store_could_not_write(tmp_path, monkeypatch):
    """The daemon takes a job's heartbeats from its batches: with a store that cannot write (a
    full disk) they stopped, and a job training on was killed as hung."""
    from rtxops.telemetry import store as store_module

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    heard = []
    store = Store(tmp_path / "full.duckdb")
    monkeypatch.setattr(store_module, "_insert", full_disk)
    try:
        with TestClient(make_app(store, token=TOKEN, on_batch=heard.append)) as client:
            r = client.post("/v1/traces", content=good_body(20), headers=PB)
            assert r.status_code == 503, r.content
            assert "No space left" in status_pb2.Status.FromString(r.content).message
        assert [b.span_count for b in heard] == [20]
        # refused, and counted as refused: /metrics and `telemetry stats` show the spans
        assert store.stats()["spans_refused"] == 20 and store.stats()["requests_refused"] == 1
    finally:
        store.close()


def test_a_job_id_of_the_longest_length_the_dashboard_opens_is_stored(served):
    from rtxops.dashboard.params import MAX_TEXT

    client, store = served
    body = synthetic.otlp_request(5, seed=3, job_id="j" * MAX_TEXT).SerializeToString()
    assert client.post("/v1/traces", content=body, headers=PB).status_code == 200
    assert stored(store)[0] > 0
