"""Governance: signed, policy-checked bundles (plan + kernel sources + SBOM + provenance + Sigstore
bundle), the trusted keyring, CEL policies and the hash-chained ledger.

Public API (the rest is internal)::

    Signer.from_key_file(path).sign_directory(dir, kind="checkpoint")
    KeylessSigner.create(token, trust_config).sign_directory(dir)   # Sigstore identity (online)
    verify(dir, Trust(keyring=Keyring.load(path)), policies=load_policies()) -> Report
"""
from __future__ import annotations

from ._bundle import Signer, write_plan_bundle
from ._errors import GovernanceError, PolicyDenied, UsageError, VerificationError
from ._keyless_sign import KeylessSigner
from ._keys import generate as generate_key
from ._layout import KINDS, PLAN, PROVENANCE, SBOM, SIGNATURE
from .keyring import Keyring, TrustedKey
from .policy import Policy, load_policies
from .sbom import KernelComponent
from .verify import Check, Report, Trust, verify

__all__ = ["Signer", "KeylessSigner", "write_plan_bundle", "GovernanceError", "PolicyDenied", "UsageError",
           "VerificationError", "generate_key", "KINDS", "PLAN", "PROVENANCE", "SBOM", "SIGNATURE",
           "Keyring", "TrustedKey", "Policy", "load_policies", "KernelComponent", "Check", "Report",
           "Trust", "verify"]
