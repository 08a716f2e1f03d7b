"""The kernel variants a plan uses, with their source files, for the bundle and its SBOM."""
from __future__ import annotations

import hashlib
import inspect
import json

from .sbom import KernelComponent


def plan_kernels(plan, registry) -> tuple[list[KernelComponent], dict[str, str]]:
    """``(components, {bundle path: source text})`` for every variant in ``plan``."""
    uses: dict[tuple[str, str], set[str]] = {}

    def use(op: str, variant: str, config) -> None:
        uses.setdefault((op, variant), set()).add(json.dumps(dict(config), sort_keys=True))

    for op, variant in plan.defaults.items():
        use(op, variant, {})
    for e in plan.entries:
        use(e.op, e.variant, e.config)
        for arm in e.explore:
            use(e.op, arm.variant, arm.config)
    components, sources = [], {}
    for (op, name), configs in sorted(uses.items()):
        v = registry.variant(op, name)
        path, text = _source(v)
        sources[path] = text
        components.append(KernelComponent(op, name, v.family, bool(v.deterministic), path,
                                          _sha256(text), tuple(sorted(configs))))
    return components, sources


def unlike_local(variants: list[dict], registry) -> str | None:
    """Why the signed kernels (the SBOM's ``variants``, as :func:`.sbom.facts` gives them) are
    not the ones ``registry`` would run, or None. A variant ``registry`` lacks is left to the
    plan's install, which refuses it."""
    for signed in variants:
        try:
            v = registry.variant(signed["op"], signed["variant"])
        except KeyError:
            continue
        name = f"{signed['op']}/{signed['variant']}"
        local = _sha256(_source(v)[1])
        if local != signed["source_sha256"]:
            return (f"{name}: this job's source (sha256 {local[:16]}…) is not the signed one "
                    f"({signed['source_sha256'][:16]}…): the plan was signed for another kernel build")
        if bool(v.deterministic) != signed["deterministic"]:
            return (f"{name}: deterministic is {bool(v.deterministic)} here, "
                    f"{signed['deterministic']} in the signed SBOM")
    return None


def _source(variant) -> tuple[str, str]:
    """(bundle path, source text) of the module that builds ``variant``."""
    module = inspect.getmodule(variant.build)
    text = inspect.getsource(module) if module else ""
    return f"kernels/{module.__name__ if module else variant.op + '.' + variant.name}.py", text


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
