"""The store a ``--direct`` job writes: opened at its first write, and a moment's reader of the
file (``rtxops telemetry stats``) delays the job's telemetry, never ends it."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from rtxops.telemetry import otlp
from rtxops.telemetry.store import ReadOnlyStore, Store, prepared
from rtxops.telemetry.store_claim import ClaimedStore, StoreHeldElsewhere

from .otlp_helpers import request, span


def _batch(name: str):
    t0 = time.time_ns()
    return prepared(otlp.convert(request([span(name, start=t0)], {"service.name": "job"}).SerializeToString(),
                                 otlp.PROTOBUF, t0))


def _hold(path, seconds: float) -> subprocess.Popen:
    """Another process holding ``path`` read-only for ``seconds`` (what ``telemetry stats`` does)."""
    code = textwrap.dedent(f"""
        import sys, time
        from rtxops.telemetry.store import ReadOnlyStore
        s = ReadOnlyStore({str(path)!r})
        print("held", flush=True)
        time.sleep({seconds})
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_nothing_is_opened_before_the_first_write(tmp_path):
    claim = ClaimedStore(tmp_path / "s.duckdb")
    claim.close()
    assert not (tmp_path / "s.duckdb").exists()


def test_a_reader_holding_the_file_delays_the_telemetry_and_no_more(tmp_path, capfd):
    path = tmp_path / "s.duckdb"
    with Store(path):
        pass
    claim = ClaimedStore(path)
    holder = _hold(path, 60)
    try:
        for _ in range(2):
            with pytest.raises(StoreHeldElsewhere):
                claim.write(_batch("while held"))
    finally:
        holder.kill()
        holder.wait()
    claim.write(_batch("after"))   # it gave up for good before: nothing more of the job was stored
    claim.close()
    err = capfd.readouterr().err
    assert err.count("is not being stored") == 1 and err.count("is stored from now") == 1, err
    s = ReadOnlyStore(path)
    try:
        with s.reader() as cur:
            assert cur.execute("SELECT name FROM spans").fetchall() == [("after",)]
    finally:
        s.close()
