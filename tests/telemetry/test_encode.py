"""The job-side OTLP encoder writes exactly the bytes of the SDK exporters' encoder."""
from __future__ import annotations

import enum
import os
import random

import pytest
from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from rtxops.telemetry import encode as E


class Version(str):
    """Like torch's TorchVersion: a str subclass as an attribute value."""


def provider(resource: dict) -> tuple[TracerProvider, InMemorySpanExporter]:
    p = TracerProvider(resource=Resource.create(resource))
    memory = InMemorySpanExporter()
    p.add_span_processor(SimpleSpanProcessor(memory))
    return p, memory


ODD = {"s": "plain", "empty": "", "uni": "é 漢 😀", "ctl": "\x00\n", "t": True, "f": False, "zero": 0,
       "neg": -5, "min": -(1 << 63), "max": (1 << 63) - 1, "half": 0.5, "negz": -0.0, "big": 1e300,
       "ints": [1, -2, 0], "strs": ["a", ""], "bools": [True], "floats": [1.5], "none": [],
       "ver": Version("2.13.0")}


def spans_of_every_shape():
    p1, m1 = provider({"service.name": "a", "torch": Version("2.1")})
    p2, m2 = provider({"service.name": "b"})
    t1, t1b, t2 = p1.get_tracer("rtxops"), p1.get_tracer("other", "1.2", schema_url="https://x"), p2.get_tracer("x")
    with t1.start_as_current_span("rtx.step", attributes=ODD, start_time=10) as step:
        step.add_event("rtx.variant.disabled", {"rtx.reason": "boom", "n": 3}, timestamp=12)
        step.add_event("bare")
        for kind in SpanKind:
            s = t1.start_span("k", kind=kind, start_time=11)
            s.end(end_time=20)
        err = t1b.start_span("err")
        err.set_status(Status(StatusCode.ERROR, "bad ü"))
        err.end()
        ok = t2.start_span("ok")
        ok.set_status(Status(StatusCode.OK))
        ok.end()
    remote = SpanContext(0x1234, 0x99, is_remote=True, trace_flags=TraceFlags(1))
    child = t1.start_span("remote-child", context=trace.set_span_in_context(trace.NonRecordingSpan(remote)))
    child.end()
    spans = list(m1.get_finished_spans()) + list(m2.get_finished_spans())
    return spans[::2] + spans[1::2]          # resources interleaved


def test_bytes_equal_the_sdk_encoder():
    spans = spans_of_every_shape()
    assert E.encode(spans) == encode_spans(spans).SerializeToString()
    for span in spans:
        assert E.encode([span]) == encode_spans([span]).SerializeToString()
    assert E.encode([]) == encode_spans([]).SerializeToString()


def test_span_builder_spans():
    from .test_spans import _run  # real spans of a tiny training run

    spans = _run(steps=3)[2]
    assert len(spans) > 10 and E.encode(spans) == encode_spans(spans).SerializeToString()


@pytest.mark.parametrize("what", ["link", "map"])
def test_declines_links_and_maps(what):
    p, memory = provider({})
    tracer = p.get_tracer("t")
    if what == "link":
        tracer.start_span("l", links=[Link(SpanContext(1, 2, False))]).end()
    else:
        span = tracer.start_span("m")
        span._attributes._dict["kv"] = {"a": 1}               # the SDK itself refuses to set one
        span.end()
    assert E.encode(memory.get_finished_spans()) is None


def test_equal_tuples_of_other_types_are_encoded_as_their_own_types():
    p, memory = provider({})
    tracer = p.get_tracer("t")
    for value in ((1, 2), (True, False), (1.0, 2.0)):  # equal as tuples: (1, 2) == (1.0, 2.0)
        tracer.start_span("s", attributes={"a": value}).end()
    spans = memory.get_finished_spans()
    assert E.encode(spans) == encode_spans(spans).SerializeToString()


