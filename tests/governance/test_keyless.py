"""Keyless signing and verification end to end, offline: `rtxops sign --keyless` against a local
fake Sigstore instance (Fulcio, CT log, Rekor v1, OIDC issuer; see fake_sigstore.py), then
`rtxops verify --identity --issuer --trusted-root` with sigstore-python's verifier, unmodified."""
from __future__ import annotations

import base64
import json

import pytest
from typer.testing import CliRunner

from rtxops.cli import app
from rtxops.governance import KeylessSigner, Trust, _dsse, _layout, verify

from .fake_sigstore import CA, FakeSigstore
from .helpers import copy

EMAIL = "release@example.com"
AMBIENT = ("SIGSTORE_ID_TOKEN", "GITHUB_ACTIONS", "GITLAB_CI", "BUILDKITE", "CIRCLECI",
           "GOOGLE_SERVICE_ACCOUNT_NAME")


@pytest.fixture(scope="module")
def fake():
    instance = FakeSigstore().start()
    yield instance
    instance.stop()


@pytest.fixture(scope="module")
def trust_files(fake, tmp_path_factory):
    """(trust_config.json, trusted_root.json) of the fake instance."""
    return fake.write(tmp_path_factory.mktemp("sigstore"))


@pytest.fixture(autouse=True)
def no_ambient_identity(monkeypatch):
    for name in AMBIENT:
        monkeypatch.delenv(name, raising=False)


def content(directory):
    directory.mkdir(parents=True)
    (directory / "weights.bin").write_bytes(bytes(range(256)) * 64)
    (directory / "config").mkdir()
    (directory / "config" / "model.json").write_text('{"layers": 4}')
    return directory


def sign(directory, *args):
    r = CliRunner().invoke(app, ["sign", str(directory), "--kind", "checkpoint", "--keyless", *args])
    return r.exit_code, " ".join(r.output.split())  # error messages wrap at the terminal width


def run_verify(directory, root, identity=EMAIL, issuer=None, fake=None):
    r = CliRunner().invoke(app, ["verify", str(directory), "--identity", identity, "--issuer",
                                 issuer or fake.issuer, "--trusted-root", str(root), "--no-ledger"])
    fails = [line for line in r.output.splitlines() if line.startswith("FAIL")]
    return r.exit_code, r.output, fails


@pytest.fixture(scope="module")
def signed(fake, trust_files, tmp_path_factory):
    """A checkpoint folder signed keyless through the CLI (copy it before changing it)."""
    directory = content(tmp_path_factory.mktemp("keyless") / "ckpt")
    code, output = sign(directory, "--identity-token", fake.token(EMAIL), "--trust-config",
                        str(trust_files[0]))
    assert code == 0, output
    assert f"as {EMAIL} ({fake.issuer})" in output
    return directory


def test_keyless_bundle_verifies_with_the_right_identity_and_issuer(signed, fake, trust_files):
    code, output, fails = run_verify(signed, trust_files[1], fake=fake)
    assert code == 0 and not fails, output
    assert f"keyless: {EMAIL} from {fake.issuer}" in output
    for check in ("signature", "statement", "files", "sbom", "provenance", "policy"):
        assert any(line.startswith(f"ok   {check}") for line in output.splitlines()), (check, output)


def test_the_bundle_is_sigstore_keyless_and_signs_the_statement_rtxops_derives(signed):
    raw = json.loads((signed / _layout.SIGNATURE).read_text())
    material = raw["verificationMaterial"]
    assert "certificate" in material and "publicKey" not in material
    (entry,) = material["tlogEntries"]
    assert entry["kindVersion"] == {"kind": "dsse", "version": "0.0.1"}
    envelope = raw["dsseEnvelope"]
    assert envelope["payloadType"] == "application/vnd.in-toto+json"
    # the signed statement is byte for byte the one key mode builds over the files on disk
    names = _layout.list_files(signed)
    digests = {n: _layout.sha256_file(signed / n) for n in names}
    assert base64.b64decode(envelope["payload"]) == _dsse.statement(digests)
    prov = json.loads((signed / _layout.PROVENANCE).read_text())
    assert prov["predicate"]["runDetails"]["builder"]["id"] == f"rtxops-cli://{EMAIL}"


def test_wrong_identity_fails(signed, fake, trust_files):
    code, output, fails = run_verify(signed, trust_files[1], identity="mallory@example.com", fake=fake)
    assert code == 1, output
    assert len(fails) == 1 and fails[0].split()[1] == "signature" and "SANs do not match" in fails[0]


def test_wrong_issuer_fails(signed, fake, trust_files):
    code, output, fails = run_verify(signed, trust_files[1], issuer="https://accounts.example.com",
                                     fake=fake)
    assert code == 1, output
    assert len(fails) == 1 and "OIDCIssuer does not match" in fails[0], output


def test_a_tampered_file_fails(signed, fake, trust_files, tmp_path):
    b = copy(signed, tmp_path / "b")
    data = bytearray((b / "weights.bin").read_bytes())
    data[100] ^= 1
    (b / "weights.bin").write_bytes(bytes(data))
    code, output, fails = run_verify(b, trust_files[1], fake=fake)
    assert code == 1, output
    assert len(fails) == 1 and fails[0].split()[1] == "files" and "weights.bin" in fails[0], output


