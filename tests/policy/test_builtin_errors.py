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

from policy import EmbeddedEngine, Outcome, PolicyBundleError, PolicyInput, PolicySettings
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
    catalogue(root, {f"team.{name}": "deny" for name in ERROR_CLASSES})
    return root


def catalogue(root: Path, outcomes: dict[str, str]) -> None:
    """Add reason codes to a policy copy's catalog (stockade/reasons/data.json), as a team adding a rule does."""
    path = root / "stockade" / "reasons" / "data.json"
    reasons = json.loads(path.read_text())
    reasons.update(
        {code: {"outcome": outcome, "message": code, "runbook": "a test's"} for code, outcome in outcomes.items()}
    )
    path.write_text(json.dumps(reasons))


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
    catalogue(root, {"team.big": "require_approval"})
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


# Builtins regorus leaves undefined on bad input even on its strict interpreter (policy.builtins):
# (rule body over input.args, arguments it is undefined for, arguments under which it is simply false)
UNDEFINED_CLASSES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "units_parse_bytes_b_suffix": (
        'units.parse_bytes(input.args.size) > units.parse_bytes("100MB")',
        {"size": "5000000000B"},
        {"size": "50MB"},
    ),
    "units_parse_bytes_unknown_unit": (
        'units.parse_bytes(input.args.size) > units.parse_bytes("100MB")',
        {"size": "5XB"},
        {"size": "50MB"},
    ),
    "units_parse_unknown_unit": ("units.parse(input.args.n) > 1000", {"n": "5GB"}, {"n": "5"}),
    "regex_replace_bad_pattern": (
        'contains(regex.replace(input.args.cmd, input.args.strip, ""), "rm -rf")',
        {"cmd": "rm -rf /", "strip": "[\"']("},
        {"cmd": "ls", "strip": "[\"']"},
    ),
    "uuid_parse_not_a_uuid": (
        "uuid.parse(input.args.id).version != 4",
        {"id": "zz"},
        {"id": "6ba7b810-9dad-41d1-80b4-00c04fd430c8"},
    ),
    # A benign value past 64 bits: the extension gives it back as regorus would (a float), not an error.
    "units_parse_unknown_unit_or_past_64_bits": ("units.parse(input.args.n) > 1e21", {"n": "5W"}, {"n": "100E"}),
    "array_slice_bad_index": (
        "count(array.slice(input.args.a, 0, input.args.i)) > 1",
        {"a": [1, 2], "i": 0.5},
        {"a": [1, 2], "i": 1},
    ),
    "bits_lsh_huge_shift": (
        "bits.lsh(input.args.x, input.args.n) > 1000",
        {"x": 10**12, "n": 10**12},
        {"x": 1, "n": 5},
    ),
    "bits_rsh_huge_shift": ("bits.rsh(input.args.x, input.args.n) > 1000", {"x": -1, "n": 10**12}, {"x": 1, "n": 5}),
    # A number past 64 bits (2**70 + 4) a rule computes: a permission-bit test must not vanish on it.
    # (Arguments cannot carry one: the router refuses them, `policy.base.EXACT_INTEGERS`.)
    "bits_and_past_64_bits": (
        "bits.and(to_number(input.args.perms), 4) != 0",
        {"perms": str(2**70 + 4)},
        {"perms": "3"},
    ),
    "bits_or_past_64_bits": ("bits.or(to_number(input.args.perms), 4) > 4", {"perms": str(2**70 + 4)}, {"perms": "0"}),
    "bits_xor_past_64_bits": (
        "bits.xor(to_number(input.args.perms), 4) > 4",
        {"perms": str(2**70 + 4)},
        {"perms": "4"},
    ),
    "bits_negate_past_64_bits": (
        "bits.negate(to_number(input.args.perms)) < -5",
        {"perms": str(2**70 + 4)},
        {"perms": "3"},
    ),
    "json_patch_bad_operation": (
        'json.patch({"admin": false}, input.args.ops).admin == false',
        {"ops": [{"op": "nope", "path": "/admin"}]},
        {"ops": [{"op": "replace", "path": "/admin", "value": True}]},
    ),
}


@pytest.mark.parametrize("name", sorted(UNDEFINED_CLASSES))
async def test_a_builtin_undefined_on_bad_input_in_a_deny_rule_denies_with_policy_error(
    tmp_path: Path, name: str
) -> None:
    """regorus returns undefined, not an error, for these even when strict: the rule would vanish
    and the call be allowed. The interpreter that confirms every allow makes them raise."""
    body, failing, benign = UNDEFINED_CLASSES[name]
    root = copy_policies(tmp_path)
    (root / "stockade" / "team.rego").write_text(
        f'package stockade\n\ndeny_reasons contains {{"code": "team.refused", "message": "refused"}} if {body}\n'
    )
    catalogue(root, {"team.refused": "deny"})
    engine = EmbeddedEngine(PolicySettings(dir=root))
    assert (await engine.decide(_input(benign))).outcome is Outcome.ALLOW, "the rule must be false, not broken"
    decision = await engine.decide(_input(failing))
    assert (decision.outcome, decision.reason_codes) == (Outcome.DENY, [POLICY_ERROR])
    # (Past 64 bits, regorus refuses the argument the extension is called with: "not an i64".)
    assert "the builtin is undefined" in decision.reasons[0].message or "not an i64" in decision.reasons[0].message