@pytest.mark.parametrize("native_on", ["1", "0"])
def test_negative_zero_is_not_written_as_zero(native_on, monkeypatch):
    class F(float):
        pass

    monkeypatch.setenv("RTXOPS_OTLP_NATIVE", native_on)
    p, memory = provider({})
    tracer = p.get_tracer("t")
    for value in (0.0, -0.0, (0.0, 1.0), (-0.0, 1.0), (F(0.0),), (F(-0.0),)):  # equal in pairs
        tracer.start_span("s", attributes={"a": value}).end()
    spans = memory.get_finished_spans()
    assert E.encode(spans) == encode_spans(spans).SerializeToString()


@pytest.mark.parametrize("value", [1 << 63, -(1 << 63) - 1, 1 << 64])
def test_declines_integers_outside_int64(value):
    p, memory = provider({})
    span = p.get_tracer("t").start_span("big")
    span._attributes._dict["n"] = value  # set past the SDK's checks: never sent wrapped
    span.end()
    assert E.encode(memory.get_finished_spans()) is None


def capturing_otlp_exporter(monkeypatch):
    """The job's OTLP exporter with its HTTP client's export replaced: (exporter, the bodies it
    posted)."""
    from rtxops.telemetry.exporters import otlp_http_exporter

    exporter = otlp_http_exporter("http://127.0.0.1:9", "tok")
    sent: list[bytes] = []

    class Result:
        success, error = True, None

    monkeypatch.setattr(exporter._client, "export", lambda body: sent.append(body) or Result())
    return exporter, sent


def test_fast_exporter_posts_the_same_bytes(monkeypatch):
    exporter, sent = capturing_otlp_exporter(monkeypatch)
    spans = spans_of_every_shape()
    assert exporter.export(spans).name == "SUCCESS"
    assert sent == [encode_spans(spans).SerializeToString()]


# ---- the compiled encoder (_otlp_encode) --------------------------------------------------

native = pytest.mark.skipif(E._otlp_encode is None, reason="C encoder not built")


def _copy(span, **changes) -> ReadableSpan:
    """``span`` as a plain ReadableSpan (what the span builder makes): the fields path."""
    fields = dict(name=span.name, context=span.get_span_context(), parent=span.parent,
                  resource=span.resource, attributes=span._attributes, events=span._events,
                  links=span._links, kind=span.kind, status=span.status, start_time=span.start_time,
                  end_time=span.end_time, instrumentation_scope=span.instrumentation_scope)
    return ReadableSpan(**{**fields, **changes})


def _by_resource(spans):
    groups: dict[int, list] = {}
    for s in spans:
        groups.setdefault(id(s.resource), []).append(s)
    return list(groups.values())


@native
@pytest.mark.parametrize("path", ["properties", "fields"])
def test_native_writes_the_sdk_bytes(path):
    for group in _by_resource(spans_of_every_shape()):
        if path == "fields":
            group = [_copy(s) for s in group]
            assert all(type(s) is ReadableSpan for s in group)
        got = E._otlp_encode.encode(group)
        assert got is not None and got == encode_spans(group).SerializeToString()
        for span in group:
            assert E._otlp_encode.encode([span]) == encode_spans([span]).SerializeToString()


@native
def test_native_encodes_the_span_builders_spans():
    from .test_spans import _run

    spans = _run(steps=3)[2]
    assert any(type(s) is ReadableSpan for s in spans)
    assert E._otlp_encode.encode(spans) == encode_spans(spans).SerializeToString()


