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
        module = inspect.getmodule(v.build)
        text = inspect.getsource(module) if module else ""
        path = f"kernels/{module.__name__ if module else op + '.' + name}.py"
        sources[path] = text
        components.append(KernelComponent(op, name, v.family, bool(v.deterministic), path,
                                          hashlib.sha256(text.encode()).hexdigest(),
                                          tuple(sorted(configs))))
    return components, sources
