"""kill -9 of the daemon while clients ingest and jobs run, then a restart on the same home: every
acknowledged span is in the store, jobs and logs are intact, a job whose processes still live is
re-adopted (and can be cancelled), one that ended meanwhile ends as its waiter saw it, and jobs
that were pending or waiting to restart go on."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx

from rtxops.telemetry.store import ReadOnlyStore

from .live import gone, otlp_batch, script, until

# Prints "TAG 0..2", then "TAG go N" when the file GO.N appears.
CHATTY = """
    import os, sys, time
    tag, go = sys.argv[1], sys.argv[2]
    for i in range(3):
        print(f"{tag} {i}", flush=True)
    n = 0
    while True:
        if os.path.exists(f"{go}.{n}"):
            print(f"{tag} go {n}", flush=True)
            n += 1
        time.sleep(0.02)
"""


def _ingest(url: str, token: str, first_seed: int, sent: dict, acked: dict, stop: threading.Event) -> None:
    """Send OTLP batches until the daemon goes away; record the span ids of each batch sent and of
    each one acknowledged (200)."""
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    seed = first_seed
    try:
        while not stop.is_set():
            request, ids = otlp_batch(300, seed=seed, job_id="kill9-ingest")
            sent[seed] = ids
            try:
                r = client.post("/v1/traces", content=request.SerializeToString(),
                                headers={"Content-Type": "application/x-protobuf"})
            except httpx.HTTPError:
                return  # the daemon died under this request: not acknowledged
            if r.status_code == 200:
                acked[seed] = ids
            seed += 2
    finally:
        client.close()


def test_kill9_mid_ingest_then_restart_keeps_acked_spans_jobs_and_logs(daemons, tmp_path):
    home, go = tmp_path / "home", str(tmp_path / "go")
    d1 = daemons.start(home)
    chatty = script(tmp_path, "chatty.py", CHATTY)

    def lines_of(d, job):
        return until(lambda: d.texts(job["id"]), what=f"lines of {job['name']}")

    # survivor: outlives the daemon, with lines stored before and after the supervisor's checkpoint
    # of its log offsets; victim: dies while no daemon watches; late: outlives the daemon, with
    # lines stored (normally) before any checkpoint
    survivor = d1.submit(["python", chatty, "S", go], name="survivor")
    victim = d1.submit(["python", chatty, "V", go + "-victim"], name="victim")
    for job, tag in ((survivor, "S"), (victim, "V")):
        until(lambda: d1.texts(job["id"]) == [f"{tag} 0", f"{tag} 1", f"{tag} 2"], 60,
              what=f"the lines of {job['name']}")
    until(lambda: d1.job(survivor["id"])["attempts"][0]["log_offsets"].get("stdout"), 30,
          what="a checkpoint of the survivor's log offsets")
    open(go + ".0", "w").close()
    until(lambda: d1.texts(survivor["id"])[-1:] == ["S go 0"], 10, what="a line after the checkpoint")
    late = d1.submit(["python", chatty, "L", go + "-late"], name="late")
    until(lambda: d1.texts(late["id"]) == ["L 0", "L 1", "L 2"], 60, what="the lines of late")
    pids = {job["name"]: d1.job(job["id"])["attempts"][0]["pid"] for job in (survivor, victim, late)}

    sent: dict[int, set[str]] = {}
    acked: dict[int, set[str]] = {}
    stop = threading.Event()
    clients = [threading.Thread(target=_ingest, args=(d1.url, d1.token, i, sent, acked, stop))
               for i in (0, 1)]
    for t in clients:
        t.start()
    until(lambda: len(acked) >= 8, 60, every=0.01, what="some acknowledged batches")
    d1.kill9()  # while both clients are still sending
    stop.set()
    for t in clients:
        t.join(30)
    assert d1.proc.returncode == -signal.SIGKILL

    assert not gone(pids["survivor"]) and not gone(pids["late"]), "jobs outlive the daemon"
    os.killpg(pids["victim"], signal.SIGKILL)
    until(lambda: gone(pids["victim"]), 10, what="the victim to die")

    d2 = daemons.start(home)
    jobs = {j["id"]: j for j in d2.client().get("/v1/jobs").json()["jobs"]}
    assert set(jobs) == {survivor["id"], victim["id"], late["id"]}
    # its waiter kept its exit status for the next daemon
    dead = d2.wait(victim["id"], 30)
    assert dead["state"] == "failed" and dead["adopted"], dead
    assert dead["attempts"][0]["outcome"] == "crashed" and dead["attempts"][0]["signal"] == "SIGKILL"
    for job in (survivor, late):
        adopted = jobs[job["id"]]
        assert adopted["state"] == "running" and adopted["adopted"], adopted
        assert adopted["attempts"][0]["pid"] == pids[job["name"]]
        kinds = [e["kind"] for e in d2.client().get(f"/v1/jobs/{job['id']}/events").json()["events"]]
        assert kinds[:2] == ["submitted", "started"] and kinds[-1] == "adopted"
    # logs survive the kill, and the re-adopted tails store no line twice
    assert d2.texts(victim["id"]) == ["V 0", "V 1", "V 2"]
    assert d2.texts(late["id"]) == ["L 0", "L 1", "L 2"]
    assert d2.texts(survivor["id"]) == ["S 0", "S 1", "S 2", "S go 0"]
    open(go + ".1", "w").close()  # and go on storing new ones, numbered on
    until(lambda: d2.texts(survivor["id"])[-1:] == ["S go 1"], 10, what="a line after the restart")
    assert [(ln["seq"], ln["text"]) for ln in d2.logs(survivor["id"])] == [
        (1, "S 0"), (2, "S 1"), (3, "S 2"), (4, "S go 0"), (5, "S go 1")]

    # the re-adopted jobs are under control again: cancel reaches their processes
    for job in (survivor, late):
        assert d2.client().post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
    for job in (survivor, late):
        assert d2.wait(job["id"], 30)["state"] == "cancelled"
        until(lambda: gone(pids[job["name"]]), 10, what=f"{job['name']} to die")
    assert d2.terminate() == 0, d2.output()

    store = ReadOnlyStore(home / "rtxops.duckdb")
    try:
        stored = {r["span_id"] for r in store.query(
            "SELECT span_id FROM spans WHERE job_id = 'kill9-ingest'")}
        missing = {seed: len(ids - stored) for seed, ids in acked.items() if ids - stored}
        assert not missing, f"acknowledged spans lost (batch seed: spans missing): {missing}"
        torn = {seed for seed, ids in sent.items() if ids & stored and ids - stored}
        assert not torn, f"batches stored in part: {torn}"
        assert stored <= set().union(*sent.values()), "no span that was never sent"
        rows = {r["job_id"]: (r["state"], json.loads(r["record"])) for r in store.query(
            "SELECT job_id, state, record FROM jobs")}
        assert {k: v[0] for k, v in rows.items()} == {
            survivor["id"]: "cancelled", late["id"]: "cancelled", victim["id"]: "failed"}
        assert rows[survivor["id"]][1]["adopted"] is True
        logs = store.query("SELECT job_id, seq, text FROM job_logs ORDER BY job_id, seq")
        assert [(r["seq"], r["text"]) for r in logs if r["job_id"] == victim["id"]] == [
            (1, "V 0"), (2, "V 1"), (3, "V 2")]
        assert [r["text"] for r in logs if r["job_id"] == survivor["id"]] == [
            "S 0", "S 1", "S 2", "S go 0", "S go 1"]
    finally:
        store.close()


def test_a_cancel_in_progress_is_carried_on_after_kill9(daemons, tmp_path):
    """The job ignores SIGTERM; its cancel waits out the grace when the daemon is killed. The
    restarted daemon goes on cancelling it (not re-adopted as running): SIGKILL, cancelled."""
    home = tmp_path / "home"
    d1 = daemons.start(home)
    stubborn = script(tmp_path, "stubborn.py", """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("up", flush=True)
        time.sleep(600)
    """)
    job = d1.submit(["python", stubborn], grace_s=5)
    until(lambda: d1.texts(job["id"]) == ["up"], what="the job's SIGTERM handler")
    assert d1.client().post(f"/v1/jobs/{job['id']}/cancel").json()["state"] == "cancelling"
    pid = d1.job(job["id"])["attempts"][-1]["pid"]
    d1.kill9()
    d2 = daemons.start(home)
    assert d2.job(job["id"])["state"] == "cancelling"
    done = d2.wait(job["id"], timeout=60)
    assert done["state"] == "cancelled" and done["reason"] == "cancelled by request", done
    until(lambda: gone(pid), what="the job's process to be killed")


def test_a_shutdown_under_way_at_a_daemon_kill_is_carried_on_as_a_cancel(daemons, tmp_path):
    """The daemon is asked to stop (SIGTERM) and killed during its jobs' grace (a service
    manager's stop timeout): the next daemon finishes the stop. The job ended cancelled, not
    re-adopted as running, nor restarted once its processes were gone."""
    home, termed = tmp_path / "home", tmp_path / "termed"
    d1 = daemons.start(home)
    stubborn = script(tmp_path, "stubborn.py", f"""
        import signal, time
        signal.signal(signal.SIGTERM, lambda *_: open({str(termed)!r}, "w").close())
        print("up", flush=True)
        time.sleep(600)
    """)
    job = d1.submit(["python", stubborn], grace_s=5, restarts=3)
    until(lambda: d1.texts(job["id"]) == ["up"], what="the job's SIGTERM handler")
    pid = d1.job(job["id"])["attempts"][-1]["pid"]
    d1.proc.send_signal(signal.SIGTERM)
    until(termed.exists, what="the daemon's SIGTERM to reach the job")
    d1.kill9()
    d2 = daemons.start(home)
    assert d2.job(job["id"])["state"] == "cancelling"
    done = d2.wait(job["id"], timeout=60)
    assert done["state"] == "cancelled" and done["reason"] == "daemon shut down", done
    assert len(done["attempts"]) == 1
    until(lambda: gone(pid), what="the job's process to be killed")


JOB = """
import sys, time
print("one", flush=True)
time.sleep(float(sys.argv[1]))
print("two", flush=True)
"""


def _run(daemon, tmp_path, seconds: float, **env):
    import subprocess

    from .live import RTXOPS, clean_env

    body = script(tmp_path, "talks.py", JOB)
    proc = subprocess.Popen([*RTXOPS, "run", "--no-summary", "--", "python", body, str(seconds)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env=clean_env(daemon.mark, RTXOPS_HOME=str(daemon.home), **env))
    assert proc.stdout.readline().strip() == "one"
    return proc


QUITS = """
    import os, sys, time
    print("up", flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.02)
    print("bye", flush=True)
    sys.exit(int(sys.argv[2]))
