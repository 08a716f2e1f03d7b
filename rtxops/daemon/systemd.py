"""sd_notify for ``Type=notify`` units: READY at start-up, WATCHDOG pings, STOPPING at shutdown.
Does nothing outside systemd (no ``NOTIFY_SOCKET``)."""
from __future__ import annotations

import os
import socket
import threading
from typing import Callable


SEND_TIMEOUT_S = 1.0


def notify(message: str) -> bool:
    """Send ``message`` to systemd; False outside systemd or when it cannot be sent. A receiver
    that stopped reading (its queue full) costs at most :data:`SEND_TIMEOUT_S`: the daemon's
    shutdown sends STOPPING=1 holding its shutdown lock, and a blocking send there waited for good."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.settimeout(SEND_TIMEOUT_S)
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
