"""A local, fake Sigstore instance for tests (the public one cannot be reached from here).

It is small but does the real cryptography, so sigstore-python's signer and verifier run
unmodified against it:

* an OIDC issuer: ES256 JWTs minted by :meth:`FakeSigstore.token`;
* Fulcio (``POST /api/v2/signingCert``): checks the token and the CSR, issues a 10-minute leaf
  under an intermediate and a root CA, with the identity in the SAN, the OIDC issuer in the
  Fulcio extensions and an embedded SCT signed by a CT log key (RFC 6962, precertificate entry);
* Rekor v1 (``POST /api/v1/log/entries``, ``dsse`` kind): checks the envelope's signature,
  appends the canonical entry to an RFC 6962 Merkle tree and answers with the signed entry
  timestamp and an inclusion proof whose checkpoint is a signed note;
* the ClientTrustConfig (trusted root + signing config) naming all of it.

No timestamp authority: with Rekor v1 the integrated time, bound by the signed entry timestamp,
is the verified time.
"""
from __future__ import annotations

import base64
import datetime
import hashlib
import json
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import jwt
import rfc8785
import uvicorn
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID, ObjectIdentifier
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .._bounded import serving

OIDC_ISSUER_V1 = ObjectIdentifier("1.3.6.1.4.1.57264.1.1")  # raw string (sigstore checks this one)
OIDC_ISSUER_V2 = ObjectIdentifier("1.3.6.1.4.1.57264.1.8")  # DER UTF8String
SCT_LIST = ObjectIdentifier("1.3.6.1.4.1.11129.2.4.2")
DSSE_TYPE = "application/vnd.in-toto+json"
P256 = "PKIX_ECDSA_P256_SHA_256"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _spki_der(key: ec.EllipticCurvePublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _log_id(key: ec.EllipticCurvePublicKey) -> bytes:
    """RFC 6962 log id: sha256 of the public key's DER SubjectPublicKeyInfo."""
    return hashlib.sha256(_spki_der(key)).digest()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _der_utf8(text: str) -> bytes:
    raw = text.encode()
    assert len(raw) < 128  # short-form length is enough for an issuer URL here
    return bytes([0x0C, len(raw)]) + raw


def _der_octets(raw: bytes) -> bytes:
    n = len(raw)
    if n < 128:
        return bytes([0x04, n]) + raw
    length = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x04, 0x80 | len(length)]) + length + raw


def _sign(key: ec.EllipticCurvePrivateKey, data: bytes) -> bytes:
    return key.sign(data, ec.ECDSA(hashes.SHA256()))


# ---- certificate authority ---------------------------------------------------------------------
@dataclass
class CA:
    """A Fulcio-like CA: a self-signed root and an intermediate that issues the leaves."""

    root_key: ec.EllipticCurvePrivateKey
    root: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def generate(cls, name: str = "fake-sigstore") -> CA:
        root_key = ec.generate_private_key(ec.SECP384R1())
        root_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, name),
                               x509.NameAttribute(NameOID.COMMON_NAME, name)])
        start = _now() - datetime.timedelta(days=1)
        root = (_ca_builder(root_name, root_name, root_key.public_key(), root_key.public_key(), start, 1)
                .sign(root_key, hashes.SHA384()))
        key = ec.generate_private_key(ec.SECP384R1())
        inter_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, name),
                                x509.NameAttribute(NameOID.COMMON_NAME, f"{name}-intermediate")])
        inter = (_ca_builder(inter_name, root_name, key.public_key(), root_key.public_key(), start, 0)
                 # Fulcio's intermediate carries the code-signing EKU too
                 .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
                 .sign(root_key, hashes.SHA384()))
        return cls(root_key, root, key, inter)

    def trusted_root_entry(self, url: str) -> dict:
        return {"subject": {"organization": "fake-sigstore", "commonName": "fake-sigstore"},
                "uri": url,
                "certChain": {"certificates": [
                    {"rawBytes": _b64(c.public_bytes(serialization.Encoding.DER))}
                    for c in (self.cert, self.root)]},
                "validFor": {"start": self.root.not_valid_before_utc.isoformat()}}


