"""Policies: YAML files of CEL rules (cel-python) over a bundle's facts → allow, or deny with the
failing rules' reasons.

A policy file::

    name: default
    params: {min_gain: 0.03}
    rules:
      - name: trusted-signer
        require: bundle.signer.trusted          # CEL; must be true
        reason: the bundle is not signed by a trusted key

Variables: ``bundle`` (kind, version, scope, signer, builder, decision, variants, packages),
``job`` (id, deterministic) and ``params``. Search order for the default policy directory:
``$RTXOPS_POLICIES``, the source checkout's ``policies/``, ``<prefix>/share/rtxops/policies``.
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ._errors import UsageError

# cel-python's compiled programs run with their activation in its module's globals: two
# evaluations at once (the daemon issues a plan while the dashboard verifies a bundle) would read
# each other's facts. One at a time; a rule takes microseconds.
_EVALUATING = threading.Lock()
# and it logs "Internal error" for every rule that fails to evaluate, which evaluate() reports
logging.getLogger("celpy").setLevel(logging.CRITICAL)


class _DuplicateKey(Exception):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: it keeps the last one,
    so a second ``rules:`` or ``require:`` would drop rules without a word (failing open)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *defaults``: overridden on purpose
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:   # an unhashable key: the base constructor says so
                break
            if duplicate:
                raise _DuplicateKey(f"the key {key!r} is given twice in one mapping "
                                    f"(line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep)


@dataclass(frozen=True)
class Rule:
    name: str
    require: str
    reason: str
    program: Any = field(compare=False, repr=False)


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reasons: tuple[str, ...]   # one per failed rule: "policy/rule: reason"


@dataclass(frozen=True)
class Policy:
    name: str
    rules: tuple[Rule, ...]
    params: dict

    @classmethod
    def from_yaml(cls, text: str, where: str = "policy") -> Policy:
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
        except yaml.YAMLError as e:
            raise UsageError(f"{where} is not valid YAML: {e}") from None
        except _DuplicateKey as e:
            raise UsageError(f"{where}: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("rules"), list):
            raise UsageError(f"{where} must be a mapping with a 'rules' list")
        env = _cel_environment()
        rules = []
        for i, r in enumerate(data["rules"]):
            if not isinstance(r, dict) or not all(isinstance(r.get(k), str) for k in ("name", "require", "reason")):
                raise UsageError(f"{where}: rules[{i}] needs string 'name', 'require' and 'reason'")
            try:
                program = _program(env, r["require"])
            except Exception as e:  # CELParseError and friends
                raise UsageError(f"{where}: rule {r['name']!r} is not valid CEL: {e}") from None
            rules.append(Rule(r["name"], r["require"], r["reason"], program))
        params = data.get("params") or {}
        if not isinstance(params, dict):
            raise UsageError(f"{where}: params must be a mapping")
        try:  # a YAML date, say: every evaluation would fail on it, blamed on the bundle
            json.dumps(params, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise UsageError(f"{where}: params must hold JSON values (strings, numbers, booleans, "
                             f"lists, mappings): {e}") from None
        return cls(str(data.get("name") or Path(where).stem), tuple(rules), params)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Policy:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise UsageError(f"cannot read policy {path}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise UsageError(f"policy {path} is not UTF-8 text") from None
        return cls.from_yaml(text, str(path))

    def evaluate(self, bundle: dict, job: dict | None = None) -> Decision:
        import celpy

        # only the facts the rules name are converted to CEL values: converting a bundle's
        # package list costs more than evaluating every rule
        keys = _bundle_keys(self.rules)
        if keys is not None:
            bundle = {k: v for k, v in bundle.items() if k in keys}
        activation = {"bundle": celpy.json_to_cel(bundle),
                      "job": celpy.json_to_cel({"id": "", "deterministic": False, **(job or {})}),
                      "params": celpy.json_to_cel(self.params)}
        reasons = []
        for rule in self.rules:
            try:
                with _EVALUATING:
                    result = rule.program.evaluate(activation)
                ok = isinstance(result, bool) and bool(result)  # BoolType subclasses int: check value
                ok = ok or (type(result).__name__ == "BoolType" and bool(result))
            except Exception as e:  # an error evaluating a rule denies, with the error
                reasons.append(f"{self.name}/{rule.name}: could not be evaluated: {_cel_error(e)}")
                continue
            if not ok:
                reasons.append(f"{self.name}/{rule.name}: {rule.reason}")
        return Decision(not reasons, tuple(reasons))


def _cel_error(e: Exception) -> str:
    """cel-python's nested ``CELEvalError(message, type, args)`` as one line."""
    args = e.args
    while len(args) >= 3 and args[0] == "evaluation error" and isinstance(args[2], tuple) and args[2]:
        args = args[2]
    if not args:
        return type(e).__name__
    message = str(args[0])
    detail = args[2] if len(args) >= 3 and isinstance(args[2], tuple) else ()
    extra = ", ".join(str(d) for d in detail if str(d) not in message)
    return f"{message} ({extra})" if extra else message


