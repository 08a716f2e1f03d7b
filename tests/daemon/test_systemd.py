"""sd_notify: a daemon under systemd (NOTIFY_SOCKET set) says READY, pings the watchdog, says
STOPPING on SIGTERM; outside systemd nothing is sent."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from rtxops.daemon import systemd


def _receive_until(sock: socket.socket, wanted: str, timeout: float) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            got.append(sock.recv(4096).decode())
        except socket.timeout:
            break
        if any(wanted in m for m in got):
            break
    return got


def test_daemon_notifies_ready_watchdog_and_stopping(tmp_path):
    address = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTXOPS_")}
    env.update(NOTIFY_SOCKET=address, WATCHDOG_USEC="400000")  # a ping every 0.2 s
    proc = subprocess.Popen([sys.executable, "-m", "rtxops.cli", "daemon", "--port", "0",
                             "--home", str(tmp_path / "home")], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ready = _receive_until(sock, "READY=1", 60)
        assert any(m.startswith("READY=1") for m in ready), ready
        pings = _receive_until(sock, "WATCHDOG=1", 5)
        assert "WATCHDOG=1" in pings
        proc.send_signal(signal.SIGTERM)
        assert "STOPPING=1" in _receive_until(sock, "STOPPING=1", 30)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        sock.close()


def test_outside_systemd_nothing_is_sent(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.notify("READY=1") is False
