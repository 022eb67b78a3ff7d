"""An evaluation error anywhere in the policy denies, on every engine: never "no reason, allow".

The regorus RVM evaluates builtins non-strictly: an error makes the rule that hit it undefined,
so a deny reason vanishes. Each case below is a deny rule a security team could write, fed an
input that makes its builtin fail; the engine that decides must deny with ``policy.error``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from policy import EmbeddedEngine, Outcome, PolicyInput, PolicySettings
from policy.base import POLICY_ERROR
from router import ControlPlane, Settings
from router.settings import AuditSettings
from runner import RunnerSettings
from tests.conftest import copy_policies, python_tool

# (rule body over input.args, arguments that make it fail, arguments under which it is simply false)
ERROR_CLASSES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "to_number_unparseable": ("to_number(input.args.amount) > 1000", {"amount": "5000x"}, {"amount": "5"}),
    "division_by_zero": ("100 / input.args.d > 1000", {"d": 0}, {"d": 1}),
    "modulo_by_zero": ("input.args.n % input.args.d == 1", {"n": 7, "d": 0}, {"n": 8, "d": 2}),
    "invalid_regex": ('regex.match(input.args.pattern, "secret")', {"pattern": "(unclosed"}, {"pattern": "^x$"}),
    "count_of_a_number": ("count(input.args.items) > 3", {"items": 5}, {"items": [1]}),
    "upper_of_a_number": ('upper(input.args.name) == "ROOT"', {"name": 7}, {"name": "alice"}),
    "json_unmarshal_garbage": ("json.unmarshal(input.args.doc).admin == true", {"doc": "{"}, {"doc": "{}"}),
    "base64_decode_garbage": ('base64.decode(input.args.token) == "root"', {"token": "!!!"}, {"token": "YQ=="}),
    "time_parse_garbage": (
        "time.parse_rfc3339_ns(input.args.at) < 0",
        {"at": "yesterday"},
        {"at": "2026-01-01T00:00:00Z"},
    ),
    "units_parse_garbage": ("units.parse_bytes(input.args.size) > 1000", {"size": "lots"}, {"size": "1"}),
    "arithmetic_on_a_string": ("input.args.qty + 1 > 1000", {"qty": "5000"}, {"qty": 5}),
    "split_of_a_number": ('count(split(input.args.path, "/")) > 5', {"path": 12}, {"path": "a/b"}),
}

BENIGN_TOOL = {"name": "t", "capabilities": [], "risk": "low", "limits": {}}


def _input(args: dict[str, Any]) -> PolicyInput:
    return PolicyInput.model_validate({
        "subject": {"agent": "a", "principal": "p@example.com"}, "session": {"id": "s-1"},
        "tool": BENIGN_TOOL, "args": args, "now": "2026-11-22T10:00:00Z",
    })  # fmt: skip


def _policy_with_deny_rules(tmp_path: Path) -> Path:
    """The shipped policy plus one team rule per error class, each denying with its own code."""
    root = copy_policies(tmp_path)
    rules = "\n".join(
        f'deny_reasons contains {{"code": "team.{name}", "message": "{name}"}} if {body}\n'
        for name, (body, _, _) in ERROR_CLASSES.items()
    )
    (root / "stockade" / "team.rego").write_text("package stockade\n\n" + rules)
    return root


@pytest.fixture
def engine(tmp_path: Path) -> EmbeddedEngine:
    return EmbeddedEngine(PolicySettings(dir=_policy_with_deny_rules(tmp_path)))


@pytest.mark.parametrize("name", sorted(ERROR_CLASSES))
async def test_a_builtin_error_in_a_deny_rule_denies_with_policy_error(engine: EmbeddedEngine, name: str) -> None:
    _, failing, benign = ERROR_CLASSES[name]
    assert (await engine.decide(_input(benign))).outcome is Outcome.ALLOW, "the rule must be false, not broken"
    decision = await engine.decide(_input(failing))
    assert decision.outcome is Outcome.DENY
    assert decision.reason_codes == [POLICY_ERROR]
    assert "policy evaluation failed" in decision.reasons[0].message


async def test_no_error_class_gets_through_and_the_rvm_alone_would_have_let_some(engine: EmbeddedEngine) -> None:
    """Counts: every failing input allowed by the engine that decides (must be 0), and by the RVM
    alone (proof that the case is the one that used to fail open)."""
    allowed = [n for n, (_, failing, _) in ERROR_CLASSES.items()
               if (await engine.decide(_input(failing))).outcome is not Outcome.DENY]  # fmt: skip
    rvm_alone = [n for n, (_, failing, _) in ERROR_CLASSES.items()
                 if json.loads(engine.evaluate_raw(_input(failing)) or "null").get("outcome") == "allow"]  # fmt: skip
    assert allowed == []
    assert "to_number_unparseable" in rvm_alone
    assert "division_by_zero" in rvm_alone


async def test_an_error_in_an_allow_path_rule_denies(tmp_path: Path) -> None:
    """An error in a rule the allow depends on (not a deny rule) is a deny too, not a default."""
    root = copy_policies(tmp_path)
    (root / "stockade" / "team.rego").write_text(
        'package stockade\n\napproval_reasons contains {"code": "team.big", "message": "big"} if {\n'
        "\tto_number(input.args.amount) > 1000\n}\n"
    )
    engine = EmbeddedEngine(PolicySettings(dir=root))
    decision = await engine.decide(_input({"amount": "9999 EUR"}))
    assert (decision.outcome, decision.reason_codes) == (Outcome.DENY, [POLICY_ERROR])
    assert (await engine.decide(_input({"amount": "9999"}))).outcome is Outcome.REQUIRE_APPROVAL


async def test_the_error_message_names_the_rule_location_without_a_backtrace(engine: EmbeddedEngine) -> None:
    decision = await engine.decide(_input({"amount": "5000x"}))
    message = decision.reasons[0].message
    assert "team.rego:" in message
    assert "backtrace" not in message.lower()
    assert "\n" not in message


async def test_an_absent_optional_destination_is_decided_alike_on_both_engines(tmp_path: Path) -> None:
    """`_ := input.args[arg]` filtered absent keys on the interpreter only; the engines must agree,
    or the call is denied as a policy error."""
    engine = EmbeddedEngine(PolicySettings(dir=copy_policies(tmp_path)))
    policy_input = PolicyInput.model_validate({
        "subject": {"agent": "a", "principal": "p@example.com"},
        "session": {"id": "s-1", "taint": ["untrusted_content"]},
        "tool": {"name": "send", "capabilities": ["sends_external"], "risk": "medium",
                 "destination_args": ["to", "cc"]},
        "args": {"to": "bob@example.com"}, "provenance": {"to": ["user"]},
        "values": {"to": [{"path": "to", "sources": ["user"]}]}, "now": "2026-11-22T10:00:00Z",
    })  # fmt: skip
    decision = await engine.decide(policy_input)
    assert decision.outcome is Outcome.ALLOW, decision.reasons


async def test_a_call_whose_policy_errors_never_runs_and_the_denial_is_audited(
    tmp_path: Path, runner_state: Path
) -> None:
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl"),
        policy=PolicySettings(dir=_policy_with_deny_rules(tmp_path)),
        runner=RunnerSettings(state_dir=runner_state),
    )
    quarantine = runner_state / "quarantine"  # each sandbox run leaves its /out there
    async with ControlPlane.from_settings(settings) as plane:
        source = "def main(**kw):\n    open('/out/ran', 'w').write('x')\n    return 1\n"
        await plane.register(python_tool("t", source, sandbox={"outputs": {"max_files": 1, "max_bytes": 10}}))
        session = await plane.open_session("a", "p@example.com")
        assert (await plane.call(session, "t", {"amount": "5"})).status == "completed"
        assert len(list(quarantine.iterdir())) == 1
        result = await plane.call(session, "t", {"amount": "5000x"})
    assert (result.status, result.reasons) == ("denied", [POLICY_ERROR])
    assert len(list(quarantine.iterdir())) == 1  # the second call never reached the sandbox
    events = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    decisions = [e for e in events if e["kind"] == "decision" and e["decision_id"] == result.decision_id]
    assert [(d["outcome"], d["result"]["reasons"][0]["code"]) for d in decisions] == [("deny", POLICY_ERROR)]
    assert result.decision_id not in {e["decision_id"] for e in events if e["kind"] == "execution"}