def _ca_builder(subject, issuer, public_key, issuer_key, start, path_length) -> x509.CertificateBuilder:
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + datetime.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=True, path_length=path_length), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key), critical=False))


# ---- Fulcio --------------------------------------------------------------------------------------
def issue_leaf(ca: CA, ct_key: ec.EllipticCurvePrivateKey, public_key, identity: str,
               issuer: str) -> x509.Certificate:
    """A Fulcio-style code-signing leaf with an embedded SCT from ``ct_key``."""
    # whole seconds: X.509 drops the fraction, and Rekor's integrated time (whole seconds) must not
    # fall before not_valid_before
    start = _now().replace(microsecond=0)
    builder = (x509.CertificateBuilder().subject_name(x509.Name([]))
               .issuer_name(ca.cert.subject).public_key(public_key)
               .serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(start + datetime.timedelta(minutes=10))
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, key_cert_sign=False, crl_sign=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
                              critical=False)
               # empty subject, so the SAN is critical (RFC 5280 4.2.1.6)
               .add_extension(x509.SubjectAlternativeName([x509.RFC822Name(identity)]), critical=True)
               .add_extension(x509.UnrecognizedExtension(OIDC_ISSUER_V1, issuer.encode()), critical=False)
               .add_extension(x509.UnrecognizedExtension(OIDC_ISSUER_V2, _der_utf8(issuer)), critical=False))
    # The precertificate is the certificate without the SCT list; the CT log signs its TBS bytes
    # together with the issuer's key hash. The SCT list goes in last, so that removing it (what
    # verifiers do, `tbs_precertificate_bytes`) gives exactly these bytes back.
    precert = builder.sign(ca.key, hashes.SHA384())
    tbs = precert.tbs_certificate_bytes
    issuer_key_hash = hashlib.sha256(_spki_der(ca.key.public_key())).digest()
    timestamp_ms = int(time.time() * 1000)
    signed = struct.pack("!BBQH", 0, 0, timestamp_ms, 1)  # v1, certificate_timestamp, ms, precert
    signed += issuer_key_hash + len(tbs).to_bytes(3, "big") + tbs + struct.pack("!H", 0)  # no extensions
    signature = _sign(ct_key, signed)
    sct = (struct.pack("!B", 0) + _log_id(ct_key.public_key()) + struct.pack("!Q", timestamp_ms)
           + struct.pack("!H", 0)                                   # extensions
           + struct.pack("!BBH", 4, 3, len(signature)) + signature)  # sha256, ecdsa
    sct_list = struct.pack("!H", len(sct) + 2) + struct.pack("!H", len(sct)) + sct
    cert = (builder.add_extension(x509.UnrecognizedExtension(SCT_LIST, _der_octets(sct_list)), critical=False)
            .sign(ca.key, hashes.SHA384()))
    assert cert.tbs_precertificate_bytes == tbs
    return cert


# ---- Rekor ---------------------------------------------------------------------------------------
def _leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def _node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two below ``n`` (RFC 6962 2.1)."""
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def merkle_root(leaves: list[bytes]) -> bytes:
    if len(leaves) == 1:
        return leaves[0]
    k = _split(len(leaves))
    return _node_hash(merkle_root(leaves[:k]), merkle_root(leaves[k:]))


def inclusion_path(index: int, leaves: list[bytes]) -> list[bytes]:
    """RFC 6962 PATH(m, D[n]), bottom-up: what sigstore's ``verify_merkle_inclusion`` chains."""
    if len(leaves) == 1:
        return []
    k = _split(len(leaves))
    if index < k:
        return inclusion_path(index, leaves[:k]) + [merkle_root(leaves[k:])]
    return inclusion_path(index - k, leaves[k:]) + [merkle_root(leaves[:k])]


