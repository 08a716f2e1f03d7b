"""Turning a directory into a signed bundle: SBOM, provenance, then the Sigstore bundle whose
DSSE statement lists every file's sha256."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from . import _dsse, _keys, provenance, sbom
from ._errors import UsageError, VerificationError
from ._layout import (KINDS, MAX_METADATA_BYTES, MAX_SIGNATURE_BYTES, PLAN, PROVENANCE, SBOM, SIGNATURE,
                      hash_files, list_files)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("rtxops")
    except Exception:
        return "0"


class DirectorySigner:
    """Turns a directory into a signed bundle. Subclasses say who signs the DSSE envelope
    (``_sign_statement``) and name the builder (``builder_id``); the statement, SBOM and provenance
    are the same for every way of signing."""

    builder: str

    @property
    def builder_id(self) -> str:
        raise NotImplementedError

    def _sign_statement(self, statement: bytes) -> dict:
        """The Sigstore bundle (JSON data) whose DSSE envelope signs ``statement``, as is."""
        raise NotImplementedError

    def sign_directory(self, directory: str | Path, *, kind: str = "checkpoint", version: int = 0,
                       scope: str | None = None, decision: dict | None = None,
                       evidence: dict | None = None,
                       kernels: list[sbom.KernelComponent] | tuple = ()) -> str:
        """Write ``sbom.cdx.json``, ``provenance.intoto.json`` and ``bundle.sigstore.json`` into
        ``directory`` (replacing earlier ones); return the bundle's root digest."""
        root = Path(directory)
        if kind not in KINDS:
            raise UsageError(f"unknown artifact kind {kind!r} (kinds: {', '.join(KINDS)})")
        if not root.is_dir() or root.is_symlink():
            raise UsageError(f"{root} is not a directory")
        try:
            names = [n for n in list_files(root) if n not in (SBOM, PROVENANCE)]
        except VerificationError as e:
            raise UsageError(f"cannot sign {root}: {e.message}") from None
        hashing = hash_files(root, names)  # overlaps with building the SBOM below
        sbom_bytes = sbom.build(kernels, name=f"rtxops-{kind}-bundle", kind=kind)  # not the folder name: reproducible
        digests = dict(hashing.result())
        digests[SBOM] = hashlib.sha256(sbom_bytes).hexdigest()
        prov = provenance.build(kind=kind, version=version, subjects=digests, scope=scope,
                                builder_id=self.builder_id, builder_version={"rtxops": _version()},
                                decision=decision, evidence=evidence)
        digests[PROVENANCE] = hashlib.sha256(prov).hexdigest()
        # signed before anything is written: a signing that fails (a keyless signer offline)
        # leaves a signed folder as it was
        signature = (json.dumps(self._sign_statement(_dsse.statement(digests)), indent=1) + "\n").encode()
        for name, data, limit in ((SIGNATURE, signature, MAX_SIGNATURE_BYTES),
                                  (PROVENANCE, prov, MAX_METADATA_BYTES), (SBOM, sbom_bytes, MAX_METADATA_BYTES)):
            if len(data) > limit:   # a bundle no verifier would read: refused, nothing written
                raise UsageError(f"cannot sign {root}: its {len(names)} files make {name} "
                                 f"{len(data) >> 20} MiB, over the {limit >> 20} MiB a verifier reads; "
                                 "bundle fewer files (an archive of them, say)")
        _replace_all(root, {SBOM: sbom_bytes, PROVENANCE: prov, SIGNATURE: signature})
        return "sha256:" + _dsse.root_digest(digests)


@dataclass
class Signer(DirectorySigner):
    """Signs bundles with an ECDSA P-256 key (key mode). ``builder`` names who built them:
    ``rtxops-daemon`` for the daemon, ``rtxops-cli`` for a user's ``rtxops sign``."""

    key: object
    builder: str = "rtxops-cli"

    @classmethod
    def from_key_file(cls, path: str | Path, builder: str = "rtxops-cli") -> Signer:
        return cls(_keys.load_private(Path(path)), builder)

    @property
    def key_id(self) -> str:
        return _keys.key_id(self.key.public_key())

    @property
    def builder_id(self) -> str:
        return f"{self.builder}://{self.key_id}"

    def _sign_statement(self, statement: bytes) -> dict:
        return _dsse.sign(statement, self.key)


def _replace_all(root: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` into ``root``, each replacing the one there: all of them on disk before
    the first replaces anything, so a write that fails (a full disk) leaves the folder as it was."""
    temps = {name: root / f".{name}.tmp" for name in files}
    try:
        for name, data in files.items():
            with open(temps[name], "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        for name, tmp in temps.items():
            tmp.replace(root / name)
    except OSError as e:
        for tmp in temps.values():
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise UsageError(f"cannot write the bundle's files into {root}: {e}") from None


def write_plan_bundle(directory: Path, plan_json: str, sources: dict[str, str]) -> None:
    """Lay out a plan bundle's content: ``plan.json`` and the kernel sources (``{path: text}``)."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    (directory / PLAN).write_text(plan_json)
    for rel, text in sources.items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
