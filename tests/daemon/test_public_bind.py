"""A daemon bound to a non-loopback address is reachable from other machines: every request
needs its token there, reads and the dashboard included (on loopback they need none)."""
from __future__ import annotations

import httpx

from rtxops.daemon.home import Home
from rtxops.daemon.server import Daemon


def test_a_daemon_on_a_public_address_wants_its_token_on_every_read(tmp_path):
    d = Daemon(Home(tmp_path / "home"), host="0.0.0.0", port=0).start_in_thread()
    try:
        base = f"http://127.0.0.1:{d.port}"
        token = {"Authorization": f"Bearer {d.token}"}
        for path in ("/v1/jobs", "/", "/v1/telemetry/stats", "/metrics", "/v1/plans/current"):
            r = httpx.get(base + path, trust_env=False)
            assert r.status_code == 401 and "bearer token" in r.text, (path, r.status_code)
            assert httpx.get(base + path, headers=token, trust_env=False).status_code in (200, 404), path
        lower = {"Authorization": f"bearer {d.token}"}   # RFC 7235: any case
        assert httpx.get(base + "/v1/jobs", headers=lower, trust_env=False).status_code == 200
        wrong = {"Authorization": f"Bearer {d.token}x"}
        assert httpx.get(base + "/v1/jobs", headers=wrong, trust_env=False).status_code == 401
        assert httpx.get(base + "/healthz", trust_env=False).status_code == 200   # probes stay open
    finally:
        d.shutdown()
