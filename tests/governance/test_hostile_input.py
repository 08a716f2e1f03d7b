"""Hostile bundles and ledgers: a signed scope that climbs out of its folder, a key-signed bundle
offered where a Sigstore identity is required, deeply nested JSON, a removed or broken ledger
head. Each is refused with a clear failure (exit 1), never a traceback, and nothing is written."""
from __future__ import annotations

import duckdb
import pytest
from typer.testing import CliRunner

from rtxops.cli import app
from rtxops.governance import Signer, UsageError, ledger
from rtxops.governance.authority import Authority
from rtxops.telemetry.store import Store

from .helpers import copy, plan_bundle


def cli(*args):
    r = CliRunner().invoke(app, list(args))
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r.exit_code, r.output


def test_a_signed_scope_that_climbs_out_of_imported_is_refused(keys, tmp_path):
    home = tmp_path / "home"
    (home / "imported").mkdir(parents=True)
    victim = tmp_path / "victim-v5"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep\n")
    evil = plan_bundle(tmp_path / "evil", keys.signer(), 5, scope="../../victim")
    code, output = cli("plan", "import", str(evil), "--keyring", str(keys.keyring_file),
                       "--home", str(home))
    assert code == 1 and "not a plain name" in output, output
    assert sorted(p.name for p in victim.iterdir()) == ["precious.txt"]
    assert list((home / "imported").iterdir()) == []


def test_the_authority_never_lays_out_a_bundle_outside_its_folder(tmp_path):
    authority = Authority.__new__(Authority)  # bundle_dir needs only the bundles folder
    authority.bundles = tmp_path / "bundles"
    assert authority.bundle_dir("j-1a2b", 3) == tmp_path / "bundles" / "j-1a2b" / "v3"
    for scope in ("..", "../x", "a/b", ""):
        with pytest.raises(UsageError, match="not a plain name"):
            authority.bundle_dir(scope, 3)


def test_a_key_signed_bundle_does_not_meet_a_required_identity(keys, good_plan, tmp_path):
    root = tmp_path / "trusted_root.json"
    root.write_text("{}")
    code, output = cli("verify", str(good_plan), "--keyring", str(keys.keyring_file), "--no-ledger",
                       "--identity", "release@example.com", "--issuer", "https://accounts.example.com",
                       "--trusted-root", str(root))
    assert code == 1 and "keyless signature by release@example.com is required" in output, output
    # the same bundle with the keyring alone verifies
    code, output = cli("verify", str(good_plan), "--keyring", str(keys.keyring_file), "--no-ledger")
    assert code == 0, output


def test_a_mistyped_keyring_path_is_a_usage_error_not_an_untrusted_signer(keys, good_plan, tmp_path):
    """It was read as an empty keyring: "signer not in the keyring", exit 1."""
    code, output = cli("verify", str(good_plan), "--keyring", str(tmp_path / "nokeyring.json"),
                       "--no-ledger")
    assert code == 2 and "no such file" in " ".join(output.split()), output


@pytest.mark.parametrize("name", ["bundle.sigstore.json", "provenance.intoto.json", "sbom.cdx.json",
                                  "plan.json"])
def test_deeply_nested_json_fails_verification_cleanly(keys, good_plan, tmp_path, name):
    bundle = copy(good_plan, tmp_path / "deep")
    (bundle / name).write_text("[" * 100_000)
    code, output = cli("verify", str(bundle), "--keyring", str(keys.keyring_file), "--no-ledger")
    assert code == 1 and "FAIL" in output and "NOT verified" in output, output


def test_a_signed_provenance_whose_decision_is_not_an_object_fails(keys, tmp_path):
    bundle = tmp_path / "odd"
    bundle.mkdir()
    (bundle / "data.bin").write_bytes(b"x")
    Signer.from_key_file(keys.root / "daemon.pem").sign_directory(bundle, kind="checkpoint",
                                                                  decision="oops")
    code, output = cli("verify", str(bundle), "--keyring", str(keys.keyring_file), "--no-ledger")
    assert code == 1 and "decision in the provenance is not an object" in output, output


