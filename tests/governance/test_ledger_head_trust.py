"""Who vouches for the ledger's head. The daemon signed its next head over whatever chain it found
(a rewrite under a stripped or deleted head was blessed), any key `keys init` made could sign a
rewritten chain's head, and a ledger emptied with its head deleted passed for a new one."""
from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from rtxops.cli import app
from rtxops.governance import VerificationError
from rtxops.governance import ledger as gl
from rtxops.governance._layout import HEAD_KIND
from rtxops.governance.authority import Authority
from rtxops.governance.keyring import Keyring
from rtxops.runtime.plan import Plan
from rtxops.telemetry.store import Store
from rtxops.telemetry.store_ledger import GENESIS, entry_hash

from .._bounded import joined
from .helpers import registry


def cli(*args):
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, " ".join(r.output.split())


def daemon_home(tmp_path, versions=(1, 2, 3)):
    """A home whose daemon issued ``versions`` of job-1's plan (a real Authority, real bundles)."""
    home = tmp_path / "home"
    home.mkdir()
    store = Store(home / "rtxops.duckdb")
    authority = Authority(home, store)
    try:
        for v in versions:
            authority.issue_plan(Plan.from_dict({"version": v, "defaults": {"gelu": "algebraic"}}),
                                 "job-1", registry(), decision={"kind": "manual"})
    finally:
        authority.close()
        store.close()
    return home


def next_plan(home, version=9):
    """The daemon restarted on ``home`` issues its next plan."""
    store = Store(home / "rtxops.duckdb")
    authority = Authority(home, store)
    try:
        return authority.issue_plan(Plan.from_dict({"version": version, "defaults": {"gelu": "algebraic"}}),
                                    "job-1", registry(), decision={"kind": "manual"})
    finally:
        authority.close()
        store.close()


def restart(home) -> None:
    """The daemon on ``home`` starts (its governance part) and stops."""
    store = Store(home / "rtxops.duckdb")
    try:
        Authority(home, store).close()
    finally:
        store.close()


def wipe_ledger(home) -> None:
    """Whoever can write the store empties the ledger and deletes its head."""
    store = Store(home / "rtxops.duckdb")
    try:
        store.run_write(lambda cur: cur.execute("DELETE FROM ledger")).result(30)
    finally:
        store.close()
    (home / "ledger.head").unlink()


def rewrite_entry_2(home):
    """Whoever can write the store: entry 2 forged, every later hash recomputed."""
    store = Store(home / "rtxops.duckdb")
    try:
        rows, prev = [], GENESIS
        for row in gl.read_entries(store):
            row = dict(row)
            if row["seq"] == 2:
                row["subject_digest"] = "sha256:" + "e" * 64
            row["prev_hash"] = prev
            row["entry_hash"] = prev = entry_hash(row)
            rows.append(row)

        def write(cur):
            cur.execute("DELETE FROM ledger")
            for r in rows:
                cur.execute(f"INSERT INTO ledger ({', '.join(r)}) VALUES ({', '.join('?' * len(r))})",
                            list(r.values()))
        store.run_write(write).result(30)
    finally:
        store.close()
    return rows


@pytest.mark.parametrize("head", ["stripped", "deleted", "foreign"])
def test_the_daemon_refuses_to_sign_over_a_chain_rewritten_under_a_head_it_cannot_trust(tmp_path, head):
    home = daemon_home(tmp_path)
    rows = rewrite_entry_2(home)
    head_file = home / "ledger.head"
    if head == "stripped":
        head_file.write_text(json.dumps({"seq": rows[-1]["seq"], "entry_hash": rows[-1]["entry_hash"]}))
    elif head == "deleted":
        head_file.unlink()
    else:   # signed, by a key the keyring does not trust for the head
        from rtxops.governance import generate_key

        generate_key(tmp_path / "other.pem", tmp_path / "other.pub")
        from rtxops.governance import Signer

        gl.write_head(head_file, rows[-1]["seq"], rows[-1]["entry_hash"],
                      Signer.from_key_file(tmp_path / "other.pem").key)
    assert cli("ledger", "verify", "--home", str(home))[0] == 1
    with pytest.raises(VerificationError, match="ledger"):
        next_plan(home)
    code, output = cli("ledger", "verify", "--home", str(home))
    assert code == 1, output   # still caught: nothing was signed over it
    assert not (home / "bundles" / "job-1" / "v9").exists()


def test_entries_added_past_the_signed_head_are_not_signed_over(tmp_path):
    """One entry past the head is a daemon killed between its commit and the head's write; more
    were added by someone else."""
    home = daemon_home(tmp_path, versions=(1,))
    store = Store(home / "rtxops.duckdb")
    try:
        for v in (2, 3):
            gl.append(store, None, kind="promote", scope="job-1", version=v,
                      subject_digest="sha256:" + "0" * 64, decision={}, signer="k")
    finally:
        store.close()
    with pytest.raises(VerificationError, match="2 entries after entry 1"):
        next_plan(home)


