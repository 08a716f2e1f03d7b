"""The rejection matrix: every broken bundle fails `rtxops verify` with its own message and exit 1;
the intact one passes (so each case can fail). Runs the real CLI in-process."""
from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rtxops.cli import app
from rtxops.governance import Keyring
from rtxops.governance._layout import MAX_SIGNATURE_BYTES

from .helpers import PROMOTE, copy, edit_bundle_json, plan_bundle, resign, sign_as_it_is

KERNEL = "kernels/rtxops.runtime.ops.gelu.py"


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["verify", *args])
    return result.exit_code, result.output


def flip_byte(path: Path, at: int = 10) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _sig(d):
    return d["dsseEnvelope"]["signatures"][0]


def case_tampered(b, keys):
    flip_byte(b / KERNEL)


def case_truncated(b, keys):
    p = b / KERNEL
    p.write_bytes(p.read_bytes()[:-5])


def case_appended(b, keys):
    with open(b / "plan.json", "ab") as f:
        f.write(b" ")


def case_extra_file(b, keys):
    (b / "kernels" / "evil.py").write_text("import os\n")


def case_extra_file_out_of_reach(b, keys):
    """Below PATH_MAX, where listing fails even for root: an unsigned file nobody walks past."""
    here = os.getcwd()
    try:
        os.chdir(b / "kernels")
        for i in range(17):
            name = f"{i:02d}" + "d" * 240
            os.mkdir(name)
            os.chdir(name)
        Path("evil.py").write_text("import os\n")
    finally:
        os.chdir(here)


def case_missing_file(b, keys):
    (b / KERNEL).unlink()


def case_renamed(b, keys):
    (b / KERNEL).rename(b / "kernels" / "renamed.py")


def case_swapped(b, keys):
    a, c = (b / KERNEL).read_bytes(), (b / "plan.json").read_bytes()
    (b / KERNEL).write_bytes(c)
    (b / "plan.json").write_bytes(a)


def case_symlink(b, keys):
    os.symlink(b / "plan.json", b / "kernels" / "link.py")


def case_dotdot(b, keys):
    resign(b, keys.signer(), digests={**_digests(b), "../outside.py": "0" * 64})


def case_absolute(b, keys):
    resign(b, keys.signer(), digests={**_digests(b), "/etc/passwd": "0" * 64})


def case_backslash(b, keys):
    resign(b, keys.signer(), digests={**_digests(b), "kernels\\evil.py": "0" * 64})


def case_signature_flipped(b, keys):
    def f(d):
        raw = bytearray(base64.b64decode(_sig(d)["sig"]))
        raw[-3] ^= 0x40
        _sig(d)["sig"] = base64.b64encode(bytes(raw)).decode()
    edit_bundle_json(b, f)


def case_signature_empty(b, keys):
    edit_bundle_json(b, lambda d: _sig(d).update(sig=""))


def case_signature_not_base64(b, keys):
    edit_bundle_json(b, lambda d: _sig(d).update(sig="%%not-base64%%"))


def case_two_signatures(b, keys):
    edit_bundle_json(b, lambda d: d["dsseEnvelope"]["signatures"].append(dict(_sig(d))))


def case_payload_type(b, keys):
    edit_bundle_json(b, lambda d: d["dsseEnvelope"].update(payloadType="application/json"))


def case_unknown_predicate(b, keys):
    resign(b, keys.signer(), mutate_statement=lambda st: st.update(predicateType="https://evil/v1"))


def case_subject_digest(b, keys):
    resign(b, keys.signer(), mutate_statement=lambda st: st["subject"][0]["digest"].update(sha256="1" * 64))


def case_wrong_key(b, keys):
    resign(b, keys.signer("stranger"))
    return ["--key", str(keys.root / "daemon.pub")]


def case_not_in_keyring(b, keys):
    resign(b, keys.signer("stranger"))


def case_revoked(b, keys):
    resign(b, keys.signer("revoked"))


def case_expired(b, keys):
    resign(b, keys.signer("expired"))


