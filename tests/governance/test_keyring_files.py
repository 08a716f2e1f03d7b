"""Keyring and key files that are not what they should be: a clear error (exit 2), never a
traceback, from every command that reads them."""
from __future__ import annotations

import base64
import json

import pytest
from typer.testing import CliRunner

from rtxops.cli import app


def _revoked_at_text(ring: dict) -> dict:
    entry = next(iter(ring["keys"].values()))
    entry["revoked_at"] = "yesterday"
    return ring


def _kinds_not_a_list(ring: dict) -> dict:
    next(iter(ring["keys"].values()))["kinds"] = "plan"
    return ring


def _revoked_at_past_any_clock(ring: dict) -> dict:
    next(iter(ring["keys"].values()))["revoked_at"] = 1e300   # crashed `keys list` (OverflowError)
    return ring


def _not_before_1969(ring: dict) -> dict:
    next(iter(ring["keys"].values()))["not_before"] = -5
    return ring


MALFORMED = {
    "keys is a list": lambda ring: {"keys": []},
    "top level is a list": lambda ring: ["keys"],
    "entry is a string": lambda ring: {"keys": {"k": "pem"}},
    "revoked_at is text": _revoked_at_text,
    "kinds is not a list": _kinds_not_a_list,
    "revoked_at out of range": _revoked_at_past_any_clock,
    "not_before negative": _not_before_1969,
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_keyring_is_a_clear_error(case, keys, good_plan, tmp_path):
    ring = MALFORMED[case](json.loads(keys.keyring_file.read_text()))
    path = tmp_path / "keyring.json"
    path.write_text(json.dumps(ring))
    for args in (["verify", str(good_plan), "--keyring", str(path), "--no-ledger"],
                 ["keys", "list", "--keyring", str(path)]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, (args, result.output, result.exception)
        assert f"keyring{path}isunreadable" in "".join(result.output.split())  # rich wraps it


def test_a_public_key_of_an_unknown_algorithm_is_a_clear_error(tmp_path):
    oid = bytes([0x06, 0x03, 0x2A, 0x03, 0x04])                     # 1.2.3.4
    algorithm = bytes([0x30, len(oid)]) + oid
    bits = bytes([0x03, 0x03, 0x00, 0x01, 0x02])
    spki = bytes([0x30, len(algorithm) + len(bits)]) + algorithm + bits
    pub = tmp_path / "odd.pub"
    pub.write_bytes(b"-----BEGIN PUBLIC KEY-----\n" + base64.encodebytes(spki) + b"-----END PUBLIC KEY-----\n")
    result = CliRunner().invoke(app, ["keys", "trust", str(pub), "--keyring", str(tmp_path / "r.json")])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "isnotaPEMpublickey" in "".join(result.output.split())


def test_a_revoked_key_stays_revoked_and_validity_must_be_positive(tmp_path):
    """`keys trust` of a revoked key made it valid again (and widened its kinds): whoever holds
    a leaked key could sign again. A validity of -1 days made a key expired at birth."""
    ring = tmp_path / "r.json"
    home = tmp_path / "home"

    def cli(*args):
        r = CliRunner().invoke(app, list(args))
        return r.exit_code, " ".join(r.output.split())

    code, out = cli("keys", "init", "--name", "k", "--keyring", str(ring), "--home", str(home))
    assert code == 0, out
    kid = out.split()[1]
    code, out = cli("keys", "revoke", kid, "--reason", "leaked", "--keyring", str(ring))
    assert code == 0, out
    code, out = cli("keys", "trust", str(home / "keys" / "k.pub"), "--keyring", str(ring))
    assert code == 2 and "was revoked (leaked)" in out, out
    assert all(k["revoked_at"] is not None for k in _entries(json.loads(ring.read_text())))
    code, out = cli("keys", "init", "--name", "k2", "--trust", "--keyring", str(tmp_path / "r2.json"),
                    "--home", str(home))
    code, out = cli("keys", "trust", str(home / "keys" / "k2.pub"), "--days", "-1",
                    "--keyring", str(tmp_path / "r3.json"))
    assert code == 2 and "positive number of days" in out, out


def _entries(ring: dict) -> list[dict]:
    keys = ring["keys"]
    return list(keys.values()) if isinstance(keys, dict) else keys


def test_key_commands_lose_no_key_and_no_revocation(tmp_path, keys):
    """`keys init --out k.pub` wrote the public key over the private one (and trusted a key no
    one holds); bad kinds were found after the key pair was written; a second revoke replaced the
    first one's time and reason; `--days nan` wrote a key that never expires; a keyring holding
    Infinity broke `keys list` with a traceback; `sign` removed a bundle's signature before it
    found the folder could not be signed."""
    ring, home = tmp_path / "r.json", tmp_path / "home"

    def cli(*args):
        r = CliRunner().invoke(app, list(args))
        return r.exit_code, " ".join(r.output.split())

    code, out = cli("keys", "init", "--out", str(tmp_path / "k.pub"), "--keyring", str(ring))
    assert code == 2 and "needs another name" in out and not (tmp_path / "k.pub").exists(), out
    code, out = cli("keys", "init", "--name", "n2", "--kinds", "plan,bogus", "--home", str(home),
                    "--keyring", str(ring))
    assert code == 2 and "unknown artifact kind 'bogus'" in out, out
    assert not (home / "keys" / "n2.pem").exists()
    code, out = cli("keys", "init", "--name", "n2", "--kinds", "plan", "--home", str(home),
                    "--keyring", str(ring))
    assert code == 0, out
    kid = out.split()[1]
    assert cli("keys", "revoke", kid, "--reason", "leaked", "--keyring", str(ring))[0] == 0
    code, out = cli("keys", "revoke", kid, "--keyring", str(ring))
    assert code == 0 and "already revoked (leaked)" in out, out
    assert next(iter(_entries(json.loads(ring.read_text()))))["revoked_reason"] == "leaked"
    for days in ("nan", "inf"):
        code, out = cli("keys", "trust", str(home / "keys" / "n2.pub"), "--days", days,
                        "--keyring", str(tmp_path / "r4.json"))
        assert code == 2 and "positive number of days" in out, out
    text = ring.read_text().replace('"revoked_reason"', '"not_after": Infinity, "revoked_reason"', 1)
    (tmp_path / "inf.json").write_text(text)
    code, out = cli("keys", "list", "--keyring", str(tmp_path / "inf.json"))
    assert code == 2 and "isunreadable" in out.replace(" ", ""), out

    bundle = tmp_path / "ckpt"
    bundle.mkdir()
    (bundle / "model.bin").write_bytes(b"weights")
    signing = home / "keys" / "n2.pem"
    assert cli("sign", str(bundle), "--key", str(signing))[0] == 0
    signed = sorted(p.name for p in bundle.iterdir())
    (bundle / "link").symlink_to(bundle / "model.bin")
    code, out = cli("sign", str(bundle), "--key", str(signing))
    assert code == 2 and "cannot sign" in out and "symlink" in out, out
    assert sorted(p.name for p in bundle.iterdir()) == sorted(signed + ["link"])


def test_names_with_colons_come_out_as_written(tmp_path):
    """Rich turned ':fire:' in a key's name into an emoji in `keys list --json` (and in every
    line the CLI prints): the JSON no longer said what the keyring holds."""
    ring = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["keys", "init", "--name", "team:fire:ops", "--keyring", str(ring),
                                 "--home", str(tmp_path / "home")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["keys", "list", "--json", "--keyring", str(ring)])
    assert r.exit_code == 0, r.output
    assert [k["name"] for k in json.loads(r.output)] == ["team:fire:ops"]


def test_validity_does_not_hang_on_the_verifiers_clock(tmp_path):
    """A key trusted "not before now" was refused by a machine whose clock was then stepped back
    (the daemon's own plans, denied until the clock caught up) or lagged (a job); a revoked key
    was still taken by a verifier whose clock lagged the revoking machine's."""
    import time

    from rtxops.governance import VerificationError
    from rtxops.governance.keyring import Keyring

    r = CliRunner().invoke(app, ["keys", "init", "--name", "k", "--keyring", str(tmp_path / "r.json"),
                                 "--home", str(tmp_path / "home"), "--trust"])
    assert r.exit_code == 0, r.output
    ring = Keyring.load(tmp_path / "r.json")
    (kid,) = ring.keys
    ring.check(kid, "checkpoint", at=time.time() - 3600)    # a clock an hour behind
    ring.revoke(kid, "leaked")
    with pytest.raises(VerificationError, match="was revoked"):
        ring.check(kid, "checkpoint", at=time.time() - 3600)


def test_two_editors_of_one_keyring_lose_neither_change(tmp_path, keys):
    """A daemon's first start (it trusts its own key) and `rtxops keys trust` at the same time:
    each loaded the file, and the one that saved last dropped the other's key. The second editor
    (a real `rtxops keys trust` process) now waits for the first to let go of the keyring."""
    import subprocess
    import sys
    from pathlib import Path

    from rtxops.governance import Keyring

    path = tmp_path / "keyring.json"
    with Keyring.editing(path) as first:       # the daemon, mid-start
        other = subprocess.Popen([str(Path(sys.executable).with_name("rtxops")), "keys", "trust",
                                  str(keys.root / "stranger.pub"), "--name", "theirs",
                                  "--keyring", str(path)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            other.wait(5)   # without the lock it loads, saves and is gone by now
        except subprocess.TimeoutExpired:
            pass
        first.trust((keys.root / "daemon.pub").read_bytes(), name="ours")
    out, _ = other.communicate(timeout=60)
    assert other.returncode == 0, out
    assert sorted(k.name for k in Keyring.load(path).keys.values()) == ["ours", "theirs"]


def test_a_key_listed_twice_is_refused_not_read_as_its_last_entry(keys, good_plan, tmp_path):
    ring = json.loads(keys.keyring_file.read_text())
    (key_id, entry), = [(k, v) for k, v in ring["keys"].items() if "plan" in v.get("kinds", [])][:1]
    revoked = json.dumps({**entry, "revoked_at": 1.0})
    body = json.dumps(ring["keys"])[1:-1]
    # the key revoked first, then listed again as it was: json would keep the second entry
    path = tmp_path / "keyring.json"
    path.write_text('{"keys": {' + f'"{key_id}": {revoked}, ' + body + "}}")
    result = CliRunner().invoke(app, ["verify", str(good_plan), "--keyring", str(path), "--no-ledger"])
    assert result.exit_code == 2, result.output
    assert "listed twice" in " ".join(result.output.split())


def test_trusting_a_key_again_adds_kinds_and_replace_sets_them(tmp_path):
    """`keys trust KEY --kinds plan`, as the README says to let a key sign plans, replaced its
    kinds: the key's checkpoint bundles stopped verifying."""
    ring, home = tmp_path / "r.json", tmp_path / "home"

    def cli(*args):
        r = CliRunner().invoke(app, list(args))
        return r.exit_code, " ".join(r.output.split())

    assert cli("keys", "init", "--name", "k", "--home", str(home), "--keyring", str(ring))[0] == 0
    bundle = tmp_path / "ckpt"
    bundle.mkdir()
    (bundle / "model.bin").write_bytes(b"weights")
    assert cli("sign", str(bundle), "--key", str(home / "keys" / "k.pem"))[0] == 0
    code, out = cli("keys", "trust", str(home / "keys" / "k.pub"), "--kinds", "plan",
                    "--keyring", str(ring))
    assert code == 0 and "(added plan)" in out, out
    (entry,) = _entries(json.loads(ring.read_text()))
    assert sorted(entry["kinds"]) == ["checkpoint", "ledger", "plan", "telemetry"]
    assert entry["name"] == "k"
    assert cli("verify", str(bundle), "--keyring", str(ring), "--no-ledger")[0] == 0
    code, out = cli("keys", "trust", str(home / "keys" / "k.pub"), "--kinds", "plan", "--replace",
                    "--keyring", str(ring))
    assert code == 0
    (entry,) = _entries(json.loads(ring.read_text()))
    assert entry["kinds"] == ["plan"]
    assert cli("verify", str(bundle), "--keyring", str(ring), "--no-ledger")[0] == 1
