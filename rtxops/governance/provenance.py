"""Provenance: an in-toto Statement v1 with an SLSA provenance v1 predicate. Builder = the rtxops
daemon (or user) that signed; external parameters = the artifact kind, version, scope and the
decision; resolved dependencies = the evidence (trials, telemetry digest); subjects = the files."""
from __future__ import annotations

import json
import re
from typing import Any

from ._errors import VerificationError

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
# a scope names a folder (bundles/<scope>, imported/<scope>-v<N>): never a path
SCOPE = re.compile(r"(?!\.{1,2}$)[A-Za-z0-9._-]{1,200}")
BUILD_TYPE = "https://rtxops.dev/bundle/v1"


def build(*, kind: str, version: int, subjects: dict[str, str], builder_id: str,
          builder_version: dict[str, str], scope: str | None = None, decision: dict | None = None,
          evidence: dict | None = None) -> bytes:
    """Canonical JSON bytes of the provenance statement. ``subjects`` is ``{name: sha256 hex}``."""
    evidence = evidence or {}
    deps: list[dict[str, Any]] = [{"uri": f"rtxops:trial/{t}", "name": f"trial:{t}"}
                                  for t in evidence.get("trial_ids", [])]
    tdigest = evidence.get("telemetry_digest")
    if isinstance(tdigest, str) and tdigest.startswith("sha256:"):
        deps.append({"name": "telemetry", "digest": {"sha256": tdigest.split(":", 1)[1]},
                     "annotations": {"windows": evidence.get("windows", {})}})
    body = {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": n, "digest": {"sha256": subjects[n]}} for n in sorted(subjects)],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {"kind": kind, "version": version, "scope": scope,
                                       "decision": decision or {}},
                "resolvedDependencies": deps,
            },
            "runDetails": {"builder": {"id": builder_id, "version": builder_version}},
        },
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()


def parse(data: bytes) -> dict:
    """The provenance statement; VerificationError when it is not SLSA v1 in-toto."""
    try:
        st = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise VerificationError("provenance", f"provenance is not valid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(st, dict) or st.get("_type") != STATEMENT_TYPE:
        raise VerificationError("provenance", "provenance is not an in-toto Statement v1")
    if st.get("predicateType") != PREDICATE_TYPE:
        raise VerificationError("provenance", f"unknown provenance predicate type "
                                              f"{st.get('predicateType')!r} (expected {PREDICATE_TYPE})")
    try:
        params = st["predicate"]["buildDefinition"]["externalParameters"]
        builder = st["predicate"]["runDetails"]["builder"]
        if not isinstance(params, dict) or not isinstance(builder, dict) \
                or not isinstance(builder.get("id"), str):
            raise TypeError
    except (KeyError, TypeError):
        raise VerificationError("provenance", "provenance lacks externalParameters or builder.id") from None
    scope, decision = params.get("scope"), params.get("decision")
    if scope is not None and not (isinstance(scope, str) and SCOPE.fullmatch(scope)):
        raise VerificationError("provenance", f"scope {scope!r} is not a plain name "
                                              "(letters, digits, '.', '_', '-'; not '.' or '..')")
    if decision is not None and not isinstance(decision, dict):
        raise VerificationError("provenance", "the decision in the provenance is not an object")
    return st


def subjects(st: dict) -> dict[str, str]:
    out = {}
    for s in st.get("subject") or []:
        if isinstance(s, dict) and isinstance(s.get("name"), str):
            out[s["name"]] = (s.get("digest") or {}).get("sha256")
    return out