def test_a_certificate_from_another_ca_fails(signed, fake, tmp_path):
    """The same instance's logs, but the pinned root trusts a different CA."""
    root = tmp_path / "other_root.json"
    root.write_text(json.dumps(fake.trusted_root(ca=CA.generate("other-ca"))))
    code, output, fails = run_verify(signed, root, fake=fake)
    assert code == 1, output
    assert len(fails) == 1 and "certificate chain" in fails[0], output


def test_an_edited_log_entry_fails(signed, fake, trust_files, tmp_path):
    """The integrated time is covered by Rekor's signed entry timestamp, checked offline."""
    b = copy(signed, tmp_path / "b")
    raw = json.loads((b / _layout.SIGNATURE).read_text())
    entry = raw["verificationMaterial"]["tlogEntries"][0]
    entry["integratedTime"] = str(int(entry["integratedTime"]) + 1)
    (b / _layout.SIGNATURE).write_text(json.dumps(raw))
    code, output, fails = run_verify(b, trust_files[1], fake=fake)
    assert code == 1, output
    assert len(fails) == 1 and "invalid log entry" in fails[0], output


def test_keyless_without_a_token_exits_2_and_leaves_the_folder_alone(fake, trust_files, tmp_path):
    directory = content(tmp_path / "ckpt")
    before = sorted(p.name for p in directory.iterdir())
    asked = len(fake.requests)
    code, output = sign(directory, "--trust-config", str(trust_files[0]))
    assert code == 2, output
    assert "keyless signing needs an OIDC identity token" in output and "--identity-token" in output
    assert sorted(p.name for p in directory.iterdir()) == before
    assert len(fake.requests) == asked


def test_the_token_can_come_from_the_environment(fake, trust_files, tmp_path, monkeypatch):
    directory = content(tmp_path / "ckpt")
    monkeypatch.setenv("SIGSTORE_ID_TOKEN", fake.token("ci@example.com"))
    code, output = sign(directory, "--trust-config", str(trust_files[0]))
    assert code == 0, output
    code, output, _ = run_verify(directory, trust_files[1], identity="ci@example.com", fake=fake)
    assert code == 0, output


def test_fulcio_refuses_a_token_it_cannot_verify(fake, trust_files, tmp_path):
    """The fake Fulcio checks the token's signature, as the real one does: a token signed by
    another key gets no certificate, and nothing is signed."""
    from cryptography.hazmat.primitives.asymmetric import ec

    directory = content(tmp_path / "ckpt")
    forged = fake.token(EMAIL, key=ec.generate_private_key(ec.SECP256R1()))
    code, output = sign(directory, "--identity-token", forged, "--trust-config", str(trust_files[0]))
    assert code == 2, output
    assert "getting a certificate" in output and not (directory / _layout.SIGNATURE).exists()


def test_an_expired_token_is_refused_before_any_request(fake, trust_files, tmp_path):
    directory = content(tmp_path / "ckpt")
    asked = len(fake.requests)
    code, output = sign(directory, "--identity-token", fake.token(EMAIL, lifetime=-60),
                        "--trust-config", str(trust_files[0]))
    assert code == 2 and "identity token is not usable" in output, output
    assert len(fake.requests) == asked


def test_identity_token_needs_keyless(fake, tmp_path):
    directory = content(tmp_path / "ckpt")
    r = CliRunner().invoke(app, ["sign", str(directory), "--identity-token", fake.token(EMAIL)])
    assert r.exit_code == 2 and "are for --keyless signing" in " ".join(r.output.split()), r.output


def test_python_api_signs_a_plan_bundle_that_the_default_policy_refuses(fake, trust_files, tmp_path):
    """Plans must come from the daemon's key (policy builder-is-daemon): a keyless plan bundle
    verifies cryptographically but the default policy denies it."""
    from rtxops.governance import load_policies, write_plan_bundle

    directory = tmp_path / "plan"
    write_plan_bundle(directory, json.dumps({"version": 3, "defaults": {}}), {})
    signer = KeylessSigner.create(fake.token(EMAIL), trust_files[0])
    signer.sign_directory(directory, kind="plan", version=3, decision={"kind": "manual"})
    trust = Trust(identity=EMAIL, issuer=fake.issuer, trusted_root=trust_files[1])
    report = verify(directory, trust)
    assert report.ok, report.lines()
    assert report.facts["signer"]["mode"] == "keyless" and report.facts["signer"]["identity"] == EMAIL
    report = verify(directory, trust, policies=load_policies())
    assert not report.ok and report.failure.name == "policy" and "builder-is-daemon" in report.failure.message
    # claiming the daemon's builder id does not make a keyless signer the daemon
    (directory / "bundle.sigstore.json").unlink()
    claiming = KeylessSigner.create(fake.token(EMAIL), trust_files[0])
    claiming.__class__ = type("Claiming", (KeylessSigner,), {"builder_id": property(lambda self: "rtxops-daemon://")})
    claiming.sign_directory(directory, kind="plan", version=3, decision={"kind": "manual"})
    report = verify(directory, trust, policies=load_policies())
    assert report.facts["builder"]["id"] == "rtxops-daemon://"
    assert not report.ok and "builder-is-daemon" in report.failure.message
