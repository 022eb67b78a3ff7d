"""The compiled RVM path (what decides in production) and the interpreter (what runs the Rego
tests) decide the same, and `run_rego_tests` holds every test to that.

First, the shipped policy is decided on both engines for inputs that trip engines up (absent,
empty, listed and wrongly typed arguments and approvals) under every capability set of a
consequential tool. Then `run_rego_tests` is given policies whose bug exists on one engine only:
a test that passes on the interpreter must still fail.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import regorus
import typer

from policy import EmbeddedEngine, PolicyInput, PolicySettings, load_bundle, run_rego_tests
from policy.base import ToolInfo
from router import Settings
from router.interfaces import policy_cli
from tests.conftest import REPO

CATALOG: dict[str, Any] = load_bundle(REPO / "policies").data["stockade"]["catalog"]


def consequential_capability_sets() -> list[list[str]]:
    """Every set of catalogued capabilities holding at least one consequential capability."""
    capabilities: list[str] = CATALOG["capabilities"]
    consequential = set(CATALOG["consequential_capabilities"])
    return [
        list(subset)
        for size in range(1, len(capabilities) + 1)
        for subset in itertools.combinations(capabilities, size)
        if consequential & set(subset)
    ]


CAPABILITY_SETS = consequential_capability_sets()

# The arguments a tool with destination "to" and amount "amount" is called with.
ARGUMENTS: dict[str, dict[str, Any]] = {
    "absent_destination_and_amount": {"subject": "hi"},
    "only_a_destination": {"to": "bob@example.com"},
    "only_an_amount": {"amount": 100},
    "empty_strings": {"to": "", "amount": ""},
    "empty_lists": {"to": [], "amount": []},
    "lists_of_values": {"to": ["bob@example.com", "eve@attacker.example"], "amount": [1, 2.5]},
    "mixed_list": {"to": ["bob@example.com", None, 3, {"x": []}], "amount": [None]},
    "number_where_a_string_is_expected": {"to": 42, "amount": "100"},
    "null": {"to": None, "amount": None},
    "nested_objects": {"to": {"address": {"email": "bob@example.com"}}, "amount": {"value": 5, "currency": "EUR"}},
    "booleans": {"to": True, "amount": False},
    # A float: an integer past 64 bits never reaches policy (`policy.base.EXACT_INTEGERS`).
    "huge_number": {"to": "bob@example.com", "amount": 1e30},
}

# Where each present argument was seen (None: the router traced nothing for it).
SOURCES: dict[str, list[str] | None] = {
    "user": ["user"],
    "untrusted": ["untrusted:get_webpage:c-5"],
    "both": ["untrusted:get_webpage:c-5", "user"],
    "nowhere": [],
    "untraced": None,
}

# Approvals as a misbehaving store could hand them over (PolicyInput.approval is any object).
APPROVALS: dict[str, dict[str, Any]] = {
    "reasons_is_a_string": {"status": "approved", "reasons": "approval.high_risk"},
    "reasons_is_null": {"status": "approved", "reasons": None},
    "reasons_missing": {"status": "approved"},
    "status_is_a_number": {"status": 1, "reasons": ["approval.high_risk"]},
    "reasons_of_wrong_types": {"status": "approved", "reasons": [None, 1, {"code": "approval.high_risk"}]},
    "empty": {},
    "every_reason": {
        "status": "approved",
        "reasons": ["approval.high_risk", "approval.financial", "approval.external_after_untrusted"],
    },
}


def consequential_input(
    capabilities: list[str], args: dict[str, Any], sources: list[str] | None, taint: list[str], risk: str = "medium"
) -> PolicyInput:
    tool: dict[str, Any] = {
        "name": "pay_or_send",
        "capabilities": capabilities,
        "risk": risk,
        "destination_args": ["to"],
        "amount_args": ["amount"],
        "sensitive_args": ["amount"],
        "content_args": ["subject"],
    }
    traced = {} if sources is None else dict.fromkeys(args, sources)
    document: dict[str, Any] = {
        "subject": {"agent": "a", "principal": "p@example.com"},
        "session": {"id": "s-1", "taint": taint},
        # Only the fields this version of the models has: the policy and its input evolve together.
        "tool": {key: value for key, value in tool.items() if key in ToolInfo.model_fields},
        "args": args,
        "provenance": traced,
        "values": {arg: [{"path": arg, "sources": found}] for arg, found in traced.items()},
        "now": "2026-11-22T10:00:00Z",
    }
    return PolicyInput.model_validate({k: v for k, v in document.items() if k in PolicyInput.model_fields})


class Interpreter:
    """The interpreter as the embedded engine confirms decisions on it: one engine for the bundle,
    reused, the input swapped per call (``evaluate_interpreted`` clones one per call: 4x slower)."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self._engine = regorus.Engine()
        for path, text in engine.bundle.modules:
            self._engine.add_policy(path, text)
        self._engine.add_data_json(engine.bundle.data_json)

    def decide(self, policy_input: PolicyInput) -> Any:
        self._engine.set_input_json(policy_input.model_dump_json())
        return json.loads(self._engine.eval_rule_as_json("data.stockade.decision"))