def test_a_removed_or_broken_ledger_head_never_turns_the_tail_check_off(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    head = home / "ledger.head"
    store = Store(home / "rtxops.duckdb")
    authority = Authority(home, store)  # the daemon's key, trusted in the home's keyring
    try:
        for v in (1, 2, 3):
            ledger.append(store, head, head_key=authority.signer.key, kind="promote",
                          scope="job-1", version=v, subject_digest="sha256:" + "0" * 64,
                          decision={}, signer="k")
    finally:
        authority.close()
        store.close()
    assert cli("ledger", "verify", "--home", str(home))[0] == 0
    con = duckdb.connect(str(home / "rtxops.duckdb"))
    con.execute("DELETE FROM ledger WHERE seq >= 2")
    con.close()
    code, output = cli("ledger", "verify", "--home", str(home))
    assert code == 1 and "the head file says 3" in output, output
    head.unlink()
    code, output = cli("ledger", "verify", "--home", str(home))
    assert code == 1 and "head file is missing" in output, output
    for broken in ("[]", '{"seq": "3", "entry_hash": "x"}', "{", "[" * 100_000):
        head.write_text(broken)
        code, output = cli("ledger", "verify", "--home", str(home))
        assert code == 1 and "head file is unreadable" in output, (broken[:20], output)
    assert ledger.check_chain([], ledger.read_head(tmp_path / "no-head")) == []  # a new ledger


def test_a_signing_that_fails_leaves_the_folder_signed_as_it_was(keys, tmp_path):
    """Re-signing deleted the signature first: a keyless signer that could not reach Rekor left
    a folder that had verified with a new SBOM and provenance and no signature."""
    from rtxops.governance import Keyring, Trust, verify
    from rtxops.governance._bundle import DirectorySigner

    class Offline(Signer):
        def _sign_statement(self, statement: bytes) -> dict:
            raise ConnectionError("rekor.sigstore.dev unreachable")

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"\x01" * 1000)
    signer = keys.signer()
    signer.sign_directory(folder, kind="checkpoint")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    trust = Trust(keyring=Keyring.load(keys.keyring_file))
    assert verify(folder, trust).ok
    assert issubclass(Offline, DirectorySigner)
    with pytest.raises(ConnectionError):
        Offline(signer.key).sign_directory(folder, kind="checkpoint", version=2)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert verify(folder, trust).ok



def test_plan_import_refuses_special_files_before_copying_anything(keys, tmp_path):
    """`plan import` copied the folder first: a device file in it (/dev/zero) was read until the
    disk filled; a FIFO failed the copy with a traceback-like error."""
    import os
    import stat

    home = tmp_path / "home"
    for name, make in (("fifo", lambda p: os.mkfifo(p)),
                       ("zero", lambda p: os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 5)))):
        if name == "zero" and os.geteuid() != 0:
            continue   # (making a device file takes root; CI runs as root)
        bundle = copy(plan_bundle(tmp_path / f"p-{name}", keys.signer(), 5), tmp_path / name)
        make(bundle / "kernels" / name)
        code, output = cli("plan", "import", str(bundle), "--keyring", str(keys.keyring_file),
                           "--home", str(home))
        assert code == 1 and f"kernels/{name} is not a regular file" in output, output
        assert not (home / "imported").exists() or list((home / "imported").iterdir()) == []


def test_keys_init_with_an_unreadable_keyring_leaves_no_key_pair_and_a_bogus_kind_is_usage(keys, tmp_path, good_plan):
    home = tmp_path / "home"
    home.mkdir()
    (home / "keyring.json").write_text("{not json")
    code, output = cli("keys", "init", "--name", "user", "--home", str(home))
    assert code == 2 and "keyring" in output, output
    assert not (home / "keys").exists() or list((home / "keys").iterdir()) == []   # a rerun can go on
    code, output = cli("verify", str(good_plan), "--keyring", str(keys.keyring_file), "--no-ledger",
                       "--kind", "bogus")
    assert code == 2 and "--kind 'bogus'" in output, output


def test_folders_nested_too_deep_are_a_clear_error_for_every_command(keys, tmp_path):
    """1500 nested folders: `plan import` and `sign` died with a RecursionError traceback
    (os.walk recurses). Past MAX_DEPTH the walk now stops; 100 show it (a tree as deep as
    Python's recursion limit would break pytest's own clean-up of its temporary folders)."""
    deep = tmp_path / "deep"
    d = deep
    for _ in range(100):
        d = d / "d"
    d.mkdir(parents=True)
    (d / "f.txt").write_text("x")
    home = tmp_path / "home"
    home.mkdir()
    for args in (["plan", "import", str(deep), "--home", str(home)],
                 ["sign", str(deep), "--key", str(keys.root / "daemon.pem")],
                 ["verify", str(deep), "--keyring", str(keys.keyring_file)]):
        code, output = cli(*args)
        assert code in (1, 2) and "nested deeper than" in " ".join(output.split()), (args, output)


def test_a_huge_unsigned_field_gives_a_short_failure_message(keys, good_plan, tmp_path):
    """The envelope's mediaType was quoted whole: a 3 MB field made a 3 MB message on the
    terminal, in --json output and in a job's refusal report."""
    import json

    bundle = copy(good_plan, tmp_path / "long")
    path = bundle / "bundle.sigstore.json"
    doc = json.loads(path.read_text())
    doc["mediaType"] = "A" * 3_000_000
    path.write_text(json.dumps(doc))
    code, output = cli("verify", str(bundle), "--keyring", str(keys.keyring_file), "--no-ledger")
    assert code == 1 and "NOT verified" in output and len(output) < 5_000, len(output)


