"""A checkpoint that fails (a full disk) makes DuckDB invalidate the database until it is opened
again: every later write and read failed until the daemon was restarted. The store now refuses
writes meanwhile (StoreBusy: a 503 with Retry-After), reopens the database once it can (DuckDB
replays its WAL: a reopen needs no room on the disk), and loses nothing it acknowledged. A file size limit stands in for the full disk (no root needed)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, logging, os, resource, signal, sys, time
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails with EFBIG
    from rtxops.telemetry import otlp, store as store_module, synthetic
    from rtxops.telemetry.store import Store

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("rtxops.telemetry.store").addHandler(handler)
    path = sys.argv[1]
    s = Store(path)
    out = {}

    def batch(seed):
        body = synthetic.otlp_request(50, seed=seed, job_id="reopen").SerializeToString()
        return otlp.convert(body, otlp.PROTOBUF, time.time_ns())

    for seed in range(60):                      # small commits: they sit in the WAL
        s.write(batch(seed))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1, hard))   # no file may grow: a full disk
    try:
        s.call(lambda cur: cur.execute("CHECKPOINT"), transaction=False)
        out["checkpoint"] = "ok"
    except Exception as e:
        out["checkpoint"] = type(e).__name__
    deadline = time.monotonic() + 30
    while not any("reopened" in m for m in said) and time.monotonic() < deadline:
        time.sleep(0.02)
    out["read"] = s.query("SELECT count(*) AS n FROM spans")[0]["n"]   # the disk still full
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    s.write(batch(200))
    out["spans"] = s.query("SELECT count(*) AS n FROM spans")[0]["n"]
    out["said"] = said
    s.close()
    print(json.dumps(out))
""")


def test_an_invalidated_database_is_reopened_and_loses_nothing(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "s.duckdb")],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["checkpoint"] == "FatalException", out
    assert any("is unusable" in m and "reopening" in m for m in out["said"]), out
    assert any(m.endswith("reopened") for m in out["said"]), out
    assert out["read"] == 60 * 50, out     # every acknowledged batch
    assert out["spans"] == 61 * 50, out    # and writes go on


DURABLE = textwrap.dedent("""
    import json, os, resource, signal, sys, time
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    os.environ["RTXOPS_STORE_WAL"] = "4MB"          # an automatic checkpoint soon
    from rtxops.telemetry import otlp, synthetic
    from rtxops.telemetry.receiver import _decode
    from rtxops.telemetry.store import Store

    path = sys.argv[1]
    s = Store(path)

    def batch(seed):
        body = synthetic.otlp_request(200, seed=seed, job_id="durable").SerializeToString()
        return _decode(body, otlp.PROTOBUF, False, 1 << 30, time.time_ns())   # as the receiver

    for seed in range(250):                        # a database file past the WAL threshold
        s.write(batch(seed))
    s.call(lambda cur: cur.execute("CHECKPOINT"), transaction=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path), hard))  # the WAL may grow
    acked, refused = 250, None
    for seed in range(1000, 1400):
        try:
            s.write(batch(seed))
            acked += 1
        except Exception as e:
            refused = (seed, f"{type(e).__name__}: {e}")
            break
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    deadline = time.monotonic() + 30
    while s.broken and time.monotonic() < deadline:
        time.sleep(0.05)
    spans = s.query("SELECT count(*) AS n FROM spans")[0]["n"]
    if refused:
        for attempt in range(100):                 # the client retries what it was refused
            try:
                s.write(batch(refused[0]))
                break
            except Exception:
                time.sleep(0.1)
    after = s.query("SELECT count(*) AS n FROM spans")[0]["n"]
    s.close()
    print(json.dumps({"acked": acked, "refused": refused and refused[1], "spans": spans,
                      "after_retry": after}))
""")


def test_a_commit_whose_checkpoint_failed_is_acknowledged_and_its_retry_stored_once(tmp_path):
    """DuckDB says "COMMIT succeeded and is durable, but the autocheckpoint failed": the batch
    was reported failed though stored, and the client's retry stored it twice."""
    r = subprocess.run([sys.executable, "-c", DURABLE, str(tmp_path / "d.duckdb")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["refused"] and "durable" not in out["refused"], out   # the one after: not stored
    assert out["spans"] == out["acked"] * 200, out                    # every ack, once
    assert out["after_retry"] == (out["acked"] + 1) * 200, out
