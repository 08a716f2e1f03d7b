"""Candidate arms for a hot bucket: the variants × configs that apply to its device and dtype."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from rtxops.runtime.bucket import Bucket
from rtxops.runtime.registry import Registry


@dataclass(frozen=True, order=True)
class Arm:
    """One (variant, config) to try; the config is canonical JSON so arms are hashable."""

    variant: str
    config_json: str = "{}"

    @classmethod
    def of(cls, variant: str, config: dict | None = None) -> Arm:
        return cls(variant, json.dumps(config or {}, sort_keys=True, separators=(",", ":")))

    @property
    def config(self) -> dict:
        return json.loads(self.config_json)

    def __str__(self) -> str:
        return self.variant if self.config_json == "{}" else f"{self.variant} {self.config_json}"


def candidates(registry: Registry, op: str, bucket: Bucket, *, deterministic: bool = False,
               max_configs_per_variant: int = 8) -> list[Arm]:
    """Every (variant, full config) that supports ``bucket``; non-deterministic variants are left
    out when the job asks for determinism. Configs are the variant's space with its defaults
    filled in (the form kernel spans carry), at most ``max_configs_per_variant`` each."""
    out = []
    for variant in registry.variants(op):
        if not variant.supports(bucket) or (deterministic and not variant.deterministic):
            continue
        configs = [{**variant.default_config, **c} for c in variant.configs()]
        for config in _spread(configs, variant.default_config, max_configs_per_variant,
                              f"{op}/{variant.name}"):
            out.append(Arm.of(variant.name, config))
    return out


def _spread(configs: list[dict], default: dict, cap: int, seed: str) -> list[dict]:
    """At most ``cap`` of ``configs``: the default first, then ones that bring values of some key
    not yet among the chosen (most new values first), then a sample; the same for the same
    ``seed``. The first ``cap`` in order left whole dimensions untried (every triton
    cross_entropy candidate had ``block_v`` auto)."""
    if len(configs) <= cap:
        return configs
    order = list(configs)
    random.Random(seed).shuffle(order)
    chosen = [c for c in order if c == default][:1]
    covered = {item for c in chosen for item in c.items()}
    rest = [c for c in order if c not in chosen]
    while len(chosen) < cap and rest:
        best = max(rest, key=lambda c: len(set(c.items()) - covered))   # first of the most new
        if not set(best.items()) - covered:
            break
        chosen.append(best)
        covered |= set(best.items())
        rest.remove(best)
    return chosen + rest[:cap - len(chosen)]