def case_malformed_json(b, keys):
    (b / "bundle.sigstore.json").write_text('{"mediaType": ')


def case_media_type(b, keys):
    edit_bundle_json(b, lambda d: d.update(mediaType="application/vnd.dev.sigstore.bundle.v9+json"))


def case_oversized(b, keys):
    with open(b / "bundle.sigstore.json", "a") as f:
        f.write(" " * (MAX_SIGNATURE_BYTES + 1))


def case_other_kind_for_key(b, keys):
    resign(b, keys.signer("ckpt_only"))


def case_other_kind_expected(b, keys):
    return ["--kind", "checkpoint"]


def case_sbom_schema(b, keys):
    sbom = json.loads((b / "sbom.cdx.json").read_text())
    sbom["components"][0]["type"] = "spaceship"
    (b / "sbom.cdx.json").write_text(json.dumps(sbom))
    resign(b, keys.signer())


def case_sbom_digest(b, keys):
    sbom = json.loads((b / "sbom.cdx.json").read_text())
    sbom["components"] = sbom["components"][1:]
    (b / "sbom.cdx.json").write_text(json.dumps(sbom))


def _resigned_sbom(b, keys, edit) -> None:
    """The SBOM edited, and the bundle signed again as it now is (a trusted signer's lie)."""
    import hashlib

    sbom = json.loads((b / "sbom.cdx.json").read_text())
    edit(sbom)
    (b / "sbom.cdx.json").write_text(json.dumps(sbom))
    prov = json.loads((b / "provenance.intoto.json").read_text())
    for subject in prov["subject"]:
        if subject["name"] == "sbom.cdx.json":
            subject["digest"]["sha256"] = hashlib.sha256((b / "sbom.cdx.json").read_bytes()).hexdigest()
    (b / "provenance.intoto.json").write_text(json.dumps(prov))
    resign(b, keys.signer())


def _kernel_components(sbom) -> list[dict]:
    return [c for c in sbom["components"] if c.get("group") == "rtxops.kernels"]


def case_sbom_without_kernels(b, keys):
    _resigned_sbom(b, keys, lambda sbom: sbom.update(
        components=[c for c in sbom["components"] if c.get("group") != "rtxops.kernels"]))


def case_sbom_kernel_hash(b, keys):
    def edit(sbom):
        for c in _kernel_components(sbom):
            c["hashes"][0]["content"] = "0" * 64
    _resigned_sbom(b, keys, edit)


def case_provenance_digest(b, keys):
    prov = json.loads((b / "provenance.intoto.json").read_text())
    prov["predicate"]["buildDefinition"]["externalParameters"]["decision"]["gain"] = 0.5
    (b / "provenance.intoto.json").write_text(json.dumps(prov))


def case_provenance_of_another_kind(b, keys):
    """A swapped, unsigned provenance was judged on what it claims before its digest."""
    prov = json.loads((b / "provenance.intoto.json").read_text())
    prov["predicate"]["buildDefinition"]["externalParameters"]["kind"] = "checkpoint"
    (b / "provenance.intoto.json").write_text(json.dumps(prov))


def case_provenance_builder_not_an_object(b, keys):
    prov = json.loads((b / "provenance.intoto.json").read_text())
    prov["predicate"]["runDetails"]["builder"] = ["not", "an", "object"]
    (b / "provenance.intoto.json").write_text(json.dumps(prov))


def case_provenance_subjects(b, keys):
    prov = json.loads((b / "provenance.intoto.json").read_text())
    prov["subject"] = prov["subject"][1:]
    (b / "provenance.intoto.json").write_text(json.dumps(prov))
    resign(b, keys.signer())


def case_policy(b, keys):
    plan_bundle(b, keys.signer(), 5, decision={"kind": "promote", "gain": 0.01, "ci_low": -0.01})


def case_plan_not_a_plan(b, keys):
    """Signed whole by a trusted key, valid JSON, listed in the SBOM, and refused by any job."""
    plan = json.loads((b / "plan.json").read_text())
    plan["effective_step"] = -3
    (b / "plan.json").write_text(json.dumps(plan))
    sign_as_it_is(b, keys.signer(), 5)