def _random_value(rnd: random.Random):
    kind = rnd.randrange(8)
    if kind == 0:
        return "".join(rnd.choice("ab é漢😀\x00") for _ in range(rnd.randrange(0, 40)))
    if kind == 1:
        return rnd.choice([0, 1, -1, 127, 128, 300, -(1 << 63), (1 << 63) - 1, rnd.getrandbits(62)])
    if kind == 2:
        return rnd.choice([0.0, -0.0, 1.5, 1e300, -2.5e-300, float("inf"), rnd.random()])
    if kind == 3:
        return rnd.random() < 0.5
    if kind == 4:
        return bytes(rnd.getrandbits(8) for _ in range(rnd.randrange(0, 20)))
    pick = rnd.choice([lambda: rnd.randrange(-1000, 1 << 40), lambda: rnd.random() < 0.5,
                       lambda: rnd.random(), lambda: "s" * rnd.randrange(0, 200)])
    return tuple(pick() for _ in range(rnd.randrange(0, 30)))


def test_random_spans_match_the_sdk_bytes_on_both_paths(monkeypatch):
    rnd = random.Random(7)
    resource = Resource.create({"service.name": "fuzz", "n": 3})
    scopes = [None, InstrumentationScope("rtxops"), InstrumentationScope("x", "1.0", "https://s")]
    for _ in range(300):
        spans = []
        for _ in range(rnd.randrange(1, 6)):
            parent = None if rnd.random() < 0.3 else SpanContext(
                rnd.getrandbits(128) or 1, rnd.getrandbits(64) or 1, is_remote=rnd.random() < 0.3)
            attrs = {f"k{i}" if rnd.random() < 0.9 else "": _random_value(rnd)
                     for i in range(rnd.randrange(0, 25))}
            if rnd.random() < 0.3:
                attrs = BoundedAttributes(maxlen=rnd.choice([None, 3]), attributes=attrs)
            events = [Event(rnd.choice(["e", "", "ü"]), {"a": _random_value(rnd)} if rnd.random() < 0.7 else None,
                            timestamp=rnd.choice([0, rnd.getrandbits(62)])) for _ in range(rnd.randrange(0, 3))]
            code = rnd.choice(list(StatusCode))
            status = Status(code, rnd.choice([None, "", "bad é"]) if code is StatusCode.ERROR else None)
            spans.append(ReadableSpan(
                rnd.choice(["rtx.kernel", "", "名前"]),
                SpanContext(rnd.getrandbits(128) or 1, rnd.getrandbits(64) or 1, False),
                parent, resource, attrs, events, (), rnd.choice(list(SpanKind)), None, status,
                rnd.choice([None, 0, rnd.getrandbits(62)]), rnd.choice([None, rnd.getrandbits(62)]),
                rnd.choice(scopes)))
        want = encode_spans(spans).SerializeToString()
        if E._otlp_encode is not None:
            assert E._otlp_encode.encode(spans) == want
        monkeypatch.setenv("RTXOPS_OTLP_NATIVE", "0")
        assert E.encode(spans) == want
        monkeypatch.delenv("RTXOPS_OTLP_NATIVE")


@native
@pytest.mark.parametrize("what", ["link", "trace_state", "two_resources", "big_int", "map",
                                  "surrogate", "key_type", "foreign_value"])
def test_native_declines_what_it_does_not_mirror(what):
    p, memory = provider({"service.name": "a"})
    tracer = p.get_tracer("t")
    base = tracer.start_span("s", attributes={"a": 1})
    base.end()
    span = _copy(memory.get_finished_spans()[0])
    spans = [span]
    if what == "link":
        spans = [_copy(span, links=(Link(SpanContext(1, 2, False)),))]
    elif what == "trace_state":
        ctx = span.context
        spans = [_copy(span, context=SpanContext(ctx.trace_id, ctx.span_id, False,
                                                  trace_state=TraceState([("k", "v")])))]
    elif what == "two_resources":
        spans = [span, _copy(span, resource=Resource.create({"service.name": "b"}))]
    elif what == "big_int":
        spans = [_copy(span, attributes={"n": 1 << 64})]
    elif what == "map":
        spans = [_copy(span, attributes={"m": {"a": 1}})]
    elif what == "surrogate":
        spans = [_copy(span, attributes={"s": "\udcff"})]
    elif what == "key_type":
        spans = [_copy(span, attributes={3: "x"})]
    else:
        spans = [_copy(span, attributes={"o": object()})]
    assert E._otlp_encode.encode(spans) is None
    if what in ("trace_state", "two_resources"):  # the Python encoder still writes the SDK's bytes
        assert E.encode(spans) == encode_spans(spans).SerializeToString()


