"""Prometheus metrics, read from the store and the supervisor at scrape time."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rtxops.telemetry.store import StoreError

from .jobs import JobState


class _Collector:
    def __init__(self, daemon) -> None:
        self.daemon = daemon

    def collect(self):
        d = self.daemon
        s = d.store.stats()
        for name, key, doc in (
            ("rtxops_ingest_spans", "spans_written", "spans committed to the store"),
            ("rtxops_ingest_batches", "batches_written", "OTLP batches committed"),
            ("rtxops_ingest_batches_repeated", "batches_repeated",
             "retried OTLP batches acknowledged without storing them again"),
            ("rtxops_ingest_spans_refused", "spans_refused",
             "spans refused (429, 503): capacity, a failed write, a closing store"),
            ("rtxops_ingest_requests_rejected", "requests_rejected", "malformed or refused requests"),
            ("rtxops_store_write_errors", "write_errors", "store write failures"),
            ("rtxops_store_rows_pruned", "rows_pruned", "rows deleted by retention prunes"),
        ):
            yield CounterMetricFamily(name, doc, value=s.get(key, 0))
        for name, key in (("rtxops_store_queue_batches", "queue_batches"),
                          ("rtxops_store_queue_spans", "queue_spans")):
            yield GaugeMetricFamily(name, "store writer queue depth", value=s.get(key, 0))
        states, crashes, hangs = d.supervisor.tally()
        g = GaugeMetricFamily("rtxops_jobs", "jobs by state", labels=["state"])
        for state in JobState:
            g.add_metric([state.value], states.get(state.value, 0))
        yield g
        restarts = CounterMetricFamily("rtxops_job_restarts", "job restarts", labels=["reason"])
        restarts.add_metric(["crash"], crashes)
        restarts.add_metric(["hang"], hangs)
        yield restarts
        try:
            swaps = d.swap_count()
        except StoreError:   # the store being reopened (a full disk): the counters above still
            swaps = None     # serve, the write errors among them
        if swaps is not None:
            yield CounterMetricFamily("rtxops_plan_swaps", "plan swaps reported by jobs", value=swaps)
        yield CounterMetricFamily("rtxops_plans_refused", "plans jobs refused",
                                  value=d.board.refused_total)


def registry_for(daemon) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(daemon))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
