"""DSSE envelopes in Sigstore bundles (v0.3), key mode: the in-toto statement lists every file with
its sha256 in the ``model_signing`` v1.0 layout, so ``model_signing``'s key verifier accepts our
bundles and our verifier checks theirs the same way."""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from . import _keys
from ._errors import VerificationError
from ._layout import SIGNATURE, check_name

BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
SERIALIZATION = {"method": "files", "hash_type": "sha256", "allow_symlinks": False,
                 "ignore_paths": [SIGNATURE]}


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE pre-authentication encoding."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def root_digest(digests: dict[str, str]) -> str:
    """sha256 over every file's digest in name order (the statement's subject)."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(bytes.fromhex(digests[name]))
    return h.hexdigest()


def statement(digests: dict[str, str], name: str = "rtxops-bundle") -> bytes:
    body = {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {"sha256": root_digest(digests)}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {"serialization": SERIALIZATION,
                      "resources": [{"name": n, "algorithm": "sha256", "digest": digests[n]}
                                    for n in sorted(digests)]},
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign(payload: bytes, key: ec.EllipticCurvePrivateKey) -> dict:
    """A Sigstore bundle v0.3 (as JSON data) holding a DSSE envelope over ``payload``."""
    sig = key.sign(pae(PAYLOAD_TYPE, payload), ec.ECDSA(hashes.SHA256()))
    return {
        "mediaType": BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": _keys.key_id(key.public_key())},
                                 "tlogEntries": []},
        "dsseEnvelope": {"payload": base64.b64encode(payload).decode(), "payloadType": PAYLOAD_TYPE,
                         "signatures": [{"sig": base64.b64encode(sig).decode(), "keyid": ""}]},
    }


@dataclass
class Envelope:
    """A parsed bundle: the signed payload, the signature and who claims to have signed."""

    raw: dict
    payload: bytes
    signature: bytes
    key_hint: str | None       # key mode
    keyless: bool


def parse(data: bytes) -> Envelope:
    """Parse a Sigstore bundle's JSON; every malformation is a VerificationError."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise VerificationError("bundle", f"{SIGNATURE} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise VerificationError("bundle", f"{SIGNATURE} is not a JSON object")
    media = raw.get("mediaType")
    if media != BUNDLE_MEDIA_TYPE:
        raise VerificationError("bundle", f"unknown bundle media type {media!r} "
                                          f"(expected {BUNDLE_MEDIA_TYPE})")
    env = raw.get("dsseEnvelope")
    if not isinstance(env, dict):
        raise VerificationError("bundle", "the bundle holds no DSSE envelope")
    if env.get("payloadType") != PAYLOAD_TYPE:
        raise VerificationError("bundle", f"DSSE payload type {env.get('payloadType')!r} is not "
                                          f"{PAYLOAD_TYPE}")
    sigs = env.get("signatures")
    if not isinstance(sigs, list) or len(sigs) != 1 or not isinstance(sigs[0], dict):
        n = len(sigs) if isinstance(sigs, list) else 0
        raise VerificationError("bundle", f"the envelope has {n} signatures; exactly one is allowed")
    sig_text = sigs[0].get("sig")
    if not isinstance(sig_text, str) or not sig_text:
        raise VerificationError("signature", "the signature is empty")
    signature = _b64(sig_text, "signature", "the signature is not base64")
    if not signature:
        raise VerificationError("signature", "the signature is empty")
    payload = _b64(env.get("payload"), "bundle", "the DSSE payload is not base64")
    material = raw.get("verificationMaterial")
    if not isinstance(material, dict):
        raise VerificationError("bundle", "the bundle has no verificationMaterial")
    hint = (material.get("publicKey") or {}).get("hint") if isinstance(material.get("publicKey"), dict) else None
    keyless = "certificate" in material or "x509CertificateChain" in material
    if not keyless and not isinstance(hint, str):
        raise VerificationError("bundle", "the bundle names neither a public key nor a certificate")
    return Envelope(raw, payload, signature, hint, keyless)


def verify_key(envelope: Envelope, key: ec.EllipticCurvePublicKey) -> None:
    """The envelope's signature verifies with ``key``; else VerificationError."""
    kid = _keys.key_id(key)
    if envelope.key_hint and envelope.key_hint != kid:
        raise VerificationError("signature", f"signed by key {envelope.key_hint[:16]}, not by the "
                                             f"expected key {kid[:16]} (wrong key)")
    try:
        key.verify(envelope.signature, pae(PAYLOAD_TYPE, envelope.payload), ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise VerificationError("signature", f"the signature does not verify with key {kid[:16]}") from None


def parse_statement(payload: bytes) -> dict[str, str]:
    """The signed file digests ``{name: sha256 hex}`` from the statement; checks its type,
    predicate type, serialization, names and subject digest."""
    try:
        st = json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise VerificationError("statement", f"the signed payload is not JSON: {e}") from None
    if not isinstance(st, dict) or st.get("_type") != STATEMENT_TYPE:
        raise VerificationError("statement", f"the signed payload is not an in-toto Statement v1")
    if st.get("predicateType") != PREDICATE_TYPE:
        raise VerificationError("statement", f"unknown predicate type {st.get('predicateType')!r} "
                                             f"(expected {PREDICATE_TYPE})")
    pred = st.get("predicate") if isinstance(st.get("predicate"), dict) else {}
    ser = pred.get("serialization")
    if not isinstance(ser, dict) or ser.get("method") != "files" or ser.get("hash_type") != "sha256" \
            or ser.get("allow_symlinks") is not False or ser.get("ignore_paths", [SIGNATURE]) not in (
                [SIGNATURE], [], None):
        raise VerificationError("statement", f"unsupported serialization {ser!r} (files, sha256, "
                                             f"no symlinks, ignoring only {SIGNATURE})")
    digests: dict[str, str] = {}
    resources = pred.get("resources")
    if not isinstance(resources, list):
        raise VerificationError("statement", "the statement lists no resources")
    for r in resources:
        if not isinstance(r, dict) or r.get("algorithm") != "sha256" or not _is_hex(r.get("digest")):
            raise VerificationError("statement", f"resource {r!r} has no sha256 digest")
        name = check_name(r.get("name"))
        if name in digests:
            raise VerificationError("manifest", f"{name} is listed twice")
        digests[name] = r["digest"]
    subjects = st.get("subject")
    if not isinstance(subjects, list) or len(subjects) != 1 or not isinstance(subjects[0], dict):
        raise VerificationError("statement", "the statement must have exactly one subject")
    want = (subjects[0].get("digest") or {}).get("sha256")
    got = root_digest(digests)
    if want != got:
        raise VerificationError("statement", f"subject digest mismatch: the statement says {want}, "
                                             f"its resources hash to {got}")
    return digests


def _b64(text, check: str, message: str) -> bytes:
    if not isinstance(text, str):
        raise VerificationError(check, message)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise VerificationError(check, message) from None


def _is_hex(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