def both(engine: EmbeddedEngine, interpreter: Interpreter, policy_input: PolicyInput) -> tuple[Any, Any]:
    """The decision on the RVM alone and on the interpreter; ("error",) where one raised."""
    try:
        raw = engine.evaluate_raw(policy_input)
        rvm = json.loads(raw) if raw is not None else None
    except Exception:  # an RVM error is a value to compare, like the interpreter's
        rvm = ("error",)
    try:
        decided = interpreter.decide(policy_input)
    except Exception:
        decided = ("error",)
    return rvm, decided


def disagreements(engine: EmbeddedEngine, interpreter: Interpreter, cases: list[tuple[str, PolicyInput]]) -> list[str]:
    found = []
    for label, policy_input in cases:
        rvm, decided = both(engine, interpreter, policy_input)
        if rvm != decided:
            found.append(f"{label}: RVM {json.dumps(rvm)[:300]} | interpreter {json.dumps(decided)[:300]}")
    return found


@pytest.fixture(scope="module")
def engine() -> EmbeddedEngine:
    return EmbeddedEngine(PolicySettings(dir=REPO / "policies"))


@pytest.fixture(scope="module")
def interpreter(engine: EmbeddedEngine) -> Interpreter:
    return Interpreter(engine)


def test_there_are_consequential_capability_sets_to_try() -> None:
    assert len(CAPABILITY_SETS) >= 2
    assert all(set(s) & set(CATALOG["consequential_capabilities"]) for s in CAPABILITY_SETS)


@pytest.mark.parametrize("shape", ARGUMENTS)
def test_the_reused_interpreter_decides_as_evaluate_interpreted(
    engine: EmbeddedEngine, interpreter: Interpreter, shape: str
) -> None:
    for policy_input in (
        consequential_input(CAPABILITY_SETS[0], ARGUMENTS[shape], SOURCES["untrusted"], ["untrusted_content"]),
        consequential_input(CAPABILITY_SETS[-1], ARGUMENTS[shape], SOURCES["user"], []),
    ):
        assert interpreter.decide(policy_input) == engine.evaluate_interpreted(policy_input)


@pytest.mark.parametrize("shape", ARGUMENTS)
def test_engines_agree_on_tricky_arguments_of_every_consequential_tool(
    engine: EmbeddedEngine, interpreter: Interpreter, shape: str
) -> None:
    args = ARGUMENTS[shape]
    cases = [
        (
            f"{shape} caps={caps} sources={label} taint={taint}",
            consequential_input(caps, args, sources, taint),
        )
        for caps in CAPABILITY_SETS
        for label, sources in SOURCES.items()
        for taint in ([], ["untrusted_content"])
    ]
    found = disagreements(engine, interpreter, cases)
    assert found == [], f"{len(found)} of {len(cases)} inputs decided differently, e.g.:\n" + "\n".join(found[:5])


@pytest.mark.parametrize("approval", APPROVALS)
def test_engines_agree_on_malformed_approvals_of_every_consequential_tool(
    engine: EmbeddedEngine, interpreter: Interpreter, approval: str
) -> None:
    cases = [
        (
            f"{approval} caps={caps} risk={risk}",
            consequential_input(caps, {"to": "bob@example.com"}, ["user"], ["untrusted_content"], risk).model_copy(
                update={"approval": APPROVALS[approval]}
            ),
        )
        for caps in CAPABILITY_SETS
        for risk in ("medium", "high")
    ]
    found = disagreements(engine, interpreter, cases)
    assert found == [], f"{len(found)} of {len(cases)} inputs decided differently, e.g.:\n" + "\n".join(found[:5])


