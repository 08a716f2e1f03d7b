"""The store's narrow layout of span rows (``span_rows`` + ``span_keys``; ``spans`` is a view).

DuckDB appends a row of integers several times faster than a row of strings, and a span's
strings repeat: a step's kernel spans differ in their numbers, not in their name, job, op,
variant, config, bucket, site and phase. So each distinct combination of those strings (a *key*)
is stored once in ``span_keys`` under a 64-bit ``key_id``, and the ids that OTLP carries as bytes
(shown as lowercase hex) are stored as unsigned integers: ``trace_hi``/``trace_lo`` (the
trace id's first and last 8 bytes, big-endian), ``span_id`` and ``parent_span_id``.

``key_id`` is a hash of the key's values (BLAKE2b, 8 bytes), so every writer gives the same key
the same id without asking the database. Two keys that collide would share the first one's
strings; at 64 bits that takes billions of keys.
"""
from __future__ import annotations

import hashlib

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

KEY_COLUMNS = ("name", "scope_name", "job_id", "rank", "op", "variant", "config", "bucket",
               "site", "phase")
ID_COLUMNS = ("trace_hi", "trace_lo", "span_id", "parent_span_id")
ROW_COLUMNS = ("kind", "start_ns", "end_ns", "duration_ns", "status_code", "status_message",
               "resource_id", "step", "plan_version", "count", "total_ns", "min_ns", "max_ns",
               "attributes")


def _pair_table() -> np.ndarray:
    """Two hex digits read as one little-endian uint16 → their byte (0x100 and up: not hex)."""
    nibble = np.full(256, 0x100, np.uint16)
    nibble[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint16)
    first, second = np.meshgrid(np.arange(256), np.arange(256), indexing="ij")  # low, high byte
    return np.where((nibble[first] | nibble[second]) > 15, 0x100,
                    (nibble[first] << 4) | nibble[second]).ravel(order="F").astype(np.uint16)


_HEX_PAIRS = _pair_table()


def split(spans: pa.Table) -> tuple[pa.Table, pa.Table]:
    """(``span_rows`` rows, ``span_keys`` rows) of wide span rows (``otlp.SPANS_SCHEMA``)."""
    rows, keys, _ = split_indexed(spans)
    return rows, keys


def split_indexed(spans: pa.Table) -> tuple[pa.Table, pa.Table, np.ndarray]:
    """:func:`split`, and for each span the row of its key in the keys table."""
    key_ids, keys, index = _keys(spans)
    trace_hi, trace_lo = _ids(spans["trace_id"], 16)
    (span_id,) = _ids(spans["span_id"], 8)
    (parent,) = _ids(spans["parent_span_id"], 8)
    rows = pa.table([trace_hi, trace_lo, span_id, parent, key_ids, *(spans[c] for c in ROW_COLUMNS)],
                    names=[*ID_COLUMNS, "key_id", *ROW_COLUMNS])
    return rows, keys, index


def merge(parts: list[tuple[pa.Table, pa.Table]]) -> tuple[pa.Table, pa.Table]:
    """One (rows, keys) pair from several batches', each key once."""
    if len(parts) == 1:
        return parts[0]
    rows = pa.concat_tables([r for r, _ in parts])
    keys = pa.concat_tables([k for _, k in parts])
    _, first = np.unique(np.asarray(keys["key_id"]), return_index=True)
    return rows, keys.take(pa.array(first)) if len(first) < keys.num_rows else keys


def key_id(values: tuple) -> int:
    """The id of one key (its values in :data:`KEY_COLUMNS` order)."""
    return int.from_bytes(hashlib.blake2b(orjson.dumps(values), digest_size=8).digest(), "big")


def _keys(spans: pa.Table) -> tuple[pa.Array, pa.Table, np.ndarray]:
    """Each span's key_id, one row per distinct key, and each span's row in that table."""
    inverse, first = distinct_rows(spans, KEY_COLUMNS)
    distinct = spans.select(list(KEY_COLUMNS)).take(pa.array(first))
    ids = np.array([key_id(values) for values in zip(*(distinct[c].to_pylist() for c in KEY_COLUMNS))],
                   np.uint64)
    return pa.array(ids[inverse]), _key_table(distinct, ids), inverse


def distinct_rows(table: pa.Table, columns) -> tuple[np.ndarray, np.ndarray]:
    """(for each row, the index of its distinct combination of ``columns``; for each
    combination, the row it first appears in). Nulls are values like any other."""
    n = table.num_rows
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    codes, sizes = [], []
    for name in columns:
        encoded = pc.dictionary_encode(table[name], null_encoding="encode").combine_chunks()
        codes.append(np.asarray(encoded.indices).astype(np.int64, copy=False))
        sizes.append(max(1, len(encoded.dictionary)))
    if np.prod([float(s) for s in sizes]) < 2.0**62:
        combined = np.zeros(n, np.int64)
        for code, size in zip(codes, sizes):
            combined = combined * size + code
        # a hash table, not a sort; its dictionary lists values in order of first appearance
        inverse = np.asarray(pc.dictionary_encode(pa.array(combined)).indices).astype(np.int64)
        seen = np.maximum.accumulate(inverse)
        first = np.flatnonzero(np.concatenate(([True], seen[1:] > seen[:-1])))
        return inverse, first
    # too many distinct values to number their combinations in 64 bits
    _, first, inverse = np.unique(np.stack(codes, axis=1), axis=0, return_index=True,
                                  return_inverse=True)
    return inverse.reshape(-1), first


def _key_table(distinct: pa.Table, ids) -> pa.Table:
    return distinct.add_column(0, "key_id", pa.array(np.asarray(ids, np.uint64)))


def _ids(column: pa.ChunkedArray | pa.Array, size: int) -> list[pa.Array]:
    """A column of ``size``-byte ids as lowercase hex (null or "" for none) → ``size // 8``
    uint64 columns, most significant bytes first."""
    a = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n, width = len(a), 2 * size
    valid = np.ones(n, bool) if a.null_count == 0 else np.asarray(a.is_valid())
    offsets = np.frombuffer(a.buffers()[1], np.int32, n + 1, a.offset * 4)
    lengths = np.diff(offsets)
    valid &= lengths != 0
    if not np.all(lengths[valid] == width):
        raise ValueError(f"a span id is not {size} bytes of lowercase hex")
    data = np.frombuffer(a.buffers()[2], np.uint8) if a.buffers()[2] is not None else np.zeros(0, np.uint8)
    if offsets[-1] - offsets[0] == int(valid.sum()) * width:
        digits = data[offsets[0]:offsets[-1]]          # the valid ids, back to back
    else:                                              # nulls that still cover bytes
        digits = data[(offsets[:-1][valid, None] + np.arange(width)).ravel()]
    pairs = _HEX_PAIRS[digits.view("<u2")]
    if pairs.size and pairs.max() > 255:
        raise ValueError(f"a span id is not {size} bytes of lowercase hex")
    raw = pairs.astype(np.uint8).reshape(-1, size)
    words = raw.view(">u8").astype(np.uint64)               # (valid rows, size // 8)
    everyone = bool(valid.all())
    out = []
    for w in range(size // 8):
        if everyone:
            out.append(pa.array(words[:, w]))
        else:
            full = np.zeros(n, np.uint64)
            full[valid] = words[:, w]
            out.append(pa.array(full, mask=~valid))
    return out
