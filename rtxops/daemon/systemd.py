"""sd_notify for ``Type=notify`` units: READY at start-up, WATCHDOG pings, STOPPING at shutdown.
Does nothing outside systemd (no ``NOTIFY_SOCKET``)."""
from __future__ import annotations

import os
import socket
import threading
from typing import Callable


def notify(message: str) -> bool:
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
        return True
    except OSError:
        return False


def start_watchdog(stop: threading.Event,
                   healthy: Callable[[float], bool] = lambda timeout: True) -> threading.Thread | None:
    """Ping WATCHDOG=1 at half the interval systemd asks for (``WATCHDOG_USEC``), each time
    ``healthy(timeout)`` says the process does its work: a ping from this thread alone would keep
    systemd satisfied while the rest of the process hangs."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec or not os.environ.get("NOTIFY_SOCKET"):
        return None
    interval = int(usec) / 1e6 / 2

    def run() -> None:
        while not stop.wait(interval):
            if healthy(interval):
                notify("WATCHDOG=1")

    thread = threading.Thread(target=run, name="rtxops-watchdog", daemon=True)
    thread.start()
    return thread
