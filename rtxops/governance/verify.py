"""Offline verification of a bundle directory, one named check after another. The first failing
check stops it (later checks rely on the earlier ones)."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _dsse, _keys, provenance, sbom
from ._errors import GovernanceError, UsageError, VerificationError
from ._layout import (KINDS, MAX_METADATA_BYTES, MAX_SIGNATURE_BYTES, PLAN, PROVENANCE, SBOM,
                      SIGNATURE, hash_files, list_files, read_limited)
from .keyring import Keyring
from .policy import Policy, evaluate_all
from ..runtime.errors import PlanError
from ..runtime.plan import Plan


@dataclass
class Check:
    name: str
    ok: bool
    message: str


@dataclass
class Report:
    path: str
    checks: list[Check] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    plan_bytes: bytes | None = field(default=None, repr=False)  # the verified plan.json, as hashed

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def failure(self) -> Check | None:
        return next((c for c in self.checks if not c.ok), None)

    def passed(self, name: str, message: str) -> None:
        self.checks.append(Check(name, True, message))

    def to_dict(self) -> dict:
        return {"path": self.path, "ok": self.ok,
                "checks": [{"check": c.name, "ok": c.ok, "message": c.message} for c in self.checks],
                "facts": self.facts}

    def lines(self) -> list[str]:
        return [f"{'ok  ' if c.ok else 'FAIL'} {c.name:<11} {c.message}" for c in self.checks]


@dataclass
class Trust:
    """Whom to trust: a keyring, one public key (PEM), or a keyless identity + issuer checked
    against a pinned Sigstore trusted root."""

    keyring: Keyring | None = None
    public_key: bytes | None = None
    identity: str | None = None
    issuer: str | None = None
    trusted_root: Path | None = None


def verify(path: str | Path, trust: Trust, *, policies: list[Policy] | None = None,
           expected_kind: str | None = None, min_version: int | None = None,
           newer_than: int | None = None, job: dict | None = None, at: float | None = None) -> Report:
    """Verify the bundle at ``path``. Raises UsageError when it cannot be read at all; every
    verification failure is the report's failing check."""
    root = Path(path)
    if not root.exists():
        raise UsageError(f"{root} does not exist")
    if root.is_symlink() or not root.is_dir():
        raise UsageError(f"{root} is not a bundle directory")
    report = Report(str(root))
    try:
        _run(root, trust, report, policies, expected_kind, min_version, newer_than, job,
             time.time() if at is None else at)
    except VerificationError as e:
        report.checks.append(Check(e.check, False, e.message))
    except UsageError:
        raise
    except (OSError, GovernanceError) as e:
        report.checks.append(Check("input", False, str(e)))
    except Exception as e:  # a malformation no check foresaw: the bundle fails, never the verifier
        report.checks.append(Check("input", False, f"malformed bundle: {type(e).__name__}: {e}"[:500]))
    return report


def _run(root: Path, trust: Trust, report: Report, policies, expected_kind, min_version,
         newer_than, job, at: float) -> None:
    names = list_files(root)
    hashing = hash_files(root, names)  # overlaps with the signature and metadata checks
    try:
        _checks(root, names, hashing, trust, report, policies, expected_kind, min_version,
                newer_than, job, at)
    finally:
        hashing.cancel()


