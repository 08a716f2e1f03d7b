"""The store a job writes itself (``RTXOPS_TELEMETRY=duckdb``, ``rtxops run --direct``).

DuckDB lets one process write a file. A job may be several Pythons: a launcher (torchrun,
``torch.multiprocessing.spawn``'s parent) that trains nothing, the workers that train, helpers
that import torch and call nothing. Whichever of them first has spans to write opens the store
and keeps it; a launcher that never records a call never takes it from its workers. A process
that has spans while another holds the file (a worker beside the first, or a moment's reader:
``rtxops telemetry stats``) tries again at its next export; it says once, on stderr, that its
telemetry is not being stored, and again when it is (its export thread counts the spans of the
exports that failed meanwhile)."""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path


class StoreHeldElsewhere(Exception):
    """Another process holds the store's file."""


class ClaimedStore:
    """Opens :class:`~rtxops.telemetry.store.Store` at ``path`` on the first :meth:`write` that
    finds the file free."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._store = None
        self._told = False   # that the file was held
        self._lock = threading.Lock()

    def write(self, batch) -> None:
        """Write ``batch`` (committed on return); raises :class:`StoreHeldElsewhere` while another
        process holds the file."""
        with self._lock:
            if self._store is None:
                self._open()
            store = self._store
        store.write(batch)

    def _open(self) -> None:
        import duckdb

        from .store import Store

        try:
            self._store = Store(self.path)
        except duckdb.IOException as e:
            if "lock" not in str(e).lower():
                raise
            if not self._told:
                self._told = True
                print(f"rtxops: the telemetry of this process (pid {os.getpid()}) is not being "
                      f"stored: another process holds {self.path} (DuckDB lets one write it; of "
                      "a job of several processes, run with --direct, the first to write keeps "
                      "it: run such a job without --direct); trying again at each export",
                      file=sys.stderr, flush=True)
            raise StoreHeldElsewhere(str(e)) from None
        if self._told:
            print(f"rtxops: the telemetry of this process (pid {os.getpid()}) is stored from now",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None
