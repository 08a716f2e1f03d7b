"""Synthetic rtxops telemetry shaped like the job exporter's, for benchmarks, tests and demos.

:func:`otlp_request` builds an OTLP request span by span (step spans with their kernel children,
the attributes :mod:`.spans` sets); :func:`kernel_batch` builds a store :class:`~.otlp.Batch` of
any size directly with numpy and Arrow (millions of rows in seconds).
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from . import schema as S
from .otlp import EVENTS_SCHEMA, RESOURCES_SCHEMA, SPANS_SCHEMA, Batch

OPS = ("rms_norm", "layer_norm", "softmax", "gelu", "silu", "swiglu", "cross_entropy", "rope",
       "attention", "linear")
VARIANTS = {"eager": "eager", "aten": "aten", "compiled": "compiled", "triton": "triton",
            "chunked": "chunked"}
SITES = {"linear": "F.linear", "attention": "F.scaled_dot_product_attention",
         "rms_norm": "module:model.RMSNorm", "rope": "fn:model.apply_rotary_pos_emb"}


@dataclass(frozen=True)
class Slot:
    """One kernel slot: what a ``rtx.kernel`` span describes."""

    op: str
    variant: str
    config: str
    bucket: str
    site: str


def slots(n_buckets: int = 50, seed: int = 0) -> list[Slot]:
    """``n_buckets`` buckets spread over the ten ops, each with a variant and config."""
    rnd = random.Random(seed)
    out = []
    for i in range(n_buckets):
        op = OPS[i % len(OPS)]
        rows = 2 ** rnd.randrange(6, 14)
        hidden = rnd.choice((512, 1024, 2048, 4096))
        variant = rnd.choice(tuple(VARIANTS))
        config = json.dumps({"block": rnd.choice((64, 128, 256))} if variant == "triton" else {},
                            sort_keys=True)
        out.append(Slot(op, variant, config, f"float32/cuda/hidden={hidden},rows={rows}",
                        SITES.get(op, f"F.{op}")))
    return out


def resource_attributes(job_id: str = "job-0", rank: int = 0) -> dict[str, Any]:
    return {S.SERVICE_NAME: "rtxops-job", S.HOST_NAME: "bench-host", S.PROCESS_PID: 4242 + rank,
            S.JOB_ID: job_id, S.RANK: rank, S.HW_GPU_MODEL: "NVIDIA H200", S.HW_GPU_COUNT: 1,
            S.TORCH_VERSION: "2.13.0"}


def otlp_request(n_spans: int, *, seed: int = 0, job_id: str = "job-0", rank: int = 0,
                 start_ns: int | None = None, kernels_per_step: int = 39,
                 step_ns: int = 50_000_000) -> ExportTraceServiceRequest:
    """About ``n_spans`` spans: steps of one ``rtx.step`` span and ``kernels_per_step`` kernel
    children with counts, times, a latency histogram and cache figures."""
    rnd = random.Random(seed)
    table = slots(seed=seed)
    t = start_ns if start_ns is not None else time.time_ns() - n_spans * step_ns // (kernels_per_step + 1)
    spans: list[Span] = []
    step = seed * 100_000
    while len(spans) < n_spans:
        trace_id, step_id = rnd.randbytes(16), rnd.randbytes(8)
        step_attrs = {S.STEP_NUMBER: step, S.PLAN_VERSION: 3, S.COUNT: 40 * kernels_per_step,
                      S.RSS: rnd.randrange(1 << 30, 1 << 32), S.DROPPED_RECORDS: 0,
                      S.CUDA_ALLOCATED: rnd.randrange(1 << 33), S.CUDA_RESERVED: 1 << 34,
                      S.CUDA_PEAK: rnd.randrange(1 << 34), S.CUDA_FRAGMENTATION: rnd.random() / 10,
                      S.CUDA_ALLOC_RETRIES: 0, S.CUDA_OOMS: 0, S.INDUCTOR_FXGRAPH_HITS: 7,
                      S.INDUCTOR_FXGRAPH_MISSES: 1}
        spans.append(_span(trace_id, step_id, b"", S.STEP, t, t + step_ns, step_attrs))
        for k in range(min(kernels_per_step, n_spans - len(spans))):
            slot = table[k % len(table)]
            count = rnd.choice((1, 2, 4, 8, 12, 24))
            lo = rnd.randrange(2_000, 200_000)
            hi = lo + rnd.randrange(0, lo)
            hist = [0] * (lo.bit_length() - 1) + [rnd.randrange(count + 1) for _ in range(3)]
            attrs = {S.OP: slot.op, S.VARIANT: slot.variant, S.FAMILY: VARIANTS[slot.variant],
                     S.CONFIG: slot.config, S.BUCKET: slot.bucket, S.SITE: slot.site,
                     S.PHASE: "fwd" if k % 3 else "bwd", S.COUNT: count,
                     S.TOTAL_NS: count * (lo + hi) // 2, S.MIN_NS: lo, S.MAX_NS: hi, S.HIST: hist,
                     S.PLAN_VERSION: 3, S.STEP_NUMBER: step, S.CACHE_MISSES: 0, S.CACHE_HITS: count}
            begin = t + k * 1000
            spans.append(_span(trace_id, rnd.randbytes(8), step_id, S.KERNEL, begin,
                               begin + count * hi, attrs))
        step += 1
        t += step_ns
    resource = Resource(attributes=_key_values(resource_attributes(job_id, rank)))
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=resource,
        scope_spans=[ScopeSpans(scope=InstrumentationScope(name="rtxops"), spans=spans)])])


_FIRST_SPAN_ID = re.compile(rb"\x0a\x10.{16}\x12\x08(.{8})", re.DOTALL)  # trace_id, span_id fields


def numbered(body: bytes, n: int) -> bytes:
    """``body`` (a serialized :func:`otlp_request`) made distinct by ``n``, at the same size: its
    first span's id (and that id as its children's parent) replaced. The receiver stores a
    repeated body once (it is a client's retry), so load generators cycling through a few
    bodies send numbered copies."""
    found = _FIRST_SPAN_ID.search(body)
    if found is None:
        raise ValueError("no span id found in the body")
    old = found.group(1)
    return body.replace(old, hashlib.blake2b(old + n.to_bytes(8, "big"), digest_size=8).digest())


def _span(trace_id: bytes, span_id: bytes, parent: bytes, name: str, start: int, end: int,
          attrs: dict[str, Any]) -> Span:
    return Span(trace_id=trace_id, span_id=span_id, parent_span_id=parent, name=name,
                kind=Span.SPAN_KIND_INTERNAL, start_time_unix_nano=start, end_time_unix_nano=end,
                attributes=_key_values(attrs))


def _key_values(attrs: dict[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=k, value=any_value(v)) for k, v in attrs.items()]


def any_value(v: Any) -> AnyValue:
    """Python value → OTLP ``AnyValue``."""
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, str):
        return AnyValue(string_value=v)
    if isinstance(v, bytes):
        return AnyValue(bytes_value=v)
    if isinstance(v, (list, tuple)):
        return AnyValue(array_value=ArrayValue(values=[any_value(x) for x in v]))
    raise TypeError(f"no AnyValue for {type(v).__name__}")


# ---- store batches at scale ------------------------------------------------------------------

def kernel_batch(n_rows: int, *, start_ns: int, duration_s: float = 3600.0, jobs: int = 4,
                 ranks: int = 2, kernels_per_step: int = 39, n_buckets: int = 50,
                 first_step: int = 0, seed: int = 0) -> Batch:
    """``n_rows`` span rows (one step span per ``kernels_per_step`` kernel spans) from ``jobs`` ×
    ``ranks`` processes spread evenly over ``duration_s`` from ``start_ns``, in time order, with
    step numbers from ``first_step``."""
    rng = np.random.default_rng(seed)
    table = slots(n_buckets, seed)
    per_step = kernels_per_step + 1
    procs = jobs * ranks
    row = np.arange(n_rows, dtype=np.int64)
    step_idx = row // per_step                       # global step counter over all processes
    k = row % per_step                               # 0: the step span, 1..: kernels
    proc = step_idx % procs
    step = first_step + step_idx // procs
    steps_total = max(1, int(step_idx[-1]) + 1) if n_rows else 1
    step_start = start_ns + (step_idx * (duration_s * 1e9 / steps_total)).astype(np.int64)
    is_step = k == 0
    slot_idx = (k - 1 + proc * 7) % len(table)
    count = np.where(is_step, per_step * 20, rng.choice([1, 2, 4, 8, 12, 24], n_rows))
    # each slot has its own latency (2 µs .. 2 ms, log-uniform); steps jitter around it (~10%)
    base = np.exp(np.random.default_rng(seed + 1).uniform(np.log(2e3), np.log(2e6), len(table)))
    lo = (base[slot_idx] * rng.lognormal(0.0, 0.1, n_rows)).astype(np.int64)
    hi = lo + (lo * rng.uniform(0.0, 0.5, n_rows)).astype(np.int64)
    # the variant of a slot changes every quarter of an hour (wall clock), as an evolve loop
    # would swap it, and the plan version with it
    phase_of_hour = step_start // (900 * 10**9)
    variant_pick = (slot_idx + phase_of_hour) % len(VARIANTS)
    variants = np.array(tuple(VARIANTS), dtype=object)[variant_pick]
    start = step_start + np.where(is_step, 0, k * 1000)
    end = np.where(is_step, start + 50_000_000, start + count * hi)
    trace = _hex(rng, n_rows, 16, repeat=per_step)
    span_ids = _hex(rng, n_rows, 8)
    parent = np.where(is_step, None, np.repeat(span_ids[::per_step], per_step)[:n_rows])
    job_ids = np.array([f"job-{j}" for j in range(jobs)], dtype=object)[proc // ranks]
    rank = (proc % ranks).astype(np.int32)
    ops = np.array([s.op for s in table], dtype=object)[slot_idx]
    kernel = lambda values: pa.array(np.where(is_step, None, values), pa.string())  # noqa: E731
    step_attrs = pa.array(
        np.char.add(np.char.add('{"rtx.mem.rss_bytes":',
                                rng.integers(1 << 30, 1 << 32, n_rows).astype(str)),
                    ',"rtx.cache.inductor.fxgraph_hits":7,"rtx.cache.inductor.fxgraph_misses":1}'),
        pa.string())
    kernel_attrs = pa.array(np.char.add(np.char.add('{"rtx.cache.hits":', count.astype(str)),
                                        ',"rtx.cache.misses":0,"rtx.hist_log2_ns":[0,0,0,0,0,0,0,0,0,0,0,3,5,2]}'),
                            pa.string())
    resource_ids = (1000 + proc).astype(np.int64)
    columns = {
        "trace_id": pa.array(trace, pa.string()), "span_id": pa.array(span_ids, pa.string()),
        "parent_span_id": pa.array(parent, pa.string()),
        "name": pa.array(np.where(is_step, S.STEP, S.KERNEL), pa.string()),
        "kind": pa.array(np.ones(n_rows, np.int32)), "start_ns": pa.array(start),
        "end_ns": pa.array(end), "duration_ns": pa.array(end - start),
        "status_code": pa.array(np.zeros(n_rows, np.int32)),
        "status_message": pa.nulls(n_rows, pa.string()), "resource_id": pa.array(resource_ids),
        "scope_name": pa.array(np.full(n_rows, "rtxops", dtype=object), pa.string()),
        "job_id": pa.array(job_ids, pa.string()), "rank": pa.array(rank),
        "step": pa.array(step), "plan_version": pa.array(1 + phase_of_hour % 1000),
        "op": kernel(ops), "variant": kernel(variants),
        "config": kernel(np.array([s.config for s in table], dtype=object)[slot_idx]),
        "bucket": kernel(np.array([s.bucket for s in table], dtype=object)[slot_idx]),
        "site": kernel(np.array([s.site for s in table], dtype=object)[slot_idx]),
        "phase": kernel(np.where(k % 3 == 0, "bwd", "fwd").astype(object)),
        "count": pa.array(count), "total_ns": pa.array(np.where(is_step, None, count * (lo + hi) // 2)),
        "min_ns": pa.array(np.where(is_step, None, lo)), "max_ns": pa.array(np.where(is_step, None, hi)),
        "attributes": pa.compute.if_else(pa.array(is_step), step_attrs, kernel_attrs),
    }
    spans = pa.table([columns[f.name].cast(f.type) for f in SPANS_SCHEMA], schema=SPANS_SCHEMA)
    resources = pa.table({
        "resource_id": pa.array(1000 + np.arange(procs, dtype=np.int64)),
        "service_name": ["rtxops-job"] * procs, "host_name": ["bench-host"] * procs,
        "job_id": [f"job-{p // ranks}" for p in range(procs)],
        "rank": pa.array([p % ranks for p in range(procs)], pa.int32()),
        "process_pid": pa.array([4242 + p for p in range(procs)], pa.int64()),
        "attributes": ['{"hw.gpu.model":"NVIDIA H200"}'] * procs, "schema_url": [None] * procs,
        "first_seen_ns": pa.array([start_ns] * procs, pa.int64())}, schema=RESOURCES_SCHEMA)
    # typed like the compiled decoder's output, which every OTLP path (receiver and direct
    # exporter) goes through
    cache_counts = (pa.array(np.where(is_step, None, count), pa.int64()),
                    pa.array(np.where(is_step, None, 0), pa.int64()))
    return Batch(resources, spans, EVENTS_SCHEMA.empty_table(), n_rows, time.time_ns(),
                 cache_counts=cache_counts)


_HEX = np.frombuffer(b"0123456789abcdef", dtype="S1")


def _hex(rng: np.random.Generator, n: int, size: int, repeat: int = 1) -> np.ndarray:
    """``n`` random lowercase hex ids of ``size`` bytes (each repeated ``repeat`` times)."""
    raw = rng.integers(0, 256, ((n + repeat - 1) // repeat, size), dtype=np.uint8)
    digits = np.empty((raw.shape[0], size * 2), dtype="S1")
    digits[:, 0::2] = _HEX[raw >> 4]
    digits[:, 1::2] = _HEX[raw & 15]
    ids = digits.view(f"S{size * 2}").ravel().astype(str).astype(object)
    return np.repeat(ids, repeat)[:n] if repeat > 1 else ids
