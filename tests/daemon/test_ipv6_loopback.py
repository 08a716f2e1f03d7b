"""A daemon on the IPv6 loopback (``--host ::1``): its URL was written without brackets
(``http://::1:8765``, which no client parses) and ``--port 0`` probed a free port with an IPv4
socket (the daemon did not start)."""
from __future__ import annotations

from .live import Daemons, cli


def test_a_daemon_on_the_ipv6_loopback_serves_the_cli_and_its_jobs(tmp_path):
    daemons = Daemons(tmp_path)
    try:
        daemon = daemons.start(args=("--host", "::1"))
        assert daemon.url.startswith("http://[::1]:")
        r = cli("submit", "--home", str(daemon.home), "--", "python", "-c", "print('over v6')",
                mark=daemons.mark)
        assert r.returncode == 0, r.stderr
        job = r.stdout.strip()
        assert daemon.wait(job)["state"] == "succeeded"
        assert daemon.texts(job) == ["over v6"]
        r = cli("logs", job, "--home", str(daemon.home), mark=daemons.mark)
        assert r.returncode == 0 and "over v6" in r.stdout, r.stderr
    finally:
        assert not daemons.cleanup()
