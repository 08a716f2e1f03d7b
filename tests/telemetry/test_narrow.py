"""The narrow layout of span rows: what goes in comes back out of the ``spans`` view unchanged."""
from __future__ import annotations

import dataclasses
import time

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from rtxops.telemetry import narrow, otlp, store as store_module, synthetic
from rtxops.telemetry import schema as S
from rtxops.telemetry.store import Store, prepared

from .otlp_helpers import request, span

ORDER = "ORDER BY start_ns, span_id"


def _spans_out(con_or_store, order: str = ORDER) -> list[dict]:
    if isinstance(con_or_store, Store):
        return con_or_store.query(f"SELECT * FROM spans {order}")
    cur = con_or_store.execute(f"SELECT * FROM spans {order}")
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def _spans_in(table: pa.Table) -> list[dict]:
    return table.sort_by([("start_ns", "ascending"), ("span_id", "ascending")]).to_pylist()


def _store_at_version_7(path, monkeypatch) -> duckdb.DuckDBPyConnection:
    """A connection to a new store at schema 7 (wide spans table); ``monkeypatch.undo()`` brings
    the current migrations back."""
    con = duckdb.connect(str(path))
    monkeypatch.setattr(store_module, "MIGRATIONS", store_module.MIGRATIONS[:7])
    monkeypatch.setattr(store_module, "SCHEMA_VERSION", 7)
    store_module.migrate(con)
    return con


def _odd_request() -> otlp.Batch:
    t0 = time.time_ns()
    spans = [
        span("rtx.step", {S.STEP_NUMBER: 3}, start=t0, trace_id=b"\xff" * 16, span_id=b"\x00" * 7 + b"\x01"),
        span("rtx.kernel", {S.OP: "gelu", S.BUCKET: "b", S.VARIANT: "aten", S.COUNT: 2,
                            S.TOTAL_NS: 10, "x.extra": [1, 2]},
             start=t0 + 1, trace_id=b"\xff" * 16, span_id=b"\x80" + b"\x00" * 7, parent=b"\x00" * 7 + b"\x01"),
        span("rtx.kernel", {S.OP: "gelu", S.BUCKET: "b", S.VARIANT: "aten", S.PHASE: "bwd"}, start=t0 + 2),
        span("custom.thing", {}, start=t0 + 3),
    ]
    return otlp.convert(request(spans).SerializeToString(), otlp.PROTOBUF, 1)


def test_every_column_reads_back_as_written(tmp_path):
    batches = [_odd_request(),
               synthetic.kernel_batch(5000, start_ns=time.time_ns() - 10**12, duration_s=300, seed=3)]
    with Store(tmp_path / "n.duckdb") as store:
        for b in batches:
            store.write(b)
        store.write(prepared(batches[1]))        # the same rows again, made on this thread
        got = _spans_out(store)
        assert store.query("SELECT count(*) AS n FROM span_keys")[0]["n"] == \
            store.query("SELECT count(DISTINCT (name, scope_name, job_id, rank, op, variant, config, "
                        "bucket, site, phase)) AS n FROM spans")[0]["n"], "each key is stored once"
    want = _spans_in(pa.concat_tables([b.spans for b in batches] + [batches[1].spans]))
    assert len(got) == len(want) and got == want
    step, kernel = (r for r in got if r["trace_id"] == "f" * 32)
    assert step["span_id"] == "0000000000000001" and step["parent_span_id"] is None
    assert kernel["span_id"] == "8000000000000000" and kernel["parent_span_id"] == step["span_id"]


def test_key_ids_do_not_depend_on_the_batch():
    a, b = (synthetic.kernel_batch(800, start_ns=10**18, seed=s) for s in (1, 2))
    keys_a, keys_b = (dict(zip(k["key_id"].to_pylist(), k.drop(["key_id"]).to_pylist()))
                      for _, k in (narrow.split(a.spans), narrow.split(b.spans)))
    shared = keys_a.keys() & keys_b.keys()
    assert shared and all(keys_a[k] == keys_b[k] for k in shared)
    assert len({tuple(v.values()) for v in keys_a.values()}) == len(keys_a)


def test_ids_that_are_not_hex_of_their_size_are_refused():
    spans = _odd_request().spans
    for column, bad in (("trace_id", "ab" * 15), ("span_id", "zz" * 8), ("span_id", "AB" * 8)):
        values = spans[column].to_pylist()
        values[0] = bad
        broken = spans.set_column(spans.schema.get_field_index(column), column,
                                  pa.array(values, pa.string()))
        with pytest.raises(ValueError, match="lowercase hex"):
            narrow.split(broken)


def test_distinct_rows_past_64_bits_of_combinations():
    rng = np.random.default_rng(0)
    columns = {f"c{i}": pa.array(rng.integers(0, 10**6, 20000).astype(str)) for i in range(4)}
    table = pa.table(columns)
    table = pa.concat_tables([table, table.slice(0, 50)])          # 50 repeated rows
    inverse, first = narrow.distinct_rows(table, list(columns))
    assert len(first) == 20000 and len(inverse) == 20050
    rows = table.to_pylist()
    assert all(rows[first[inverse[i]]] == rows[i] for i in range(0, 20050, 97))
    assert all(inverse[20000 + i] == inverse[i] for i in range(50))


