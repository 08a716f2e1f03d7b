"""Candidate arms for a hot bucket: the variants × configs that apply to its device and dtype."""
from __future__ import annotations

import json
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
        for i, config in enumerate(variant.configs()):
            if i >= max_configs_per_variant:
                break
            out.append(Arm.of(variant.name, {**variant.default_config, **config}))
    return out
