"""Plans: immutable, versioned routing tables (op × bucket → variant + config).

Canonical JSON (sorted keys, no whitespace) gives the digest. ``Plan.from_json`` and
``Plan.validate`` turn every malformed plan into a :class:`PlanError` naming the bad field.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Mapping

from .errors import PlanError, RuntimeErrorBase

MAX_VERSION = 2**62  # versions and steps fit the ledger's and the store's BIGINT columns


@dataclass(frozen=True)
class ExploreArm:
    """A share of a bucket's calls routed to another (variant, config) to measure it."""

    variant: str
    config: Mapping[str, Any]
    weight: float


@dataclass(frozen=True)
class PlanEntry:
    op: str
    bucket: str
    variant: str
    config: Mapping[str, Any] = field(default_factory=dict)
    explore: tuple[ExploreArm, ...] = ()


@dataclass(frozen=True)
class Plan:
    version: int
    entries: tuple[PlanEntry, ...] = ()
    defaults: Mapping[str, str] = field(default_factory=dict)
    parent: str | None = None
    created_at: str = ""
    effective_step: int | None = None
    # where the plan was tuned: {torch, triton, cuda, device}; None = anywhere (not in the JSON)
    environment: Mapping[str, str] | None = None

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict:
        d: dict[str, Any] = {
            "version": self.version,
            "parent": self.parent,
            "created_at": self.created_at,
            "defaults": dict(self.defaults),
            "entries": [
                {
                    "op": e.op,
                    "bucket": e.bucket,
                    "variant": e.variant,
                    "config": dict(e.config),
                    "explore": [
                        {"variant": a.variant, "config": dict(a.config), "weight": a.weight}
                        for a in e.explore
                    ],
                }
                for e in sorted(self.entries, key=lambda e: (e.op, e.bucket))
            ],
        }
        if self.effective_step is not None:
            d["effective_step"] = self.effective_step
        if self.environment is not None:
            d["environment"] = dict(self.environment)
        return d

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, no insignificant whitespace."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanError(f"plan is not valid JSON: {e}") from None
        except RecursionError:
            raise PlanError("plan is nested too deeply to be a plan") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        if not isinstance(data, dict):
            raise PlanError(f"plan must be a JSON object, got {type(data).__name__}")
        version = _field(data, "version", int, "plan")
        if version < 0:
            raise PlanError("plan.version must be >= 0")
        if version > MAX_VERSION:
            raise PlanError(f"plan.version must be <= 2**62, got {version}")
        entries = []
        for i, raw in enumerate(_field(data, "entries", list, "plan", default=[])):
            where = f"plan.entries[{i}]"
            if not isinstance(raw, dict):
                raise PlanError(f"{where} must be an object")
            arms = []
            for j, a in enumerate(_field(raw, "explore", list, where, default=[])):
                aw = f"{where}.explore[{j}]"
                if not isinstance(a, dict):
                    raise PlanError(f"{aw} must be an object")
                weight = _field(a, "weight", (int, float), aw)
                if not 0 < weight <= 1:
                    raise PlanError(f"{aw}.weight must be in (0, 1], got {weight}")
                arms.append(ExploreArm(_field(a, "variant", str, aw),
                                       _field(a, "config", dict, aw, default={}), float(weight)))
            if sum(a.weight for a in arms) > 1:
                raise PlanError(f"{where}.explore weights add up to more than 1")
            entries.append(PlanEntry(
                op=_field(raw, "op", str, where),
                bucket=_field(raw, "bucket", str, where),
                variant=_field(raw, "variant", str, where),
                config=_field(raw, "config", dict, where, default={}),
                explore=tuple(arms),
            ))
        seen = set()
        for e in entries:
            if (e.op, e.bucket) in seen:
                raise PlanError(f"plan has two entries for {e.op} bucket {e.bucket}")
            seen.add((e.op, e.bucket))
        defaults = _field(data, "defaults", dict, "plan", default={})
        for op, v in defaults.items():
            if not isinstance(v, str):
                raise PlanError(f"plan.defaults.{op} must be a variant name (string)")
        parent = data.get("parent")
        if parent is not None and not isinstance(parent, str):
            raise PlanError("plan.parent must be a digest string or null")
        step = data.get("effective_step")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)
                                 or not 0 <= step <= MAX_VERSION):
            raise PlanError("plan.effective_step must be an integer in [0, 2**62]")
        environment = data.get("environment")
        if environment is not None and (not isinstance(environment, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in environment.items())):
            raise PlanError("plan.environment must be an object of strings (torch, triton, cuda, device)")
        return cls(version, tuple(entries), defaults, parent,
                   _field(data, "created_at", str, "plan", default=""), step, environment)

    # ---- validation against a registry ----------------------------------------------------
    def validate(self, registry) -> Plan:
        """Check every op, variant, config and bucket against ``registry``; return self."""
        for op, variant in self.defaults.items():
            _check(registry, op, variant, {}, f"plan.defaults.{op}")
        for i, e in enumerate(self.entries):
            where = f"plan.entries[{i}]"
            _check(registry, e.op, e.variant, e.config, where)
            canonical = registry.op(e.op).parse_bucket(e.bucket).id
            if canonical != e.bucket:   # the runtime would never find the entry
                raise PlanError(f"{where}.bucket {e.bucket!r}: write it as {canonical!r}")
            for j, a in enumerate(e.explore):
                _check(registry, e.op, a.variant, a.config, f"{where}.explore[{j}]")
        return self

    def entry(self, op: str, bucket_id: str) -> PlanEntry | None:
        return self._index().get((op, bucket_id))

    def _index(self) -> dict:
        index = self.__dict__.get("_index_cache")
        if index is None:
            index = {(e.op, e.bucket): e for e in self.entries}
            object.__setattr__(self, "_index_cache", index)
        return index

    def derive(self, entries=None, defaults=None, effective_step=None) -> Plan:
        """A child plan: version + 1, parent = this plan's digest."""
        return Plan(
            version=self.version + 1,
            entries=tuple(self.entries if entries is None else entries),
            defaults=dict(self.defaults if defaults is None else defaults),
            parent=self.digest,
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            effective_step=effective_step,
            environment=self.environment,
        )

    def environment_mismatch(self, here: Mapping[str, str] | None = None) -> str | None:
        """Why this plan, tuned in another environment, must not run here; None when it may."""
        if not self.environment:
            return None
        here = current_environment() if here is None else here
        # (a device still unknown, "": CUDA not initialized by the job yet, is not compared)
        diffs = [f"{k} {v!r} (here {here.get(k)!r})" for k, v in sorted(self.environment.items())
                 if here.get(k) != v and not (k == "device" and here.get(k) == "")]
        if not diffs:
            return None
        return f"plan version {self.version} was tuned for another environment: " + ", ".join(diffs)