@native
def test_native_declines_what_is_not_a_list_or_tuple():
    p, memory = provider({})
    p.get_tracer("t").start_span("s", links=[Link(SpanContext(1, 2, False))]).end()  # it declines
    spans = memory.get_finished_spans()
    assert E._otlp_encode.encode(3) is None and E._otlp_encode.encode(iter(spans)) is None
    # a one-shot iterable reaches the Python encoder whole (it declines links too)
    p.get_tracer("t").start_span("plain").end()
    plain = memory.get_finished_spans()[1:]
    assert E.encode(iter(plain)) == encode_spans(plain).SerializeToString()


def test_python_encoder_writes_subclass_values_as_the_sdk_does(monkeypatch):
    monkeypatch.setenv("RTXOPS_OTLP_NATIVE", "0")

    class Color(str, enum.Enum):
        RED = "red"

    class Weird(int):
        def __index__(self):
            return 5

    class Half(float):
        def __float__(self):
            return 0.25

    class Raw(bytes):
        def __radd__(self, other):
            return b"not me"

    p, memory = provider({})
    p.get_tracer("t").start_span("s", attributes={"c": Color.RED, "w": Weird(3), "h": Half(0.5),
                                                 "ie": enum.IntEnum("E", "A B").B,
                                                 "r": Raw(b"raw")}).end()
    spans = memory.get_finished_spans()
    assert E.encode(spans) == encode_spans(spans).SerializeToString()
    assert b"Color.RED" not in E.encode(spans)


_MUTATING = '''
import sys
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.trace import SpanContext, Status, StatusCode
from rtxops.telemetry import encode as E

class Attrs(dict):
    def items(self):  # Python code run mid-encode rebinds the span's fields (frees the old ones)
        span._status = None
        span._events = ()
        return super().items()

class Grows(list):
    def __iter__(self):  # clears the list holding it while being read
        outer.clear()
        return super().__iter__()

inner = Grows([1, 2])
outer = [inner, "y" * 100]
span = ReadableSpan("n", SpanContext(0xABC, 0x12, False), resource=Resource.create({}),
                    attributes=Attrs(a=1, b=outer), status=Status(StatusCode.ERROR, "x" * 50),
                    events=[Event("e" * 40, {"k": 1}, 5)], start_time=5, end_time=9)
spans = [span]
body = E._otlp_encode.encode(spans)
sys.stdout.write("ok" if body is None or isinstance(body, bytes) else "bad")
'''


@native
def test_native_survives_fields_changed_while_it_encodes(tmp_path):
    """Python code the encoder runs (a mapping's items(), a sequence's __iter__) may rebind the
    span's fields or empty a list it is reading: it must keep what it reads alive."""
    import subprocess
    import sys

    script = tmp_path / "mutating.py"
    script.write_text(_MUTATING)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONMALLOC": "debug"}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "ok"


@native
def test_an_sdk_the_c_encoder_does_not_know_leaves_the_python_encoder(monkeypatch):
    import importlib

    def refuse(*args):
        raise TypeError("the span context type must be a tuple subclass")

    monkeypatch.setattr(E._otlp_encode, "configure", refuse)
    try:
        again = importlib.reload(E)  # the import still works, without the C encoder
        assert again._otlp_encode is None
        spans = spans_of_every_shape()
        assert again.encode(spans) == encode_spans(spans).SerializeToString()
    finally:
        monkeypatch.undo()
        importlib.reload(E)
    assert E._otlp_encode is not None