@dataclass
class RekorLog:
    """An append-only Merkle tree of canonical entries, signed by ``key``."""

    key: ec.EllipticCurvePrivateKey
    name: str = "rekor.fake-sigstore.test"
    leaves: list[bytes] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def log_id(self) -> bytes:
        return _log_id(self.key.public_key())

    def append(self, body: bytes) -> dict:
        """Add a canonical entry body; the Rekor v1 response for it."""
        with self.lock:
            self.leaves.append(_leaf_hash(body))
            index, leaves = len(self.leaves) - 1, list(self.leaves)
        integrated = int(time.time())
        log_id = self.log_id.hex()
        body_b64 = _b64(body)
        # signed entry timestamp: the log's promise over the canonical JSON of these four fields
        set_payload = rfc8785.dumps({"body": body_b64, "integratedTime": integrated, "logID": log_id,
                                     "logIndex": index})
        root = merkle_root(leaves)
        return {hashlib.sha256(body).hexdigest(): {
            "body": body_b64, "integratedTime": integrated, "logID": log_id, "logIndex": index,
            "verification": {
                "signedEntryTimestamp": _b64(_sign(self.key, set_payload)),
                "inclusionProof": {"logIndex": index, "treeSize": len(leaves), "rootHash": root.hex(),
                                   "hashes": [h.hex() for h in inclusion_path(index, leaves)],
                                   "checkpoint": self.checkpoint(len(leaves), root)}}}}

    def checkpoint(self, size: int, root: bytes) -> str:
        """A signed note (transparency-dev format): the body, a blank line, then
        ``— <name> base64(key hint[4] + signature)``."""
        note = f"{self.name} - 1\n{size}\n{_b64(root)}\n"
        sig = self.log_id[:4] + _sign(self.key, note.encode())
        return f"{note}\n\u2014 {self.name} {_b64(sig)}\n"


