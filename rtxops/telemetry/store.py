"""The DuckDB telemetry store: schema and migrations, the single writer thread, and read queries.

One :class:`Store` per database file and process. Batches (Arrow tables from :mod:`.otlp`) go
through a bounded queue to one writer thread that inserts them with Arrow, several queued batches
in one transaction, and resolves each batch's future only after that transaction committed (the
DuckDB WAL makes a commit durable). A batch whose request body was committed in the last
:data:`RETRY_WINDOW_S` (a client's retry after an answer it did not get) is acknowledged and
not stored again. Readers get their own cursors. This module is the only place
in rtxops that writes SQL; the evolve loop and the dashboard call its query methods.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

# Arrow's own allocator keeps freed batch buffers: in a 3-minute soak the daemon peaked at 452 MB
# with it and 270 MB with the system allocator. Only takes effect before pyarrow's first import.
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")

import duckdb  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402

from .. import settings  # noqa: E402
from . import narrow, rollup  # noqa: E402
from .otlp import Batch, TelemetryError  # noqa: E402

log = logging.getLogger("rtxops.telemetry.store")

Future = concurrent.futures.Future
HOUR_NS = 3600 * 10**9
RETRY_WINDOW_S = 15 * 60       # how long a committed request body is remembered (see Store)
MAX_REMEMBERED = 100_000       # request digests remembered at most
REOPEN_RETRY_S = 5.0           # between attempts to reopen a database DuckDB invalidated


class StoreError(TelemetryError):
    """The store cannot take or serve data."""


class StoreBusy(StoreError):
    """The write queue is full; try again after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StoreClosed(StoreError):
    """The store is closed or closing."""


def default_path() -> Path:
    """``$RTXOPS_HOME/rtxops.duckdb`` (``RTXOPS_HOME`` defaults to ``./.rtxops``)."""
    return Path(os.environ.get("RTXOPS_HOME") or ".rtxops") / "rtxops.duckdb"


def _warn_if_shared(folder: Path) -> None:
    """DuckDB makes its write-ahead log (``.wal``, deleted at each checkpoint and made again)
    with the process's umask, whatever the store file's mode: in a folder other users can reach,
    the jobs' environments and output written there can be read by them."""
    try:
        chain = [folder.resolve(), *folder.resolve().parents]
        reachable = all(d.stat().st_mode & 0o001 for d in chain)   # every folder: o+x
        mode = folder.stat().st_mode
    except OSError:
        return
    if reachable:
        log.warning("the store's folder %s is open to other users (mode %o): they can read the "
                    "store's write-ahead log; `chmod 700` it or keep the store elsewhere",
                    folder, mode & 0o7777)


def connection_config() -> dict[str, Any]:
    """DuckDB settings of the store's connection (``RTXOPS_STORE_THREADS``, ``RTXOPS_STORE_MEMORY``)."""
    return settings.store_connection()


# ---- schema ----------------------------------------------------------------------------------
# Migrations are append-only: never edit a released one, add the next version. Attribute columns
# hold JSON text (VARCHAR rather than the JSON type: the cast would re-parse every row on insert).

_V1 = (
    """CREATE TABLE resources (
        resource_id BIGINT PRIMARY KEY, service_name VARCHAR, host_name VARCHAR, job_id VARCHAR,
        rank INTEGER, process_pid BIGINT, attributes VARCHAR, schema_url VARCHAR,
        first_seen_ns BIGINT)""",
    """CREATE TABLE spans (
        trace_id VARCHAR, span_id VARCHAR, parent_span_id VARCHAR, name VARCHAR, kind INTEGER,
        start_ns BIGINT, end_ns BIGINT, duration_ns BIGINT, status_code INTEGER,
        status_message VARCHAR, resource_id BIGINT, scope_name VARCHAR, job_id VARCHAR,
        rank INTEGER, step BIGINT, plan_version BIGINT, op VARCHAR, variant VARCHAR,
        config VARCHAR, bucket VARCHAR, site VARCHAR, phase VARCHAR, count BIGINT,
        total_ns BIGINT, min_ns BIGINT, max_ns BIGINT, attributes VARCHAR)""",
    """CREATE TABLE span_events (
        trace_id VARCHAR, span_id VARCHAR, time_ns BIGINT, name VARCHAR, attributes VARCHAR)""",
    """CREATE TABLE ingest_batches (
        received_ns BIGINT, committed_ns BIGINT, spans BIGINT, events BIGINT)""",
    """CREATE VIEW kernel_spans AS
        SELECT job_id, rank, step, plan_version, op, variant, config, bucket, site, phase,
               count, total_ns, min_ns, max_ns, start_ns, end_ns, trace_id, span_id,
               attributes->>'rtx.family' AS family,
               TRY_CAST(attributes->>'rtx.cache.hits' AS BIGINT) AS cache_hits,
               TRY_CAST(attributes->>'rtx.cache.misses' AS BIGINT) AS cache_misses,
               TRY_CAST(attributes->>'rtx.mem.delta_bytes' AS BIGINT) AS mem_delta_bytes,
               TRY_CAST(attributes->>'rtx.mem.peak_bytes' AS BIGINT) AS mem_peak_bytes,
               coalesce(TRY_CAST(attributes->>'rtx.sampled' AS BOOLEAN), false) AS sampled,
               attributes->'rtx.hist_log2_ns' AS hist_log2_ns
        FROM spans WHERE name = 'rtx.kernel'""",
    """CREATE VIEW step_times AS
        SELECT job_id, rank, step, duration_ns, plan_version, start_ns, end_ns, trace_id,
               count AS calls
        FROM spans WHERE name = 'rtx.step'""",
    """CREATE VIEW memory_timeline AS
        SELECT job_id, rank, step, start_ns,
               TRY_CAST(attributes->>'rtx.mem.rss_bytes' AS BIGINT) AS rss_bytes,
               TRY_CAST(attributes->>'rtx.cuda.allocated_bytes' AS BIGINT) AS cuda_allocated_bytes,
               TRY_CAST(attributes->>'rtx.cuda.reserved_bytes' AS BIGINT) AS cuda_reserved_bytes,
               TRY_CAST(attributes->>'rtx.cuda.peak_bytes' AS BIGINT) AS cuda_peak_bytes,
               TRY_CAST(attributes->>'rtx.cuda.fragmentation' AS DOUBLE) AS cuda_fragmentation,
               TRY_CAST(attributes->>'rtx.cuda.alloc_retries' AS BIGINT) AS cuda_alloc_retries,
               TRY_CAST(attributes->>'rtx.cuda.ooms' AS BIGINT) AS cuda_ooms
        FROM spans WHERE name = 'rtx.step'""",
    """CREATE VIEW swaps AS
        SELECT job_id, rank, step, start_ns AS at_ns,
               TRY_CAST(attributes->>'rtx.plan.from' AS BIGINT) AS plan_from,
               TRY_CAST(attributes->>'rtx.plan.to' AS BIGINT) AS plan_to,
               attributes->>'rtx.plan.digest' AS plan_digest
        FROM spans WHERE name = 'rtx.swap'""",
)

_V2 = (
    """CREATE TABLE jobs (
        job_id VARCHAR PRIMARY KEY, name VARCHAR, state VARCHAR, created_ns BIGINT,
        updated_ns BIGINT, record VARCHAR)""",
    """CREATE TABLE job_logs (
        job_id VARCHAR, seq BIGINT, ts_ns BIGINT, attempt INTEGER, rank INTEGER, stream VARCHAR,
        text VARCHAR)""",
    """CREATE TABLE job_events (
        job_id VARCHAR, ts_ns BIGINT, kind VARCHAR, detail VARCHAR)""",
)