"""


def test_jobs_that_end_or_wait_to_restart_while_no_daemon_runs_are_taken_up_by_the_next(daemons, tmp_path):
    """Before waiters, a job that ended while the daemon was down was "lost" (exit status
    unknown), and one waiting to restart was lost with its restart budget unspent."""
    home, go = tmp_path / "home", str(tmp_path / "go")
    d1 = daemons.start(home)
    quits = script(tmp_path, "quits.py", QUITS)
    ok = d1.submit(["python", quits, go, "0"], name="ok")
    bad = d1.submit(["python", quits, go, "3"], name="bad", restarts=1, backoff_s=0)
    later = d1.submit(["python", "-c", "import sys; sys.exit(5)"], name="later", restarts=1,
                      backoff_s=20)
    for job in (ok, bad):
        until(lambda: d1.texts(job["id"]) == ["up"], 60, what=f"{job['name']} to start")
    until(lambda: d1.job(later["id"])["state"] == "restarting", 60, what="a restart to wait")
    pids = [d1.job(job["id"])["attempts"][0]["pid"] for job in (ok, bad)]
    due = d1.job(later["id"])["next_attempt_at_ns"]
    d1.kill9()
    open(go, "w").close()     # both end while no daemon runs
    until(lambda: all(gone(pid) for pid in pids), 30, what="the jobs to end")

    d2 = daemons.start(home)
    done = d2.wait(ok["id"], 60)
    assert done["state"] == "succeeded", done
    assert done["attempts"][0]["exit_code"] == 0 and done["adopted"]
    assert d2.texts(ok["id"]) == ["up", "bye"]      # its last line, written while no daemon ran
    failed = d2.wait(bad["id"], 60)
    assert failed["state"] == "failed" and "restart budget (1) spent" in failed["reason"], failed
    assert [a["exit_code"] for a in failed["attempts"]] == [3, 3]  # restarted by the new daemon
    resumed = d2.wait(later["id"], 60)
    assert [a["exit_code"] for a in resumed["attempts"]] == [5, 5], resumed
    assert resumed["attempts"][1]["started_at_ns"] >= due     # its backoff was waited out
    kinds = [e["kind"] for e in d2.client().get(f"/v1/jobs/{later['id']}/events").json()["events"]]
    assert "resumed" in kinds
    assert d2.terminate() == 0, d2.output()


# Ends with 130 on SIGINT and 143 on SIGTERM, but only once the file GO appears.
SLOW_TO_STOP = """
    import os, signal, sys, time
    def stop(code):
        def handler(*_):
            print(f"stopping {code}", flush=True)
            while not os.path.exists(sys.argv[1]):
                time.sleep(0.02)
            sys.exit(code)
        return handler
    signal.signal(signal.SIGINT, stop(130))
    signal.signal(signal.SIGTERM, stop(143))
    print("up", flush=True)
    while True:
        time.sleep(0.05)