async def test_a_size_in_bytes_with_a_b_suffix_cannot_slip_past_a_size_cap(tmp_path: Path) -> None:
    """The reviewer's case: a cap on ``units.parse_bytes`` is enforced for every spelling of a size."""
    root = copy_policies(tmp_path)
    (root / "stockade" / "team.rego").write_text(
        'package stockade\n\ndeny_reasons contains {"code": "team.too_big", "message": "over 100MB"} if {\n'
        '\tunits.parse_bytes(input.args.size) > units.parse_bytes("100MB")\n}\n'
    )
    catalogue(root, {"team.too_big": "deny"})
    engine = EmbeddedEngine(PolicySettings(dir=root))
    outcomes = {size: (await engine.decide(_input({"size": size}))).reason_codes
                for size in ["50MB", "5GB", "5000000000", "5000000000B", "5000000000b", "5GiB", "5XB"]}  # fmt: skip
    assert outcomes == {
        "50MB": [], "5GB": ["team.too_big"], "5000000000": ["team.too_big"], "5GiB": ["team.too_big"],
        "5000000000B": [POLICY_ERROR], "5000000000b": [POLICY_ERROR], "5XB": [POLICY_ERROR],
    }  # fmt: skip


@pytest.mark.parametrize(
    ("rule", "data"),
    [
        ('normalized := regex.replace(input.args.cmd, "[\\"\'](", "")', None),
        ('normalized := regex.replace(input.args.cmd, data.team.strip, "")', {"strip": "[\"'("}),
        ('too_big if units.parse_bytes(input.args.size) > units.parse_bytes("100XB")', None),
    ],
    ids=["literal_pattern", "pattern_from_data", "literal_size"],
)
async def test_a_builtin_argument_that_fails_every_call_refuses_the_policy_and_a_reload_keeps_the_old(
    tmp_path: Path, rule: str, data: dict[str, Any] | None
) -> None:
    """A pattern that does not compile, or a size that does not parse, written in the rule or in
    data.json, fails every call that reaches it: the policy does not load, naming the call."""
    root = copy_policies(tmp_path)
    if data is not None:
        (root / "team").mkdir()
        (root / "team" / "data.json").write_text(json.dumps(data))
    team = root / "stockade" / "team.rego"
    team.write_text(f"package stockade\n\n{rule}\n")
    with pytest.raises(PolicyBundleError, match=r"stockade/team\.rego:3:\d+: (regex\.replace|units\.parse_bytes)"):
        EmbeddedEngine(PolicySettings(dir=root))
    team.unlink()
    engine = EmbeddedEngine(PolicySettings(dir=root))
    before = engine.revision
    team.write_text(f"package stockade\n\n{rule}\n")
    with pytest.raises(PolicyBundleError, match="fail on every call"):
        await engine.reload()
    assert engine.revision == before


async def test_an_error_beside_another_deny_reason_stays_on_record(tmp_path: Path) -> None:
    """The RVM leaves a rule that errs undefined; when another rule denies anyway, the error's own
    reason vanished and policy.error was nowhere (review finding). A deny is confirmed on the
    interpreter too: it keeps the reason that fired and gains policy.error."""
    root = copy_policies(tmp_path)
    (root / "stockade" / "team.rego").write_text(
        "package stockade\n\n"
        'deny_reasons contains {"code": "team.over", "message": "over"} if to_number(input.args.amount) > 1000\n\n'
        'deny_reasons contains {"code": "team.flagged", "message": "flagged"} if input.args.flag == true\n'
    )
    catalogue(root, {"team.over": "deny", "team.flagged": "deny"})
    engine = EmbeddedEngine(PolicySettings(dir=root))
    codes = {
        name: (await engine.decide(_input(args))).reason_codes
        for name, args in {
            "error alone": {"amount": "5000x"},
            "error and a reason": {"amount": "5000x", "flag": True},
            "two reasons": {"amount": "5000", "flag": True},
        }.items()
    }
    assert codes == {
        "error alone": [POLICY_ERROR],
        "error and a reason": ["team.flagged", POLICY_ERROR],
        "two reasons": ["team.flagged", "team.over"],
    }
