"""A job's page lists the variants its runtime disabled (``rtx.variant.disabled`` events), each
once, with why: they were in no view before, only in a span export."""
from __future__ import annotations

import html
import time

import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from rtxops.telemetry.schema import ERROR_EVENT

from ..telemetry.otlp_helpers import kvs, request, span

REASON = "first call differs from reference: max abs error 3.2 <script>alert(1)</script>"


@pytest.fixture
def api(live):
    with live.client() as c:
        yield c


def _event(variant: str, at: int) -> Span.Event:
    return Span.Event(time_unix_nano=at, name=ERROR_EVENT, attributes=kvs(
        {"rtx.op": "gelu", "rtx.bucket": "float32/cpu/rows=16", "rtx.variant": variant,
         "rtx.config": "{}", "rtx.reason": REASON, "rtx.phase": "fwd"}))


def _post(live, job: str, spans: list) -> None:
    body = request(spans, {"service.name": "trainer", "rtx.job.id": job, "rtx.rank": 0})
    with live.client(token=True) as c:
        r = c.post("/v1/traces", content=body.SerializeToString(),
                   headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 200, r.text


def test_the_job_page_lists_each_disabled_variant_once_with_why(api, live):
    t0 = time.time_ns()
    job, other = f"disabled-{t0}", f"clean-{t0}"
    _post(live, job, [span("rtx.step", {"rtx.step": 1}, start=t0, duration=10**6,
                           events=[_event("tanh", t0 + 10)]),
                      span("rtx.step", {"rtx.step": 2}, start=t0 + 10**6, duration=10**6,
                           events=[_event("tanh", t0 + 10**6 + 10), _event("fused", t0 + 10**6 + 20)])])
    _post(live, other, [span("rtx.step", {"rtx.step": 1}, start=t0, duration=10**6)])
    detail = api.get(f"/api/jobs/{job}").json()
    assert [(d["variant"], d["reports"], d["first_ns"]) for d in detail["disabled"]] == \
        [("tanh", 2, t0 + 10), ("fused", 1, t0 + 10**6 + 20)]
    assert detail["disabled"][0]["reason"] == REASON
    assert api.get(f"/api/jobs/{other}").json()["disabled"] == []
    page = api.get(f"/jobs/{job}").text
    assert "Disabled variants" in page and html.escape(REASON) in page and "<script>alert" not in page
    assert "None reported" in api.get(f"/jobs/{other}").text
