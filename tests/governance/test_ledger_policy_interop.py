"""Ledger tamper detection (edit, delete, reorder, tail cut) through `rtxops ledger verify`; the
default policy's decisions; reproducible SBOMs; a key-mode bundle verified by model_signing."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rtxops.cli import app
from rtxops.governance import Keyring, Trust, load_policies, verify
from rtxops.governance import ledger as gl
from rtxops.telemetry.store import Store

from .helpers import PROMOTE, copy, home_ledger_key, plan_bundle


@pytest.fixture
def ledger_home(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    store = Store(home / "rtxops.duckdb")
    key = home_ledger_key(home, store)
    for v, kind in [(1, "manual"), (2, "promote"), (3, "deny"), (3, "promote"), (4, "rollback")]:
        gl.append(store, home / "ledger.head", head_key=key, kind=kind, scope="job-1", version=v,
                  subject_digest=f"sha256:{v:064x}", decision={"kind": kind}, signer="k")
    store.close()
    return home


def ledger_verify(home):
    r = CliRunner().invoke(app, ["ledger", "verify", "--home", str(home)])
    return r.exit_code, r.output


def tamper(home, sql):
    store = Store(home / "rtxops.duckdb")
    try:
        store.run_write(lambda cur: cur.execute(sql)).result(30)
    finally:
        store.close()


def test_intact_ledger_verifies_and_exports(ledger_home, tmp_path, keys):
    code, output = ledger_verify(ledger_home)
    assert code == 0 and "5 entries" in output, output
    out = tmp_path / "export"
    r = CliRunner().invoke(app, ["ledger", "export", str(out), "--home", str(ledger_home), "--sign",
                                 "--key", str(tmp_path / "missing.pem")])
    assert r.exit_code == 2 and not out.exists(), r.output  # nothing unsigned left behind
    r = CliRunner().invoke(app, ["ledger", "export", str(out), "--home", str(ledger_home), "--sign",
                                 "--key", str(keys.root / "daemon.pem")])
    assert r.exit_code == 0, r.output
    lines = (out / "ledger.jsonl").read_text().splitlines()
    assert [json.loads(x)["version"] for x in lines] == [1, 2, 3, 3, 4]
    assert gl.check_chain([json.loads(x) for x in lines]) == []
    report = verify(out, Trust(keyring=Keyring.load(keys.keyring_file)), expected_kind="ledger")
    assert report.ok, report.lines()


@pytest.mark.parametrize("sql, problem", [
    ("UPDATE ledger SET version = 9 WHERE seq = 2", "entry 2: its hash does not match its contents (edited entry)"),
    ("UPDATE ledger SET decision = '{\"kind\":\"promote\"}' WHERE seq = 3", "entry 3: its hash does not match"),
    ("DELETE FROM ledger WHERE seq = 3", "entry 4: expected sequence number 3"),
    ("UPDATE ledger SET seq = CASE seq WHEN 2 THEN 3 WHEN 3 THEN 2 ELSE seq END WHERE seq IN (2, 3)",
     "previous hash does not match"),
    ("DELETE FROM ledger WHERE seq = 5", "the last entry is 4, the head file says 5"),
    ("ALTER TABLE ledger DROP COLUMN reason", "cannot be read as rtxops writes it"),
])
def test_ledger_detects_tampering(ledger_home, sql, problem):
    tamper(ledger_home, sql)
    code, output = ledger_verify(ledger_home)
    assert code == 1 and problem in " ".join(output.split()), output


def test_a_store_that_is_not_a_store_is_named_so_not_locked(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "rtxops.duckdb").write_bytes(b"not a database" * 100)
    code, output = ledger_verify(home)
    output = " ".join(output.split())
    assert code == 2 and "cannot open" in output and "no daemon answers" in output, output
    assert "locked" not in output


def _facts(good_plan, keys, job=None, policies=None):
    return verify(good_plan, Trust(keyring=Keyring.load(keys.keyring_file)),
                  policies=policies or load_policies(), job=job)


def test_default_policy(good_plan, keys, tmp_path):
    assert _facts(good_plan, keys).ok
    # a rollback needs no gain; a manual publish is allowed when the daemon signed it
    for decision in ({"kind": "rollback"}, {"kind": "manual"}):
        b = plan_bundle(tmp_path / decision["kind"], keys.signer(), 6, decision=decision)
        assert _facts(b, keys).ok, decision
    # gain below 3 %, or a confidence interval reaching zero: denied
    for bad in ({**PROMOTE, "gain": 0.02}, {**PROMOTE, "ci_low": 0.0}, {"kind": "whim"}):
        b = plan_bundle(tmp_path / "bad", keys.signer(), 6, decision=bad)
        report = _facts(b, keys)
        assert not report.ok and report.failure.name == "policy", bad
    # a job asking for determinism refuses a non-deterministic variant
    b = copy(good_plan, tmp_path / "nd")
    report = _facts(b, keys, job={"deterministic": True})
    assert report.ok  # algebraic gelu is deterministic
    facts = dict(report.facts)
    facts["variants"] = [{**facts["variants"][0], "deterministic": False}]
    from rtxops.governance.policy import evaluate_all

    denied = evaluate_all(load_policies(), facts, {"deterministic": True})
    assert not denied.allowed and any("determinism" in r for r in denied.reasons)
    assert evaluate_all(load_policies(), facts, {"deterministic": False}).allowed
    # a plan built by a builder other than the daemon whose key signed it
    from rtxops.governance import Signer

    user = Signer.from_key_file(keys.root / "daemon.pem", builder="rtxops-cli")
    b = plan_bundle(tmp_path / "cli", user, 6)
    report = _facts(b, keys)
    assert not report.ok and "builder-is-daemon" in report.failure.message


def test_policy_check_cli(good_plan, keys, tmp_path):
    r = CliRunner().invoke(app, ["policy", "check", str(good_plan), "--keyring", str(keys.keyring_file)])
    assert r.exit_code == 0 and "allowed by default" in r.output
    strict = tmp_path / "strict.yaml"
    strict.write_text("name: strict\nrules:\n  - name: big-gain\n    require: bundle.decision.gain >= 0.5\n"
                      "    reason: only huge gains\n")
    r = CliRunner().invoke(app, ["policy", "check", str(good_plan), "--keyring", str(keys.keyring_file),
                                 "--policy", str(strict)])
    assert r.exit_code == 1 and "strict/big-gain: only huge gains" in r.output
    strict.write_text("name: broken\nrules:\n  - name: x\n    require: 'bundle.('\n    reason: r\n")
    r = CliRunner().invoke(app, ["policy", "check", str(good_plan), "--keyring", str(keys.keyring_file),
                                 "--policy", str(strict)])
    assert r.exit_code == 2 and "not valid CEL" in r.output


def test_sbom_is_reproducible_and_lists_kernels(keys, tmp_path):
    a = plan_bundle(tmp_path / "a", keys.signer(), 3)
    b = plan_bundle(tmp_path / "b", keys.signer(), 3)
    assert (a / "sbom.cdx.json").read_bytes() == (b / "sbom.cdx.json").read_bytes()
    assert (a / "provenance.intoto.json").read_bytes() == (b / "provenance.intoto.json").read_bytes()
    sbom = json.loads((a / "sbom.cdx.json").read_text())
    assert sbom["specVersion"] == "1.6" and "serialNumber" not in sbom
    names = {c["name"] for c in sbom["components"]}
    assert {"gelu/algebraic", "torch"} <= names
    prov = json.loads((a / "provenance.intoto.json").read_text())
    assert prov["predicateType"] == "https://slsa.dev/provenance/v1"
    deps = prov["predicate"]["buildDefinition"]["resolvedDependencies"]
    assert {d.get("name") for d in deps} >= {"trial:t-1", "trial:t-2", "telemetry"}


def test_model_signing_verifies_our_key_mode_bundle(keys, tmp_path):
    model_signing = pytest.importorskip("model_signing")  # a test dependency (pyproject [test])
    ckpt = tmp_path / "ckpt"
    (ckpt / "shards").mkdir(parents=True)
    (ckpt / "shards" / "w0.bin").write_bytes(b"\x01" * 4096)
    (ckpt / "config.json").write_text("{}")
    r = CliRunner().invoke(app, ["sign", str(ckpt), "--kind", "checkpoint", "--key", str(keys.root / "daemon.pem")])
    assert r.exit_code == 0, r.output
    config = model_signing.verifying.Config().use_elliptic_key_verifier(public_key=keys.root / "daemon.pub")
    config.verify(ckpt, ckpt / "bundle.sigstore.json")
    (ckpt / "config.json").write_text('{"x": 1}')
    with pytest.raises(ValueError):
        config.verify(ckpt, ckpt / "bundle.sigstore.json")


def test_keyless_bundle_against_a_foreign_trusted_root(good_plan, keys, tmp_path):
    """A bundle with a certificate that does not chain to the pinned trusted root is refused
    offline (no network): here a self-made certificate against sigstore's pinned production root."""
    import base64
    import datetime

    import sigstore
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "not-fulcio")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(minutes=10))
            .sign(key, hashes.SHA256()))
    b = copy(good_plan, tmp_path / "keyless")
    data = json.loads((b / "bundle.sigstore.json").read_text())
    data["verificationMaterial"] = {"certificate": {"rawBytes": base64.b64encode(
        cert.public_bytes(serialization.Encoding.DER)).decode()}, "tlogEntries": []}
    (b / "bundle.sigstore.json").write_text(json.dumps(data))
    from pathlib import Path

    store = Path(sigstore.__path__[0]) / "_store"  # the trusted roots sigstore-python pins
    root = next(p for p in store.rglob("trusted_root.json") if "sigstage" not in str(p))
    r = CliRunner().invoke(app, ["verify", str(b), "--identity", "me@example.com", "--issuer",
                                 "https://accounts.example.com", "--trusted-root", str(root), "--no-ledger"])
    assert r.exit_code == 1, r.output
    fail = [line for line in r.output.splitlines() if line.startswith("FAIL")]
    assert len(fail) == 1 and ("signature" in fail[0] or "bundle" in fail[0]), r.output
    # against keyring-only trust a keyless bundle fails verification (exit 1), no usage error
    r = CliRunner().invoke(app, ["verify", str(b), "--keyring", str(keys.keyring_file), "--no-ledger"])
    assert r.exit_code == 1 and "keyless bundle but no identity/issuer trusted" in r.output, r.output


