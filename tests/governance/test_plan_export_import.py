"""`rtxops plan export` copies a signed plan out of $RTXOPS_HOME; `rtxops plan import` on another
home verifies it against that home's keyring first."""
from __future__ import annotations

import json
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
    exploring = source / "bundles" / "job-1" / "v13"  # an explore round: not a plan to ship
    exploring.mkdir()
    (exploring / "plan.json").write_text(json.dumps({"version": 13, "entries": [
        {"op": "gelu", "bucket": "float32/cpu/n=8", "variant": "eager", "config": {},
         "explore": [{"variant": "tanh", "config": {}, "weight": 0.1}]}]}))
    ring = Keyring(source / "keyring.json")  # the daemon's key, as its first start trusts it
    ring.trust(keys.pub("daemon"))
    ring.save()
    v12 = source / "bundles" / "job-1" / "v12" / "plan.json"
    v12.write_bytes(v12.read_bytes() + b" ")  # altered on disk: not shipped
    code, output = cli("plan", "export", str(tmp_path / "shipped"), "--job", "job-1", "--home", str(source))
    assert code == 1 and "does not verify" in output and not (tmp_path / "shipped").exists(), output
    v12.write_bytes(v12.read_bytes()[:-1])
    (source / "keyring.json").write_text("{ broken")  # the check cannot run: nothing left behind
    code, output = cli("plan", "export", str(tmp_path / "shipped"), "--job", "job-1", "--home", str(source))
    assert code == 2 and "unreadable" in output and not (tmp_path / "shipped").exists(), output
    ring.save()
    code, output = cli("plan", "export", str(tmp_path / "shipped"), "--job", "job-1", "--home", str(source))
    assert code == 0 and "plan version 12" in output, output
    code, output = cli("plan", "export", str(tmp_path / "none"), "--home", str(source))
    assert code == 2 and "give --job (one of job-1)" in " ".join(output.split()), output

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


def test_import_keeps_exactly_the_bytes_it_verified(keys, tmp_path, monkeypatch):
    """The folder changes right after it was verified (a plan.json rewritten, a symlink to a file
    outside it added): what lands under imported/ is the verified copy."""
    import os

    import rtxops.governance as governance

    bundle = plan_bundle(tmp_path / "v5", keys.signer(), 5)
    signed_plan = (bundle / "plan.json").read_bytes()
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the bundle\n")
    verify = governance.verify

    def verify_then_change(*args, **kwargs):
        report = verify(*args, **kwargs)
        (bundle / "plan.json").write_text('{"version": 5, "defaults": {"gelu": "evil"}}')
        os.symlink(secret, bundle / "kernels" / "loot.txt")
        return report

    monkeypatch.setattr(governance, "verify", verify_then_change)
    home = tmp_path / "home"
    code, output = cli("plan", "import", str(bundle), "--keyring", str(keys.keyring_file), "--home", str(home))
    assert code == 0, output
    kept = home / "imported" / "job-1-v5"
    assert (kept / "plan.json").read_bytes() == signed_plan
    assert not (kept / "kernels" / "loot.txt").exists()
    assert sorted(p.name for p in (home / "imported").iterdir()) == ["job-1-v5"]  # no staging left

    # imported again now, the symlink fails the layout check and nothing is kept
    monkeypatch.setattr(governance, "verify", verify)
    shutil.rmtree(kept)
    code, output = cli("plan", "import", str(bundle), "--keyring", str(keys.keyring_file), "--home", str(home))
    assert code == 1 and "symlink" in output, output
    assert list((home / "imported").iterdir()) == []


def test_importing_a_folder_that_holds_the_home_is_refused(tmp_path):
    """`rtxops plan import .` in a project whose home is ./.rtxops copied the folder into itself
    (a 74 KB error of nested paths)."""
    project = tmp_path / "project"
    (project / ".rtxops").mkdir(parents=True)
    code, output = cli("plan", "import", str(project), "--home", str(project / ".rtxops"))
    assert code == 2 and "holds this home's imported plans" in " ".join(output.split()), output
    assert len(output) < 1000 and not (project / ".rtxops" / "imported").exists()


def test_importing_a_path_that_is_no_folder_is_a_usage_error(tmp_path):
    """Exit 1 ("FAIL layout cannot list"), as for a bundle that failed its checks."""
    home = tmp_path / "home"
    afile = tmp_path / "afile"
    afile.write_text("x")
    for path, said in ((tmp_path / "missing", "does not exist"), (afile, "is not a folder")):
        code, output = cli("plan", "import", str(path), "--home", str(home))
        assert code == 2 and said in " ".join(output.split()), output