def case_min_version(b, keys):
    return ["--min-version", "6"]


def _digests(b: Path) -> dict:
    from rtxops.governance._layout import list_files, sha256_file

    return {n: sha256_file(b / n) for n in list_files(b)}


CASES = {
    "tampered": (case_tampered, "files", f"{KERNEL}: sha256"),
    "truncated": (case_truncated, "files", f"{KERNEL}: sha256"),
    "appended": (case_appended, "files", "plan.json: sha256"),
    "extra file": (case_extra_file, "files", "extra file kernels/evil.py"),
    "extra file out of reach": (case_extra_file_out_of_reach, "layout", "cannot list kernels/00ddd"),
    "missing file": (case_missing_file, "files", f"missing file {KERNEL}"),
    "renamed file": (case_renamed, "files", f"missing file {KERNEL}"),
    "swapped files": (case_swapped, "files", f"{KERNEL}: sha256"),
    "symlink": (case_symlink, "layout", "kernels/link.py is a symlink"),
    "dotdot in manifest": (case_dotdot, "manifest", "'../outside.py' has '..'"),
    "absolute in manifest": (case_absolute, "manifest", "'/etc/passwd' is an absolute path"),
    "backslash in manifest": (case_backslash, "manifest", "'kernels\\\\evil.py' holds a backslash"),
    "signature flipped": (case_signature_flipped, "signature", "the signature does not verify"),
    "signature empty": (case_signature_empty, "signature", "the signature is empty"),
    "signature not base64": (case_signature_not_base64, "signature", "the signature is not base64"),
    "two signatures": (case_two_signatures, "bundle", "2 signatures; exactly one"),
    "payload type": (case_payload_type, "bundle", "DSSE payload type 'application/json'"),
    "unknown predicate": (case_unknown_predicate, "statement", "unknown predicate type 'https://evil/v1'"),
    "subject digest": (case_subject_digest, "statement", "subject digest mismatch"),
    "wrong key": (case_wrong_key, "signature", "(wrong key)"),
    "not in keyring": (case_not_in_keyring, "signer", "is not in the keyring"),
    "revoked key": (case_revoked, "signer", "was revoked at"),
    "expired key": (case_expired, "signer", "expired at"),
    "malformed json": (case_malformed_json, "bundle", "is not valid JSON"),
    "media type": (case_media_type, "bundle", "unknown bundle media type"),
    "oversized": (case_oversized, "bundle", "oversized input"),
    "key for another kind": (case_other_kind_for_key, "signer", "may sign checkpoint bundles, not plan"),
    "another kind expected": (case_other_kind_expected, "kind", "a plan bundle, not a checkpoint bundle"),
    "sbom schema": (case_sbom_schema, "sbom", "fails the CycloneDX 1.6 schema"),
    "sbom digest": (case_sbom_digest, "files", "the SBOM's sha256"),
    "provenance digest": (case_provenance_digest, "files", "the provenance's sha256"),
    "provenance of another kind": (case_provenance_of_another_kind, "files", "the provenance's sha256"),
    "provenance builder": (case_provenance_builder_not_an_object, "files", "the provenance's sha256"),
    "provenance subjects": (case_provenance_subjects, "provenance", "subjects do not match"),
    "sbom lists no kernels": (case_sbom_without_kernels, "kernels", "not in the SBOM: gelu/algebraic"),
    "sbom kernel hash": (case_sbom_kernel_hash, "kernels", "is not a signed file with the sha256"),
    "policy": (case_policy, "policy", "default/measured-gain"),
    "older than min version": (case_min_version, "version", "older than the minimum version 6 asked for"),
    "signed plan that no job takes": (case_plan_not_a_plan, "plan",
                                      "not a valid plan: plan.effective_step must be an integer"),
}


