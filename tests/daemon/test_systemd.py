"""sd_notify: a daemon under systemd (NOTIFY_SOCKET set) says READY, pings the watchdog, says
STOPPING on SIGTERM; outside systemd nothing is sent."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
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


def test_the_watchdog_goes_quiet_while_the_event_loop_hangs(tmp_path, monkeypatch):
    """The pings came from a thread of their own: a daemon whose event loop hung kept systemd's
    watchdog satisfied. They now follow a /healthz the server answers."""
    from rtxops.daemon.home import Home
    from rtxops.daemon.server import Daemon

    address = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")   # a ping every 0.1 s
    monkeypatch.setenv("RTXOPS_EVOLVE", "0")
    d = Daemon(Home.resolve(tmp_path / "home"), port=0, job_grace_s=1).start_in_thread()
    stop = threading.Event()
    try:
        systemd.start_watchdog(stop, d.answers)
        assert "WATCHDOG=1" in _receive_until(sock, "WATCHDOG=1", 5)
        loop = d.server.servers[0].get_loop()
        loop.call_soon_threadsafe(time.sleep, 2.0)        # the event loop hangs for 2 s
        time.sleep(0.3)
        _receive_until(sock, "nothing", 0.3)              # what was sent before it hung
        assert _receive_until(sock, "WATCHDOG=1", 1.0) == []
        assert "WATCHDOG=1" in _receive_until(sock, "WATCHDOG=1", 5)   # and again after
    finally:
        stop.set()
        d.shutdown()
        sock.close()


def test_a_notify_socket_nobody_reads_costs_a_bounded_wait(tmp_path, monkeypatch):
    """A full notify queue (a receiver that stopped reading) blocked the send for good: the
    daemon's shutdown sends STOPPING=1 holding its shutdown lock."""
    address = str(tmp_path / "notify.sock")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(address)
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.connect(address)
    filler.setblocking(False)
    try:
        for _ in range(100_000):    # until the receiver's queue takes no more
            filler.send(b"WATCHDOG=1")
    except BlockingIOError:
        pass
    finally:
        filler.close()
    result: list[bool] = []
    sender = threading.Thread(target=lambda: result.append(systemd.notify("STOPPING=1")), daemon=True)
    started = time.monotonic()
    sender.start()
    sender.join(15)
    receiver.close()
    assert result == [False] and time.monotonic() - started < 10, "the send waited on"
