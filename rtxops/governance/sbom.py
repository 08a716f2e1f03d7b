"""CycloneDX 1.6 SBOMs (cyclonedx-python-lib): the Python environment's packages (torch, triton,
CUDA where present) plus one component per kernel variant a plan uses, with its source hash and
config. Reproducible: no serial number, no timestamp, components sorted, canonical JSON."""
from __future__ import annotations

import functools
import importlib.metadata as md
import json
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from ._errors import VerificationError

SPEC_VERSION = "1.6"


@dataclass(frozen=True)
class KernelComponent:
    """A kernel variant shipped in a bundle: ``source`` is its path inside the bundle."""

    op: str
    variant: str
    family: str
    deterministic: bool
    source: str
    source_sha256: str
    configs: tuple[str, ...] = field(default=())  # canonical JSON of each config used


def build(kernels: list[KernelComponent] | tuple = (), name: str = "rtxops-bundle",
          kind: str = "plan") -> bytes:
    """The SBOM as canonical JSON bytes, validated with the library's strict JSON validator.
    Reproducible, so the same inputs in one process (same environment) give the cached bytes."""
    return _build(tuple(kernels), name, kind)


@functools.lru_cache(maxsize=64)
def _build(kernels: tuple[KernelComponent, ...], name: str, kind: str) -> bytes:
    from cyclonedx.model import HashAlgorithm, HashType, Property
    from cyclonedx.model.bom import Bom
    from cyclonedx.model.component import Component, ComponentType
    from cyclonedx.output.json import JsonV1Dot6

    bom = Bom()
    bom.metadata.component = Component(name=name, type=ComponentType.APPLICATION, bom_ref="bundle",
                                       properties=[Property(name="rtx:kind", value=kind)])
    for k in kernels:
        props = [Property(name="rtx:op", value=k.op), Property(name="rtx:variant", value=k.variant),
                 Property(name="rtx:family", value=k.family),
                 Property(name="rtx:deterministic", value=str(k.deterministic).lower()),
                 Property(name="rtx:source", value=k.source)]
        props += [Property(name="rtx:config", value=c) for c in k.configs]
        bom.components.add(Component(
            name=f"{k.op}/{k.variant}", type=ComponentType.LIBRARY, group="rtxops.kernels",
            version=k.source_sha256[:12], bom_ref=f"kernel:{k.op}/{k.variant}",
            hashes=[HashType(alg=HashAlgorithm.SHA_256, content=k.source_sha256)], properties=props))
    with warnings.catch_warnings():  # a bundle without kernels has no dependency graph: fine
        warnings.simplefilter("ignore", UserWarning)
        data = json.loads(JsonV1Dot6(bom).output_as_string())
    env = _environment()
    data["components"] = sorted(data.get("components", []) + env["components"],
                                key=lambda c: c["bom-ref"])
    data["dependencies"] = sorted(data.get("dependencies", []) + env["dependencies"],
                                  key=lambda d: d["ref"])
    data.pop("serialNumber", None)
    data.get("metadata", {}).pop("timestamp", None)
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    problem = schema_problem(text)  # the strict 1.6 schema, before signing
    if problem:
        raise VerificationError("sbom", f"the SBOM built fails the CycloneDX {SPEC_VERSION} schema: {problem}")
    return text.encode()


def schema_problem(text: str) -> str | None:
    """Why ``text`` is not a valid CycloneDX 1.6 JSON document, or None. Checked against the
    library's strict 1.6 schema files with jsonschema_rs (the library's own validator imports in
    seconds, which a job verifying a plan cannot afford)."""
    try:
        try:
            data = json.loads(text)
        except ValueError as e:
            return f"not JSON: {e}"
        for error in _schema_validator().iter_errors(data):
            return str(error).splitlines()[0][:500]
        return None
    except RecursionError:
        return "nested too deeply to be a CycloneDX document"


