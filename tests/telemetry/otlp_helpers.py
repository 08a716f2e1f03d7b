"""Small builders of OTLP requests for the telemetry tests."""
from __future__ import annotations

import os
import time
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from rtxops.telemetry.synthetic import any_value

RESOURCE = {"service.name": "trainer", "host.name": "h1", "process.pid": 77, "rtx.job.id": "job-a",
            "rtx.rank": 1, "hw.gpu.model": "H200"}


def kvs(attrs: dict[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=k, value=any_value(v)) for k, v in attrs.items()]


def span(name: str = "rtx.kernel", attrs: dict[str, Any] | None = None, *, start: int | None = None,
         duration: int = 1000, parent: bytes = b"", trace_id: bytes | None = None,
         span_id: bytes | None = None, events: list[Span.Event] | None = None) -> Span:
    start = time.time_ns() if start is None else start
    return Span(trace_id=trace_id if trace_id is not None else os.urandom(16),
                span_id=span_id if span_id is not None else os.urandom(8), parent_span_id=parent,
                name=name, kind=Span.SPAN_KIND_INTERNAL, start_time_unix_nano=start,
                end_time_unix_nano=start + duration, attributes=kvs(attrs or {}),
                events=events or [], status=Status(code=Status.STATUS_CODE_OK))


def request(spans: list[Span], resource: dict[str, Any] | None = None) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=Resource(attributes=kvs(RESOURCE if resource is None else resource)),
        scope_spans=[ScopeSpans(scope=InstrumentationScope(name="test"), spans=spans)])])
