"""A real job process, polling a plan endpoint, is offered every broken bundle of the rejection
matrix in turn: it refuses each one (reporting why) and keeps training on its old plan; then a
valid bundle is installed, and a replayed older one and one tuned for another device are refused."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rtxops.runtime.bootstrap import child_environment

from .helpers import copy, plan_bundle
from .test_verify_rejections import CASES

# cases a job meets over HTTP (CLI-only options, and symlinks and folders past PATH_MAX, which
# the file map cannot carry, aside)
JOB_CASES = [n for n in CASES if n not in ("symlink", "wrong key", "another kind expected",
                                             "older than min version", "extra file out of reach")]

TRAIN = """
import os, sys, time
import torch, torch.nn.functional as F
torch.manual_seed(0)
w = torch.randn(16, 16, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.01)
x = torch.randn(4, 16)
step = 0
while not os.path.exists(sys.argv[1]) and step < 20000:
    opt.zero_grad()
    F.gelu(x @ w).sum().backward()
    opt.step()
    step += 1
    time.sleep(0.01)
print("trained", step, flush=True)
"""


def files_of(directory) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(directory):
        for n in names:
            p = os.path.join(root, n)
            out[os.path.relpath(p, directory).replace(os.sep, "/")] = open(p, "rb").read()
    return out


class Offers:
    """What the fake plan endpoint serves: one offer at a time, next when the job reports a
    refusal (or, for a valid one, polls again with its ETag: it took it)."""

    def __init__(self, offers: list[tuple[str, str, dict[str, bytes], bool]]) -> None:
        self.offers, self.index, self.reports = offers, 0, []
        self.lock = threading.Lock()

    def current(self):
        with self.lock:
            return self.offers[self.index] if self.index < len(self.offers) else None

    def advance(self, name: str) -> None:
        with self.lock:
            if self.index < len(self.offers) and self.offers[self.index][0] == name:
                self.index += 1


def serve(offers: Offers) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code: int, body: bytes = b"", headers: dict | None = None) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            offer = offers.current()
            if offer is None:
                return self._send(404)
            name, plan_json, files, valid = offer
            etag = f'"{name}"'
            if self.path.startswith("/v1/plans/current"):
                if self.headers.get("If-None-Match") == etag:
                    if valid:
                        offers.advance(name)
                    return self._send(304)
                return self._send(200, plan_json.encode(), {"ETag": etag})
            if self.path.startswith("/v1/plans/bundle"):
                body = {"files": {k: base64.b64encode(v).decode() for k, v in files.items()}}
                return self._send(200, json.dumps(body).encode())
            self._send(404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            offer = offers.current()
            offers.reports.append((offer[0] if offer else None, body["reason"]))
            if offer:
                offers.advance(offer[0])
            self._send(204)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_job_keeps_its_plan_when_offered_bad_bundles(keys, good_plan, tmp_path):
    plan_json = (good_plan / "plan.json").read_text()
    offers = []
    for i, name in enumerate(JOB_CASES):
        bundle = copy(good_plan, tmp_path / f"case{i}")
        CASES[name][0](bundle, keys)
        offers.append((name, plan_json, files_of(bundle), False))
    offers.append(("dotdot file name", plan_json, {**files_of(good_plan), "../evil.py": b"x"}, False))
    ckpt = plan_bundle(tmp_path / "ckpt", keys.signer(), 5)
    keys.signer().sign_directory(ckpt, kind="checkpoint", version=5)
    offers.append(("checkpoint bundle", plan_json, files_of(ckpt), False))
    offers.append(("valid", plan_json, files_of(good_plan), True))
    older = plan_bundle(tmp_path / "v3", keys.signer(), 3)
    offers.append(("replay", (older / "plan.json").read_text(), files_of(older), False))
    elsewhere = plan_bundle(tmp_path / "v6", keys.signer(), 6, environment={"device": "TPU-9000"})
    offers.append(("other device", (elsewhere / "plan.json").read_text(), files_of(elsewhere), False))
    expected = {n: CASES[n][2] for n in JOB_CASES}
    expected.update({"dotdot file name": "'../evil.py' has '..'",
                     "checkpoint bundle": "a checkpoint bundle, not a plan bundle",
                     "replay": "plan version 3 is not newer than the running version 5",
                     "other device": "tuned for another environment: device 'TPU-9000'"})

    state = Offers(offers)
    server = serve(state)
    stop, summary = tmp_path / "stop", tmp_path / "summary.json"
    (tmp_path / "train.py").write_text(TRAIN)
    env = child_environment({k: v for k, v in os.environ.items() if not k.startswith("RTXOPS_")},
                            summary=str(summary),
                            plan_verifier="rtxops.governance.authority:plan_verifier_for_job")
    env.update(RTXOPS_DAEMON=f"http://127.0.0.1:{server.server_port}", RTXOPS_JOB_ID="job-1",
               RTXOPS_PLAN_POLL_S="0.05", RTXOPS_KEYRING=str(keys.keyring_file))
    job = subprocess.Popen([sys.executable, str(tmp_path / "train.py"), str(stop)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while state.current() is not None and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.05)
        assert state.current() is None, (state.index, state.reports[-3:])
    finally:
        stop.touch()
        output, _ = job.communicate(timeout=60)
        server.shutdown()
    assert job.returncode == 0, output

    by_offer = dict(state.reports)
    assert sorted(by_offer) == sorted(expected), (sorted(by_offer), sorted(expected))
    for name, message in expected.items():
        assert message in by_offer[name], (name, by_offer[name])
    data = json.loads(summary.read_text())
    assert data["plan_version"] == 5, "only the valid bundle was installed"
    assert len(data["plan_rejections"]) == len(expected)
    gelu = {s["variant"] for s in data["slots"] if s["op"] == "gelu" and s["calls"]}
    assert gelu == {"reference", "algebraic"}, gelu
    assert data["steps"] > len(offers), "the job kept training while it refused bundles"