def current_environment(probe_cuda: bool = False) -> dict[str, str]:
    """This process's torch, triton, CUDA and device model (what a plan records it was tuned in).
    The device is "" (unknown) in a CUDA build of torch that has not initialized CUDA, unless
    ``probe_cuda``: a job must not initialize it before its script does (the daemon may)."""
    import importlib.metadata

    import torch

    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = ""
    if torch.cuda.is_initialized() or (probe_cuda and torch.cuda.is_available()):
        device = torch.cuda.get_device_name(0)
    else:
        device = "" if torch.version.cuda and not probe_cuda else "cpu"
    return {"torch": torch.__version__, "triton": triton, "cuda": torch.version.cuda or "",
            "device": device}


def default_plan() -> Plan:
    """Version 0: every op on its reference, so rtxops changes nothing."""
    return Plan(version=0)


def _field(data: dict, name: str, kind, where: str, default: Any = ...):
    if name not in data:
        if default is ...:
            raise PlanError(f"{where}.{name} is missing")
        return default
    value = data[name]
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise PlanError(f"{where}.{name} must be {want}, got {type(value).__name__}")
    return value


def _check(registry, op: str, variant: str, config: Mapping, where: str) -> None:
    try:
        v = registry.variant(op, variant)
    except RuntimeErrorBase as e:
        raise PlanError(f"{where}: {e}") from None
    problem = v.check_config(dict(config))
    if problem:
        raise PlanError(f"{where}: variant {op}/{variant}: {problem}")


__all__ = ["Plan", "PlanEntry", "ExploreArm", "default_plan", "current_environment"]