def test_intact_bundle_verifies(good_plan, keys):
    code, output = run(str(good_plan), "--keyring", str(keys.keyring_file), "--no-ledger")
    assert code == 0, output
    # the checks, and lines for the keyring trusted and the ledger check skipped
    assert output.count("ok  ") == 12 and "verified:" in output
    assert f"ok   trust       keyring {keys.keyring_file}\n" in output
    assert "ok   ledger      skipped (--no-ledger)" in output


@pytest.mark.parametrize("name", list(CASES))
def test_broken_bundle_is_rejected(name, good_plan, keys, tmp_path):
    mutate, check, message = CASES[name]
    bundle = copy(good_plan, tmp_path / "b")
    extra = mutate(bundle, keys) or []
    args = [str(bundle), "--no-ledger", *(["--keyring", str(keys.keyring_file)] if "--key" not in extra else []), *extra]
    code, output = run(*args)
    assert code == 1, output
    fail = [line for line in output.splitlines() if line.startswith("FAIL")]
    assert len(fail) == 1 and fail[0].split()[1] == check and message in fail[0], output


def test_json_report(good_plan, keys, tmp_path):
    bundle = copy(good_plan, tmp_path / "b")
    case_tampered(bundle, keys)
    result = CliRunner().invoke(app, ["verify", str(bundle), "--keyring", str(keys.keyring_file),
                                      "--no-ledger", "--json"])
    report = json.loads(result.output)
    assert result.exit_code == 1 and report["ok"] is False
    assert report["checks"][-1]["check"] == "files" and not report["checks"][-1]["ok"]
    assert all(c["ok"] for c in report["checks"][:-1])


def test_unreadable_input_and_bad_usage_exit_2(good_plan, keys, tmp_path):
    assert run(str(tmp_path / "nope"), "--keyring", str(keys.keyring_file))[0] == 2
    assert run(str(good_plan), "--identity", "me@example.com")[0] == 2
    assert run(str(good_plan), "--key", str(tmp_path / "missing.pub"))[0] == 2
    bad = tmp_path / "keyring.json"
    bad.write_text("{not json")
    code, output = run(str(good_plan), "--keyring", str(bad))
    assert code == 2 and "keyring" in output
    bad.write_text("[" * 100_000)   # nested past the JSON parser's recursion limit
    code, output = run(str(good_plan), "--keyring", str(bad))
    assert code == 2 and "keyring" in output and "RecursionError" in output, output


def test_replay_of_an_older_plan_is_refused_by_the_ledger(keys, tmp_path):
    """The ledger of $RTXOPS_HOME holds version 7 for the scope; a valid version-5 bundle is a replay."""
    from rtxops.governance import ledger
    from rtxops.telemetry.store import Store

    home = tmp_path / "home"
    home.mkdir()
    (home / "keyring.json").write_bytes(keys.keyring_file.read_bytes())  # its daemon's key
    bundle = plan_bundle(tmp_path / "v5", keys.signer(), 5, scope="job-1")
    store = Store(home / "rtxops.duckdb")
    try:
        ledger.start(store, home / "ledger.head", keys.signer().key, issued_before=False)
        ledger.append(store, home / "ledger.head", head_key=keys.signer().key, kind="promote", scope="job-1", version=7,
                      subject_digest="sha256:" + "0" * 64, decision={}, signer=keys.signer().key_id)
    finally:
        store.close()
    code, output = run(str(bundle), "--keyring", str(keys.keyring_file), "--home", str(home))
    assert code == 1 and "replay of an older plan" in output, output
    # another scope's ledger entries do not count
    other = plan_bundle(tmp_path / "other", keys.signer(), 5, scope="job-2")
    code, output = run(str(other), "--keyring", str(keys.keyring_file), "--home", str(home))
    # a ledger check that passed says so: it cannot be told from one not made otherwise
    assert code == 0 and "ok   ledger      no replay: the ledger's newest for job-2 is none yet" in output
    newer = plan_bundle(tmp_path / "v9", keys.signer(), 9, scope="job-1")
    code, output = run(str(newer), "--keyring", str(keys.keyring_file), "--home", str(home))
    assert code == 0 and "the ledger's newest for job-1 is version 7, this is 9" in output, output


