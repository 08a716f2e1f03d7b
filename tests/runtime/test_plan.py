"""Plans: canonical JSON, digests, and a clear PlanError for every malformed plan."""
from __future__ import annotations

import json

import pytest

from rtxops.runtime.errors import PlanError
from rtxops.runtime.plan import Plan
from rtxops.runtime.registry import default_registry

GOOD = {
    "version": 2,
    "parent": None,
    "created_at": "2026-11-30T00:00:00+00:00",
    "defaults": {"gelu": "eager"},
    "entries": [
        {"op": "rms_norm", "bucket": "float32/cpu/hidden=64,rows=16", "variant": "chunked",
         "config": {"chunk_rows": 256},
         "explore": [{"variant": "fused", "config": {}, "weight": 0.1}]},
    ],
}


def test_round_trip_is_canonical_and_digest_is_stable():
    plan = Plan.from_dict(GOOD).validate(default_registry())
    text = plan.to_json()
    assert json.loads(text) == GOOD
    assert text == json.dumps(GOOD, sort_keys=True, separators=(",", ":"))
    reordered = json.dumps(dict(reversed(list(GOOD.items()))))
    assert Plan.from_json(reordered).digest == plan.digest
    child = plan.derive()
    assert child.version == 3 and child.parent == plan.digest and child.digest != plan.digest


def _with(**changes):
    d = json.loads(json.dumps(GOOD))
    for path, value in changes.items():
        target = d
        keys = path.split("__")
        for k in keys[:-1]:
            target = target[int(k)] if k.isdigit() else target[k]
        if value is KeyError:
            del target[keys[-1]]
        else:
            target[keys[-1]] = value
    return json.dumps(d)


@pytest.mark.parametrize("text,message", [
    ("{", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    ('{"version": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ("[1, 2]", "must be a JSON object"),
    (_with(version=KeyError), "plan.version is missing"),
    (_with(version="7"), "plan.version must be int"),
    (_with(version=True), "plan.version must be int"),
    (_with(version=-1), ">= 0"),
    (_with(version=10**30), "plan.version must be <= 2**62"),
    (_with(effective_step=10**30), "plan.effective_step must be an integer in [0, 2**62]"),
    (_with(entries="x"), "plan.entries must be list"),
    (_with(entries__0__op=KeyError), "plan.entries[0].op is missing"),
    (_with(entries__0__variant=KeyError), "plan.entries[0].variant is missing"),
    (_with(entries__0__explore__0__weight=1.5), "weight must be in (0, 1]"),
    (_with(defaults={"gelu": 3}), "must be a variant name"),
])
def test_malformed_plans_raise_plan_error(text, message):
    with pytest.raises(PlanError) as e:
        Plan.from_json(text)
    assert message in str(e.value)


@pytest.mark.parametrize("text,message", [
    (_with(entries__0__op="conv9d"), "unknown op 'conv9d'"),
    (_with(entries__0__variant="warp_speed"), "unknown variant 'warp_speed' for op 'rms_norm'"),
    (_with(entries__0__config={"chunk_rows": 3}), "chunk_rows=3 not in"),
    (_with(entries__0__config={"tile": 3}), "unknown config key 'tile'"),
    (_with(entries__0__bucket="float32-cpu"), "is not of the form"),
    (_with(entries__0__bucket="float99/cpu/hidden=4"), "unknown dtype 'float99'"),
    # the runtime keys on the dims in the op's order: an entry written otherwise never applied
    (_with(entries__0__bucket="float32/cpu/rows=512,hidden=64"),
     "bucket 'float32/cpu/rows=512,hidden=64': write it as 'float32/cpu/hidden=64,rows=512'"),
    (_with(entries__0__bucket="float32/cpu/hidden=64"), "must give each of hidden, rows once"),
    (_with(defaults={"gelu": "nope"}), "plan.defaults.gelu: unknown variant 'nope'"),
])
def test_plans_naming_unknown_things_fail_validation(text, message):
    plan = Plan.from_json(text)
    with pytest.raises(PlanError) as e:
        plan.validate(default_registry())
    assert message in str(e.value)


def test_environment_is_optional_and_keeps_old_digests():
    plain = Plan.from_dict({"version": 1, "defaults": {"gelu": "algebraic"}})
    assert "environment" not in plain.to_json()
    assert plain.digest == Plan.from_json(plain.to_json()).digest
    env = {"torch": "2.0", "triton": "3.0", "cuda": "12.4", "device": "NVIDIA H100"}
    tuned = Plan.from_dict({"version": 1, "defaults": {"gelu": "algebraic"}, "environment": env})
    assert tuned.digest != plain.digest and Plan.from_json(tuned.to_json()).environment == env
    assert tuned.environment_mismatch(env) is None
    problem = tuned.environment_mismatch({**env, "device": "cpu"})
    assert "another environment" in problem and "device 'NVIDIA H100' (here 'cpu')" in problem
    assert plain.environment_mismatch({"device": "cpu"}) is None
    with pytest.raises(PlanError, match="plan.environment"):
        Plan.from_dict({"version": 1, "environment": {"torch": 2}})


def test_the_plan_docs_list_every_op_with_its_variants_and_dims():
    """docs/plan.md is where a user finds what a plan may name: it must not fall behind."""
    from pathlib import Path

    from rtxops.runtime.registry import default_registry

    text = (Path(__file__).resolve().parents[2] / "docs" / "plan.md").read_text()
    registry = default_registry()
    for spec in registry.ops():
        row = f"| `{spec.name}` | {', '.join(v.name for v in registry.variants(spec.name))} | " \
              f"{', '.join(spec.dims)} |"
        assert row in text, row