# -- run_rego_tests decides every input a test feeds on both engines ------------------------


def test_every_shipped_rego_test_is_replayed_on_the_rvm() -> None:
    results = run_rego_tests(REPO / "policies")
    assert results
    assert [r.name for r in results if not r.replayed] == []
    assert [(r.name, r.not_replayed) for r in results if r.not_replayed] == []


def write(root: Path, decision: str, tests: str, data: dict[str, Any] | None = None) -> Path:
    (root / "stockade").mkdir(parents=True, exist_ok=True)
    (root / "stockade" / "decision.rego").write_text(decision)
    (root / "stockade" / "decision_test.rego").write_text(tests)
    if data is not None:
        (root / "stockade" / "data.json").write_text(json.dumps(data))
    return root


# The destination arguments that are present, spelt two ways. On the RVM (regorus 0.13) neither
# filters out an absent key: the bug that once let every destination check pass unnoticed.
RVM_ONLY_BUGS = {
    "wildcard": "_ := input.args[arg]",
    "named_variable": "value := input.args[arg]",
}
DIVERGENT_TEST = """package stockade_test

import data.stockade

test_only_present_destinations_are_checked if {
\td := stockade.decision with input as {"tool": {"destination_args": ["to", "cc"]}, "args": {"to": "bob@example.com"}}
\td.checked == ["to"]
}
"""


@pytest.mark.parametrize("spelling", RVM_ONLY_BUGS)
def test_a_bug_only_the_rvm_has_fails_the_rego_test_that_passes_on_the_interpreter(
    tmp_path: Path, spelling: str
) -> None:
    decision = (
        "package stockade\n\n"
        'decision := {"outcome": "allow", "reasons": [], "checked": checked}\n\n'
        f"checked := [arg | some arg in input.tool.destination_args; {RVM_ONLY_BUGS[spelling]}]\n"
    )
    [result] = run_rego_tests(write(tmp_path, decision, DIVERGENT_TEST))
    assert result.interpreter_passed is True
    assert result.error is None
    assert result.passed is False
    assert result.replayed == 1
    [disagreement] = result.disagreements
    assert disagreement.where == "stockade/decision_test.rego:6"
    assert disagreement.rvm["checked"] == ["to", "cc"]
    assert disagreement.interpreter["checked"] == ["to"]
    assert disagreement.input["args"] == {"to": "bob@example.com"}
    assert "differs at checked" in disagreement.describe()


def test_the_same_policy_written_portably_passes(tmp_path: Path) -> None:
    # A well-formed decision this time (a passing test must feed one): what was checked, as labels.
    decision = (
        "package stockade\n\n"
        'decision := {"outcome": "allow", "reasons": [], "obligations": {"session_labels": checked}}\n\n'
        "checked := [arg | some arg in input.tool.destination_args;\n"
        '\targ in object.keys(object.get(input, "args", {}))]\n'
    )
    tests = DIVERGENT_TEST.replace("d.checked", "d.obligations.session_labels")
    [result] = run_rego_tests(write(tmp_path, decision, tests))
    assert (result.passed, result.replayed, result.disagreements) == (True, 1, ())


def test_an_error_only_the_interpreter_raises_fails_the_test(tmp_path: Path) -> None:
    # The test looks at a helper package; the decision on the same input raises on the strict
    # interpreter and is silently undefined (so: the default) on the RVM.
    decision = (
        "package stockade\n\n"
        'default decision := {"outcome": "deny", "reasons": []}\n\n'
        'decision := {"outcome": "allow", "reasons": []} if to_number(input.args.amount) < 1000\n'
    )
    tests = (
        "package stockade_test\n\nimport data.tools\n\n"
        "test_pay_is_a_payment if tools.is_payment\n"
        '\twith input as {"tool": {"name": "pay"}, "args": {"amount": "5x"}}\n'
    )
    root = write(tmp_path, decision, tests)
    (root / "stockade" / "tools.rego").write_text('package tools\n\nis_payment if input.tool.name == "pay"\n')
    [result] = run_rego_tests(root)
    assert result.interpreter_passed is True
    assert result.passed is False
    [disagreement] = result.disagreements
    assert disagreement.rvm == {"outcome": "deny", "reasons": []}
    assert disagreement.rvm_error is None
    assert disagreement.interpreter is None
    assert disagreement.interpreter_error == "could not parse string as number"
    assert "interpreter decided an error (could not parse string as number)" in disagreement.describe()


