"""The daemon's retention: prune telemetry older than ``--retention`` (``RTXOPS_RETENTION``) at
start and then every :data:`EVERY_S`, on a thread of its own."""
from __future__ import annotations

import json
import logging
import os
import threading

from rtxops.telemetry import store_retention
from rtxops.telemetry.store import Store, StoreError

log = logging.getLogger("rtxops.daemon")

DEFAULT = "30d"
EVERY_S = 3600.0


def retention_from(text: str | None) -> float | None:
    """Seconds of retention from ``--retention`` or ``RTXOPS_RETENTION`` (default
    :data:`DEFAULT`); None for ``off``. ValueError for anything else."""
    text = (text or os.environ.get("RTXOPS_RETENTION") or DEFAULT).strip()
    if text.lower() == "off":
        return None
    try:
        return store_retention.check_age(store_retention.parse_age(text))
    except ValueError as e:
        raise ValueError(f"retention: {e} (or 'off')") from None


class RetentionThread:
    """Prunes ``store`` every ``every_s`` seconds, the first time at once."""

    def __init__(self, store: Store, retention_s: float, every_s: float = EVERY_S) -> None:
        self.store, self.retention_s, self.every_s = store, retention_s, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rtxops-retention", daemon=True)

    def start(self) -> RetentionThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                report = store_retention.prune(self.store, self.retention_s)
            except (StoreError, TimeoutError) as e:   # closing, or a busy writer: next round
                log.warning(json.dumps({"event": "prune_failed", "error": str(e)}))
            except Exception as e:  # a DuckDB error: logged, the daemon goes on
                log.error(json.dumps({"event": "prune_failed", "error": f"{type(e).__name__}: {e}"}))
            else:
                if report.total:
                    log.info(json.dumps({"event": "pruned", **report.as_dict()}))
            self._stop.wait(self.every_s)