def test_only_a_key_trusted_for_the_head_may_sign_it(tmp_path):
    home = daemon_home(tmp_path)
    assert cli("keys", "init", "--name", "user", "--home", str(home))[0] == 0
    user = Keyring.load(home / "keyring.json").keys
    assert all(HEAD_KIND not in k.kinds for k in user.values() if k.name == "user")
    # someone drops the tail and strips the head's signature, then signs it with their own key
    store = Store(home / "rtxops.duckdb")
    try:
        store.run_write(lambda cur: cur.execute("DELETE FROM ledger WHERE seq = 3")).result(30)
        (second,) = store.query("SELECT seq, entry_hash FROM ledger WHERE seq = 2")
    finally:
        store.close()
    (home / "ledger.head").write_text(json.dumps(second))
    code, output = cli("ledger", "sign-head", "--key", str(home / "keys" / "user.pem"), "--home", str(home))
    assert code == 1 and "not trusted to sign the ledger's head" in output, output
    assert "signature" not in (home / "ledger.head").read_text()
    # a head signed by a key trusted for ledger bundles but not for the head does not verify
    from rtxops.governance import Signer

    gl.write_head(home / "ledger.head", 2, second["entry_hash"],
                  Signer.from_key_file(home / "keys" / "user.pem").key)
    code, output = cli("ledger", "verify", "--home", str(home))
    assert code == 1 and "not trusted to sign the ledger's head" in output, output


def test_an_emptied_ledger_with_its_head_deleted_is_not_a_new_one(tmp_path):
    home = daemon_home(tmp_path, versions=(1, 2))
    replay = tmp_path / "v1"
    shutil.copytree(home / "bundles" / "job-1" / "v1", replay)
    code, output = cli("verify", str(replay), "--home", str(home))
    assert code == 1 and "replay of an older plan" in output, output
    wipe_ledger(home)
    code, output = cli("ledger", "verify", "--home", str(home))
    assert code == 1 and "head file is missing" in output, output
    code, output = cli("verify", str(replay), "--home", str(home))
    assert code == 1 and "the ledger is not intact" in output, output
    with pytest.raises(VerificationError, match="head file is missing"):
        next_plan(home)   # and the restarted daemon does not start it afresh (bundles were issued)
    assert not (home / "ledger.head").exists()


