"""Loading CEL's grammar while another thread parses Python: CPython 3.11.7's AST conversion
tracks its depth in one global (gh-106905), so the load can fail once. It must not fail a policy."""
import ast
import gc
import sys
import threading

import celpy
import pytest

from rtxops.governance.policy import Policy

POLICY = "rules:\n - name: kind\n   require: bundle.kind == 'plan'\n   reason: not a plan\n"


class OneRaceDuringAstConversion:
    """Once, while this thread is inside ``ast.parse`` (lark's ``literal_eval``), a garbage
    collection hands the GIL to a thread that runs a whole ``ast.parse`` of its own."""

    def __init__(self):
        self.armed = True
        self.go, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._other_parse, daemon=True)
        self.owner = threading.get_ident()

    def _other_parse(self):
        self.go.wait()
        ast.parse("x = [1, 2, 3]")
        self.done.set()

    def _on_gc(self, phase, info):
        if not self.armed or threading.get_ident() != self.owner or phase != "start":
            return
        caller = sys._getframe(1)
        if caller.f_code.co_name == "parse" and caller.f_code.co_filename.endswith("ast.py"):
            self.armed = False
            self.go.set()
            self.done.wait(10)

    def __enter__(self):
        self.threshold = gc.get_threshold()
        gc.set_threshold(20)
        gc.callbacks.append(self._on_gc)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._on_gc)
        gc.set_threshold(*self.threshold)
        self.go.set()
        self.thread.join(10)


@pytest.fixture
def fresh_grammar():
    loaded = celpy.CELParser.CEL_PARSER
    celpy.CELParser.CEL_PARSER = None
    yield
    if celpy.CELParser.CEL_PARSER is None:
        celpy.CELParser.CEL_PARSER = loaded


def test_a_policy_loads_when_another_thread_parses_python_during_the_grammar_load(fresh_grammar):
    with OneRaceDuringAstConversion() as race:
        policy = Policy.from_yaml(POLICY)
    assert not race.armed, "the race was never injected: this test no longer tests anything"
    assert policy.evaluate({"kind": "plan"}).allowed
    assert policy.evaluate({"kind": "kernel"}).reasons == ("policy/kind: not a plan",)