def test_a_bundle_another_home_signed_is_not_checked_against_this_homes_ledger(keys, tmp_path):
    """Every home has a `_default` scope: another home's v5, imported here, was refused as a
    replay of this home's v7 though this ledger never saw that signer's plans."""
    from rtxops.governance import ledger
    from rtxops.telemetry.store import Store

    home = tmp_path / "home"
    home.mkdir()
    (home / "keyring.json").write_bytes(keys.keyring_file.read_bytes())
    store = Store(home / "rtxops.duckdb")
    try:
        ledger.start(store, home / "ledger.head", keys.signer().key, issued_before=False)
        ledger.append(store, home / "ledger.head", head_key=keys.signer().key, kind="promote",
                      scope="_default", version=7, subject_digest="sha256:" + "0" * 64,
                      decision={}, signer=keys.signer().key_id)
    finally:
        store.close()
    shipped = plan_bundle(tmp_path / "v5", keys.signer("stranger"), 5, scope="_default")
    code, output = run(str(shipped), "--key", str(keys.root / "stranger.pub"), "--home", str(home))
    assert code == 0 and "not checked: this home's ledger holds no plan signed by" in output, output


def test_a_plan_of_the_daemons_key_before_a_rotation_is_still_a_replay(keys, tmp_path):
    """Counting only the bundle's own signer's entries passed the last plan of a rotated-out
    daemon key (v5 of K1) though the ledger holds v8 of its successor K2."""
    from rtxops.governance import ledger
    from rtxops.telemetry.store import Store

    home = tmp_path / "home"
    home.mkdir()
    (home / "keyring.json").write_bytes(keys.keyring_file.read_bytes())
    bundle = plan_bundle(tmp_path / "v5", keys.signer(), 5, scope="job-1")
    store = Store(home / "rtxops.duckdb")
    try:
        ledger.start(store, home / "ledger.head", keys.signer().key, issued_before=False)
        for version, signer, digest in ((5, keys.signer().key_id, _root_digest(bundle)),
                                        (8, "k2-" + "0" * 61, "sha256:" + "8" * 64)):
            ledger.append(store, home / "ledger.head", head_key=keys.signer().key, kind="promote",
                          scope="job-1", version=version, subject_digest=digest, decision={},
                          signer=signer)
    finally:
        store.close()
    code, output = run(str(bundle), "--keyring", str(keys.keyring_file), "--home", str(home))
    assert code == 1 and "replay of an older plan" in output, output


def test_the_ledger_check_trusts_no_tampered_ledger_and_no_second_bundle_of_a_version(keys, tmp_path):
    """An edited ledger (the newer entry's version lowered below the replayed bundle's) fails the
    check instead of passing the replay; so does another bundle under a version the ledger took."""
    import duckdb

    from rtxops.governance import ledger
    from rtxops.telemetry.store import Store

    home = tmp_path / "home"
    home.mkdir()
    (home / "keyring.json").write_bytes(keys.keyring_file.read_bytes())  # its daemon's key
    bundle = plan_bundle(tmp_path / "v5", keys.signer(), 5, scope="job-1")
    twin = plan_bundle(tmp_path / "twin", keys.signer(), 5, scope="job-1",
                       decision={**PROMOTE, "gain": 0.09})
    store = Store(home / "rtxops.duckdb")
    try:
        ledger.start(store, home / "ledger.head", keys.signer().key, issued_before=False)
        ledger.append(store, home / "ledger.head", head_key=keys.signer().key, kind="promote", scope="job-1", version=5,
                      subject_digest=_root_digest(bundle), decision={}, signer=keys.signer().key_id)
        ledger.append(store, home / "ledger.head", head_key=keys.signer().key, kind="promote", scope="job-1", version=7,
                      subject_digest="sha256:" + "0" * 64, decision={}, signer=keys.signer().key_id)
    finally:
        store.close()
    args = ("--keyring", str(keys.keyring_file), "--home", str(home))
    code, output = run(str(bundle), *args)
    assert code == 1 and "replay of an older plan" in output, output
    one = tmp_path / "one"  # a ledger whose newest is version 5, of the other bundle
    one.mkdir()
    (one / "keyring.json").write_bytes(keys.keyring_file.read_bytes())
    store = Store(one / "rtxops.duckdb")
    try:
        ledger.start(store, one / "ledger.head", keys.signer().key, issued_before=False)
        ledger.append(store, one / "ledger.head", head_key=keys.signer().key, kind="promote",
                      scope="job-1", version=5, subject_digest=_root_digest(bundle), decision={},
                      signer=keys.signer().key_id)
    finally:
        store.close()
    code, output = run(str(twin), "--keyring", str(keys.keyring_file), "--home", str(one))
    assert code == 1 and "the ledger accepted another bundle as version 5" in output, output
    con = duckdb.connect(str(home / "rtxops.duckdb"))
    con.execute("UPDATE ledger SET version = 1 WHERE seq = 2")  # hide the newer version
    con.close()
    code, output = run(str(bundle), *args)
    assert code == 1 and "the ledger is not intact" in output and "edited entry" in output, output
    con = duckdb.connect(str(home / "rtxops.duckdb"))
    con.execute("DELETE FROM ledger WHERE seq = 2")
    con.close()
    (home / "ledger.head").write_text(json.dumps(
        {"seq": 1, "entry_hash": _entry_hash(home, 1)}))  # the head put back to match...
    code, output = run(str(bundle), *args)  # ...but without the daemon's key to sign it
    assert code == 1 and "the head file is not signed" in output, output