REPLAY_POLICY = """package stockade

import data.stockade.catalog

default decision := {"outcome": "deny", "reasons": [{"code": "policy.default_deny", "message": "no rule allows it"}]}

# What the decision saw goes out in a reason's message: a well-formed decision, as production needs.
decision := {"outcome": "allow", "reasons": [
	{"code": "seen", "message": json.marshal(object.get(input, "args", {}))},
]} if {
\tinput.tool.risk in catalog.auto_allow
}

helper := 1
"""

REPLAY_TESTS = """package stockade_test

import data.stockade

_input(risk) := {"tool": {"risk": risk}, "args": {}}

_seen(d) := json.unmarshal(d.reasons[0].message)

_decide(i) := d if {
\td := stockade.decision with input as i
}

_with_args(args) := d if {
\td := stockade.decision with input.args as args
}

test_a_helper_function_feeds_the_decision if {
\t_decide(_input("low")).outcome == "allow"
}

test_a_variable_bound_earlier if {
\ti := object.union(_input("low"), {"args": {"n": 1}})
\td := stockade.decision with input as i
\t_seen(d) == {"n": 1}
}

test_every_iteration if {
\tevery risk in ["low", "none"] {
\t\td := stockade.decision with input as _input(risk) # a comment
\t\td.outcome in {"allow", "deny"}
\t}
}

test_a_comprehension if {
\toutcomes := [d.outcome | some risk in ["low", "high"]; d := stockade.decision with input as _input(risk)]
\toutcomes == ["allow", "deny"]
}

test_data_the_test_replaces_is_replaced_on_the_rvm_too if {
\td := stockade.decision with input as {
\t\t"tool": {"risk": "high"}, # multi-line, with a comment: "with input as"
\t\t"args": {"\u00e9": "\u20ac"},
\t}
\t\twith data.stockade.catalog.auto_allow as ["high"]
\td.outcome == "allow"
}

test_a_partial_input_patches_the_enclosing_one if {
\td := _with_args({"x": 1}) with input as _input("low")
\t_seen(d) == {"x": 1}
}

test_a_mocked_function_is_not_replayed if {
\td := stockade.decision with input as _input("low") with time.now_ns as 5
\td.outcome == "allow"
}

test_a_replaced_rule_is_not_replayed if {
\td := stockade.decision with input as _input("low") with data.stockade.helper as 2
\td.outcome == "allow"
}

test_a_set_is_not_replayed if {
\td := stockade.decision with input as {"tool": {"risk": "low"}, "args": {"s": {1, 2}}}
\td.outcome == "allow"
}

test_no_input if {
\tstockade.helper == 1
}

test_a_number_beyond_64_bits if {
\td := stockade.decision with input as {"tool": {"risk": "low"}, "args": {"n": 100000000000000000000000000000}}
\t_seen(d).n > 1
}
"""


def test_every_way_a_test_can_feed_an_input_is_replayed(tmp_path: Path) -> None:
    root = write(tmp_path, REPLAY_POLICY, REPLAY_TESTS, {"catalog": {"auto_allow": ["low"]}})
    results = {r.name: r for r in run_rego_tests(root)}
    assert {name: r.passed for name, r in results.items() if not r.passed} == {}
    assert {name: r.disagreements for name, r in results.items() if r.disagreements} == {}
    assert {name: r.replayed for name, r in results.items()} == {
        "test_a_helper_function_feeds_the_decision": 1,
        "test_a_variable_bound_earlier": 1,
        "test_every_iteration": 2,
        "test_a_comprehension": 2,
        "test_data_the_test_replaces_is_replaced_on_the_rvm_too": 1,
        "test_a_partial_input_patches_the_enclosing_one": 2,
        "test_a_mocked_function_is_not_replayed": 0,
        "test_a_replaced_rule_is_not_replayed": 0,
        "test_a_set_is_not_replayed": 0,
        "test_no_input": 0,
        "test_a_number_beyond_64_bits": 1,
    }
    not_replayed = {name: r.not_replayed for name, r in results.items() if r.not_replayed}
    where = "stockade/decision_test.rego:{}".format
    assert not_replayed == {
        "test_a_mocked_function_is_not_replayed": (
            f"{where(line_of(REPLAY_TESTS, 'time.now_ns'))}: "
            "`with time.now_ns` replaces a function, which the RVM cannot",
        ),
        "test_a_replaced_rule_is_not_replayed": (
            f"{where(line_of(REPLAY_TESTS, 'data.stockade.helper as'))}: "
            "`with data.stockade.helper` replaces a rule, which the RVM cannot",
        ),
        "test_a_set_is_not_replayed": (
            f"{where(line_of(REPLAY_TESTS, '{1, 2}'))}: "
            "`with input` is given a set or an object with non-string keys, which JSON "
            "(and so no production call) cannot carry",
        ),
    }