def test_migration_to_the_narrow_layout_keeps_every_span(tmp_path, monkeypatch):
    path = tmp_path / "v7.duckdb"
    con = _store_at_version_7(path, monkeypatch)
    old = [_odd_request(), synthetic.kernel_batch(3000, start_ns=time.time_ns() - 10**12, seed=5)]
    for b in old:
        con.register("b", b.spans)
        con.execute("INSERT INTO spans SELECT * FROM b")
    before = _spans_out(con)
    con.close()
    monkeypatch.undo()
    with Store(path) as store:
        assert store.migrated_from == 7
        assert _spans_out(store) == before
        new = _odd_request()
        store.write(new)                      # the same strings under the writers' key ids
        assert len(_spans_out(store)) == len(before) + new.span_count
        kinds = {r["name"]: r["n"] for r in store.query(
            "SELECT name, count(*) AS n FROM spans GROUP BY name")}
        assert kinds["custom.thing"] == 2 and kinds["rtx.step"] == 1 + 75 + 1


def test_newest_steps_are_the_newest_whatever_the_layout(tmp_path):
    """step_times / memory_timeline find their newest rows in span_rows first (see
    Store._newest_since): the answer is the one the spans view gives on its own."""
    with Store(tmp_path / "s.duckdb") as store:
        start = time.time_ns() - 10**12
        for seed in range(3):                                   # interleaved jobs and ranks
            store.write(synthetic.kernel_batch(4000, start_ns=start + seed, duration_s=500, seed=seed))
        store.write(_odd_request())
        for job in (None, "job-1", "job-a"):
            for limit in (1, 7, 40, 10_000):
                since = start + 100 * 10**9
                want = store.query("""
                    SELECT job_id, rank, step, duration_ns, plan_version, start_ns FROM step_times
                    WHERE ($job IS NULL OR job_id = $job) AND start_ns >= $since
                    ORDER BY start_ns DESC, rank, job_id LIMIT $limit""",
                                   {"job": job, "since": since, "limit": limit})
                got = store.step_times(job_id=job, since_ns=since, limit=limit)
                key = lambda r: (-r["start_ns"], r["rank"], r["job_id"])  # noqa: E731
                assert sorted(got, key=key) == want and (want or job == "job-a")
                mem = store.memory_timeline(job_id=job, since_ns=since, limit=limit)
                assert sorted((r["start_ns"], r["rss_bytes"]) for r in mem) == sorted(
                    (r["start_ns"], r["rss_bytes"]) for r in store.query(
                        "SELECT * FROM memory_timeline WHERE ($job IS NULL OR job_id = $job) "
                        "AND start_ns >= $since ORDER BY start_ns DESC LIMIT $limit",
                        {"job": job, "since": since, "limit": limit}))


def test_null_ids_read_as_null_however_arrow_lays_them_out():
    ids = pa.array(["ab" * 8, "cd" * 8, "ef" * 8])
    # a null that still covers its 16 bytes (Arrow allows it), then a slice of the array
    covered = pa.Array.from_buffers(pa.string(), 3, [pa.array([True, False, True]).buffers()[1],
                                                     *ids.buffers()[1:]], null_count=1)
    assert narrow._ids(covered, 8)[0].to_pylist() == [0xABABABABABABABAB, None, 0xEFEFEFEFEFEFEFEF]
    assert narrow._ids(covered.slice(1), 8)[0].to_pylist() == [None, 0xEFEFEFEFEFEFEFEF]
    assert narrow._ids(pa.array(["", None, "01" * 8]), 8)[0].to_pylist() == [None, None, 0x0101010101010101]
    rows, keys = narrow.split(otlp.SPANS_SCHEMA.empty_table())
    assert rows.num_rows == keys.num_rows == 0


def test_keys_past_what_an_index_would_hold_in_memory(tmp_path, monkeypatch):
    """Keys accumulate with every job; span_keys has no primary key, whose in-memory index
    outgrew the memory limit (here 32 MB: 400 k keys; at the default 96 MB about a million)."""
    monkeypatch.setenv("RTXOPS_STORE_MEMORY", "32MB")
    base = synthetic.kernel_batch(20_000, start_ns=10**18, seed=1)
    site_column = base.spans.schema.get_field_index("site")
    with Store(tmp_path / "keys.duckdb") as store:
        for i in range(20):
            sites = pa.array(np.char.add(f"m.{i}.", np.arange(20_000).astype(str)).astype(object))
            batch = dataclasses.replace(base, spans=base.spans.set_column(site_column, "site", sites))
            store.write(batch)
        assert store.query("SELECT count(*) AS n FROM span_keys")[0]["n"] == 400_000
    with Store(tmp_path / "keys.duckdb") as store:     # a fresh writer knows none of them
        store.write(_odd_request())
        store.write(batch)                             # its keys were stored before
        assert store.query("SELECT count(*) AS n, count(DISTINCT key_id) AS d FROM span_keys")[0] == \
            {"n": 400_004, "d": 400_004}
        assert store.query("SELECT count(*) AS n FROM spans")[0]["n"] == 400_000 + 4 + 20_000


def test_migration_refuses_ids_it_cannot_keep_and_changes_nothing(tmp_path, monkeypatch):
    path = tmp_path / "odd.duckdb"
    con = _store_at_version_7(path, monkeypatch)
    good = _odd_request()
    con.register("b", good.spans)
    con.execute("INSERT INTO spans SELECT * FROM b")
    con.execute("UPDATE spans SET trace_id = 'abababababababab' WHERE name = 'custom.thing'")  # 8 bytes
    before = _spans_out(con)
    con.close()
    monkeypatch.undo()
    with pytest.raises(duckdb.Error, match="1 spans whose ids are not OTLP ids"):
        Store(path)
    con = duckdb.connect(str(path))
    assert con.execute("SELECT max(version) FROM schema_version").fetchone()[0] == 7
    assert _spans_out(con) == before
    con.execute("DELETE FROM spans WHERE length(trace_id) <> 32")
    con.close()
    with Store(path) as store:
        assert store.migrated_from == 7 and len(_spans_out(store)) == len(before) - 1