_GRAMMAR_ATTEMPTS = 5


def _cel_environment():
    """A CEL environment whose programs are transpiled to Python (several times faster to
    evaluate than the interpreter).

    The first one in a process loads cel-python's grammar, which calls ``ast.literal_eval``.
    CPython before 3.11.9/3.12.3 tracks AST-conversion depth in one global (gh-106905), so
    another thread's ``ast.parse`` landing during it fails the load with a SystemError
    ("AST constructor recursion depth mismatch"). Nothing is cached on failure: try again.
    """
    import celpy

    for attempt in range(1, _GRAMMAR_ATTEMPTS + 1):
        try:
            return celpy.Environment(runner_class=celpy.CompiledRunner)
        except Exception as e:
            if attempt == _GRAMMAR_ATTEMPTS or not _is_ast_depth_race(e):
                raise


_HAS = re.compile(r"\bhas\s*\(")


def _program(env, require: str):
    """``require`` as a runnable CEL program. cel-python's compiled runner gives ``has()`` a
    Python bool that ``!`` and ``?:`` have no overload for (the rule then denies as "could not
    be evaluated"): rules that use it run on its interpreter."""
    import celpy

    ast = env.compile(require)
    if _HAS.search(require):
        return celpy.InterpretedRunner(env, ast)
    return env.program(ast)


def _is_ast_depth_race(error: BaseException | None) -> bool:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, SystemError) and "recursion depth mismatch" in str(error):
            return True
        error = getattr(error, "orig_exc", None) or error.__cause__ or error.__context__
    return False


_BUNDLE_FIELD = re.compile(r"\bbundle\s*\.\s*([A-Za-z_]\w*)(\s*\()?")
_BUNDLE_ANY = re.compile(r"\bbundle\b")


def _bundle_keys(rules: tuple[Rule, ...]) -> frozenset[str] | None:
    """The bundle facts the rules name as ``bundle.<key>``; None when one uses ``bundle``
    otherwise (then every fact is needed)."""
    keys: set[str] = set()
    for rule in rules:
        named = _BUNDLE_FIELD.findall(rule.require)
        # ``bundle.all(k, ...)`` and the like are macros over every fact, not fields
        if len(named) != len(_BUNDLE_ANY.findall(rule.require)) or any(call for _, call in named):
            return None
        keys.update(name for name, _ in named)
    return frozenset(keys)


def default_policy_dir() -> Path:
    named = os.environ.get("RTXOPS_POLICIES")
    if named:  # named, it is the one: a typo must not fall back to the shipped policy
        if not Path(named).is_dir() or not _policy_files(Path(named)):
            raise UsageError(f"RTXOPS_POLICIES={named} is not a folder holding policy files "
                             "(*.yaml, *.yml)")
        return Path(named)
    for c in (Path(__file__).resolve().parents[2] / "policies",
              Path(sys.prefix) / "share" / "rtxops" / "policies"):
        if c.is_dir() and _policy_files(c):
            return c
    raise UsageError("no policy directory found: set RTXOPS_POLICIES to a folder of policy YAML files")


def _policy_files(folder: Path) -> list[Path]:
    """The policy files of ``folder``: ``*.yaml`` and ``*.yml`` (a ``.yml`` one was skipped, its
    rules not enforced, without a word)."""
    return sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")])


def load_policies(paths: list[str | os.PathLike[str]] | None = None) -> list[Policy]:
    """The policies in ``paths`` (files or folders), else every file in the default folder."""
    files: list[Path] = []
    for p in paths or [default_policy_dir()]:
        p = Path(p)
        files += _policy_files(p) if p.is_dir() else [p]
    if not files:
        raise UsageError("no policy files given")
    return [Policy.load(f) for f in files]


def evaluate_all(policies: list[Policy], bundle: dict, job: dict | None = None) -> Decision:
    reasons: list[str] = []
    for p in policies:
        reasons += p.evaluate(bundle, job).reasons
    return Decision(not reasons, tuple(reasons))
