"""Telemetry ingest throughput: OTLP protobuf over HTTP → committed in DuckDB, and the direct
Arrow write path.

End to end: a receiver (uvicorn + the store) runs in a child process, as the daemon would; this
process sends pre-encoded requests of ``--spans-per-request`` rtxops-shaped spans from
``--clients`` concurrent keep-alive connections. A 200 means committed, so the figure is committed
spans per second of wall time, cross-checked against the rows in the file afterwards. Also
reported: the conversion alone (one core; the compiled decoder and the pure-Python reference), and
``Store.write`` of ready Arrow batches, each with its CPU seconds: on a small shared machine the
wall-clock figures move with everyone else's load (recorded as the load average), CPU time much
less. Prints JSON (and writes it with ``--out``).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _report import report
from rtxops.telemetry import otlp, synthetic
from rtxops.telemetry.store import Store, prepared


def serve(path: str) -> None:
    """Child process: receiver on an ephemeral port; prints it, serves until stdin closes."""
    import uvicorn

    from rtxops.telemetry.receiver import make_app

    store = Store(path)
    server = uvicorn.Server(uvicorn.Config(make_app(store, token="bench"), host="127.0.0.1", port=0,
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    print(server.servers[0].sockets[0].getsockname()[1], flush=True)
    sys.stdin.read()
    server.should_exit = True
    thread.join()
    stats = store.stats()
    store.close()
    stats["cpu_s"] = round(_cpu(), 2)
    print(json.dumps(stats), flush=True)


def _cpu(who: int = resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def end_to_end(workdir: Path, requests: list[bytes], spans_per_request: int, clients: int,
               seconds: float) -> dict:
    path = workdir / "ingest.duckdb"
    child = subprocess.Popen([sys.executable, __file__, "--serve", str(path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    port = int(child.stdout.readline())
    sent = [0] * clients
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        headers = {"Content-Type": otlp.PROTOBUF, "Authorization": "Bearer bench"}
        k = i
        while time.perf_counter() < deadline:
            conn.request("POST", "/v1/traces", synthetic.numbered(requests[k % len(requests)], k), headers)
            resp = conn.getresponse()
            resp.read()
            with lock:
                statuses[resp.status] = statuses.get(resp.status, 0) + 1
            if resp.status == 200:
                sent[i] += spans_per_request
            else:
                time.sleep(float(resp.getheader("Retry-After", "0.1")))
            k += clients
        conn.close()

    started, cpu_started = time.perf_counter(), _cpu()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    client_cpu = _cpu() - cpu_started
    child.stdin.close()
    server_stats = json.loads(child.stdout.readline())
    child.wait(60)
    with Store(path) as store:
        stored = store.query("SELECT count(*) AS n FROM spans")[0]["n"]
    acked = sum(sent)
    server_cpu = server_stats.pop("cpu_s")
    return {"spans_per_s": round(acked / elapsed), "spans_acked": acked, "spans_in_file": stored,
            "server_cpu_us_per_span": round(server_cpu / max(acked, 1) * 1e6, 2),
            "client_cpu_us_per_span": round(client_cpu / max(acked, 1) * 1e6, 2),
            "seconds": round(elapsed, 2), "clients": clients, "spans_per_request": spans_per_request,
            "bytes_per_request": len(requests[0]), "http_statuses": statuses, "server": server_stats}


def conversion_only(requests: list[bytes], spans_per_request: int, native: bool) -> dict:
    os.environ["RTXOPS_OTLP_NATIVE"] = "1" if native else "0"
    try:
        otlp.convert(requests[0], otlp.PROTOBUF, 0)
        started, cpu_started = time.perf_counter(), _cpu()
        for body in requests:
            otlp.convert(body, otlp.PROTOBUF, 0)
        elapsed, cpu = time.perf_counter() - started, _cpu() - cpu_started
    finally:
        os.environ.pop("RTXOPS_OTLP_NATIVE")
    spans = len(requests) * spans_per_request
    return {"spans_per_s": round(spans / elapsed), "us_per_span": round(elapsed / spans * 1e6, 2),
            "cpu_us_per_span": round(cpu / spans * 1e6, 2)}


def arrow_write(workdir: Path, rows_per_batch: int, batches: int) -> dict:
    """Decoded span batches (kernel rows, as the decoders hand them over) into the store.

    ``rows_per_s``: Store.write of batches whose rollup and narrow rows were made on the thread
    that produced them (the receiver's decoding threads, the direct exporter's export thread),
    so the writer only inserts. ``pipelined``: one thread preparing each batch and submitting it
    while the writer inserts the one before (the direct exporter's path). ``writer_prepares``:
    Store.write of raw batches (the writer makes both itself)."""
    start = time.time_ns() - 3600 * 10**9
    raw = [synthetic.kernel_batch(rows_per_batch, start_ns=start + i * 10**9, seed=i)
           for i in range(min(batches, 3))]
    prep_started, prep_cpu = time.perf_counter(), _cpu()
    ready = [prepared(b) for b in raw]
    prep_s, prep_cpu = time.perf_counter() - prep_started, _cpu() - prep_cpu
    rows = batches * rows_per_batch
    out = {"rows_per_batch": rows_per_batch, "batches": batches,
           "prepare_us_per_row": round(prep_s / (len(raw) * rows_per_batch) * 1e6, 3),
           "prepare_cpu_us_per_row": round(prep_cpu / (len(raw) * rows_per_batch) * 1e6, 3)}

    def timed(name: str, run) -> tuple[float, float]:
        store = Store(workdir / f"{name}.duckdb")
        store.write(ready[0])                              # warm-up, not timed
        started, cpu_started = time.perf_counter(), _cpu()
        run(store)
        elapsed, cpu = time.perf_counter() - started, _cpu() - cpu_started
        store.close()
        return elapsed, cpu

    def written(batch_list):
        return lambda store: [store.write(batch_list[i % len(batch_list)]) for i in range(batches)]

    def pipelined(store):
        waiting = None                      # the queue holds one batch of this size
        for i in range(batches):
            batch = prepared(raw[i % len(raw)])
            if waiting is not None:
                waiting.result()
            waiting = store.submit(batch)
        waiting.result()

    for name, run in (("prepared", written(ready)), ("pipelined", pipelined),
                      ("writer_prepares", written(raw))):
        elapsed, cpu = timed(name, run)
        key = "rows_per_s" if name == "prepared" else name
        out[key] = round(rows / elapsed) if key == "rows_per_s" else {
            "rows_per_s": round(rows / elapsed), "rows_per_cpu_s": round(rows / cpu)}
        if name == "prepared":
            out["rows_per_cpu_s"] = round(rows / cpu)
            out["seconds"] = round(elapsed, 2)
    out["duckdb_floor_wide_table"] = bare_insert(workdir, raw, batches)
    return out


def bare_insert(workdir: Path, ready: list, batches: int) -> dict:
    """The same span rows appended as they are decoded (wide: ids as hex, every string on every
    row) to a bare DuckDB table (no rollup, no other tables, one statement per batch), with the
    store's DuckDB settings: the floor under the store before its narrow layout."""
    import duckdb

    from rtxops.telemetry.store import connection_config

    con = duckdb.connect(str(workdir / "bare.duckdb"), config=connection_config())
    first = ready[0].spans
    con.execute("CREATE TABLE spans AS SELECT * FROM first LIMIT 0")
    con.execute("INSERT INTO spans SELECT * FROM first")          # warm-up, not timed
    started, cpu_started = time.perf_counter(), _cpu()
    for i in range(batches):
        con.register("_batch", ready[i % len(ready)].spans)
        con.execute("INSERT INTO spans SELECT * FROM _batch")
    elapsed, cpu = time.perf_counter() - started, _cpu() - cpu_started
    con.close()
    rows = batches * first.num_rows
    return {"rows_per_s": round(rows / elapsed), "rows_per_cpu_s": round(rows / cpu)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", metavar="DB", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=15.0, help="end-to-end run length")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--spans-per-request", type=int, default=2000)
    parser.add_argument("--arrow-rows", type=int, default=1_000_000, help="rows per direct write")
    parser.add_argument("--arrow-batches", type=int, default=5)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    requests = [synthetic.otlp_request(args.spans_per_request, seed=i, job_id=f"job-{i % 4}",
                                       rank=i % 2).SerializeToString() for i in range(16)]
    with tempfile.TemporaryDirectory(prefix="rtxops-bench-") as tmp:
        result = {
            "bench": "ingest", "python": platform.python_version(), "cpus": os.cpu_count(),
            "machine": platform.machine(), "load_average_before": os.getloadavg(),
            "targets": {"end_to_end_spans_per_s": 100_000, "arrow_rows_per_s": 1_000_000},
            "end_to_end": end_to_end(Path(tmp), requests, args.spans_per_request, args.clients,
                                     args.seconds),
            "conversion_only_one_core": conversion_only(requests, args.spans_per_request, True),
            "conversion_only_reference_decoder": conversion_only(requests, args.spans_per_request,
                                                                 False),
            "arrow_write": arrow_write(Path(tmp), args.arrow_rows, args.arrow_batches),
        }
    result["load_average_after"] = os.getloadavg()
    report(result, args.out)


if __name__ == "__main__":
    main()