def test_a_ledger_rewritten_to_match_its_head_fails_on_the_heads_signature(ledger_home):
    """Whoever can write the store and the head file, but does not hold the daemon's key, can
    make a consistent shorter chain: the head's signature is what catches it."""
    from rtxops.telemetry.store import ReadOnlyStore

    code, output = ledger_verify(ledger_home)
    assert code == 0 and "head signed by" in output, output
    tamper(ledger_home, "DELETE FROM ledger WHERE seq >= 4")
    store = ReadOnlyStore(ledger_home / "rtxops.duckdb")
    try:
        (third,) = store.query("SELECT entry_hash FROM ledger WHERE seq = 3")
    finally:
        store.close()
    head_file = ledger_home / "ledger.head"
    head = {**json.loads(head_file.read_text()), "seq": 3, "entry_hash": third["entry_hash"]}
    head_file.write_text(json.dumps(head))
    code, output = ledger_verify(ledger_home)
    assert code == 1 and "signature does not match its sequence number and hash" in " ".join(output.split()), output
    for field in ("signature", "key_id", "signed_at"):
        del head[field]
    head_file.write_text(json.dumps(head))
    code, output = ledger_verify(ledger_home)
    assert code == 1 and "the head file is not signed" in " ".join(output.split()), output


def test_a_head_written_before_heads_were_signed_is_signed_on_request_once_the_chain_checks(tmp_path):
    """An existing home, upgraded: its unsigned head fails `ledger verify`, and a daemon starting
    on it does not sign it (whoever wrote an unsigned head over a rewritten chain would get it
    blessed); `rtxops ledger sign-head` does, after checking the chain, and not over a broken one."""
    from rtxops.governance.authority import Authority

    for broken in (False, True):
        home = tmp_path / f"home-{broken}"
        home.mkdir()
        store = Store(home / "rtxops.duckdb")
        for v in (1, 2):  # as an rtxops before signed heads wrote them
            gl.append(store, home / "ledger.head", kind="manual", scope="job-1", version=v,
                      subject_digest=f"sha256:{v:064x}", decision={"kind": "manual"}, signer="k")
        if broken:
            store.run_write(lambda cur: cur.execute("UPDATE ledger SET version = 9 WHERE seq = 1")).result(30)
        Authority(home, store).close()  # a daemon's start: makes its key, signs nothing
        store.close()
        code, output = ledger_verify(home)
        assert code == 1, output
        r = CliRunner().invoke(app, ["ledger", "sign-head", "--home", str(home)])
        output = " ".join(r.output.split())
        if broken:
            assert r.exit_code == 1 and "edited entry" in output, output
            assert "signature" not in (home / "ledger.head").read_text()
        else:
            assert r.exit_code == 0 and "signed the head of the ledger (2 entries)" in output, output
            code, output = ledger_verify(home)
            assert code == 0 and "head signed by" in output, output