def dsse_entry_body(proposed: dict) -> bytes:
    """Check a proposed ``dsse`` entry (every signature verifies with the certificate) and return
    the canonical entry Rekor stores; raises ValueError when it is not acceptable."""
    if proposed.get("kind") != "dsse" or proposed.get("apiVersion") != "0.0.1":
        raise ValueError("only dsse 0.0.1 entries are supported")
    content = proposed["spec"]["proposedContent"]
    envelope = json.loads(content["envelope"])
    verifier = content["verifiers"][0]
    cert = x509.load_pem_x509_certificate(base64.b64decode(verifier))
    payload = base64.b64decode(envelope["payload"])
    ptype = envelope["payloadType"].encode()
    pae = b"DSSEv1 %d %s %d %s" % (len(ptype), ptype, len(payload), payload)
    signatures = []
    for s in envelope["signatures"]:
        sig = base64.b64decode(s["sig"])
        try:
            cert.public_key().verify(sig, pae, ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            raise ValueError("the envelope's signature does not verify with the certificate") from None
        signatures.append({"signature": _b64(sig), "verifier": verifier})
    return rfc8785.dumps({
        "apiVersion": "0.0.1", "kind": "dsse",
        "spec": {"envelopeHash": {"algorithm": "sha256",
                                  "value": hashlib.sha256(rfc8785.dumps(envelope)).hexdigest()},
                 "payloadHash": {"algorithm": "sha256", "value": hashlib.sha256(payload).hexdigest()},
                 "signatures": sorted(signatures, key=lambda s: s["signature"])}})


# ---- the instance --------------------------------------------------------------------------------
class FakeSigstore:
    """Fulcio + CT log + Rekor v1 + an OIDC issuer on 127.0.0.1 (``start()`` / ``stop()``)."""

    def __init__(self, issuer: str = "https://oidc.fake-sigstore.test") -> None:
        self.issuer = issuer
        self.oidc_key = ec.generate_private_key(ec.SECP256R1())
        self.ca = CA.generate()
        self.ct_key = ec.generate_private_key(ec.SECP256R1())
        self.rekor = RekorLog(ec.generate_private_key(ec.SECP256R1()))
        for i in range(5):  # earlier entries, so the inclusion proofs are not trivial
            self.rekor.append(rfc8785.dumps({"seed": i}))
        self.url = ""
        self.requests: list[str] = []
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    # -- identities
    def token(self, email: str, *, issuer: str | None = None, lifetime: int = 300,
              key: ec.EllipticCurvePrivateKey | None = None) -> str:
        """An OIDC ID token for ``email`` (audience ``sigstore``), signed by this issuer's key
        unless ``key`` says otherwise."""
        now = int(time.time())
        claims = {"iss": issuer or self.issuer, "aud": "sigstore", "sub": email, "email": email,
                  "email_verified": True, "iat": now, "nbf": now, "exp": now + lifetime}
        return jwt.encode(claims, key or self.oidc_key, algorithm="ES256")

    # -- trust material
    def trusted_root(self, ca: CA | None = None) -> dict:
        """The trusted root clients pin; ``ca`` swaps in another certificate authority."""
        start = (_now() - datetime.timedelta(days=1)).isoformat()

        def log(url: str, key: ec.EllipticCurvePublicKey) -> dict:
            return {"baseUrl": url, "hashAlgorithm": "SHA2_256",
                    "publicKey": {"rawBytes": _b64(_spki_der(key)), "keyDetails": P256,
                                  "validFor": {"start": start}},
                    "logId": {"keyId": _b64(_log_id(key))}}

        return {"mediaType": "application/vnd.dev.sigstore.trustedroot+json;version=0.1",
                "tlogs": [log(self.url, self.rekor.key.public_key())],
                "certificateAuthorities": [(ca or self.ca).trusted_root_entry(self.url)],
                "ctlogs": [log(self.url + "/ct", self.ct_key.public_key())],
                "timestampAuthorities": []}

    def signing_config(self) -> dict:
        start = (_now() - datetime.timedelta(days=1)).isoformat()

        def service(url: str) -> dict:
            return {"url": url, "majorApiVersion": 1, "validFor": {"start": start},
                    "operator": "fake-sigstore"}

        return {"mediaType": "application/vnd.dev.sigstore.signingconfig.v0.2+json",
                "caUrls": [service(self.url)], "oidcUrls": [service(self.issuer)],
                "rekorTlogUrls": [service(self.url)], "tsaUrls": [],
                "rekorTlogConfig": {"selector": "ANY"}, "tsaConfig": {"selector": "ANY"}}

    def trust_config(self) -> dict:
        return {"mediaType": "application/vnd.dev.sigstore.clienttrustconfig.v0.1+json",
                "trustedRoot": self.trusted_root(), "signingConfig": self.signing_config()}

    def write(self, directory: Path) -> tuple[Path, Path]:
        """Write ``trust_config.json`` and ``trusted_root.json``; return their paths."""
        directory.mkdir(parents=True, exist_ok=True)
        config, root = directory / "trust_config.json", directory / "trusted_root.json"
        config.write_text(json.dumps(self.trust_config(), indent=1))
        root.write_text(json.dumps(self.trusted_root(), indent=1))
        return config, root

    # -- the services
    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/api/v2/signingCert")
        async def signing_cert(request: Request):
            self.requests.append("fulcio")
            auth = request.headers.get("authorization", "")
            try:
                claims = jwt.decode(auth.removeprefix("Bearer "), self.oidc_key.public_key(),
                                    algorithms=["ES256"], audience="sigstore", issuer=self.issuer)
            except jwt.PyJWTError as e:
                return JSONResponse({"code": 401, "message": f"invalid identity token: {e}"}, 401)
            if not claims.get("email_verified"):
                return JSONResponse({"code": 400, "message": "email not verified"}, 400)
            body = await request.json()
            csr = x509.load_pem_x509_csr(base64.b64decode(body["certificateSigningRequest"]))
            if not csr.is_signature_valid:  # proof of possession of the key
                return JSONResponse({"code": 400, "message": "invalid CSR signature"}, 400)
            leaf = issue_leaf(self.ca, self.ct_key, csr.public_key(), claims["email"], self.issuer)
            chain = [c.public_bytes(serialization.Encoding.PEM).decode()
                     for c in (leaf, self.ca.cert, self.ca.root)]
            return JSONResponse({"signedCertificateEmbeddedSct": {"chain": {"certificates": chain}}}, 201)

        @app.post("/api/v1/log/entries")
        async def log_entries(request: Request):
            self.requests.append("rekor")
            try:
                body = dsse_entry_body(await request.json())
            except (ValueError, KeyError, TypeError) as e:
                return JSONResponse({"code": 400, "message": str(e)}, 400)
            return JSONResponse(self.rekor.append(body), 201)

        return app

    def start(self) -> FakeSigstore:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self.app(), log_level="warning"))
        self._thread = serving(self._server, "the fake Sigstore server", sockets=[sock])
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
