"""OTLP/HTTP trace receiver: ``POST /v1/traces`` (protobuf or JSON, optionally gzip) → the store.

Follows the OTLP/HTTP spec: the response body is an ``ExportTraceServiceResponse`` on success and a
``google.rpc.Status`` on failure, in the request's encoding; 400/401/413/415 are final (the client
must not retry), 429/503 carry ``Retry-After``. A request is stored whole or not at all, and a 200
is sent only after its rows are committed. A retry of a request already committed (the client
did not get the answer in time) gets a 200 and stores nothing again.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import math
import time
import zlib
from typing import Any, Callable

import anyio
from fastapi import APIRouter, FastAPI, Request, Response
from google.protobuf import json_format
from google.rpc import code_pb2, status_pb2

from rtxops.bearer import carries_token

from . import otlp
from .otlp import JSON, PROTOBUF, TelemetryInputError
from .store import Store, StoreBusy, StoreClosed, StoreError, prepared

log = logging.getLogger("rtxops.telemetry.receiver")

DEFAULT_MAX_BODY = 16 << 20           # bytes on the wire
DEFAULT_MAX_DECOMPRESSED = 64 << 20   # bytes after gzip
DEFAULT_MAX_INFLIGHT = 8              # requests read, decoded or written at once
DEFAULT_SLOT_WAIT_S = 2.0             # how long a request waits for one of those slots
DEFAULT_BODY_TIMEOUT_S = 30.0         # how long a request may take to send its body
# how long a queued batch may wait for its commit: under the OTLP exporters' own 10 s timeout, so
# a client that gives up and retries never finds its first attempt committed behind its back
DEFAULT_COMMIT_TIMEOUT_S = 8.0
MIN_COMMIT_WAIT_S = 1.0
MAX_GZIP_MEMBERS = 64                 # gzip members in one body


class _TooLarge(Exception):
    pass


def make_router(store: Store, *, token: str | None, max_body_bytes: int = DEFAULT_MAX_BODY,
                max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED,
                max_inflight: int = DEFAULT_MAX_INFLIGHT, slot_wait_s: float = DEFAULT_SLOT_WAIT_S,
                body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S, path: str = "/v1/traces",
                on_batch: Callable[[otlp.Batch], None] | None = None) -> APIRouter:
    """A router with ``POST {path}`` writing into ``store``.

    ``token``: the bearer token every request must carry (None: no check, for tests and local
    use). ``on_batch`` sees every batch once it is decoded, stored or not (the daemon takes
    heartbeats there: a job steps on whether or not the store can take its spans). At most ``max_inflight`` requests hold a body in memory at once (reading and
    decoding it); one that waits longer than ``slot_wait_s`` for a slot gets 429, so memory stays
    bounded under any flood. A body that takes longer than ``body_timeout_s`` to arrive gets 408
    and gives its slot back (a stalled client would otherwise hold it for good). A batch still
    queued after ``commit_timeout_s`` (a writer held up) is withdrawn and answered 503: nothing
    of it is written, so the client's retry stores it once; one already being committed is
    waited for."""
    router = APIRouter()
    expected = token.encode() if token is not None else None
    slots = asyncio.Semaphore(max_inflight)
    # decoding gets threads of its own: on anyio's shared 40, slow endpoints (publishes, job
    # submits waiting on the store) starved ingest; made on the event loop, as anyio wants
    decoders: list[anyio.CapacityLimiter] = []

    @router.post(path, include_in_schema=False)
    async def export_traces(request: Request) -> Response:
        received_ns = time.time_ns()  # before any wait: the client's own timeout runs from here
        encoding = _response_encoding(request.headers.get("content-type"))
        if expected is not None and not carries_token(request.headers.get("authorization"), expected):
            return _status(encoding, 401, code_pb2.UNAUTHENTICATED,
                           "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
        kind = otlp.media_type(request.headers.get("content-type"))
        if kind not in (PROTOBUF, JSON):
            store.note_rejected()
            return _status(encoding, 415, code_pb2.INVALID_ARGUMENT,
                           f"unsupported content type {kind or '(none)'!r}: send {PROTOBUF} or {JSON}")
        content_encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if content_encoding not in ("identity", "gzip"):
            store.note_rejected()
            return _status(encoding, 415, code_pb2.INVALID_ARGUMENT,
                           f"unsupported content encoding {content_encoding!r}: send gzip or none")
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > max_body_bytes:
            store.note_rejected()
            return _status(encoding, 413, code_pb2.INVALID_ARGUMENT,
                           f"body of {declared} bytes is over the {max_body_bytes}-byte limit")
        try:
            with anyio.fail_after(slot_wait_s):
                await slots.acquire()
        except TimeoutError:
            store.note_refused()
            return _status(encoding, 429, code_pb2.RESOURCE_EXHAUSTED,
                           "the receiver is busy; retry later", {"Retry-After": "1"})
        if not decoders:
            decoders.append(anyio.CapacityLimiter(max_inflight))
        return await _handle(request, store, slots, decoders[0], kind, encoding,
                             content_encoding == "gzip", max_body_bytes, max_decompressed_bytes,
                             body_timeout_s, commit_timeout_s, on_batch, received_ns)

    return router


def make_app(store: Store, token: str | None = None, **router_options: Any) -> FastAPI:
    """A FastAPI app with just the receiver (tests, benchmarks; the daemon has its own app)."""
    app = FastAPI(title="rtxops OTLP receiver", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(make_router(store, token=token, **router_options))
    return app


async def _handle(request: Request, store: Store, slot: asyncio.Semaphore,
                  decoders: anyio.CapacityLimiter, kind: str, encoding: str, gzipped: bool,
                  max_body: int, max_decompressed: int, body_timeout_s: float,
                  commit_timeout_s: float, on_batch: Callable[[otlp.Batch], None] | None,
                  received_ns: int) -> Response:
    """Read, decode and queue the request while holding ``slot``; wait for the commit without it
    (queued batches are bounded by the store)."""
    try:
        try:
            with anyio.fail_after(body_timeout_s):
                body = await _read_body(request, max_body)
        except TimeoutError:
            store.note_rejected()
            return _status(encoding, 408, code_pb2.DEADLINE_EXCEEDED,
                           f"the body did not arrive within {body_timeout_s:g} s")
        batch = await anyio.to_thread.run_sync(_decode, body, kind, gzipped, max_decompressed,
                                               received_ns, limiter=decoders)
        del body
        if batch.span_count == 0 and batch.resources.num_rows == 0:
            return _success(encoding)
        _heard(on_batch, batch)
        future = store.submit(batch)
    except _TooLarge as e:
        store.note_rejected()
        return _status(encoding, 413, code_pb2.INVALID_ARGUMENT, str(e))
    except TelemetryInputError as e:
        store.note_rejected()
        return _status(encoding, 400, code_pb2.INVALID_ARGUMENT, str(e))
    except StoreBusy as e:
        return _status(encoding, 429, code_pb2.RESOURCE_EXHAUSTED, str(e),
                       {"Retry-After": str(math.ceil(e.retry_after))})
    except StoreClosed as e:
        store.note_refused(batch.span_count)
        return _status(encoding, 503, code_pb2.UNAVAILABLE, str(e), {"Retry-After": "5"})
    finally:
        slot.release()
    # the deadline counts from the request's arrival, as the client's own timeout does; at least
    # a second is left for the commit (a slow upload to an idle store is not refused for it)
    left = commit_timeout_s - (time.time_ns() - received_ns) / 1e9
    try:
        await _committed(future, max(left, MIN_COMMIT_WAIT_S))
    except _Withdrawn:
        store.note_refused(batch.span_count)
        return _status(encoding, 503, code_pb2.UNAVAILABLE,
                       f"the store did not commit the batch within {commit_timeout_s:g} s; nothing "
                       "of it was written", {"Retry-After": "5"})
    except StoreError as e:      # the write failed (a full disk): refused, the client retries
        store.note_refused(batch.span_count)
        return _status(encoding, 503, code_pb2.UNAVAILABLE, str(e), {"Retry-After": "5"})
    return _success(encoding)


def _heard(on_batch: Callable[[otlp.Batch], None] | None, batch: otlp.Batch) -> None:
    if on_batch is None:
        return
    try:
        on_batch(batch)
    except Exception:  # a listener's failure is not the client's problem
        log.exception("rtxops receiver: on_batch listener failed")


class _Withdrawn(Exception):
    pass


async def _committed(future, timeout_s: float) -> None:
    """Wait for ``future``'s commit; past ``timeout_s`` withdraw it if the writer has not taken
    it yet (:class:`_Withdrawn`), else wait for the commit under way. A request cancelled
    meanwhile (the server stopping) withdraws it too: its client saw no answer and will retry."""
    waiting = asyncio.wrap_future(future)
    try:
        await asyncio.wait_for(asyncio.shield(waiting), max(timeout_s, 0.0))
    except asyncio.TimeoutError:
        if future.cancel():  # still queued: the writer skips it and gives its queue place back
            raise _Withdrawn from None
        await waiting
    except asyncio.CancelledError:
        future.cancel()
        raise


async def _read_body(request: Request, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge(f"body is over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def _decode(body: bytes, kind: str, gzipped: bool, max_decompressed: int, received_ns: int) -> otlp.Batch:
    digest = hashlib.sha256(kind.encode() + b"\0")   # SHA-256: SHA-NI makes it 2x blake2b here
    digest.update(body)
    if gzipped:
        body = _gunzip(body, max_decompressed)
    elif len(body) > max_decompressed:
        raise _TooLarge(f"body is over the {max_decompressed}-byte limit")
    try:
        # prepared here, beside the store's writer thread rather than in it
        batch = prepared(otlp.convert(body, kind, received_ns))
        return dataclasses.replace(batch, digest=digest.digest()[:16])
    except TelemetryInputError:
        raise
    except Exception as e:  # decoding is a function of the body alone: a case no check foresaw
        log.warning("rtxops receiver: refused a request no check foresaw: %r", e)
        raise TelemetryInputError(f"the request could not be decoded ({type(e).__name__})") from None


def _gunzip(data: bytes, limit: int) -> bytes:
    """Decompress gzip ``data`` (one or more members), refusing output past ``limit`` bytes."""
    out: list[bytes] = []
    size = members = 0
    while data:
        members += 1
        if members > MAX_GZIP_MEMBERS:  # zlib copies the rest of the body after each member
            raise TelemetryInputError(f"gzip body has over {MAX_GZIP_MEMBERS} members")
        d = zlib.decompressobj(wbits=31)
        try:
            piece = d.decompress(data, limit - size + 1)
        except zlib.error as e:
            raise TelemetryInputError(f"body is not valid gzip: {e}") from None
        size += len(piece)
        if size > limit or d.unconsumed_tail:
            raise _TooLarge(f"body decompresses to over the {limit}-byte limit")
        out.append(piece)
        if not d.eof:
            raise TelemetryInputError("gzip body is truncated")
        data = d.unused_data
    return b"".join(out)


def _response_encoding(content_type: str | None) -> str:
    return JSON if otlp.media_type(content_type) == JSON else PROTOBUF


def _success(encoding: str) -> Response:
    message = otlp.response()
    if encoding == JSON:
        return Response(json_format.MessageToJson(message, indent=None), 200, media_type=JSON)
    return Response(message.SerializeToString(), 200, media_type=PROTOBUF)


def _status(encoding: str, http_status: int, code: int, message: str,
            headers: dict[str, str] | None = None) -> Response:
    status = status_pb2.Status(code=code, message=message)
    if encoding == JSON:
        body = json_format.MessageToJson(status, indent=None).encode()
    else:
        body = status.SerializeToString()
    return Response(body, http_status, headers=headers, media_type=encoding)
