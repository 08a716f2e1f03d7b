"""Two first ``POST /v1/evolve/tune`` at once made two task runners (an unlocked cache), each
running its own tasks side by side: "one task at a time" broke, and one runner's tasks could not
be looked up."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from rtxops.daemon.home import Home
from rtxops.daemon.server import Daemon
from rtxops.evolve import offline


def test_concurrent_first_submits_make_one_task_runner(tmp_path, monkeypatch):
    made = []
    real_init = offline.TuneTasks.__init__

    def slow_init(self, *args, **kwargs):
        made.append(threading.get_ident())
        time.sleep(0.5)  # widen the window the second submit used to slip through
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(offline.TuneTasks, "__init__", slow_init)
    daemon = Daemon(Home.resolve(tmp_path / "home"), port=0).start_in_thread()
    try:
        headers = {"Authorization": f"Bearer {daemon.token}"}

        def submit(_):
            return httpx.post(daemon.url + "/v1/evolve/tune", json={"op": "no-such-op"},
                              headers=headers, timeout=60).status_code

        with ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(submit, range(4)))
        assert codes == [422] * 4
        assert len(made) == 1, f"{len(made)} task runners were made"
    finally:
        daemon.shutdown()
