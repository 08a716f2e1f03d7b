"""ECDSA P-256 keys: generate, load, and the key id (sha256 of the public key's PEM, as the
``model_signing`` tool's ``publicKey.hint``)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ._errors import UsageError


def public_pem(key: ec.EllipticCurvePublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def key_id(key: ec.EllipticCurvePublicKey) -> str:
    return hashlib.sha256(public_pem(key)).hexdigest()


def generate(private_path: Path, public_path: Path | None = None) -> str:
    """Write a new P-256 private key (mode 0600, never overwritten) and its public key; return the
    key id."""
    public_path = public_path or private_path.with_suffix(".pub")
    if public_path.resolve() == private_path.resolve():  # `--out k.pub`: the public key over it
        raise UsageError(f"{private_path}: the private key needs another name than its public "
                         f"key's ({public_path}); use a .pem name")
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    private_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise UsageError(f"{private_path} exists; refusing to overwrite a key") from None
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public_path.write_bytes(public_pem(key.public_key()))
    return key_id(key.public_key())


def load_private(path: Path) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), None)
    except OSError as e:
        raise UsageError(f"cannot read key {path}: {e.strerror}") from None
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise UsageError(f"{path} is not an unencrypted PEM private key: {e}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        raise UsageError(f"{path} is not an ECDSA P-256 key")
    return key


def load_public(data: bytes, where: str = "public key") -> ec.EllipticCurvePublicKey:
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as e:
        raise UsageError(f"{where} is not a PEM public key: {e}") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise UsageError(f"{where} is not an ECDSA P-256 public key")
    return key
