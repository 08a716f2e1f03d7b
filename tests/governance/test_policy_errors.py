"""Policies under bad input and concurrency: a rule that cannot be evaluated denies with one
readable line (no "Internal error" from cel-python), a policy file that is not UTF-8 or whose
params are not JSON values is refused on loading, a misspelt RTXOPS_POLICIES is an error (not the
shipped policy), and evaluations on two threads never see each other's facts."""
from __future__ import annotations

import logging
import threading

import pytest

from rtxops.governance._errors import UsageError
from rtxops.governance.policy import Policy, default_policy_dir

from .._bounded import joined

TRUSTED = "name: t\nrules:\n  - {name: trusted, require: bundle.signer.trusted, reason: untrusted}\n"


def test_a_rule_that_cannot_be_evaluated_denies_with_one_readable_line(caplog):
    policy = Policy.from_yaml("name: t\nrules:\n"
                              "  - {name: a, require: 'bundle.nosuch == 1', reason: r}\n"
                              "  - {name: b, require: '1/0 == 1', reason: r}\n")
    with caplog.at_level(logging.DEBUG):
        decision = policy.evaluate({"kind": "plan"})
    assert not decision.allowed
    assert decision.reasons == ("t/a: could not be evaluated: no such member in mapping: 'nosuch'",
                                "t/b: could not be evaluated: divide by zero (integer division or "
                                "modulo by zero)")
    assert "Internal error" not in caplog.text


def test_policy_files_that_cannot_be_policies_are_refused_on_loading(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe rules: []")
    with pytest.raises(UsageError, match="is not UTF-8 text"):
        Policy.load(binary)
    with pytest.raises(UsageError, match="params must hold JSON values"):
        Policy.from_yaml("params: {since: 2024-01-01}\n" + TRUSTED.split("\n", 1)[1])
    # PyYAML keeps the last of a repeated key: a second `rules:` dropped the first ones unsaid
    with pytest.raises(UsageError, match="the key 'rules' is given twice"):
        Policy.from_yaml(TRUSTED + "rules: []\n")
    anchored = ("base: &b {name: a, require: 'true', reason: r}\n"
                "rules:\n  - <<: *b\n    name: b\n")   # a merge key is overridden on purpose
    assert [r.name for r in Policy.from_yaml(anchored).rules] == ["b"]


def test_a_misspelt_policies_folder_is_an_error_not_the_shipped_policy(tmp_path, monkeypatch):
    (tmp_path / "strict").mkdir()
    (tmp_path / "strict" / "strict.yaml").write_text(TRUSTED)
    monkeypatch.setenv("RTXOPS_POLICIES", str(tmp_path / "strict"))
    assert default_policy_dir() == tmp_path / "strict"
    monkeypatch.setenv("RTXOPS_POLICIES", str(tmp_path / "strcit"))
    with pytest.raises(UsageError, match="strcit is not a folder holding policy files"):
        default_policy_dir()
    monkeypatch.delenv("RTXOPS_POLICIES")
    assert default_policy_dir().name == "policies"  # unset: the shipped one


def test_evaluations_on_two_threads_never_see_each_others_facts():
    """cel-python keeps the activation of a compiled program in its module's globals."""
    import sys

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    policy = Policy.from_yaml(TRUSTED)
    wrong: list[str] = []

    def run(trusted: bool) -> None:
        for _ in range(3000):
            if policy.evaluate({"signer": {"trusted": trusted}}).allowed != trusted:
                wrong.append("allowed an untrusted signer" if not trusted else "denied a trusted one")

    try:
        threads = [threading.Thread(target=run, args=(t,)) for t in (True, False)]
        for t in threads:
            t.start()
        for t in threads:
            joined(t)
    finally:
        sys.setswitchinterval(before)
    assert not wrong, f"{len(wrong)} wrong decisions, e.g. {wrong[0]}"


@pytest.mark.parametrize("require,facts,allowed", [
    # has() guards an optional fact: the compiled runner's has() could not be negated or branched on
    ("!has(bundle.decision.p_value) || bundle.decision.p_value < 0.05", {"decision": {}}, True),
    ("!has(bundle.decision.p_value) || bundle.decision.p_value < 0.05", {"decision": {"p_value": 0.5}}, False),
    ("has(bundle.decision.p_value) ? bundle.decision.p_value < 0.05 : true", {"decision": {}}, True),
    ("has(bundle.decision.kind) && bundle.decision.kind == 'promote'", {"decision": {"kind": "promote"}}, True),
    # macros over the whole bundle see every fact (they were handed an empty map)
    ('bundle.all(k, k != "decision")', {"kind": "plan", "decision": {}}, False),
    ('bundle.all(k, k != "decision")', {"kind": "plan"}, True),
    ('bundle.exists(k, k == "kind")', {"kind": "plan", "decision": {}}, True),
])
def test_optional_facts_and_macros_over_the_bundle_evaluate_as_cel_says(require, facts, allowed):
    policy = Policy.from_yaml(f"name: t\nrules:\n  - {{name: r, require: {require!r}, reason: denied}}\n")
    decision = policy.evaluate(facts)
    assert decision.allowed is allowed, decision.reasons


def test_a_yml_policy_in_the_folder_is_enforced_too(tmp_path, monkeypatch):
    """Only *.yaml files were read: a strict.yml beside them was skipped in silence."""
    from rtxops.governance.policy import load_policies

    (tmp_path / "base.yaml").write_text(TRUSTED)
    (tmp_path / "strict.yml").write_text("name: strict\nrules:\n"
                                         "  - {name: never, require: 'false', reason: closed}\n")
    monkeypatch.setenv("RTXOPS_POLICIES", str(tmp_path))
    names = [p.name for p in load_policies()]
    assert names == ["t", "strict"]
    (tmp_path / "base.yaml").unlink()
    assert [p.name for p in load_policies()] == ["strict"]   # a folder of .yml files alone