def _checks(root, names, hashing, trust: Trust, report: Report, policies, expected_kind,
            min_version, newer_than, job, at) -> None:
    report.passed("layout", f"{len(names)} files, no symlinks")
    if not (root / SIGNATURE).is_file():
        raise VerificationError("bundle", f"{SIGNATURE} is missing: the directory is not signed")
    env = _dsse.parse(read_limited(root / SIGNATURE, MAX_SIGNATURE_BYTES, "bundle"))
    report.passed("bundle", f"Sigstore bundle v0.3, one DSSE signature")

    signer = _signature(env, trust, report, at)
    signed = _dsse.parse_statement(env.payload)
    report.passed("statement", f"in-toto statement over {len(signed)} files, subject digest matches")
    _same_names(names, signed)  # now, not after hashing a file that is not even signed

    for n in (SBOM, PROVENANCE):
        if n not in signed:
            raise VerificationError("manifest", f"{n} is not among the signed files")
    prov_bytes = read_limited(root / PROVENANCE, MAX_METADATA_BYTES, "provenance")
    sbom_bytes = read_limited(root / SBOM, MAX_METADATA_BYTES, "sbom")
    # the kind and the signer's rights are read from the provenance: only from the signed one (a
    # swapped provenance fails as tampered, not on what it claims)
    _files([PROVENANCE], {PROVENANCE: signed[PROVENANCE]},
           {PROVENANCE: hashlib.sha256(prov_bytes).hexdigest()})
    prov = provenance.parse(prov_bytes)
    params = prov["predicate"]["buildDefinition"]["externalParameters"]
    kind = params.get("kind")
    if kind not in KINDS:
        raise VerificationError("kind", f"unknown artifact kind {kind!r}")
    if expected_kind and kind != expected_kind:
        raise VerificationError("kind", f"the bundle is a {kind} bundle, not a {expected_kind} bundle")
    if signer.get("entry") is not None:
        problem = signer["entry"].problem(kind, at)
        if problem:
            raise VerificationError("signer", problem)

    # the files this function parses are hashed from the very bytes it parses (read once), so a
    # file swapped between the hashing and the parsing cannot pass
    parsed = {PROVENANCE: prov_bytes, SBOM: sbom_bytes}
    if kind == "plan" and PLAN in signed and PLAN in names:
        parsed[PLAN] = read_limited(root / PLAN, MAX_METADATA_BYTES, "plan")
    builder = prov["predicate"]["runDetails"]["builder"]
    version = params.get("version", 0)
    # while the big files hash: the schema check and the policy, whose results are reported in
    # order below (a bundle that fails an earlier check still fails on that one)
    sbom_problem = sbom.schema_problem(sbom_bytes.decode("utf-8", "replace"))
    facts = allowed = None
    if not sbom_problem:
        try:
            facts = _facts(kind, version, params, signer, builder, sbom_bytes, signed)
            allowed = evaluate_all(policies, facts, job) if policies else None
        except Exception:  # unverified bytes: fail (again) in order below, where it belongs
            facts = allowed = None

    digests = {**hashing.result(), **{n: hashlib.sha256(b).hexdigest() for n, b in parsed.items()}}
    _files(names, signed, digests)
    report.passed("files", f"every file's sha256 matches the signed statement ({len(signed)} files)")

    if sbom_problem:
        raise VerificationError("sbom", f"the SBOM fails the CycloneDX {sbom.SPEC_VERSION} schema: {sbom_problem}")
    report.passed("sbom", f"CycloneDX {sbom.SPEC_VERSION}, schema valid, digest signed")

    want = {n: d for n, d in signed.items() if n != PROVENANCE}
    if provenance.subjects(prov) != want:
        raise VerificationError("provenance", "provenance subjects do not match the signed files")
    report.passed("provenance", f"SLSA v1, kind {kind}, builder {builder['id'][:48]}")

    if not isinstance(version, int) or isinstance(version, bool):
        raise VerificationError("version", f"version {version!r} is not an integer")
    if kind == "plan":
        if PLAN not in signed:
            raise VerificationError("plan", f"a plan bundle must hold {PLAN}")
        plan = _plan_json(parsed[PLAN])
        try:   # what a job would refuse on install is not a plan that verified
            Plan.from_dict(plan)
        except PlanError as e:
            raise VerificationError("plan", f"{PLAN} is not a valid plan: {e}") from None
        if plan.get("version") != version:
            raise VerificationError("plan", f"{PLAN} has version {plan.get('version')!r}, the "
                                            f"provenance says {version}")
        kernels = _sbom_describes(plan, sbom_bytes, digests)
        report.passed("kernels", f"the SBOM lists the plan's {kernels} kernel variants, sources signed")
    if min_version is not None and version < min_version:
        raise VerificationError("version", f"version {version} is older than the minimum "
                                           f"version {min_version} asked for (a replay of an older "
                                           "bundle?)")
    if newer_than is not None and version <= newer_than:
        raise VerificationError("version", f"version {version} is not newer than the running "
                                           f"version {newer_than}")
    report.passed("version", f"version {version}" + (f" >= {min_version}" if min_version is not None else "")
                  + (f" > running {newer_than}" if newer_than is not None else ""))

    report.facts = facts or _facts(kind, version, params, signer, builder, sbom_bytes, signed)
    if policies:
        allowed = allowed or evaluate_all(policies, report.facts, job)
        if not allowed.allowed:
            raise VerificationError("policy", "denied: " + "; ".join(allowed.reasons))
        report.passed("policy", f"allowed by {', '.join(p.name for p in policies)}")
    report.plan_bytes = parsed.get(PLAN)


def _facts(kind, version, params, signer, builder, sbom_bytes, signed) -> dict:
    """What policies see about a bundle (see :mod:`.policy`)."""
    sb = sbom.facts(json.loads(sbom_bytes))
    numeric = ("gain", "ci_low", "ci_high", "p_value")
    # a figure the decision could not give (too few samples: null) reads as the default below
    decision = {k: (float(v) if isinstance(v, int) and not isinstance(v, bool) and k in numeric
                    else v)
                for k, v in (params.get("decision") or {}).items() if v is not None or k not in numeric}
    return {
        "kind": kind, "version": version, "scope": params.get("scope") or "",
        "signer": {k: v for k, v in signer.items() if k != "entry"},
        "builder": {"id": builder["id"], "version": builder.get("version") or {}},
        "decision": {"kind": "", "gain": 0.0, "ci_low": 0.0, **decision},
        "variants": sb["variants"], "packages": sb["packages"],
        "digest": "sha256:" + _dsse.root_digest(signed),
    }