MINUTE_NS = 60 * 10**9
HIST_BINS_PER_OCTAVE = 16

_ROLLUP_SELECT = f"""
SELECT job_id, op, bucket, variant, config, phase, start_ns // {MINUTE_NS} AS minute,
       count(*) AS samples, sum(count) AS calls, sum(total_ns) AS total_ns,
       min(min_ns) AS min_ns, max(max_ns) AS max_ns, min(start_ns) AS first_ns,
       max(start_ns) AS last_ns,
       sum(TRY_CAST(attributes->>'rtx.cache.hits' AS BIGINT)) AS cache_hits,
       sum(TRY_CAST(attributes->>'rtx.cache.misses' AS BIGINT)) AS cache_misses,
       histogram(CAST(floor(log2(greatest(total_ns / count, 1)) * {HIST_BINS_PER_OCTAVE}) AS INTEGER))
           FILTER (WHERE count > 0 AND total_ns IS NOT NULL) AS mean_hist
FROM {{source}} WHERE name = 'rtx.kernel'
GROUP BY ALL
"""

# Kernel spans rolled up per minute, written in the same transaction as the spans, so windowed
# kernel statistics read thousands of rows instead of millions. mean_hist counts the kernel spans'
# mean ns (total/count: one value per step and site) in bins of 1/16 octave.
_V3 = (
    """CREATE TABLE kernel_minutes (
        job_id VARCHAR, op VARCHAR, bucket VARCHAR, variant VARCHAR, config VARCHAR,
        phase VARCHAR, minute BIGINT, samples BIGINT, calls BIGINT, total_ns BIGINT,
        min_ns BIGINT, max_ns BIGINT, first_ns BIGINT, last_ns BIGINT, cache_hits BIGINT,
        cache_misses BIGINT, mean_hist MAP(INTEGER, BIGINT))""",
    "INSERT INTO kernel_minutes BY NAME " + _ROLLUP_SELECT.format(source="spans"),
)

_KEY = "hash(job_id, op, bucket, variant, config, phase)"
_V4 = (
    "ALTER TABLE kernel_minutes ADD COLUMN key_id UBIGINT",
    f"UPDATE kernel_minutes SET key_id = {_KEY}",
)

# The evolve loop's tables (#5): the tuning database, trials, correctness-gate results and
# decisions (promotions, rejections, canaries, rollbacks) with their evidence as JSON text.
_V5 = (
    """CREATE TABLE tuning (
        op VARCHAR, bucket VARCHAR, variant VARCHAR, config VARCHAR, device VARCHAR,
        torch_version VARCHAR, triton_version VARCHAR, source_hash VARCHAR, source VARCHAR,
        trials BIGINT, median_ns DOUBLE, spread DOUBLE, peak_bytes BIGINT, status VARCHAR,
        reason VARCHAR, updated_ns BIGINT,
        PRIMARY KEY (op, bucket, variant, config, device, torch_version, triton_version,
                     source_hash))""",
    """CREATE TABLE trials (
        trial_id VARCHAR PRIMARY KEY, job_id VARCHAR, op VARCHAR, bucket VARCHAR,
        variant VARCHAR, config VARCHAR, mode VARCHAR, strategy VARCHAR, started_ns BIGINT,
        ended_ns BIGINT, samples BIGINT, median_ns DOUBLE, p95_ns DOUBLE, spread DOUBLE,
        peak_bytes BIGINT, status VARCHAR, detail VARCHAR)""",
    """CREATE TABLE gate_results (
        op VARCHAR, bucket VARCHAR, variant VARCHAR, config VARCHAR, device VARCHAR,
        torch_version VARCHAR, triton_version VARCHAR, source_hash VARCHAR, passed BOOLEAN,
        reason VARCHAR, max_error DOUBLE, checked_ns BIGINT,
        PRIMARY KEY (op, bucket, variant, config, device, torch_version, triton_version,
                     source_hash))""",
    """CREATE TABLE decisions (
        decision_id VARCHAR PRIMARY KEY, job_id VARCHAR, op VARCHAR, bucket VARCHAR,
        kind VARCHAR, candidate_variant VARCHAR, candidate_config VARCHAR,
        incumbent_variant VARCHAR, incumbent_config VARCHAR, plan_version BIGINT, gain DOUBLE,
        ci_low DOUBLE, ci_high DOUBLE, p_value DOUBLE, reason VARCHAR, evidence VARCHAR,
        bundle_digest VARCHAR, at_ns BIGINT)""",
)

# Governance (#6): the append-only, hash-chained ledger of signed decisions (see store_ledger.py).
_V6 = (
    """CREATE TABLE ledger (
        seq BIGINT PRIMARY KEY, at_ns BIGINT, kind VARCHAR, scope VARCHAR, version BIGINT,
        subject_digest VARCHAR, decision VARCHAR, signer VARCHAR, reason VARCHAR,
        prev_hash VARCHAR, entry_hash VARCHAR)""",
)

_V7 = (
    """CREATE TABLE tune_tasks (
        task_id VARCHAR PRIMARY KEY, state VARCHAR, submitted_ns BIGINT, ended_ns BIGINT,
        summary VARCHAR, record VARCHAR)""",
)

# The narrow layout of span rows (see :mod:`.narrow`): integer ids, one row per distinct set of
# a span's strings in span_keys, and ``spans`` a view with the columns of the table it replaces.
# span_keys has no primary key: DuckDB holds a key's index in memory, which past about a million
# keys outgrows the store's memory limit (keys accumulate with every job); the writer adds only
# the keys it cannot find (see _insert).
_KEY_LIST = ", ".join(narrow.KEY_COLUMNS)
_OTLP_IDS = """(trace_id IS NULL OR regexp_full_match(trace_id, '[0-9a-fA-F]{32}'))
    AND (span_id IS NULL OR regexp_full_match(span_id, '[0-9a-fA-F]{16}'))
    AND (parent_span_id IS NULL OR parent_span_id = ''
         OR regexp_full_match(parent_span_id, '[0-9a-fA-F]{16}'))"""