def test_the_daemon_does_not_chain_onto_a_ledger_rewritten_under_its_signed_head(ledger_home,
                                                                                 monkeypatch):
    """An entry the signed head names was rewritten (hashes recomputed or not): the next append
    refuses instead of signing the rewritten chain; an entry past the head (a daemon killed
    between its commit and the head's write) is fine."""
    from rtxops.governance import VerificationError

    key = home_ledger_key(ledger_home)
    head_file = ledger_home / "ledger.head"
    store = Store(ledger_home / "rtxops.duckdb")
    try:
        real_write_head = gl.write_head

        def killed_before_the_head(path, *args, **kwargs):
            if path == head_file:
                raise KeyboardInterrupt("killed")
            return real_write_head(path, *args, **kwargs)

        monkeypatch.setattr(gl, "write_head", killed_before_the_head)
        with pytest.raises(KeyboardInterrupt):   # committed, its head never written
            gl.append(store, head_file, head_key=key, kind="manual", scope="job-1", version=5,
                      subject_digest="sha256:" + "5" * 64, decision={}, signer="k")
        monkeypatch.setattr(gl, "write_head", real_write_head)
        gl.append(store, ledger_home / "ledger.head", head_key=key, kind="manual", scope="job-1",
                  version=6, subject_digest="sha256:" + "6" * 64, decision={}, signer="k")
        store.run_write(lambda cur: cur.execute(
            "UPDATE ledger SET entry_hash = 'sha256:rewritten' WHERE seq = 7")).result(30)
        with pytest.raises(VerificationError, match="entry 7 is not the one its signed head names"):
            gl.append(store, ledger_home / "ledger.head", head_key=key, kind="manual",
                      scope="job-1", version=7, subject_digest="sha256:" + "7" * 64, decision={},
                      signer="k")
        assert store.query("SELECT max(seq) AS n FROM ledger") == [{"n": 7}]
    finally:
        store.close()