def line_of(text: str, snippet: str) -> int:
    [line] = [n for n, content in enumerate(text.splitlines(), 1) if snippet in content]
    return line


def test_data_a_test_replaces_is_replaced_on_the_rvm_too(tmp_path: Path) -> None:
    # The RVM-only bug is switched on by the test's `with data`: it shows only if the RVM saw it.
    decision = (
        "package stockade\n\n"
        'decision := {"outcome": "allow", "reasons": [], "checked": checked}\n\n'
        "checked := [arg | some arg in input.tool.destination_args; _ := input.args[arg]] if data.stockade.buggy\n\n"
        "checked := [arg | some arg in input.tool.destination_args; arg in object.keys(input.args)] if {\n"
        "\tnot data.stockade.buggy\n}\n"
    )
    tests = DIVERGENT_TEST.replace("\n\td.checked", "\n\t\twith data.stockade.buggy as true\n\td.checked")
    [result] = run_rego_tests(write(tmp_path, decision, tests, {"buggy": False}))
    assert result.interpreter_passed is True
    [disagreement] = result.disagreements
    assert (disagreement.rvm["checked"], disagreement.interpreter["checked"]) == (["to", "cc"], ["to"])


def policy_test(root: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`stockade policy test --dir root *args` in this process: (exit code, stdout). Called past the
    app's callback, which would configure logging for the whole test session."""
    context = typer.Context(typer.main.get_command(policy_cli.policy_app), obj=Settings())
    with pytest.raises(typer.Exit) as exited:
        policy_cli.policy_test(context, directory=root, as_json="--json" in args)
    return exited.value.exit_code, capsys.readouterr().out


def test_policy_test_exits_1_and_names_the_disagreement(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    decision = (
        "package stockade\n\n"
        'decision := {"outcome": "allow", "reasons": [], "checked": checked}\n\n'
        f"checked := [arg | some arg in input.tool.destination_args; {RVM_ONLY_BUGS['wildcard']}]\n"
    )
    root = write(tmp_path, decision, DIVERGENT_TEST)
    code, text = policy_test(root, capsys)
    assert code == 1, text
    assert "FAIL stockade/decision_test.rego::test_only_present_destinations_are_checked" in text
    assert "passes on the interpreter, but the RVM decides differently" in text
    assert "RVM disagrees at stockade/decision_test.rego:6" in text
    assert '"checked":["to","cc"]' in text
    assert '"checked":["to"]' in text
    assert "0 passed, 1 failed; 1 replayed on the RVM (1 inputs), 1 disagree" in text
    code, text = policy_test(root, capsys, "--json")
    assert code == 1
    [entry] = json.loads(text)
    assert entry["passed"] is False
    assert entry["error"] is None
    [disagreement] = entry["rvm"]["disagreements"]
    assert disagreement["where"] == "stockade/decision_test.rego:6"
    assert disagreement["rvm"]["checked"] == ["to", "cc"]
    assert disagreement["interpreter"]["checked"] == ["to"]


def test_policy_test_shows_what_was_not_replayed_and_still_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tests = (
        "package stockade_test\n\nimport data.stockade\n\n"
        "test_mocked if {\n"
        '\td := stockade.decision with input as {"tool": {"risk": "low"}, "args": {}} with time.now_ns as 5\n'
        '\td.outcome == "allow"\n}\n'
    )
    root = write(tmp_path, REPLAY_POLICY, tests, {"catalog": {"auto_allow": ["low"]}})
    code, text = policy_test(root, capsys)
    assert code == 0, text
    assert "PASS stockade/decision_test.rego::test_mocked" in text
    assert "not replayed on the RVM: stockade/decision_test.rego:6: `with time.now_ns` replaces a function" in text
    assert "1 passed, 0 failed; 0 replayed on the RVM (0 inputs), 0 disagree, 1 not (fully) replayed" in text