_V8 = (
    # only rows written by hand can hold other ids (the decoders check them): refuse rather than
    # lose them; the transaction leaves the store as it was
    f"""SELECT CASE WHEN count(*) > 0 THEN error(
        'the store holds ' || count(*) || ' spans whose ids are not OTLP ids (32 and 16 hex '
        || 'digits); this rtxops stores ids as integers and will not drop them. Delete or fix '
        || 'them with the DuckDB CLI: DELETE FROM spans WHERE NOT ({" ".join(_OTLP_IDS.split()).replace("'", "''")})')
        END FROM spans WHERE NOT ({_OTLP_IDS})""",
    """CREATE TABLE span_keys (
        key_id UBIGINT, name VARCHAR, scope_name VARCHAR, job_id VARCHAR,
        rank INTEGER, op VARCHAR, variant VARCHAR, config VARCHAR, bucket VARCHAR, site VARCHAR,
        phase VARCHAR)""",
    """CREATE TABLE span_rows (
        trace_hi UBIGINT, trace_lo UBIGINT, span_id UBIGINT, parent_span_id UBIGINT,
        key_id UBIGINT, kind INTEGER, start_ns BIGINT, end_ns BIGINT, duration_ns BIGINT,
        status_code INTEGER, status_message VARCHAR, resource_id BIGINT, step BIGINT,
        plan_version BIGINT, count BIGINT, total_ns BIGINT, min_ns BIGINT, max_ns BIGINT,
        attributes VARCHAR)""",
    # spans stored before: their keys hashed by DuckDB (another id than the writers' for the
    # same strings: both rows stay, and read the same)
    f"INSERT INTO span_keys SELECT hash({_KEY_LIST}), * FROM (SELECT DISTINCT {_KEY_LIST} FROM spans)",
    f"""INSERT INTO span_rows SELECT
        TRY_CAST('0x' || substr(trace_id, 1, 16) AS UBIGINT),
        TRY_CAST('0x' || substr(trace_id, 17, 16) AS UBIGINT),
        TRY_CAST('0x' || span_id AS UBIGINT), TRY_CAST('0x' || parent_span_id AS UBIGINT),
        hash({_KEY_LIST}), {", ".join(narrow.ROW_COLUMNS)}
    FROM spans ORDER BY start_ns""",
    "DROP TABLE spans",
    """CREATE VIEW spans AS SELECT
        printf('%016x%016x', r.trace_hi, r.trace_lo) AS trace_id,
        printf('%016x', r.span_id) AS span_id,
        CASE WHEN r.parent_span_id IS NOT NULL THEN printf('%016x', r.parent_span_id) END
            AS parent_span_id,
        k.name, r.kind, r.start_ns, r.end_ns, r.duration_ns, r.status_code, r.status_message,
        r.resource_id, k.scope_name, k.job_id, k.rank, r.step, r.plan_version, k.op, k.variant,
        k.config, k.bucket, k.site, k.phase, r.count, r.total_ns, r.min_ns, r.max_ns,
        r.attributes
    FROM span_rows r JOIN span_keys k USING (key_id)""",
)
_V9 = ("ALTER TABLE ingest_batches ADD COLUMN digest BLOB",)
# a job's exit exports what ran after its last optimizer step as an rtx.step numbered -1 (its
# kernel spans hang under it): not a training step, kept out of step times and step counts
_V10 = (
    """CREATE OR REPLACE VIEW step_times AS
        SELECT job_id, rank, step, duration_ns, plan_version, start_ns, end_ns, trace_id,
               count AS calls
        FROM spans WHERE name = 'rtx.step' AND (step IS NULL OR step >= 0)""",
)

MIGRATIONS: tuple[tuple[int, str, tuple[str, ...]], ...] = (
    (1, "resources, spans, span events, ingest log; kernel/step/memory/swap views", _V1),
    (2, "jobs, job logs and job events of the supervisor", _V2),
    (3, "kernel spans rolled up per minute (kernel_minutes)", _V3),
    (4, "kernel_minutes.key_id: one integer per (job, op, bucket, variant, config, phase)", _V4),
    (5, "evolve: tuning database, trials, gate results, decisions", _V5),
    (6, "governance: ledger (append-only, hash-chained)", _V6),
    (7, "offline tuning tasks (they outlive the daemon)", _V7),
    (8, "span rows narrow: integer ids, strings once per key (span_keys); spans a view", _V8),
    (9, "ingest_batches.digest: a retried request is stored once", _V9),
    (10, "step_times leaves out the tail after a job's last optimizer step (step -1)", _V10),
)
SCHEMA_VERSION = MIGRATIONS[-1][0]


def migrate(con: duckdb.DuckDBPyConnection) -> int:
    """Bring the database to :data:`SCHEMA_VERSION`; returns the version it was at. A database
    with tables or views but no schema version is not a store: refused, left as it is."""
    if _has_schema_version(con):
        found = con.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchone()[0]
    else:
        (objects,) = con.execute(
            "SELECT (SELECT count(*) FROM duckdb_tables() WHERE database_name = current_database()) "
            "+ (SELECT count(*) FROM duckdb_views() WHERE NOT internal "
            "AND database_name = current_database())").fetchone()
        if objects:
            raise StoreError(f"{con.execute('PRAGMA database_list').fetchone()[2]} holds tables "
                             "and is not an rtxops store: point RTXOPS_STORE or RTXOPS_HOME elsewhere")
        found = 0
    if found > SCHEMA_VERSION:
        raise StoreError(f"the store's schema is version {found}, newer than this rtxops "
                         f"understands ({SCHEMA_VERSION}); upgrade rtxops")
    for version, description, statements in MIGRATIONS:
        if version <= found:
            continue
        if found:                                     # an existing store: this may take a while
            log.info("rtxops store: migrating to schema %d: %s", version, description)
        con.execute("BEGIN")
        try:
            # (in the first migration's transaction: a failed one leaves the file as it was)
            con.execute("CREATE TABLE IF NOT EXISTS schema_version "
                        "(version INTEGER PRIMARY KEY, description VARCHAR, applied_ns BIGINT)")
            for sql in statements:
                con.execute(sql)
            con.execute("INSERT INTO schema_version VALUES (?, ?, ?)",
                        [version, description, time.time_ns()])
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
    return found


def _has_schema_version(con: duckdb.DuckDBPyConnection) -> bool:
    return bool(con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'schema_version' "
                            "AND database_name = current_database()").fetchone()[0])


# ---- the store -------------------------------------------------------------------------------

@dataclass
class _Pending:
    batch: Batch
    future: Future


@dataclass
class _Task:
    fn: Callable[[duckdb.DuckDBPyConnection], Any]
    future: Future
    transaction: bool = True


_STOP = object()