def test_a_signed_export_signs_only_the_ledger(ledger_home, tmp_path, keys):
    """A stray file in the folder was signed as part of the "ledger" bundle (and verified)."""
    out = tmp_path / "export"
    out.mkdir()
    (out / "notes.txt").write_text("not the ledger\n")
    args = ["ledger", "export", str(out), "--home", str(ledger_home), "--sign",
            "--key", str(keys.root / "daemon.pem")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and "holds notes.txt" in r.output, r.output
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]   # nothing written
    (out / "notes.txt").unlink()
    for _ in range(2):   # into the empty folder, then over that export
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        assert verify(out, Trust(keyring=Keyring.load(keys.keyring_file)), expected_kind="ledger").ok


def test_a_ledger_that_does_not_check_intact_is_not_signed_on_export(ledger_home, tmp_path, keys):
    """`ledger export --sign` signed an edited ledger with the daemon's key: the bundle verified."""
    tamper(ledger_home, "UPDATE ledger SET version = 9 WHERE seq = 2")
    out = tmp_path / "export"
    args = ["ledger", "export", str(out), "--home", str(ledger_home)]
    r = CliRunner().invoke(app, [*args, "--sign", "--key", str(keys.root / "daemon.pem")])
    assert r.exit_code == 1 and "entry 2" in r.output and "nothing signed" in " ".join(r.output.split())
    assert not out.exists()
    r = CliRunner().invoke(app, args)   # unsigned, to look at
    assert r.exit_code == 0, r.output
    head = json.loads((out / "ledger.head.json").read_text())   # the head, to tell a cut tail
    assert head["seq"] == 5 and head["signature"]


def test_a_plan_signed_with_the_cli_verifies_and_a_plan_rtxops_cannot_run_is_not_signed(keys, tmp_path):
    """`rtxops sign --kind plan` wrote an SBOM without the plan's kernels: every such bundle
    failed `verify`; a plan.json whose version was a string was signed too."""
    d = tmp_path / "plan"
    d.mkdir()
    (d / "plan.json").write_text(json.dumps({"version": 3, "defaults": {"gelu": "algebraic"}}))
    sign = ["sign", str(d), "--kind", "plan", "--key", str(keys.root / "daemon.pem")]
    r = CliRunner().invoke(app, sign)
    assert r.exit_code == 0, r.output
    assert verify(d, Trust(keyring=Keyring.load(keys.keyring_file)), expected_kind="plan").ok
    (d / "plan.json").write_text(json.dumps({"version": "3"}))
    r = CliRunner().invoke(app, sign)
    assert r.exit_code == 2 and "plan.version must be int" in r.output, r.output


def test_a_signing_whose_write_fails_leaves_the_signed_folder_as_it_was(keys, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "weights.bin").write_bytes(b"w" * 100)
    sign = ["sign", str(ckpt), "--key", str(keys.root / "daemon.pem")]
    assert CliRunner().invoke(app, [*sign, "--version", "1"]).exit_code == 0
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    (ckpt / ".bundle.sigstore.json.tmp").mkdir()   # the last file's write fails (a full disk)
    r = CliRunner().invoke(app, [*sign, "--version", "2"])
    assert r.exit_code == 2 and "cannot write the bundle's files" in r.output, r.output
    (ckpt / ".bundle.sigstore.json.tmp").rmdir()
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    assert verify(ckpt, Trust(keyring=Keyring.load(keys.keyring_file))).ok
