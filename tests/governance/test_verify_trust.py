"""Whom a verification trusts: a keyring entry is checked at the verification's ``at`` time, and a
bundle claiming a certificate against keyring-only trust fails verification (exit 1), not usage."""
from __future__ import annotations

import importlib
import json

from rtxops.governance import _layout
from rtxops.governance.keyring import Keyring

from .helpers import copy, resign
from .test_verify_rejections import run

verify_mod = importlib.import_module("rtxops.governance.verify")


def test_keyring_entry_is_checked_at_the_given_time(good_plan, keys, tmp_path):
    bundle = copy(good_plan, tmp_path / "b")
    resign(bundle, keys.signer("expired"))  # trusted from now-100 to now-10
    ring = Keyring.load(keys.keyring_file)
    trust = verify_mod.Trust(keyring=ring)
    (window,) = [k for k in ring.keys.values() if k.name == "expired"]
    # within the window the keys were made with (the fixture may be older than a minute)
    report = verify_mod.verify(bundle, trust, at=(window.not_before + window.not_after) / 2)
    assert report.ok, report.lines()
    report = verify_mod.verify(bundle, trust)
    assert not report.ok and "expired at" in report.failure.message


def test_keyless_bundle_against_keyring_only_trust_fails_verification(good_plan, keys, tmp_path):
    bundle = copy(good_plan, tmp_path / "b")
    sig = bundle / _layout.SIGNATURE
    raw = json.loads(sig.read_text())
    raw["verificationMaterial"] = {"certificate": {"rawBytes": "AAAA"}, "tlogEntries": []}
    sig.write_text(json.dumps(raw))
    report = verify_mod.verify(bundle, verify_mod.Trust(keyring=Keyring.load(keys.keyring_file)))
    assert not report.ok and report.failure.name == "signer"
    assert "keyless bundle but no identity/issuer trusted" in report.failure.message
    code, output = run(str(bundle), "--keyring", str(keys.keyring_file), "--no-ledger")
    assert code == 1 and "keyless bundle but no identity/issuer trusted" in output, output
