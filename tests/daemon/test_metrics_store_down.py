"""/metrics while the store is being reopened after a fatal write error (a full disk): the scrape
failed whole (500) on the one family read from the store, and the write-error counter that says
what is wrong went with it."""
from __future__ import annotations

import types

from prometheus_client.parser import text_string_to_metric_families

from rtxops.daemon.metrics import registry_for, render
from rtxops.daemon.server import Daemon
from rtxops.telemetry.store import Store


def test_metrics_are_served_while_the_store_is_being_reopened(tmp_path):
    store = Store(tmp_path / "rtxops.duckdb")
    daemon = types.SimpleNamespace(store=store, board=types.SimpleNamespace(refused_total=0),
                                   supervisor=types.SimpleNamespace(tally=lambda: ({}, 0, 0)))
    daemon.swap_count = lambda: Daemon.swap_count(daemon)
    registry = registry_for(daemon)

    def families() -> dict:
        return {f.name: f for f in text_string_to_metric_families(render(registry).decode())}

    assert "rtxops_plan_swaps" in families()
    with store._lock:   # the state the writer leaves while it retries to reopen the file
        connection, store._con, store.broken = store._con, None, "IO Error: No space left on device"
    store.write_errors += 1
    try:
        shown = families()
        assert shown["rtxops_store_write_errors"].samples[0].value == 1
        assert "rtxops_plan_swaps" not in shown
    finally:
        with store._lock:
            store._con, store.broken = connection, None
        store.close()
