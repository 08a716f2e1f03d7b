"""Keyless (Sigstore) verification, offline: the certificate chain, transparency-log proof and
signed timestamps are checked against a pinned trusted root; the certificate must name the
required identity and OIDC issuer."""
from __future__ import annotations

import json

from ._dsse import PAYLOAD_TYPE
from ._errors import UsageError, VerificationError


def verify_keyless(envelope, trust) -> dict:
    """Verify ``envelope`` (a parsed bundle with a certificate); returns identity and issuer."""
    if not (trust.identity and trust.issuer and trust.trusted_root):
        raise UsageError("a keyless bundle needs --identity, --issuer and --trusted-root "
                         "(the pinned Sigstore trusted root JSON)")
    from sigstore.errors import Error as SigstoreError
    from sigstore.models import Bundle, TrustedRoot
    from sigstore.verify import Verifier, policy

    try:
        root = TrustedRoot.from_file(str(trust.trusted_root))
    except Exception as e:
        raise UsageError(f"trusted root {trust.trusted_root} is unreadable: {e}") from None
    try:
        bundle = Bundle.from_json(json.dumps(envelope.raw))
    except Exception as e:
        raise VerificationError("bundle", f"not a valid Sigstore bundle: {e}") from None
    try:
        payload_type, payload = Verifier(trusted_root=root).verify_dsse(
            bundle, policy.Identity(identity=trust.identity, issuer=trust.issuer))
    except SigstoreError as e:
        raise VerificationError("signature", f"keyless verification failed: {e}") from None
    if payload_type != PAYLOAD_TYPE:
        raise VerificationError("signature", f"the verified payload type is {payload_type!r}, not "
                                             f"{PAYLOAD_TYPE}")
    if payload != envelope.payload:
        raise VerificationError("signature", "the verified payload differs from the envelope's")
    return {"identity": trust.identity, "issuer": trust.issuer}