def test_a_signed_file_that_is_a_link_is_refused_without_reading_it(keys, good_plan, tmp_path):
    """The size was checked with stat(), then the file read whole through any link: one swapped
    for a link to /dev/zero after the check was read without a limit."""
    from rtxops.governance._errors import VerificationError
    from rtxops.governance._layout import read_limited

    link = tmp_path / "zero"
    link.symlink_to("/dev/zero")
    with pytest.raises(VerificationError, match="cannot read zero"):
        read_limited(link, 1 << 20, "provenance")
    big = tmp_path / "big"
    big.write_bytes(b"x" * 2048)
    with pytest.raises(VerificationError, match="over the 1024 byte limit"):
        read_limited(big, 1024, "provenance")


@pytest.mark.parametrize("limit", ["MAX_SIGNATURE_BYTES", "MAX_METADATA_BYTES"])
def test_a_folder_whose_bundle_no_verifier_would_read_is_refused_before_anything_is_written(
        keys, tmp_path, monkeypatch, limit):
    """`rtxops sign` wrote a signature of any size, which verification refuses past its limit:
    a folder of ~23 000 files was signed and could never verify. The limits here are made small
    instead of the folder large."""
    from rtxops.governance import _bundle

    folder = tmp_path / "shards"
    folder.mkdir()
    for i in range(40):
        (folder / f"s-{i:04d}.bin").write_bytes(b"x")
    monkeypatch.setattr(_bundle, limit, 4096)
    with pytest.raises(UsageError, match=r"cannot sign .*: its 40 files make .* over the 0 MiB a "
                                         r"verifier reads; bundle fewer files"):
        keys.signer().sign_directory(folder, kind="checkpoint")
    assert sorted(p.name for p in folder.iterdir()) == [f"s-{i:04d}.bin" for i in range(40)]


def test_signing_a_plan_folder_writes_no_kernel_source_through_a_symlink(keys, good_plan, tmp_path):
    """`rtxops sign --kind plan` wrote the kernel sources through a symlinked ``kernels/`` (outside
    the folder) and only then refused the symlink. A bad key wrote them too before failing."""
    folder, outside = tmp_path / "plan", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    (folder / "plan.json").write_bytes((good_plan / "plan.json").read_bytes())
    (folder / "kernels").symlink_to(outside)
    r = CliRunner().invoke(app, ["sign", str(folder), "--kind", "plan", "--key", str(keys.root / "daemon.pem")])
    assert r.exit_code == 2 and "kernels is a symlink" in " ".join(r.output.split())
    assert list(outside.iterdir()) == []
    (folder / "kernels").unlink()
    r = CliRunner().invoke(app, ["sign", str(folder), "--kind", "plan", "--key", str(tmp_path / "no.pem")])
    assert r.exit_code == 2
    assert sorted(p.name for p in folder.iterdir()) == ["plan.json"]


def test_verify_names_the_keyring_it_trusted_and_where_it_came_from(good_plan, keys, tmp_path,
                                                                    monkeypatch):
    """Without --keyring or a home, the keyring is ./.rtxops's: a downloaded folder can bring
    one along, so the output says which keyring vouched and that it came from this folder."""
    (tmp_path / ".rtxops").mkdir()
    (tmp_path / ".rtxops" / "keyring.json").write_bytes(keys.keyring_file.read_bytes())
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RTXOPS_HOME", raising=False)
    code, output = cli("verify", str(good_plan), "--no-ledger")
    flat = " ".join(output.split())
    assert code == 0 and f"keyring {tmp_path / '.rtxops' / 'keyring.json'}" in flat, output
    assert "(the home in this folder; --keyring or --home names another)" in flat


def test_verify_says_when_no_keyring_is_there_and_refuses_a_missing_trusted_root(good_plan, tmp_path,
                                                                                 monkeypatch):
    """A home without a keyring file was named as the trust anchor like any other ("ok"), and a
    mistyped --trusted-root failed the verification (exit 1) instead of the command (exit 2)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RTXOPS_HOME", raising=False)
    code, output = cli("verify", str(good_plan), "--no-ledger")
    flat = " ".join(output.split())
    assert code == 1 and "keyring.json: no such file, no key trusted" in flat, output
    code, output = cli("verify", str(good_plan), "--identity", "me@example.com", "--issuer",
                       "https://issuer.example", "--trusted-root", str(tmp_path / "root.json"))
    assert code == 2 and "--trusted-root" in output and "no such file" in output, output


def test_signing_in_a_home_without_keys_says_how_to_make_one(tmp_path):
    folder = tmp_path / "kernel"
    folder.mkdir()
    (folder / "k.py").write_text("pass\n")
    code, output = cli("sign", str(folder), "--kind", "kernel", "--home", str(tmp_path / "home"))
    said = "".join(output.split())   # (the console wraps the paths anywhere)
    init = f"`rtxopskeysinit--home{tmp_path / 'home'}--kindscheckpoint,telemetry,ledger,kernel`makesone"
    assert code == 2 and init in said, output
    assert sorted(p.name for p in folder.iterdir()) == ["k.py"]
