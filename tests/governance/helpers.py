"""Building real signed bundles (and broken ones) for the governance tests."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from rtxops.governance import Keyring, Signer, generate_key, write_plan_bundle
from rtxops.governance import _dsse, _layout
from rtxops.governance._kernels import plan_kernels
from rtxops.governance.authority import DAEMON_KINDS
from rtxops.runtime.plan import Plan

PROMOTE = {"kind": "promote", "op": "gelu", "bucket": "gelu|f32|cpu|r8|h32",
           "candidate": {"variant": "algebraic", "config": {}},
           "incumbent": {"variant": "reference", "config": {}}, "gain": 0.08, "ci_low": 0.04,
           "ci_high": 0.12, "p_value": 0.001, "objective": "time", "deterministic": True}
EVIDENCE = {"trial_ids": ["t-1", "t-2"], "windows": {"a": [0, 1]}, "telemetry_digest": "sha256:" + "ab" * 32}


class Keys:
    """Keys on disk: ``daemon`` (trusted), ``stranger`` (not in the keyring), ``revoked``,
    ``expired`` and ``ckpt_only`` (trusted for checkpoints only)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.keyring_file = root / "keyring.json"
        ring = Keyring(self.keyring_file)
        for name in ("daemon", "stranger", "revoked", "expired", "ckpt_only"):
            generate_key(root / f"{name}.pem")
        now = time.time()
        ring.trust(self.pub("daemon"), name="daemon", kinds=DAEMON_KINDS)
        ring.revoke(ring.trust(self.pub("revoked"), name="revoked").key_id, "leaked")
        ring.trust(self.pub("expired"), name="expired", not_before=now - 100, not_after=now - 10)
        ring.trust(self.pub("ckpt_only"), name="ckpt", kinds=["checkpoint"])
        ring.save()

    def pub(self, name: str) -> bytes:
        return (self.root / f"{name}.pub").read_bytes()

    def signer(self, name: str = "daemon") -> Signer:
        return Signer.from_key_file(self.root / f"{name}.pem", builder="rtxops-daemon")


def home_ledger_key(home: Path, store=None):
    """The private key a daemon on ``home`` signs the ledger head with, made and trusted in the
    home's keyring as a daemon's first start does (which, given the store, also writes the
    empty ledger's signed head)."""
    from rtxops.governance.authority import Authority

    authority = Authority(home, store)
    authority.close()
    return authority.signer.key


def registry():
    from rtxops.runtime.registry import default_registry

    return default_registry()


def plan_bundle(directory: Path, signer: Signer, version: int, *, decision: dict | None = None,
                environment: dict | None = None, scope: str = "job-1") -> Path:
    """A signed plan bundle: gelu → algebraic, with its kernel source."""
    data = {"version": version, "defaults": {"gelu": "algebraic"}}
    if environment is not None:
        data["environment"] = environment
    plan = Plan.from_dict(data)
    kernels, sources = plan_kernels(plan, registry())
    write_plan_bundle(directory, plan.to_json(), sources)
    signer.sign_directory(directory, kind="plan", version=version, scope=scope,
                          decision=PROMOTE if decision is None else decision, evidence=EVIDENCE,
                          kernels=kernels)
    return directory


def sign_as_it_is(directory: Path, signer: Signer, version: int) -> None:
    """Sign a plan bundle's directory whole again (statement, SBOM, provenance) as its files are
    now: a key holder signing whatever ``plan.json`` says."""
    signer.sign_directory(directory, kind="plan", version=version, scope="job-1", decision=PROMOTE,
                          evidence=EVIDENCE, kernels=plan_kernels(Plan.from_dict(
                              {"version": version, "defaults": {"gelu": "algebraic"}}), registry())[0])


def resign(directory: Path, signer: Signer, *, digests: dict | None = None,
           mutate_statement=None) -> None:
    """Sign the directory's files as they are now (an attacker holding a key, or a test building
    a statement that is signed but wrong)."""
    if digests is None:
        names = _layout.list_files(directory)
        digests = {n: _layout.sha256_file(directory / n) for n in names}
    payload = _dsse.statement(digests)
    if mutate_statement is not None:
        st = json.loads(payload)
        mutate_statement(st)
        payload = json.dumps(st, sort_keys=True, separators=(",", ":")).encode()
    bundle = _dsse.sign(payload, signer.key)
    (directory / _layout.SIGNATURE).write_text(json.dumps(bundle))


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def edit_bundle_json(directory: Path, fn) -> None:
    path = directory / _layout.SIGNATURE
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))
