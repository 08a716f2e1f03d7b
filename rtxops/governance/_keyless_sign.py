"""Keyless signing with sigstore-python: an OIDC identity token buys a short-lived Fulcio
certificate for an ephemeral key, the key signs the DSSE envelope and Rekor logs it. The bundle
holds the certificate and the log entry, so ``verify_keyless`` checks it offline."""
from __future__ import annotations

import os
from pathlib import Path

from ._bundle import DirectorySigner
from ._errors import GovernanceError, UsageError

NO_TOKEN = ("keyless signing needs an OIDC identity token: pass --identity-token, set "
            "SIGSTORE_ID_TOKEN, or run where an ambient one is found (GitHub Actions, GitLab CI, "
            "Buildkite, CircleCI, Google Cloud)")


def find_token(token: str | None = None) -> str:
    """``token``, else ``$SIGSTORE_ID_TOKEN``, else an ambient CI credential; UsageError if none."""
    from sigstore.oidc import IdentityError, detect_credential

    token = token or os.environ.get("SIGSTORE_ID_TOKEN")
    if not token:
        try:
            token = detect_credential()
        except IdentityError as e:
            raise UsageError(f"ambient OIDC credential detection failed: {e}") from None
    if not token:
        raise UsageError(NO_TOKEN)
    return token


def load_trust_config(path: Path | None):
    """The Sigstore ClientTrustConfig at ``path`` (a private instance), else the production
    instance's (fetched and checked with TUF, so online)."""
    from sigstore.models import ClientTrustConfig

    if path is None:
        try:
            return ClientTrustConfig.production()
        except Exception as e:  # TUF and network errors have no common base
            raise UsageError(f"cannot load the Sigstore production trust config (offline?): {e}") from None
    try:
        return ClientTrustConfig.from_json(Path(path).read_text())
    except Exception as e:
        raise UsageError(f"trust config {path} is not a readable Sigstore ClientTrustConfig: {e}") from None


class KeylessSigner(DirectorySigner):
    """Signs bundles with a Sigstore identity (keyless). Construct with :meth:`create`."""

    def __init__(self, signer, identity: str, issuer: str, builder: str = "rtxops-cli") -> None:
        self._signer = signer
        self.identity, self.issuer, self.builder = identity, issuer, builder

    @classmethod
    def create(cls, token: str | None = None, trust_config: Path | None = None,
               builder: str = "rtxops-cli") -> KeylessSigner:
        """Parse the identity token (see :func:`find_token`) and get the signing certificate from
        the instance's Fulcio now, before any file is written."""
        from sigstore.oidc import IdentityError, IdentityToken
        from sigstore.sign import Signer, SigningContext

        try:
            identity = IdentityToken(find_token(token))
        except IdentityError as e:
            raise UsageError(f"the OIDC identity token is not usable: {e}") from None
        config = load_trust_config(trust_config)
        try:
            context = SigningContext.from_trust_config(config)
            signer = Signer(identity, context, cache=True)  # asks Fulcio, checks the SCT
        except Exception as e:  # sigstore's HTTP clients raise untyped errors
            raise GovernanceError(f"keyless signing failed getting a certificate: "
                                  f"{type(e).__name__}: {e}") from None
        return cls(signer, identity.identity, identity.federated_issuer, builder)

    @property
    def builder_id(self) -> str:
        return f"{self.builder}://{self.identity}"

    def _sign_statement(self, statement: bytes) -> dict:
        import json

        from sigstore.dsse import Statement

        try:
            bundle = self._signer.sign_dsse(Statement(statement))  # these bytes, unchanged
        except Exception as e:
            raise GovernanceError(f"keyless signing failed: {type(e).__name__}: {e}") from None
        return json.loads(bundle.to_json())