def test_a_new_home_starts_with_a_signed_empty_head_and_an_old_daemon_key_gets_the_head_kind(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    restart(home)
    head = gl.read_head(home / "ledger.head")
    assert (head["seq"], head["entry_hash"]) == (0, GENESIS) and "signature" in head
    code, output = cli("ledger", "verify", "--home", str(home))
    assert code == 0 and "ledger intact: 0 entries, head signed by" in output, output
    # a keyring written before the head kind existed: the daemon's own entry gains it at start
    ring = json.loads((home / "keyring.json").read_text())
    for entry in ring["keys"].values():
        entry["kinds"] = ["plan", "telemetry", "ledger", "checkpoint"]
    (home / "keyring.json").write_text(json.dumps(ring))
    assert cli("ledger", "verify", "--home", str(home))[0] == 1
    restart(home)
    assert cli("ledger", "verify", "--home", str(home))[0] == 0
    next_plan(home, version=1)
    code, output = cli("ledger", "verify", "--home", str(home))
    assert code == 0 and "ledger intact: 1 entries" in output, output


def forge_entry(home, version=100):
    """Whoever can write the store appends one well-chained entry after the signed head."""
    store = Store(home / "rtxops.duckdb")
    try:
        gl.append(store, None, kind="promote", scope="job-1", version=version,
                  subject_digest="sha256:" + "f" * 64, decision={}, signer="k")
    finally:
        store.close()


def test_one_entry_appended_by_someone_else_is_not_signed_over(tmp_path):
    """One entry past the head passed for a daemon killed between its commit and its head's
    write: the daemon signed its next head over a forged promote (and `rtxops verify` then
    refused the daemon's own newest bundle as a replay)."""
    home = daemon_home(tmp_path, versions=(1,))
    forge_entry(home)
    with pytest.raises(VerificationError, match="never signed a head for it"):
        next_plan(home)
    code, output = cli("ledger", "verify", "--home", str(home))
    assert code == 1, output


def killed_between_entry_and_head(home, monkeypatch) -> None:
    """The restarted daemon on ``home`` issues v2 and is killed after the entry's commit, before
    its head is written."""
    real_write_head = gl.write_head

    def killed(path, *args, **kwargs):
        if path.name == "ledger.head":
            raise KeyboardInterrupt("killed")
        return real_write_head(path, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(gl, "write_head", killed)
        with pytest.raises(KeyboardInterrupt):
            next_plan(home, version=2)


def test_a_daemon_killed_between_an_entry_and_its_head_is_taken_up_at_restart(tmp_path, monkeypatch):
    home = daemon_home(tmp_path, versions=(1,))
    killed_between_entry_and_head(home, monkeypatch)
    assert cli("ledger", "verify", "--home", str(home))[0] == 1   # the head is one behind
    restart(home)   # takes the head it signed for entry 2
    code, output = cli("ledger", "verify", "--home", str(home))
    assert code == 0 and "2 entries" in output, output
    assert not (home / "ledger.head.next").exists()
    next_plan(home, version=3)


def test_a_wiped_ledger_is_not_started_afresh_by_a_restart_even_without_bundles(tmp_path):
    """Ledger emptied, head and bundles deleted: the restarted daemon took it for its first
    start and signed an empty head, and `ledger verify` said intact."""
    home = daemon_home(tmp_path, versions=(1, 2))
    wipe_ledger(home)
    shutil.rmtree(home / "bundles")
    restart(home)
    assert not (home / "ledger.head").exists()
    code, output = cli("ledger", "verify", "--home", str(home))
    assert code == 1 and "head file is missing" in output, output
    # starting a new ledger on purpose is the key holder's explicit act
    code, output = cli("ledger", "sign-head", "--key", str(home / "keys" / "daemon.pem"),
                       "--home", str(home))
    assert code == 0, output
    assert cli("ledger", "verify", "--home", str(home))[0] == 0


def test_readers_never_see_an_entry_without_its_head(tmp_path):
    """Entry and head were written one after the other with nothing to stop a reader between
    them: `ledger verify` through the daemon and the dashboard reported tampering now and then
    on a daemon that was only publishing."""
    import threading

    home = daemon_home(tmp_path, versions=(1,))
    store = Store(home / "rtxops.duckdb")
    authority = Authority(home, store)
    stop, alarms = threading.Event(), []

    def read() -> None:
        check = gl.ChainCheck()
        try:
            while not stop.is_set():
                with authority.ledger_lock:
                    rows, head = gl.read_entries(store), gl.read_head(authority.head_file)
                    alarms.extend(gl.check_chain(rows, head) + check.problems(store, head))
        except Exception as e:  # noqa: BLE001 - a reader that died is a failure too
            alarms.append(repr(e))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for v in range(2, 40):
            authority._record(kind="manual", scope="job-1", version=v,
                              subject_digest="sha256:" + "0" * 64, decision={}, signer="k")
    finally:
        stop.set()
        joined(reader)
        authority.close()
        store.close()
    assert alarms == []


def test_a_crash_mid_append_after_a_key_rotation_is_taken_up_at_restart(tmp_path, monkeypatch):
    """The head was signed by the daemon's earlier key (still trusted for heads): the restart
    checked the pending head against the current key alone, threw it away, and the ledger was
    stuck for good ("never signed a head for it")."""
    home = daemon_home(tmp_path, versions=(1,))            # head signed by K1
    (home / "keys" / "daemon.pem").rename(tmp_path / "old.pem")   # rotated: K1 stays trusted
    (home / "keys" / "daemon.pub").rename(tmp_path / "old.pub")
    killed_between_entry_and_head(home, monkeypatch)     # entry 2 committed by K2, no head
    restart(home)
    code, output = cli("ledger", "verify", "--home", str(home))
    assert code == 0 and "2 entries" in output, output
    next_plan(home, version=3)


def test_a_first_start_that_failed_on_the_keyring_leaves_no_key_without_a_ledger(tmp_path):
    """The key was made before the keyring was read: a first start that failed there left a
    key, so the next start took the home for an old one and never started its ledger (every
    plan refused: head missing)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "keyring.json").write_text("{not json")
    store = Store(home / "rtxops.duckdb")
    try:
        from rtxops.governance import UsageError

        with pytest.raises(UsageError):
            Authority(home, store)
        assert not (home / "keys" / "daemon.pem").exists()
        (home / "keyring.json").unlink()
        Authority(home, store).close()
    finally:
        store.close()
    assert gl.read_head(home / "ledger.head")["seq"] == 0
    next_plan(home, version=1)



def revoke_and_rotate_the_daemon_key(home) -> str:
    """The daemon's key leaked: revoked, and a new one made by the next start. Its key id."""
    old = next(k for k in Keyring.load(home / "keyring.json").keys.values() if k.name == "rtxops daemon")
    assert cli("keys", "revoke", old.key_id[:16], "--reason", "leaked", "--home", str(home))[0] == 0
    for name in ("daemon.pem", "daemon.pub"):
        (home / "keys" / name).unlink()
    restart(home)   # a new daemon key, trusted for the head
    return old.key_id


def test_a_head_signed_by_a_revoked_key_is_signed_anew_once_the_chain_checks(tmp_path):
    """A leaked daemon key revoked and rotated: `sign-head` said "signed already" (exit 0) and the
    daemon refused every plan until someone edited the head file by hand."""
    home = daemon_home(tmp_path)
    revoke_and_rotate_the_daemon_key(home)
    code, output = cli("ledger", "verify", "--home", str(home))
    assert code == 1 and "revoked" in output, output
    code, output = cli("ledger", "sign-head", "--home", str(home))
    assert code == 0 and "not trusted" in output and "signed the head" in output, output
    assert cli("ledger", "verify", "--home", str(home))[0] == 0
    assert next_plan(home, version=9).is_dir()   # the daemon chains on again


def test_a_head_signed_by_a_revoked_key_over_an_edited_chain_stays_unsigned(tmp_path):
    home = daemon_home(tmp_path)
    old_key = revoke_and_rotate_the_daemon_key(home)
    store = Store(home / "rtxops.duckdb")
    try:
        store.run_write(lambda cur: cur.execute(
            "UPDATE ledger SET version = 42 WHERE seq = 2")).result(30)
    finally:
        store.close()
    code, output = cli("ledger", "sign-head", "--home", str(home))
    assert code == 1 and "entry 2" in output, output
    assert json.loads((home / "ledger.head").read_text())["key_id"] == old_key


def test_a_tail_cut_under_an_older_signed_head_is_found_by_the_bundles_the_daemon_issued(tmp_path):
    """Whoever kept a copy of an earlier head could delete the entries after it and put that head
    back: the chain and its signed head checked intact, and the older plan passed `verify` as
    the newest. The bundles the daemon issued meanwhile are still in the home."""
    home = daemon_home(tmp_path, versions=(1, 2))
    old_head = (home / "ledger.head").read_bytes()
    next_plan(home, version=3)
    v2 = tmp_path / "v2"
    shutil.copytree(home / "bundles" / "job-1" / "v2", v2)
    assert cli("ledger", "verify", "--home", str(home))[0] == 0
    store = Store(home / "rtxops.duckdb")
    try:
        store.run_write(lambda cur: cur.execute("DELETE FROM ledger WHERE seq = 3")).result(30)
    finally:
        store.close()
    (home / "ledger.head").write_bytes(old_head)
    code, output = cli("ledger", "verify", "--home", str(home))
    assert code == 1 and "job-1/v3: this home's daemon issued it, and no ledger entry" in output, output
    code, output = cli("verify", str(v2), "--home", str(home))
    assert code == 1 and "the ledger is not intact" in output, output


def test_a_linked_or_broken_version_folder_beside_the_bundles_is_no_traceback(tmp_path):
    """A ``bundles/<scope>/v7`` that is a link to a folder (or a folder that is not a bundle)
    made `ledger verify` end in a UsageError traceback: the daemon moves real bundles there."""
    import os

    home = daemon_home(tmp_path, versions=(1,))
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", home / "bundles" / "job-1" / "v7")
    (home / "bundles" / "job-1" / "v8").mkdir()
    code, out = cli("ledger", "verify", "--home", str(home))
    assert code == 0 and "ledger intact" in out, out


def test_a_head_left_unsigned_over_a_cut_chain_names_the_cut_and_is_not_signed(tmp_path):
    """The last entry deleted and an unsigned head written for the one before: `ledger verify`
    said only "not signed … sign-head signs it", and `sign-head` then signed over the cut."""
    home = daemon_home(tmp_path, versions=(1, 2, 3))
    store = Store(home / "rtxops.duckdb")
    try:
        rows = store.query("SELECT seq, entry_hash FROM ledger ORDER BY seq")
        store.run_write(lambda cur: cur.execute("DELETE FROM ledger WHERE seq = 3")).result(30)
    finally:
        store.close()
    (home / "ledger.head").write_text(json.dumps({"seq": 2, "entry_hash": rows[1]["entry_hash"]}))
    before = (home / "ledger.head").read_text()
    code, output = cli("ledger", "verify", "--home", str(home))
    assert code == 1 and "v3: this home's daemon issued it, and no ledger entry records it" in output
    code, output = cli("ledger", "sign-head", "--home", str(home))
    assert code == 1 and "no ledger entry records it" in output, output
    assert (home / "ledger.head").read_text() == before