def _root_digest(bundle: Path) -> str:
    from rtxops.governance import _dsse, _layout

    names = _layout.list_files(bundle)
    return "sha256:" + _dsse.root_digest({n: _layout.sha256_file(bundle / n) for n in names})


def _entry_hash(home: Path, seq: int) -> str:
    import duckdb

    con = duckdb.connect(str(home / "rtxops.duckdb"), read_only=True)
    try:
        return con.execute("SELECT entry_hash FROM ledger WHERE seq = ?", [seq]).fetchone()[0]
    finally:
        con.close()


def test_a_key_trusted_with_the_default_kinds_signs_no_plans(good_plan, keys, tmp_path):
    """`keys trust` granted plans by default: a colleague's key trusted for checkpoints could sign
    a plan every job took (plans are the daemon's; `keys init` already left them out)."""
    ring = tmp_path / "ring.json"
    Keyring(ring).save()
    r = CliRunner().invoke(app, ["keys", "trust", str(keys.root / "daemon.pub"), "--keyring", str(ring)])
    assert r.exit_code == 0, r.output
    code, output = run(str(good_plan), "--keyring", str(ring), "--no-ledger")
    assert code == 1 and "plan" in output, output


def test_keyring_revocation_through_the_cli(good_plan, keys, tmp_path):
    ring = tmp_path / "ring.json"
    Keyring(ring).save()
    r = CliRunner().invoke(app, ["keys", "trust", str(keys.root / "daemon.pub"), "--kinds",
                                 "plan,checkpoint,telemetry,ledger", "--keyring", str(ring)])
    assert r.exit_code == 0, r.output
    assert run(str(good_plan), "--keyring", str(ring), "--no-ledger")[0] == 0
    kid = Keyring.load(ring).keys.popitem()[0]
    r = CliRunner().invoke(app, ["keys", "revoke", kid[:12], "--keyring", str(ring), "--reason", "lost laptop"])
    assert r.exit_code == 0, r.output
    code, output = run(str(good_plan), "--keyring", str(ring), "--no-ledger")
    assert code == 1 and "revoked" in output and "lost laptop" in output


