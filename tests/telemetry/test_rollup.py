"""The Arrow kernel rollup writes the same kernel_minutes rows as the SQL one it replaced."""
from __future__ import annotations

import time

import duckdb
import pyarrow as pa

from rtxops.telemetry import otlp, rollup, synthetic
from rtxops.telemetry import schema as S
from rtxops.telemetry.store import HIST_BINS_PER_OCTAVE, MINUTE_NS, _insert, migrate, prepared

from .otlp_helpers import request, span

REFERENCE = f"""
SELECT hash(job_id, op, bucket, variant, config, phase) AS key_id, start_ns // {MINUTE_NS} AS minute,
       any_value(job_id) AS job_id, any_value(op) AS op, any_value(bucket) AS bucket,
       any_value(variant) AS variant, any_value(config) AS config, any_value(phase) AS phase,
       count(*) AS samples, sum(count) AS calls, sum(total_ns) AS total_ns,
       min(min_ns) AS min_ns, max(max_ns) AS max_ns, min(start_ns) AS first_ns,
       max(start_ns) AS last_ns,
       sum(TRY_CAST(attributes->>'rtx.cache.hits' AS BIGINT)) AS cache_hits,
       sum(TRY_CAST(attributes->>'rtx.cache.misses' AS BIGINT)) AS cache_misses,
       histogram(CAST(floor(log2(greatest(total_ns / count, 1)) * {HIST_BINS_PER_OCTAVE}) AS INTEGER))
           FILTER (WHERE count > 0 AND total_ns IS NOT NULL) AS mean_hist
FROM _rtx_batch WHERE name = 'rtx.kernel'
GROUP BY 1, 2
"""
COLUMNS = ("key_id, minute, job_id, op, bucket, variant, config, phase, samples, calls, total_ns, "
           "min_ns, max_ns, first_ns, last_ns, cache_hits, cache_misses, mean_hist")


def reference_rows(batches: list[otlp.Batch]) -> list[tuple]:
    """The SQL rollup of ``batches``' spans, their figures checked as the store checks them."""
    con = duckdb.connect()
    migrate(con)
    con.register("_rtx_batch", pa.concat_tables([rollup.valid_figures(b).spans for b in batches]))
    con.execute("DELETE FROM kernel_minutes")
    con.execute("INSERT INTO kernel_minutes BY NAME " + REFERENCE)
    return con.execute(f"SELECT {COLUMNS} FROM kernel_minutes ORDER BY ALL").fetchall()


def stored_rows(batches: list[otlp.Batch]) -> list[tuple]:
    """kernel_minutes after one store transaction of ``batches`` (the writer's group commit)."""
    con = duckdb.connect()
    migrate(con)
    con.execute("DELETE FROM kernel_minutes")
    _insert(con, batches)
    return con.execute(f"SELECT {COLUMNS} FROM kernel_minutes ORDER BY ALL").fetchall()


def odd_kernels() -> bytes:
    base = {S.OP: "softmax", S.BUCKET: "b", S.VARIANT: "eager", S.PHASE: "fwd", S.COUNT: 3,
            S.TOTAL_NS: 3000, S.MIN_NS: 900, S.MAX_NS: 1100}
    t0 = (time.time_ns() // MINUTE_NS) * MINUTE_NS
    spans = [
        span("rtx.kernel", {**base, S.CACHE_HITS: 2, S.CACHE_MISSES: 1}, start=t0),
        span("rtx.kernel", {k: v for k, v in base.items() if k != S.TOTAL_NS}, start=t0 + 2),
        span("rtx.kernel", {**base, S.TOTAL_NS: 1}, start=t0 + 3),                    # mean < 1
        span("rtx.kernel", {**base, S.TOTAL_NS: -50}, start=t0 + 3),                  # not a time
        span("rtx.kernel", {k: v for k, v in base.items() if k != S.OP}, start=t0 + 4),  # null key
        span("rtx.kernel", {**base, S.CACHE_HITS: 7}, start=t0 + MINUTE_NS),          # next minute
        span("rtx.step", {S.STEP_NUMBER: 1, S.CACHE_HITS: 100}, start=t0),
    ]
    return request(spans).SerializeToString()


def odd_cache_values() -> bytes:
    base = {S.OP: "gelu", S.BUCKET: "b", S.VARIANT: "aten", S.PHASE: "bwd", S.COUNT: 1, S.TOTAL_NS: 10}
    spans = [span("rtx.kernel", {**base, S.CACHE_HITS: v}) for v in ("5", 2.0, True, [1], 3)]
    return request(spans).SerializeToString()


def test_same_rows_as_the_sql_rollup():
    decoded = [otlp.convert(synthetic.otlp_request(400, seed=i, job_id=f"j{i % 2}").SerializeToString(),
                            otlp.PROTOBUF, 1) for i in range(3)]
    decoded += [otlp.convert(odd_kernels(), otlp.PROTOBUF, 1)]
    assert all(b.cache_counts is not None for b in decoded)
    odd = otlp.convert(odd_cache_values(), otlp.PROTOBUF, 1)
    assert odd.cache_counts is None                 # strings, doubles: the JSON path decides
    arrow = synthetic.kernel_batch(3000, start_ns=time.time_ns() - 3 * MINUTE_NS, duration_s=240)
    attached = [rollup.for_batch(b) for b in decoded]
    ready = [prepared(b) for b in decoded + [arrow]]        # as the receiver hands them over
    assert all(b.rollup is not None for b in attached + ready) and rollup.for_batch(odd).rollup is None
    for batches in (decoded, decoded[-1:], [odd], [arrow], decoded + [odd, arrow], attached,
                    attached[:1], [odd] + attached + [arrow], ready, ready[-1:], ready + [odd]):
        want = reference_rows(batches)
        assert len(want) >= 1
        assert stored_rows(batches) == want


def test_spans_with_zero_calls_count_but_get_no_bin():
    """The SQL rollup failed the whole write on these (0/0 → NaN cast before its FILTER)."""
    base = {S.OP: "softmax", S.BUCKET: "b", S.VARIANT: "eager", S.PHASE: "fwd", S.MIN_NS: 1, S.MAX_NS: 1}
    t0 = (time.time_ns() // MINUTE_NS) * MINUTE_NS
    body = request([span("rtx.kernel", {**base, S.COUNT: 0, S.TOTAL_NS: 0}, start=t0),
                    span("rtx.kernel", {**base, S.COUNT: 0, S.TOTAL_NS: 5}, start=t0 + 1),
                    span("rtx.kernel", {**base, S.COUNT: 2, S.TOTAL_NS: 2048}, start=t0 + 2)]).SerializeToString()
    (row,) = stored_rows([otlp.convert(body, otlp.PROTOBUF, 1)])
    samples, calls, total, hist = row[8], row[9], row[10], row[17]
    assert (samples, calls, total) == (3, 2, 2053) and hist == {160: 1}