"""


def test_a_stop_or_hang_kill_under_way_at_a_daemon_kill_ends_as_such(daemons, tmp_path):
    """A stop asked for (Ctrl-C forwarded by `rtxops run`) and a kill for a hang lived only in
    the daemon's memory: after a restart the attempt they ended read as a crash, and the job
    restarted (on its crash budget) instead of ending cancelled or on its hang budget."""
    home, go = tmp_path / "home", str(tmp_path / "go")
    d1 = daemons.start(home)
    slow = script(tmp_path, "slow.py", SLOW_TO_STOP)
    stopped = d1.submit(["python", slow, go], name="stopped", restarts=3)
    # (a hang after its handlers are in: the runtime's start takes seconds on a busy machine)
    hung = d1.submit(["python", slow, go], name="hung", restarts=3, hang_timeout_s=15, grace_s=600)
    until(lambda: d1.texts(stopped["id"]) == ["up"], 60, what="the job to start")
    r = d1.client().post(f"/v1/jobs/{stopped['id']}/signal", json={"signal": "SIGINT", "stop": True})
    assert r.status_code == 200 and r.json()["pids"], r.text
    until(lambda: d1.texts(stopped["id"]) == ["up", "stopping 130"], 60, what="the stop")
    until(lambda: d1.texts(hung["id"]) == ["up", "stopping 143"], 60, what="the hang's SIGTERM")
    assert d1.job(hung["id"])["state"] == "hung"
    pids = [d1.job(job["id"])["attempts"][0]["pid"] for job in (stopped, hung)]
    d1.kill9()
    open(go, "w").close()     # both end while no daemon runs
    until(lambda: all(gone(pid) for pid in pids), 30, what="the jobs to end")

    d2 = daemons.start(home)
    cancelled = d2.wait(stopped["id"], 60)
    assert cancelled["state"] == "cancelled", cancelled
    assert "stopped by SIGINT sent on request" in cancelled["reason"]
    assert len(cancelled["attempts"]) == 1
    failed = d2.wait(hung["id"], 60)
    assert failed["state"] == "failed" and "hang restart budget (0) spent" in failed["reason"], failed
    assert [a["outcome"] for a in failed["attempts"]] == ["hung"]
    assert d2.terminate() == 0, d2.output()


def test_rtxops_run_follows_its_job_to_a_restarted_daemon(daemons, tmp_path):
    """A daemon killed -9 under `rtxops run`: it said the job was gone (exit 2, "left no summary")
    while the job trained on unseen. It now waits for a daemon to serve the home again, which
    adopts the job, and goes on showing its output."""
    first = daemons.start()
    proc = _run(first, tmp_path, 6)
    first.kill9()
    daemons.start(first.home)
    out, errs = proc.communicate(timeout=120)
    assert "two" in out.split(), (out, errs)
    assert "waiting up to" in errs and "following job" in errs, errs
    assert "left no summary" not in errs


def test_rtxops_run_says_the_job_may_run_on_when_no_daemon_comes_back(daemons, tmp_path):
    first = daemons.start()
    proc = _run(first, tmp_path, 600, RTXOPS_RECONNECT_S="2")
    first.kill9()
    out, errs = proc.communicate(timeout=60)
    assert proc.returncode == 2, (out, errs)
    assert "may still be running unsupervised" in " ".join(errs.split()), errs
    assert "left no summary" not in errs
    from .live import marked

    orphans = marked(first.mark)  # the job, in its own session, trains on: as it was told
    assert orphans
    for pid in orphans:
        os.kill(pid, signal.SIGKILL)
    until(lambda: not marked(first.mark), 10, what="the orphaned job to go")


LEAVES_A_CHILD = """
    import os, subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])   # a leftover
    print("up", flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
    print("bye", flush=True)
"""


def test_an_adopted_job_ends_with_its_main_process_not_its_leftovers(daemons, tmp_path):
    """An adopted attempt was alive while any of its processes was: a job whose main process
    exited 0 stayed "running" for as long as a child it left (a data-loader worker) lived, and
    the leftover was never killed."""
    home, go = tmp_path / "home", str(tmp_path / "go")
    d1 = daemons.start(home)
    job = d1.submit(["python", script(tmp_path, "leaves.py", LEAVES_A_CHILD), go], name="leaves")
    until(lambda: d1.texts(job["id"]) == ["up"], 60, what="the job to start")
    d1.kill9()
    d2 = daemons.start(home)
    open(go, "w").close()
    done = d2.wait(job["id"], 60)
    assert done["state"] == "succeeded" and done["adopted"], done
    assert done["attempts"][0]["exit_code"] == 0
    assert d2.terminate() == 0, d2.output()


# Steps every 0.3 s, each posting an rtx.step span (a heartbeat) to the daemon it was started by,
# until the file GO appears.
STEPS_TO_ITS_DAEMON = """
    import http.client, json, os, sys, time, urllib.request
    url, token, job = os.environ["RTXOPS_DAEMON"], os.environ["RTXOPS_TOKEN"], os.environ["RTXOPS_JOB_ID"]
    step = 0
    print("up", flush=True)
    while not os.path.exists(sys.argv[1]):
        step += 1
        t = time.time_ns()
        body = {"resourceSpans": [{"resource": {"attributes": [
            {"key": "rtx.job.id", "value": {"stringValue": job}},
            {"key": "rtx.rank", "value": {"intValue": "0"}}]},
            "scopeSpans": [{"spans": [{"traceId": os.urandom(16).hex(), "spanId": os.urandom(8).hex(),
                "name": "rtx.step", "startTimeUnixNano": str(t - 1000), "endTimeUnixNano": str(t),
                "attributes": [{"key": "rtx.step", "value": {"intValue": str(step)}}]}]}]}]}
        request = urllib.request.Request(url + "/v1/traces", data=json.dumps(body).encode(), headers={
            "Content-Type": "application/json", "Authorization": "Bearer " + token})
        try:
            urllib.request.urlopen(request, timeout=5).read()
        except (OSError, http.client.HTTPException):
            # the daemon that started it is gone (the new one listens elsewhere); killed in the
            # middle of an answer, it leaves an IncompleteRead (not an OSError: the job died)
            pass
        time.sleep(0.3)
    print("bye", flush=True)
"""


def test_an_adopted_job_heard_from_by_no_one_is_not_killed_as_hung(daemons, tmp_path):
    """A job keeps sending its steps to the address of the daemon that started it; a daemon
    restarted on another port hears none, and killed the healthy job as hung."""
    home, go = tmp_path / "home", str(tmp_path / "go")
    d1 = daemons.start(home)
    # (a slow start on a busy machine is not the hang this is about)
    job = d1.submit(["python", script(tmp_path, "steps.py", STEPS_TO_ITS_DAEMON), go], name="steps",
                    hang_timeout_s=5, first_step_timeout_s=120)
    until(lambda: (d1.job(job["id"]).get("last_step") or 0) >= 3, 60, what="steps to be heard")
    d1.kill9()
    d2 = daemons.start(home)
    time.sleep(12)                     # past the hang timeout, with no step heard
    assert d2.job(job["id"])["state"] == "running", d2.job(job["id"])
    open(go, "w").close()
    done = d2.wait(job["id"], 60)
    assert done["state"] == "succeeded" and done["adopted"], done
    assert d2.terminate() == 0, d2.output()


def test_an_adopted_job_follows_its_daemon_restarted_on_another_port(daemons, tmp_path):
    """A job kept the address of the daemon that started it: after a kill -9 and a restart on
    another port its steps and spans went nowhere and its plans never came. It now follows the
    home's daemon.url: the new daemon hears its steps, stores them whole and delivers a plan."""
    from .test_daemon_plans import TRAIN

    home, stop, summary = tmp_path / "home", tmp_path / "stop", tmp_path / "summary.json"
    d1 = daemons.start(home)
    job_id = d1.submit(["python", script(tmp_path, "train.py", TRAIN), str(stop)], name="train",
                       env={"RTXOPS_PLAN_POLL_S": "0.2", "RTXOPS_EXPORT_INTERVAL_S": "0.5",
                            "RTXOPS_SUMMARY": str(summary)})["id"]
    until(lambda: (d1.job(job_id).get("last_step") or 0) >= 3, 60, what="the job's first steps")
    d1.kill9()
    d2 = daemons.start(home)
    assert d2.url != d1.url
    killed_at = d2.job(job_id).get("last_step") or 0
    until(lambda: (d2.job(job_id).get("last_step") or 0) >= killed_at + 5, 60,
          what="the restarted daemon to hear the job's steps")
    r = d2.client().post("/v1/plans", params={"job": job_id},
                         json={"version": 1, "defaults": {"gelu": "algebraic"}})
    assert r.status_code == 201, r.text
    effective = r.json()["effective_step"]
    until(lambda: (d2.job(job_id).get("last_step") or 0) >= effective + 3, 60,
          what="steps past the plan's effective step")
    stop.touch()
    done = d2.wait(job_id, 60)
    assert done["state"] == "succeeded" and done["adopted"], done
    data = json.loads(summary.read_text())
    assert data["plan_version"] == 1, data["plan_rejections"]
    assert d2.terminate() == 0, d2.output()
    store = ReadOnlyStore(home / "rtxops.duckdb")
    try:
        steps = [r["step"] for r in store.query(
            "SELECT step FROM step_times WHERE job_id = ? ORDER BY step", [job_id])]
    finally:
        store.close()
    # the batch that failed at the dead address was sent again to the new one: no step lost
    assert steps == list(range(1, data["steps"] + 1)), (steps, data["steps"])


def test_ctrl_c_while_waiting_for_a_gone_daemon_says_the_job_runs_on(daemons, tmp_path):
    """Ctrl-C while `rtxops run` waited for its daemon to come back: "cannot reach the daemon",
    exit 2, and nothing about the job, which trained on unsupervised."""
    first = daemons.start()
    proc = _run(first, tmp_path, 600, RTXOPS_RECONNECT_S="60")
    first.kill9()
    time.sleep(3)                      # waiting for a daemon to come back
    proc.send_signal(signal.SIGINT)
    out, errs = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, errs)
    assert "runs on unsupervised" in " ".join(errs.split()), errs
    from .live import marked

    for pid in marked(first.mark):     # the job, as it was told
        os.kill(pid, signal.SIGKILL)
    until(lambda: not marked(first.mark), 10, what="the orphaned job to go")