def _signature(env: _dsse.Envelope, trust: Trust, report: Report, at: float) -> dict:
    if env.keyless:
        if not (trust.identity or trust.issuer or trust.trusted_root):
            # the bundle's own claim (a certificate) meets a verifier that trusts keys only: the
            # bundle fails verification; it is no misuse of the command
            raise VerificationError("signer", "keyless bundle but no identity/issuer trusted "
                                              "(this verification trusts keys only)")
        from ._keyless import verify_keyless

        identity = verify_keyless(env, trust)
        report.passed("signature", f"keyless: {identity['identity']} from {identity['issuer']}")
        return {"key_id": "", "trusted": True, "mode": "keyless", **identity, "entry": None}
    if trust.identity or trust.issuer:
        # the verifier asked for a Sigstore identity: a bundle signed with a key does not have one,
        # whichever keys are trusted besides
        raise VerificationError("signer", "a key-signed bundle, but a keyless signature by "
                                          f"{trust.identity or trust.issuer} is required")
    if trust.public_key is not None:
        key = _keys.load_public(trust.public_key)
        _dsse.verify_key(env, key)
        kid = _keys.key_id(key)
        report.passed("signature", f"verifies with the given key {kid[:16]}")
        return {"key_id": kid, "trusted": True, "mode": "key", "name": "", "entry": None}
    if trust.keyring is None:
        raise UsageError("give a public key, a keyring, or a keyless identity and issuer")
    entry = trust.keyring.check(env.key_hint or "", None, at)
    _dsse.verify_key(env, _keys.load_public(entry.pem.encode(), f"keyring key {entry.key_id[:16]}"))
    report.passed("signature", f"verifies with trusted key {entry.key_id[:16]}"
                  + (f" ({entry.name})" if entry.name else ""))
    return {"key_id": entry.key_id, "trusted": True, "mode": "key", "name": entry.name, "entry": entry}


def _same_names(names: list[str], signed: dict[str, str]) -> None:
    on_disk = set(names)
    missing = sorted(set(signed) - on_disk)
    if missing:
        raise VerificationError("files", f"missing file {missing[0]} (signed but not in the bundle)")
    extra = sorted(on_disk - set(signed))
    if extra:
        raise VerificationError("files", f"extra file {extra[0]} (in the bundle but not signed)")


def _files(names: list[str], signed: dict[str, str], digests: dict[str, str]) -> None:
    _same_names(names, signed)
    for n in sorted(signed):
        if digests[n] != signed[n]:
            what = {SBOM: "the SBOM's", PROVENANCE: "the provenance's"}.get(n, f"{n}:")
            raise VerificationError("files", f"{what} sha256 {digests[n][:16]}… differs from the signed "
                                             f"{signed[n][:16]}… (tampered, truncated or swapped)")


def _sbom_describes(plan: dict, sbom_bytes: bytes, digests: dict[str, str]) -> int:
    """The SBOM's kernels are exactly the variants ``plan`` uses, each with a signed source file
    of the sha256 the SBOM gives (the policies read the kernels' facts from the SBOM)."""
    variants = sbom.facts(json.loads(sbom_bytes))["variants"]
    listed = {(v["op"], v["variant"]) for v in variants}
    used = _plan_variants(plan)
    if listed != used:
        extra, missing = sorted(listed - used), sorted(used - listed)
        raise VerificationError("kernels", "the SBOM's kernels are not the plan's: "
                                + "; ".join(f"{what} {'/'.join(pair)}" for what, pairs in
                                            (("not used by the plan:", extra), ("not in the SBOM:", missing))
                                            for pair in pairs))
    for v in variants:
        if digests.get(v["source"]) != v["source_sha256"]:
            raise VerificationError("kernels", f"{v['op']}/{v['variant']}: source {v['source']!r} "
                                               "is not a signed file with the sha256 the SBOM gives")
    return len(variants)


def _plan_variants(plan: dict) -> set[tuple[str, str]]:
    """The (op, variant) pairs ``plan.json`` names: defaults, entries and their explore arms."""
    try:
        used = {(op, v) for op, v in (plan.get("defaults") or {}).items()}
        for e in plan.get("entries") or []:
            used.add((e["op"], e["variant"]))
            used.update((e["op"], arm["variant"]) for arm in e.get("explore") or [])
    except (AttributeError, KeyError, TypeError) as e:
        raise VerificationError("plan", f"{PLAN} is not a plan: {type(e).__name__}: {e}") from None
    if not all(isinstance(x, str) for pair in used for x in pair):
        raise VerificationError("plan", f"{PLAN} names an op or variant that is not a string")
    return used


def _plan_json(data: bytes) -> dict:
    try:
        data = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise VerificationError("plan", f"{PLAN} is not valid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(data, dict):
        raise VerificationError("plan", f"{PLAN} is not a JSON object")
    return data
