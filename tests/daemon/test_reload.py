"""SIGHUP reload: a broken policy file is logged and the policies in force stay (the daemon lives
on); a reload waits for a publish in flight instead of overwriting it with stale state."""
from __future__ import annotations

import json
import logging
import threading
from types import SimpleNamespace

from rtxops.daemon.plans import PlanBoard
from rtxops.daemon.server import Daemon
from rtxops.governance.authority import Authority
from rtxops.runtime.plan import Plan


def test_broken_policy_file_on_reload_keeps_the_old_policies(tmp_path, monkeypatch, caplog):
    authority = Authority(tmp_path / "gov")
    board = PlanBoard(tmp_path / "plans", authority)
    (tmp_path / "plans").mkdir(exist_ok=True)
    before = authority.policies
    broken = tmp_path / "policies"
    broken.mkdir()
    (broken / "default.yaml").write_text("name: broken\nrules:\n  - require: '((('\n")
    monkeypatch.setenv("RTXOPS_POLICIES", str(broken))
    with caplog.at_level(logging.ERROR, logger="rtxops.daemon"):
        Daemon.reload(SimpleNamespace(board=board))  # raised out of the signal handler before
    assert authority.policies is before
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "rtxops.daemon"]
    assert lines and lines[-1]["event"] == "reload_failed" and lines[-1]["error"]


def test_reload_waits_for_a_publish_in_flight(tmp_path):
    (tmp_path / "plans").mkdir()
    board = PlanBoard(tmp_path / "plans", SimpleNamespace(reload=lambda: None))
    signing, release = threading.Event(), threading.Event()

    def slow_issue(plan, key, decision, evidence):
        signing.set()
        release.wait(10)

    board._issue = slow_issue
    plan = Plan.from_dict({"version": 3, "defaults": {"gelu": "reference"}})
    publisher = threading.Thread(target=board.publish, args=(plan, "job-1"))
    publisher.start()
    assert signing.wait(30)
    reloader = threading.Thread(target=board.reload)
    reloader.start()
    reloader.join(0.3)
    blocked = reloader.is_alive()
    release.set()
    publisher.join(10)
    reloader.join(10)
    assert blocked, "reload ran while a publish was in flight"
    assert board.current("job-1") == plan


def test_the_sighup_handler_returns_at_once():
    """The handler runs on the event loop's thread: a reload waiting for a publish in flight
    (signing, the ledger) froze every request meanwhile. It now reloads on a thread of its own."""
    returned = threading.Event()
    seen: list[bool] = []
    done = threading.Event()

    def slow_reload():  # as one waiting for a publish: it ends only once the handler returned
        seen.append(returned.wait(5))
        done.set()

    Daemon._on_sighup(SimpleNamespace(reload=slow_reload), 1, None)
    returned.set()
    assert done.wait(10) and seen == [True]
