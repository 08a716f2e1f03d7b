"""`rtxops plan export` copies a signed plan out of $RTXOPS_HOME; `rtxops plan import` on another
home verifies it against that home's keyring first."""
from __future__ import annotations

import shutil

from typer.testing import CliRunner

from rtxops.cli import app
from rtxops.governance import Keyring

from .helpers import plan_bundle


def cli(*args):
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.output


def test_export_then_import_verifies_first(keys, tmp_path):
    source = tmp_path / "machine-a"
    plan_bundle(source / "bundles" / "job-1" / "v5", keys.signer(), 5)
    plan_bundle(source / "bundles" / "job-1" / "v12", keys.signer(), 12)
    code, output = cli("plan", "export", str(tmp_path / "shipped"), "--job", "job-1", "--home", str(source))
    assert code == 0 and "plan version 12" in output, output

    target = tmp_path / "machine-b"
    code, output = cli("plan", "import", str(tmp_path / "shipped"), "--home", str(target))
    assert code == 1 and "not in the keyring" in output, output   # machine b trusts nobody yet
    ring = Keyring(target / "keyring.json")
    ring.trust(keys.pub("daemon"), kinds=["plan"])
    ring.save()
    code, output = cli("plan", "import", str(tmp_path / "shipped"), "--home", str(target))
    assert code == 0 and (target / "imported" / "job-1-v12" / "plan.json").is_file(), output

    tampered = shutil.copytree(tmp_path / "shipped", tmp_path / "tampered")
    (tampered / "plan.json").write_text((tampered / "plan.json").read_text().replace("algebraic", "tanh"))
    code, output = cli("plan", "import", str(tampered), "--home", str(target))
    assert code == 1 and "plan.json: sha256" in output, output
    code, output = cli("plan", "export", str(tmp_path / "none"), "--job", "nobody", "--home", str(source))
    assert code == 2 and "no signed plan bundle" in output
