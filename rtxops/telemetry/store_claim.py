"""The store a job writes itself (``RTXOPS_TELEMETRY=duckdb``, ``rtxops run --direct``).

DuckDB lets one process write a file. A job may be several Pythons: a launcher (torchrun,
``torch.multiprocessing.spawn``'s parent) that trains nothing, the workers that train, helpers
that import torch and call nothing. Whichever of them first has spans to write opens the store
and keeps it; a launcher that never records a call never takes it from its workers. Another
process that has spans while the store is held is told once, on stderr, that its telemetry is
not stored (its export thread counts the spans as failed)."""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path


class StoreHeldElsewhere(Exception):
    """Another process holds the store's file."""


class ClaimedStore:
    """Opens :class:`~rtxops.telemetry.store.Store` at ``path`` on the first :meth:`write`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._store = None
        self._held: str | None = None   # why the store could not be opened (then never tried again)
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

        if self._held is not None:
            raise StoreHeldElsewhere(self._held)
        try:
            self._store = Store(self.path)
        except duckdb.IOException as e:
            if "lock" not in str(e).lower():
                raise
            # the first process to write keeps the file for the job's life: asking again on
            # every export would only repeat this
            self._held = f"another process of the job writes {self.path}: {e}"
            print(f"rtxops: the telemetry of this process (pid {os.getpid()}) is not stored: "
                  f"another process of the job writes {self.path} (a job run with --direct "
                  "stores one process's telemetry; without --direct the daemon stores every "
                  "process's)", file=sys.stderr, flush=True)
            raise StoreHeldElsewhere(self._held) from None

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None