def test_a_failed_check_stops_the_hashing_of_a_big_file(good_plan, keys, tmp_path, monkeypatch):
    """A big file beside the signed ones, or a bundle whose signature is unreadable: verify
    answers without waiting for the hash, and the hashing threads stop within a chunk (they kept
    `rtxops verify` from exiting until a terabyte file was read). Hashing is made slow here (tiny
    chunks) instead of the file huge."""
    import threading
    import time

    from rtxops.governance import Keyring, Trust, verify
    from rtxops.governance import _layout

    monkeypatch.setattr(_layout, "_CHUNK", 16)
    monkeypatch.setattr(_layout, "_PIPELINE_BYTES", 0)
    extra, unsigned = copy(good_plan, tmp_path / "extra"), copy(good_plan, tmp_path / "unsigned")
    (unsigned / "bundle.sigstore.json").write_text("{}")
    trust = Trust(keyring=Keyring.load(keys.keyring_file))
    for bundle, check in ((extra, "files"), (unsigned, "bundle")):
        (bundle / "zz_big.bin").write_bytes(b"\0" * (32 << 20))  # minutes at 16 bytes a chunk
        started = time.monotonic()
        report = verify(bundle, trust)
        assert not report.ok and [c.name for c in report.checks if not c.ok] == [check]
        assert time.monotonic() - started < 10

        def hashing() -> list[str]:
            return [t.name for t in threading.enumerate() if t.name.startswith("rtxops-hash")]

        deadline = time.monotonic() + 5
        while hashing() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not hashing(), f"{bundle.name}: still hashing: {hashing()}"


def test_a_plan_bundle_verified_where_there_is_no_home_says_the_ledger_was_not_checked(
        good_plan, keys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RTXOPS_HOME", raising=False)
    code, output = run(str(good_plan), "--keyring", str(keys.keyring_file))
    assert code == 0 and "ledger" in output and "not checked: no rtxops home" in output, output
    code, output = run(str(good_plan), "--keyring", str(keys.keyring_file),  # named: it must exist
                       "--home", str(tmp_path / "nope"))
    assert code == 2 and "no rtxops home at" in " ".join(output.split()), output


def test_names_in_a_report_are_printed_as_they_are_not_read_as_markup(good_plan, keys, tmp_path):
    """A file named ``a[/red]`` crashed `rtxops verify` (Rich's MarkupError, no verdict), and
    ``x[black on black]HIDDEN[/]`` was shown as ``xHIDDEN``, in the --json output too."""
    for name in ("a[/red]", "x[black on black]HIDDEN[/]"):
        bundle = copy(good_plan, tmp_path / f"b{len(name)}")
        (bundle / name).parent.mkdir(parents=True, exist_ok=True)
        (bundle / name).write_text("x")
        code, output = run(str(bundle), "--keyring", str(keys.keyring_file), "--no-ledger")
        assert code == 1 and f"extra file {name}" in output and "NOT verified" in output, output
        code, output = run(str(bundle), "--keyring", str(keys.keyring_file), "--no-ledger", "--json")
        assert code == 1 and name in json.loads(output)["checks"][-1]["message"], output


def test_a_bundle_cannot_send_the_terminal_escape_codes(good_plan, keys, tmp_path):
    """A key hint or a symlink's name is the bundle's own text, shown in the failure: it reached
    the terminal raw (``\\x1b[2J`` cleared the screen). A name that is not UTF-8 is refused."""
    hinted = copy(good_plan, tmp_path / "hint")
    edit_bundle_json(hinted,
                     lambda d: d["verificationMaterial"]["publicKey"].update(hint="\x1b[2J\x1b[31mHELLO"))
    linked = copy(good_plan, tmp_path / "link")
    (linked / "\x1b[2Jx").symlink_to(linked / "plan.json")
    for bundle, shown in ((hinted, "\\x1b[2J\\x1b[31mHELLO"), (linked, "\\x1b[2Jx is a symlink")):
        code, output = run(str(bundle), "--keyring", str(keys.keyring_file), "--no-ledger")
        assert code == 1 and "\x1b" not in output and shown in output, output
    named = copy(good_plan, tmp_path / "named")
    with open(os.path.join(os.fsencode(named), b"\xff.txt"), "wb") as f:
        f.write(b"x")
    code, output = run(str(named), "--keyring", str(keys.keyring_file), "--no-ledger")
    assert code == 1 and "is not UTF-8" in output, output