class Store:
    """A DuckDB telemetry database with one writer thread (see the module docstring).

    ``max_queue_batches`` / ``max_queue_spans`` bound what waits for the writer (a span event
    counts as a span there): past either, :meth:`submit` refuses with :class:`StoreBusy` and
    counts the refused spans.
    ``max_commit_spans`` caps how many queued spans one transaction takes. Every
    ``compact_every_s`` the writer merges the kernel_minutes rows separate commits wrote. A pass
    costs 20-40 ms of CPU however few rows it merges (four statements planned and run): every
    half minute, that was a third of the daemon's CPU beside a settled job. The readers sum the
    rows anyway; five minutes of them unmerged (a few hundred a key at most) cost them nothing
    measurable.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, max_queue_batches: int = 256,
                 max_queue_spans: int = 1_000_000, max_commit_spans: int = 1_000_000,
                 compact_every_s: float = 300.0) -> None:
        self.path = Path(path) if path is not None else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        _warn_if_shared(self.path.parent)
        self.max_queue_batches = max_queue_batches
        self.max_queue_spans = max_queue_spans
        self.max_commit_spans = max_commit_spans
        self.compact_every_s = compact_every_s
        self._compacted = time.monotonic()
        self._wal_threshold = settings.store_wal()   # (a malformed one is said here, not in the writer)
        self._con = duckdb.connect(str(self.path), config=connection_config())
        try:
            self.migrated_from = migrate(self._con)
        except BaseException:
            self._con.close()   # (its lock on the file with it)
            raise
        with contextlib.suppress(OSError):   # jobs' environments and output: the user's alone
            os.chmod(self.path, 0o600)
        if self._con.execute("SELECT count(*) FROM information_schema.tables "
                             "WHERE table_name = '_rtx_rows'").fetchone()[0]:
            self._con.close()   # it would stand in for the rows every write hands DuckDB
            raise StoreError(f"the store at {self.path} holds a table or view named _rtx_rows; "
                             "rename or drop it with the DuckDB CLI")
        self._lock = threading.Lock()               # counters, queue bounds, cursor creation
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closing = False
        self.queue_batches = 0
        self.queue_spans = 0
        self.spans_written = 0
        self.batches_written = 0
        self.commits = 0
        self.spans_refused = 0
        self.requests_refused = 0
        self.requests_rejected = 0
        self.spans_rejected = 0
        self.write_errors = 0
        self.batches_repeated = 0
        self.spans_repeated = 0
        self.rows_pruned = 0
        self.broken: str | None = None               # why the database is being reopened
        self.last_write_error: tuple[float, str] | None = None   # (monotonic time, reason)
        self._write_failed = False                   # writer thread only
        self._rate = 200_000.0                       # spans/s, for Retry-After hints
        self._digests = _recent_digests(self._con)   # writer thread only
        self._resources_stored: set[int] = set()     # writer thread only
        self._keys_stored: set[int] = set()          # span key ids committed (writer thread only)
        self._writer = threading.Thread(target=self._run, args=(self._con.cursor(),),
                                        name="rtxops-store-writer", daemon=True)
        self._writer.start()

    # -- writing --

    def submit(self, batch: Batch) -> Future:
        """Queue ``batch``; the future resolves (to None) once it is committed."""
        future: Future = Future()
        with self._lock:
            if self._closing:
                raise StoreClosed(f"the store at {self.path} is closed")
            if self.broken:
                self.spans_refused += batch.span_count
                self.requests_refused += 1
                raise StoreBusy(f"the store is being reopened after a fatal error: {self.broken}",
                                REOPEN_RETRY_S)
            # a batch larger than the whole queue still goes in when the queue is empty: refused
            # there, it would be refused on every retry
            if (self.queue_batches + 1 > self.max_queue_batches
                    or (self.queue_batches and self.queue_spans + _rows(batch) > self.max_queue_spans)):
                self.spans_refused += batch.span_count
                self.requests_refused += 1
                raise StoreBusy(f"the store's write queue is full ({self.queue_batches} batches, "
                                f"{self.queue_spans} spans waiting)", self._retry_after())
            self.queue_batches += 1
            self.queue_spans += _rows(batch)
            self._queue.put(_Pending(batch, future))
        return future

    def write(self, batch: Batch, timeout: float | None = None) -> None:
        """Submit ``batch`` and wait until it is committed (on timeout, see :meth:`call`)."""
        _settled(self.submit(batch), timeout)

    def call(self, fn: Callable[[duckdb.DuckDBPyConnection], Any], timeout: float | None = 30.0,
             *, transaction: bool = True) -> Any:
        """:meth:`run_write` and wait for its result. A write still queued after ``timeout`` is
        withdrawn (TimeoutError: nothing was written); one already running is waited for, so a
        caller never gives up on a write that then commits behind its back."""
        return _settled(self.run_write(fn, transaction=transaction), timeout)

    def run_write(self, fn: Callable[[duckdb.DuckDBPyConnection], Any], *,
                  transaction: bool = True) -> Future:
        """Run ``fn(cursor)`` on the writer thread in a transaction of its own (the other tables
        of the store use this: jobs, logs); the future resolves to its result once committed.
        ``transaction=False`` runs it bare (a CHECKPOINT cannot run inside a transaction)."""
        future: Future = Future()
        with self._lock:
            if self._closing:
                raise StoreClosed(f"the store at {self.path} is closed")
            if self.broken:
                raise StoreBusy(f"the store is being reopened after a fatal error: {self.broken}",
                                REOPEN_RETRY_S)
            self._queue.put(_Task(fn, future, transaction))
        return future

    def forget_stored_ids(self) -> None:
        """Forget which span keys and resources the writer has committed (call it on the writer
        thread, from a :meth:`run_write` function that deleted such rows: later batches then
        write them again)."""
        self._keys_stored.clear()
        self._resources_stored.clear()

    def note_refused(self, spans: int = 0) -> None:
        """Count a request refused: the receiver was saturated (its spans were never decoded, so
        they are not counted unless given), or its batch was not written."""
        with self._lock:
            self.requests_refused += 1
            self.spans_refused += spans

    def note_pruned(self, rows: int) -> None:
        """Count rows a retention prune deleted (for :meth:`stats`)."""
        with self._lock:
            self.rows_pruned += rows

    def note_rejected(self, requests: int = 1, spans: int = 0) -> None:
        """Count input the receiver turned away as malformed (for :meth:`stats`)."""
        with self._lock:
            self.requests_rejected += requests
            self.spans_rejected += spans

    def close(self, timeout: float | None = 60.0) -> None:
        """Write what is queued, checkpoint, and close. Later submits raise :class:`StoreClosed`."""
        with self._lock:
            if self._closing:
                already = True
            else:
                already, self._closing = False, True
                self._queue.put(_STOP)
        if already:
            self._writer.join(timeout)
            return
        self._writer.join(timeout)
        if self._writer.is_alive():
            log.error("rtxops store: the writer did not finish within %ss; closing anyway", timeout)
            return
        if self._con is None:
            return
        with contextlib.suppress(duckdb.Error):
            self._con.execute("CHECKPOINT")
        self._con.close()

    @property
    def closed(self) -> bool:
        return self._closing

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _retry_after(self) -> float:
        return max(1.0, min(60.0, self.queue_spans / max(self._rate, 1.0)))

    def _run(self, cur: duckdb.DuckDBPyConnection) -> None:
        # Fewer automatic checkpoints than DuckDB's 16 MB default: each one recompresses the
        # spans table's partly filled last row group, so frequent ones dominate the writer's time
        # under load (256 MB: 105 k spans/s in bench/ingest.py). Commits stay durable through
        # the WAL; the cost is memory (what waits for a checkpoint; past DuckDB's memory limit
        # it spills to temporary files) and WAL replay time after a crash.
        cur.execute(f"SET checkpoint_threshold = '{self._wal_threshold}'")
        stop = False
        deferred: list[_Task] = []
        while not stop:
            item = self._queue.get()
            group: list[_Pending] = []
            spans = 0
            while True:
                if item is _STOP:
                    stop = True
                    break
                if isinstance(item, _Task):
                    deferred.append(item)
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    continue
                if item.future.set_running_or_notify_cancel():
                    group.append(item)
                    spans += item.batch.span_count
                else:
                    self._dequeued(item.batch)
                if spans >= self.max_commit_spans:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if group:
                self._commit_group(cur, group)
                self._maybe_compact(cur)
            for task in deferred:
                if not _run_task(cur, task):
                    failed = task.future.exception() if not task.future.cancelled() else None
                    self._note_write_error(failed or "a checkpoint failed after a commit")
            deferred.clear()
            if self._write_failed:
                self._write_failed = False
                cur = self._usable(cur)
                if cur is None:   # closed while the database could not be reopened
                    self._fail_queued()
                    return
        cur.close()

    def _fail_queued(self) -> None:
        """Resolve what waits in the queue as not written (the store closed unusable)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Pending):
                self._dequeued(item.batch)
            if item is not _STOP and item.future.set_running_or_notify_cancel():
                item.future.set_exception(StoreClosed(f"the store at {self.path} closed unusable"))

    def _note_write_error(self, error: BaseException | str | None) -> None:
        self._write_failed = True
        with self._lock:
            self.last_write_error = (time.monotonic(), str(error).splitlines()[0] if error else "")

    def _usable(self, cur: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection | None:
        """After a failed write: ``cur`` if the database still works, else a new connection once
        one can be opened. DuckDB invalidates a database whose checkpoint failed (a full disk,
        say) until it is opened again; reopening replays its WAL, so nothing committed is lost.
        Meanwhile submits are refused (503 with Retry-After) and readers get a StoreError."""
        try:
            cur.execute("SELECT 1")
            return cur
        except duckdb.Error as e:
            reason = str(e).splitlines()[0]
        log.error("rtxops store: the database at %s is unusable (%s); reopening it", self.path, reason)
        with self._lock:
            self.broken = reason
            old, self._con = self._con, None
        for c in (cur, old):
            with contextlib.suppress(Exception):
                c.close()
        while True:
            con = None
            try:
                con = duckdb.connect(str(self.path), config=connection_config())
                fresh = con.cursor()
                fresh.execute(f"SET checkpoint_threshold = '{self._wal_threshold}'")
                break
            except duckdb.Error as e:   # no space yet, or a reader still holds the old database
                log.warning("rtxops store: reopening %s failed (%s); retrying in %ss", self.path,
                            str(e).splitlines()[0], REOPEN_RETRY_S)
                if con is not None:
                    with contextlib.suppress(Exception):
                        con.close()
            with self._lock:
                if self._closing:
                    return None
            time.sleep(REOPEN_RETRY_S)
        self.forget_stored_ids()
        self._digests = _recent_digests(fresh)   # a client's retry of a body committed before
        with self._lock:
            self._con, self.broken = con, None
        log.warning("rtxops store: %s reopened", self.path)
        return fresh

    def _dequeued(self, batch: Batch) -> None:
        with self._lock:
            self.queue_batches -= 1
            self.queue_spans -= _rows(batch)

    def compact(self, before_ns: int | None = None, timeout: float | None = 60.0) -> None:
        """Merge the kernel_minutes rows that separate commits wrote for one minute, for minutes
        before ``before_ns`` (default: all but the last two). The writer also does this itself
        every ``compact_every_s``."""
        before = _compact_before(before_ns)
        self.call(lambda cur: _compact(cur, before), timeout)

    def _maybe_compact(self, cur: duckdb.DuckDBPyConnection) -> None:
        if time.monotonic() - self._compacted < self.compact_every_s:
            return
        self._compacted = time.monotonic()
        try:
            cur.execute("BEGIN")
            _compact(cur, _compact_before(None))
            cur.execute("COMMIT")
        except duckdb.Error as e:
            with contextlib.suppress(duckdb.Error):
                cur.execute("ROLLBACK")
            self._note_write_error(e)
            log.exception("rtxops store: compacting kernel_minutes failed")

    def _commit_group(self, cur: duckdb.DuckDBPyConnection, group: list[_Pending]) -> None:
        fresh, again = self._without_repeats(group)
        if fresh:
            self._commit_fresh(cur, fresh)
        if again:   # repeats of a batch in this group: stored or not as that one was
            self._commit_group(cur, again)

    def _commit_fresh(self, cur: duckdb.DuckDBPyConnection, group: list[_Pending]) -> None:
        started = time.perf_counter()
        try:
            keys = _insert(cur, self._without_stored_resources([p.batch for p in group]),
                           self._keys_stored)
        except Exception as e:                       # isolate the batch that failed
            if _durable(e):   # committed; the checkpoint after it failed: reopen, after the acks
                keys = []
                self._note_write_error(e)
            elif len(group) > 1:
                for pending in group:
                    self._commit_group(cur, [pending])
                return
            else:
                with self._lock:
                    self.write_errors += 1
                self._note_write_error(e)
                self._dequeued(group[0].batch)
                group[0].future.set_exception(StoreError(f"writing a batch failed: {e}"))
                return
        if len(self._resources_stored) > 100_000:
            self._resources_stored.clear()
        for p in group:
            self._resources_stored.update(p.batch.resources["resource_id"].to_pylist())
        if len(self._keys_stored) > 100_000:
            self._keys_stored.clear()
        self._keys_stored.update(keys)
        self._remember([p.batch.digest for p in group if p.batch.digest is not None])
        spans = sum(p.batch.span_count for p in group)
        elapsed = time.perf_counter() - started
        with self._lock:
            self.spans_written += spans
            self.batches_written += len(group)
            self.commits += 1
            self.queue_batches -= len(group)
            self.queue_spans -= sum(_rows(p.batch) for p in group)
            if spans >= 1000 and elapsed > 0:
                self._rate = 0.8 * self._rate + 0.2 * spans / elapsed
        for pending in group:
            pending.future.set_result(None)

    def _without_repeats(self, group: list[_Pending]) -> tuple[list[_Pending], list[_Pending]]:
        """(the batches of ``group`` to store, those that repeat an earlier one of the group).
        Batches whose request body was committed before are acknowledged as they are (their
        spans are stored already)."""
        fresh: list[_Pending] = []
        again: list[_Pending] = []
        seen: set[bytes] = set()
        for pending in group:
            digest = pending.batch.digest
            if digest is not None and digest in seen:
                again.append(pending)
                continue
            if digest is None or digest not in self._digests:
                fresh.append(pending)
                if digest is not None:
                    seen.add(digest)
                continue
            self._dequeued(pending.batch)
            with self._lock:
                self.batches_repeated += 1
                self.spans_repeated += pending.batch.span_count
            pending.future.set_result(None)
        return fresh, again

    def _remember(self, digests: list[bytes]) -> None:
        now = time.time_ns()
        for digest in digests:
            self._digests[digest] = now
        oldest = now - RETRY_WINDOW_S * 10**9
        # an OrderedDict: a plain dict skips every deleted slot at its front on each iteration
        while self._digests and (len(self._digests) > MAX_REMEMBERED
                                 or next(iter(self._digests.values())) < oldest):
            self._digests.popitem(last=False)

    def _without_stored_resources(self, batches: list[Batch]) -> list[Batch]:
        """Batches less the resource rows already committed (their INSERT OR IGNORE costs a
        primary-key probe per commit)."""
        if not self._resources_stored:
            return batches
        stored = pa.array(list(self._resources_stored), pa.int64())
        return [b if not b.resources.num_rows else dataclasses.replace(
            b, resources=b.resources.filter(pc.invert(pc.is_in(b.resources["resource_id"], stored))))
            for b in batches]

    # -- reading --

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A new connection to the same database, for one thread's reads (close it after use)."""
        with self._lock:
            if self._closing and not self._writer.is_alive():
                raise StoreClosed(f"the store at {self.path} is closed")
            if self._con is None:
                raise StoreError(f"the store is being reopened after a fatal error: {self.broken}")
            return self._con.cursor()

    @contextlib.contextmanager
    def reader(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """``with store.reader() as cur:`` a cursor that is closed afterwards."""
        cur = self.cursor()
        try:
            yield cur
        finally:
            cur.close()

    def query(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> list[dict]:
        """Run a read query with parameters; rows as dicts."""
        with self.reader() as cur:
            result = cur.execute(sql, params or [])
            names = [d[0] for d in result.description]
            return [dict(zip(names, row)) for row in result.fetchall()]

    def stats(self) -> dict[str, int]:
        """Ingest counters of this process (for /metrics and the dashboard)."""
        with self._lock:
            return {
                "spans_written": self.spans_written, "batches_written": self.batches_written,
                "commits": self.commits, "spans_refused": self.spans_refused,
                "requests_refused": self.requests_refused,
                "requests_rejected": self.requests_rejected, "spans_rejected": self.spans_rejected,
                "write_errors": self.write_errors, "batches_repeated": self.batches_repeated,
                "spans_repeated": self.spans_repeated, "rows_pruned": self.rows_pruned,
                "queue_batches": self.queue_batches,
                "queue_spans": self.queue_spans,
            }

    # -- the queries the evolve loop and the dashboard need --

    def kernel_stats(self, *, since_ns: int | None = None, until_ns: int | None = None,
                     job_id: str | None = None, op: str | None = None) -> list[dict]:
        """Per (job, op, bucket, variant, config, phase) over the whole minutes of
        ``[since_ns, until_ns)`` (default: the last hour): samples (kernel spans: one per step
        and site), calls, total/mean/min/max ns (exact), and p50/p95 of the per-step mean ns
        (from 1/16-octave bins: within about 2%)."""
        since_ns, until_ns = _window(since_ns, until_ns)
        return self.query(_KERNEL_STATS, {"since": since_ns, "until": until_ns, "job": job_id, "op": op})

    def step_times(self, *, job_id: str | None = None, since_ns: int | None = None,
                   limit: int = 10_000) -> list[dict]:
        """One row per step span: job, rank, step, duration, plan version, start time."""
        return self.query("""
            SELECT job_id, rank, step, duration_ns, plan_version, start_ns FROM step_times
            WHERE ($job IS NULL OR job_id = $job) AND start_ns >= $since
            ORDER BY start_ns DESC LIMIT $limit""",
                          {"job": job_id, "since": self._newest_since("rtx.step", job_id, since_ns, limit),
                           "limit": limit})

    def swaps(self, *, job_id: str | None = None, since_ns: int | None = None) -> list[dict]:
        """Plan swaps: job, rank, step, time, from/to version, plan digest."""
        return self.query("""
            SELECT * FROM swaps WHERE ($job IS NULL OR job_id = $job) AND at_ns >= $since
            ORDER BY at_ns""", {"job": job_id, "since": since_ns or 0})

    def memory_timeline(self, *, job_id: str | None = None, since_ns: int | None = None,
                        limit: int = 10_000) -> list[dict]:
        """RSS and CUDA allocator figures per step (from step spans)."""
        return self.query("""
            SELECT * FROM memory_timeline
            WHERE ($job IS NULL OR job_id = $job) AND start_ns >= $since
            ORDER BY start_ns DESC LIMIT $limit""",
                          {"job": job_id, "since": self._newest_since("rtx.step", job_id, since_ns, limit),
                           "limit": limit})

    def _newest_since(self, name: str, job_id: str | None, since_ns: int | None, limit: int) -> int:
        """A start time at or before that of the newest ``limit`` spans named ``name`` (of one
        job) since ``since_ns``. DuckDB reads only the newest row groups for an ORDER BY ...
        LIMIT over one table, not through the join of the ``spans`` view: so the newest are
        found in ``span_rows`` alone, and the view's query gets their start as a lower bound."""
        since = since_ns or 0
        keys = self.query("SELECT key_id FROM span_keys WHERE name = $name AND ($job IS NULL OR job_id = $job)",
                          {"name": name, "job": job_id})
        if not keys or len(keys) > 64:
            return since
        # an OR of equalities: DuckDB turns an IN list of more than a few values into a join,
        # which reads every row group again (the ids are integers from the store itself)
        match = " OR ".join(f"key_id = {int(k['key_id'])}" for k in keys)
        row = self.query(f"""
            SELECT min(start_ns) AS floor FROM (
                SELECT start_ns FROM span_rows WHERE ({match}) AND start_ns >= $since
                ORDER BY start_ns DESC LIMIT $limit)""", {"since": since, "limit": limit})
        return since if row[0]["floor"] is None else max(since, row[0]["floor"])

    def cache_hit_rates(self, *, job_id: str | None = None, since_ns: int | None = None,
                        until_ns: int | None = None) -> list[dict]:
        """Hits, misses and hit rate per cache: ``variant`` (the runtime's build cache, per op,
        variant and bucket, summed over kernel spans), ``inductor.fxgraph`` and
        ``triton.autotune`` (process-cumulative counters on step spans: per process, the last
        value in the window less the last one before it, looked for as far back as the window
        is long; summed over a job's processes, a restarted job's old and new ones apart). The
        variant cache is counted in whole minutes."""
        since_ns, until_ns = _window(since_ns, until_ns)
        return self.query(_CACHE_HIT_RATES, {"since": since_ns, "until": until_ns, "job": job_id,
                                             "before": since_ns - max(0, until_ns - since_ns)})

    def jobs(self) -> list[dict]:
        """Jobs seen: resource facts and the span time range per job."""
        return self.query("""
            SELECT r.job_id, list(DISTINCT r.service_name) AS services,
                   list(DISTINCT r.host_name) AS hosts, count(DISTINCT r.rank) AS ranks,
                   min(r.first_seen_ns) AS first_seen_ns
            FROM resources r GROUP BY r.job_id ORDER BY first_seen_ns""")

    def ingest_stats(self) -> dict[str, int]:
        """Spans and batches stored (all time, from the ingest log) plus this process's counters."""
        row = self.query("""
            SELECT count(*) AS batches_stored, coalesce(sum(spans), 0) AS spans_stored,
                   coalesce(sum(events), 0) AS events_stored,
                   max(committed_ns) AS last_commit_ns
            FROM ingest_batches""")[0]
        return {**row, **self.stats()}


def _rows(batch: Batch) -> int:
    """What a queued batch counts against ``max_queue_spans``: its spans and its span events (a
    request of empty events is small on the wire and as many rows in memory)."""
    return batch.span_count + batch.events.num_rows


def _settled(future: Future, timeout: float | None) -> Any:
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:  # (not yet the builtin before Python 3.11)
        if future.cancel():  # still queued: the writer skips it
            raise
        return future.result()  # running: its outcome, whichever it is


def _run_task(cur: duckdb.DuckDBPyConnection, task: _Task) -> bool:
    """Run ``task``; False after a database error (the writer then checks the database)."""
    if not task.future.set_running_or_notify_cancel():
        return True
    result = None
    try:
        if not task.transaction:
            result = task.fn(cur)
        else:
            cur.execute("BEGIN")
            result = task.fn(cur)
            cur.execute("COMMIT")
    except BaseException as e:
        if _durable(e):   # committed; the checkpoint after it failed (the writer reopens)
            task.future.set_result(result)
            return False
        with contextlib.suppress(duckdb.Error):
            cur.execute("ROLLBACK")
        task.future.set_exception(e)
        return not isinstance(e, duckdb.Error)
    task.future.set_result(result)
    return True


def _durable(error: BaseException) -> bool:
    """Whether ``error`` says its COMMIT succeeded (DuckDB's automatic checkpoint after it failed
    and invalidated the database): the write stands, and must not be reported failed."""
    return isinstance(error, duckdb.Error) and "COMMIT succeeded and is durable" in str(error)


def _compact_before(before_ns: int | None) -> int:
    """The first minute not to compact: by default the one before the current (late spans)."""
    return (time.time_ns() if before_ns is None else before_ns) // MINUTE_NS - (
        1 if before_ns is None else 0)


def _compact(cur: duckdb.DuckDBPyConnection, before_minute: int) -> None:
    for sql in _COMPACT:
        cur.execute(sql, {"before": before_minute} if "$before" in sql else None)


def _window(since_ns: int | None, until_ns: int | None) -> tuple[int, int]:
    """Default: the last hour, with a minute's slack for clocks ahead of ours."""
    now = time.time_ns()
    return (now - HOUR_NS if since_ns is None else since_ns,
            now + 60 * 10**9 if until_ns is None else until_ns)


def prepared(batch: Batch) -> Batch:
    """``batch`` with its figures past 2^53 taken out of the summed columns
    (:func:`.rollup.valid_figures`) and its kernel rollup and narrow rows made (:mod:`.rollup`,
    :mod:`.narrow`). Producers call this on their own thread (the receiver's decoding, the direct
    exporter's export thread), so the store's single writer only inserts."""
    index = None
    if batch.narrow is None:
        batch = rollup.valid_figures(batch)
        rows, keys, index = narrow.split_indexed(batch.spans)
        batch = dataclasses.replace(batch, narrow=(rows, keys))
    return rollup.for_batch(batch, index)


def _insert(cur: duckdb.DuckDBPyConnection, batches: list[Batch],
            stored_keys: set | None = None) -> list[int]:
    """One transaction: resources and span keys (new ones only), span rows, events, and one
    ingest row per batch. Returns the span key ids it committed."""
    # a batch no producer prepared: its figures are checked here, before rows and rollup
    batches = [b if b.narrow is not None else rollup.valid_figures(b) for b in batches]
    rows, keys = narrow.merge([b.narrow if b.narrow is not None else narrow.split(b.spans)
                               for b in batches])
    if stored_keys and keys.num_rows:                # a batch has few keys; the set may be large
        keys = keys.filter(pa.array([k not in stored_keys for k in keys["key_id"].to_pylist()]))
    tables = {
        "resources": pa.concat_tables([b.resources for b in batches]),
        "span_keys": keys,
        "span_rows": rows,
        "span_events": pa.concat_tables([b.events for b in batches]),
    }
    now = time.time_ns()
    log_rows = pa.table({"received_ns": [b.received_ns for b in batches],
                         "committed_ns": [now] * len(batches),
                         "spans": [b.span_count for b in batches],
                         "events": [b.events.num_rows for b in batches],
                         "digest": pa.array([b.digest for b in batches], pa.binary())})
    cur.execute("BEGIN")
    try:
        for name, table in tables.items():
            if name == "span_keys" and table.num_rows:
                table = _unknown_keys(cur, table)    # the cache forgets; a restart starts it empty
            if table.num_rows:
                verb = "INSERT OR IGNORE" if name == "resources" else "INSERT"
                execute_on(cur, f"{verb} INTO {name} BY NAME SELECT * FROM _rtx_rows", table)
        if rows.num_rows:
            _rollup(cur, batches)
        execute_on(cur, "INSERT INTO ingest_batches BY NAME SELECT * FROM _rtx_rows", log_rows)
        cur.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(duckdb.Error):
            cur.execute("ROLLBACK")
        raise
    return keys["key_id"].to_pylist()


def execute_on(cur: duckdb.DuckDBPyConnection, sql: str, _rtx_rows: pa.Table) -> duckdb.DuckDBPyConnection:
    """``cur.execute(sql)`` where ``sql`` reads the Arrow table ``_rtx_rows``. DuckDB finds the
    table among this function's locals (a replacement scan): registering it as a view and
    dropping that again took longer than a small insert itself (a micro-benchmark; in the
    daemon the difference is within its noise)."""
    return cur.execute(sql)


def _recent_digests(con: duckdb.DuckDBPyConnection) -> collections.OrderedDict[bytes, int]:
    """The request digests committed in the last :data:`RETRY_WINDOW_S`, oldest first (a
    client's retry can outlive a daemon restart)."""
    rows = con.execute(
        "SELECT digest, committed_ns FROM ingest_batches WHERE digest IS NOT NULL "
        "AND committed_ns >= ? ORDER BY committed_ns DESC LIMIT ?",
        [time.time_ns() - RETRY_WINDOW_S * 10**9, MAX_REMEMBERED]).fetchall()
    return collections.OrderedDict((bytes(digest), ns) for digest, ns in reversed(rows))


def _unknown_keys(cur: duckdb.DuckDBPyConnection, keys: pa.Table) -> pa.Table:
    """The rows of ``keys`` whose key_id span_keys does not hold (the join is built on the few
    keys of the batch and probed with the stored ones)."""
    known = execute_on(cur, "SELECT DISTINCT key_id FROM span_keys SEMI JOIN _rtx_rows USING (key_id)",
                       keys).fetchall()
    if not known:
        return keys
    return keys.filter(pc.invert(pc.is_in(keys["key_id"], pa.array([k for (k,) in known], pa.uint64()))))


def _rollup(cur: duckdb.DuckDBPyConnection, batches: list[Batch]) -> None:
    """kernel_minutes rows of the batches' spans (see :mod:`.rollup`), in the caller's transaction."""
    parts = [b.rollup for b in batches if b.rollup is not None]
    rest = [b for b in batches if b.rollup is None]
    if rest:
        spans = pa.concat_tables([b.spans for b in rest])
        kernel = rollup.kernels(spans)
        if all(b.cache_counts is not None for b in rest):
            mask = pc.equal(spans["name"], "rtx.kernel")
            hits, misses = (pa.chunked_array([b.cache_counts[i] for b in rest], pa.int64()).filter(mask)
                            for i in (0, 1))
        else:
            counts = execute_on(cur, rollup.CACHE_COUNTS_SQL, spans).to_arrow_table()
            hits, misses = counts["cache_hits"], counts["cache_misses"]
        parts.append(rollup.tables(kernel, hits, misses))
    rows = rollup.merge(parts)
    if not rows.num_rows:
        return
    execute_on(cur, rollup.INSERT_SQL, rows)


# Merges the rows of a (key, minute) that separate commits wrote, in minutes before $before.
def _saturated(column: str) -> str:
    """``sum(column)`` (a HUGEINT in DuckDB) held within BIGINT, as the rollup's sums are."""
    low, high = -2**63, 2**63 - 1   # (not least/greatest: DuckDB's skip NULL, the sum of nulls)
    return (f"CAST(CASE WHEN sum({column}) > {high} THEN {high} WHEN sum({column}) < {low} "
            f"THEN {low} ELSE sum({column}) END AS BIGINT) AS {column}")


_COMPACT = (
    f"""CREATE TEMP TABLE _rtx_compact AS
    WITH dup AS (
        SELECT key_id, minute FROM kernel_minutes WHERE minute < $before
        GROUP BY ALL HAVING count(*) > 1
    ), old AS (
        SELECT k.* FROM kernel_minutes k JOIN dup USING (key_id, minute)
    ), bins AS (
        SELECT key_id, minute, e.key AS bin, sum(e.value) AS n
        FROM old, unnest(map_entries(mean_hist)) AS t(e) GROUP BY ALL
    ), hist AS (
        SELECT key_id, minute, map_from_entries(list((bin, n))) AS mean_hist FROM bins GROUP BY ALL
    )
    SELECT any_value(job_id) AS job_id, any_value(op) AS op, any_value(bucket) AS bucket,
           any_value(variant) AS variant, any_value(config) AS config, any_value(phase) AS phase,
           minute, {_saturated("samples")}, {_saturated("calls")}, {_saturated("total_ns")},
           min(min_ns) AS min_ns, max(max_ns) AS max_ns, min(first_ns) AS first_ns,
           max(last_ns) AS last_ns, {_saturated("cache_hits")},
           {_saturated("cache_misses")}, any_value(hist.mean_hist) AS mean_hist, key_id
    FROM old LEFT JOIN hist USING (key_id, minute) GROUP BY key_id, minute""",
    """DELETE FROM kernel_minutes USING _rtx_compact c
    WHERE kernel_minutes.key_id = c.key_id AND kernel_minutes.minute = c.minute""",
    "INSERT INTO kernel_minutes BY NAME SELECT * FROM _rtx_compact",
    "DROP TABLE _rtx_compact",
)

# one row per (job, op, bucket, variant, config, phase) key over a "window_rows" CTE of
# kernel_minutes rows; shared with the dashboard's kernel table (store_views.py)
KERNEL_TOTALS_CTE = """totals AS (
    SELECT key_id, any_value(job_id) AS job_id, any_value(op) AS op, any_value(bucket) AS bucket,
           any_value(variant) AS variant, any_value(config) AS config, any_value(phase) AS phase,
           sum(samples) AS samples, sum(calls) AS calls, sum(total_ns) AS total_ns,
           sum(total_ns) / nullif(sum(calls), 0) AS mean_ns, min(min_ns) AS min_ns,
           max(max_ns) AS max_ns, min(first_ns) AS first_ns, max(last_ns) AS last_ns
    FROM window_rows GROUP BY key_id
)"""

# p50/p95 of each key's per-step mean ns from its summed histogram bins: CTEs that follow a
# "bins" CTE of (key_id, bin, n); shared with the dashboard's queries (store_views.py)
QUANTILE_CTES = f"""cumulative AS (
    SELECT key_id, bin, sum(n) OVER (PARTITION BY key_id ORDER BY bin) AS upto,
           sum(n) OVER (PARTITION BY key_id) AS all_n
    FROM bins
), quantiles AS (
    SELECT key_id,
           pow(2, (min(bin) FILTER (WHERE upto >= 0.5 * all_n) + 0.5) / {HIST_BINS_PER_OCTAVE})
               AS p50_step_mean_ns,
           pow(2, (min(bin) FILTER (WHERE upto >= 0.95 * all_n) + 0.5) / {HIST_BINS_PER_OCTAVE})
               AS p95_step_mean_ns
    FROM cumulative GROUP BY key_id
)"""

_KERNEL_STATS = f"""
WITH window_rows AS (
    SELECT * FROM kernel_minutes
    WHERE minute >= $since // {MINUTE_NS} AND minute <= ($until - 1) // {MINUTE_NS}
      AND ($job IS NULL OR job_id = $job) AND ($op IS NULL OR op = $op)
), {KERNEL_TOTALS_CTE}, bins AS (
    SELECT key_id, e.key AS bin, sum(e.value) AS n
    FROM window_rows, unnest(map_entries(mean_hist)) AS t(e) GROUP BY ALL
), {QUANTILE_CTES}
SELECT t.* EXCLUDE (key_id), q.p50_step_mean_ns, q.p95_step_mean_ns
FROM totals t LEFT JOIN quantiles q USING (key_id)
ORDER BY job_id, op, bucket, phase, mean_ns
"""


def _in_window(counter: str) -> str:
    """SQL: what a process-cumulative counter of one process counted in the window: its last
    value in the window less its last one before it."""
    last_in = f"arg_max({counter}, start_ns) FILTER (WHERE inside AND {counter} IS NOT NULL)"
    before = f"arg_max({counter}, start_ns) FILTER (WHERE NOT inside AND {counter} IS NOT NULL)"
    return f"CASE WHEN {last_in} IS NOT NULL THEN greatest({last_in} - coalesce({before}, 0), 0) END"


_CACHE_HIT_RATES = f"""
WITH variant AS (
    SELECT job_id, 'variant' AS cache, op, variant, bucket,
           sum(cache_hits) AS hits, sum(cache_misses) AS misses
    FROM kernel_minutes
    WHERE minute >= $since // {MINUTE_NS} AND minute <= ($until - 1) // {MINUTE_NS}
      AND ($job IS NULL OR job_id = $job)
      AND (cache_hits IS NOT NULL OR cache_misses IS NOT NULL)
    GROUP BY ALL
), counter_rows AS (
    SELECT job_id, resource_id, start_ns, start_ns >= $since AS inside,
           TRY_CAST(attributes->>'rtx.cache.inductor.fxgraph_hits' AS BIGINT) AS fx_hits,
           TRY_CAST(attributes->>'rtx.cache.inductor.fxgraph_misses' AS BIGINT) AS fx_misses,
           TRY_CAST(attributes->>'rtx.cache.triton.autotune_hits' AS BIGINT) AS tr_hits,
           TRY_CAST(attributes->>'rtx.cache.triton.autotune_misses' AS BIGINT) AS tr_misses
    FROM spans
    WHERE name = 'rtx.step' AND start_ns >= $before AND start_ns < $until
      AND ($job IS NULL OR job_id = $job)
), counters AS (
    SELECT job_id, resource_id,
           {_in_window("fx_hits")} AS fx_hits, {_in_window("fx_misses")} AS fx_misses,
           {_in_window("tr_hits")} AS tr_hits, {_in_window("tr_misses")} AS tr_misses
    FROM counter_rows GROUP BY ALL HAVING bool_or(inside)
), compilers AS (
    SELECT job_id, 'inductor.fxgraph' AS cache, NULL AS op, NULL AS variant, NULL AS bucket,
           sum(fx_hits) AS hits, sum(fx_misses) AS misses
    FROM counters WHERE fx_hits IS NOT NULL OR fx_misses IS NOT NULL GROUP BY job_id
    UNION ALL
    SELECT job_id, 'triton.autotune', NULL, NULL, NULL, sum(tr_hits), sum(tr_misses)
    FROM counters WHERE tr_hits IS NOT NULL OR tr_misses IS NOT NULL GROUP BY job_id
)
SELECT *, hits / nullif(coalesce(hits, 0) + coalesce(misses, 0), 0) AS hit_rate
FROM (SELECT * FROM variant UNION ALL SELECT * FROM compilers)
ORDER BY job_id, cache, op, variant, bucket
"""


# ---- export and summaries (also usable on a read-only connection) ----------------------------

def telemetry_summary(q) -> dict[str, int]:
    """What was stored and what was lost on the way: spans by name, ingest batches, and the drop
    counters jobs report on their step spans (records the recorder could not keep, steps the
    export queue refused, spans an exporter failed to deliver)."""
    out: dict[str, int] = {}
    for row in q.query("SELECT name, count(*) AS n FROM spans GROUP BY name ORDER BY name"):
        out[f"spans {row['name']}"] = row["n"]
    row = q.query("SELECT count(*) AS batches, coalesce(sum(spans), 0) AS spans FROM ingest_batches")[0]
    out["ingest batches"] = row["batches"]
    out["ingest spans"] = row["spans"]
    drops = q.query("""
        WITH per_process AS (
            SELECT job_id, rank,
                   sum(coalesce(TRY_CAST(attributes->>'rtx.dropped.records' AS BIGINT), 0)) AS records,
                   max(coalesce(TRY_CAST(attributes->>'rtx.dropped.steps' AS BIGINT), 0)) AS steps,
                   max(coalesce(TRY_CAST(attributes->>'rtx.dropped.spans' AS BIGINT), 0)) AS spans
            -- the drop counts grow within one exporter: per process (a restarted attempt
            -- keeps its job id and rank, and counts from zero again)
            FROM spans WHERE name = 'rtx.step' GROUP BY job_id, rank, resource_id)
        SELECT coalesce(sum(records), 0) AS records, coalesce(sum(steps), 0) AS steps,
               coalesce(sum(spans), 0) AS spans FROM per_process""")[0]
    out["dropped call records (jobs)"] = int(drops["records"])
    out["dropped steps (jobs)"] = int(drops["steps"])
    out["dropped spans (jobs)"] = int(drops["spans"])
    return out


class ReadOnlyStore:
    """Read access to a store file no process is writing (a running daemon holds DuckDB's lock:
    ask the daemon instead). Same ``reader``/``query`` as :class:`Store`, and the same DuckDB
    settings (without them an export's sort of a large store took gigabytes)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._con = duckdb.connect(str(self.path), read_only=True, config=connection_config())
        except duckdb.Error as e:
            raise StoreError(f"cannot open {self.path} for reading: {e}") from None
        try:
            found = self._con.execute("SELECT max(version) FROM schema_version").fetchone()[0]
        except duckdb.Error:
            found = None
        if found != SCHEMA_VERSION:   # its tables are not the ones the readers ask for
            self._con.close()
            raise StoreError(
                f"{self.path} is not an rtxops store" if found is None else
                f"the store {self.path} has schema version {found}, newer than this rtxops "
                f"understands ({SCHEMA_VERSION}): upgrade rtxops" if found > SCHEMA_VERSION else
                f"the store {self.path} has schema version {found}, older than this rtxops's "
                f"({SCHEMA_VERSION}): start `rtxops daemon` on its home once to bring it up to date")

    def cursor(self) -> duckdb.DuckDBPyConnection:
        return self._con.cursor()

    reader = Store.reader
    query = Store.query

    def close(self) -> None:
        self._con.close()