@functools.lru_cache(maxsize=1)
def _schema_validator():
    import jsonschema_rs
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.schema._res import BOM_JSON_STRICT, CRYPTOGRAPHY_DEFS, JSF, SPDX_JSON

    prefix = "http://cyclonedx.org/schema/"
    refs = {f"{prefix}spdx.SNAPSHOT.schema.json": SPDX_JSON, f"{prefix}jsf-0.82.SNAPSHOT.schema.json": JSF,
            f"{prefix}cryptography-defs.SNAPSHOT.schema.json": CRYPTOGRAPHY_DEFS}

    def retrieve(uri: str):
        if uri not in refs:
            raise ValueError(f"schema {uri} is not bundled (no network lookups)")
        with open(refs[uri]) as f:
            return json.load(f)

    with open(BOM_JSON_STRICT[SchemaVersion.V1_6]) as f:
        schema = json.load(f)
    return jsonschema_rs.Draft7Validator(schema, retriever=retrieve, validate_formats=True)


def facts(sbom: dict) -> dict[str, Any]:
    """What policies see of an SBOM: packages (name, version, licenses) and kernel variants."""
    packages, variants = [], []
    for c in sbom.get("components", []):
        props = {}
        for p in c.get("properties", []):
            props.setdefault(p.get("name"), p.get("value"))
        if c.get("group") == "rtxops.kernels":
            variants.append({"op": props.get("rtx:op", ""), "variant": props.get("rtx:variant", ""),
                             "family": props.get("rtx:family", ""),
                             "deterministic": props.get("rtx:deterministic") == "true",
                             "source": props.get("rtx:source", ""),
                             "source_sha256": next((h.get("content", "") for h in c.get("hashes", [])), "")})
        else:
            licenses = [lic.get("license", {}).get("name") or lic.get("license", {}).get("id")
                        or lic.get("expression", "") for lic in c.get("licenses", [])]
            packages.append({"name": c.get("name", ""), "version": c.get("version", ""),
                             "licenses": [x for x in licenses if x]})
    return {"packages": packages, "variants": variants}


@functools.lru_cache(maxsize=1)
def _environment() -> dict:
    """The installed Python packages as CycloneDX components (cached: a process's environment
    does not change while it runs)."""
    from cyclonedx.model import Property
    from cyclonedx.model.bom import Bom
    from cyclonedx.model.component import Component, ComponentType
    from cyclonedx.model.license import DisjunctiveLicense
    from cyclonedx.output.json import JsonV1Dot6
    from packageurl import PackageURL

    bom = Bom()
    seen = set()
    for dist in md.distributions():
        name, version = dist.metadata.get("Name"), dist.version
        if not name or name.lower() in seen:
            continue
        seen.add(name.lower())
        lic = dist.metadata.get("License-Expression") or dist.metadata.get("License") or ""
        licenses = [DisjunctiveLicense(name=lic.strip())] if lic.strip() and len(lic) < 100 else []
        bom.components.add(Component(
            name=name, version=version, type=ComponentType.LIBRARY, bom_ref=f"pkg:pypi/{name.lower()}",
            purl=PackageURL(type="pypi", name=name.lower(), version=version), licenses=licenses))
    cuda = _torch_cuda()
    if cuda:
        bom.components.add(Component(name="cuda", version=cuda, type=ComponentType.PLATFORM,
                                     bom_ref="platform:cuda",
                                     properties=[Property(name="rtx:source", value="torch.version.cuda")]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        data = json.loads(JsonV1Dot6(bom).output_as_string())
    return {"components": data.get("components", []), "dependencies": data.get("dependencies", [])}


def _torch_cuda() -> str | None:
    """torch's CUDA version, read from its version file (importing torch takes seconds)."""
    try:
        text = md.distribution("torch").locate_file("torch/version.py").read_text()
    except (md.PackageNotFoundError, OSError):
        return None
    m = re.search(r"^cuda\b[^=]*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return m.group(1) if m else None
