"""The embedded engine against the shipped policy and against broken ones: real regorus."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from policy import EmbeddedEngine, Outcome, PolicyBundleError, PolicyInput, PolicySettings, run_rego_tests
from policy.base import CredentialRequest, RateCounts, ValueSources
from tests.conftest import REPO
from tests.policy.test_builtin_errors import catalogue


def make_input(
    caps: list[str] | None = None,
    risk: str = "low",
    taint: list[str] | None = None,
    limits: dict[str, float] | None = None,
) -> PolicyInput:
    return PolicyInput.model_validate(
        {
            "subject": {"agent": "a", "principal": "p@example.com"},
            "session": {"id": "s-1", "taint": taint or []},
            "tool": {"name": "t", "capabilities": caps or [], "risk": risk, "limits": limits or {}},
            "args": {"x": 1},
            "now": "2026-11-22T10:00:00Z",
        }
    )


def trifecta_input(sources: list[str], taint: list[str]) -> PolicyInput:
    base = make_input(["sends_external"], "medium", taint)
    tool = base.tool.model_copy(update={"destination_args": ["to"], "amount_args": ["amount"]})
    provenance = {"to": sources} if sources else {}
    values = {"to": [ValueSources(path="to", sources=sources)], "amount": [ValueSources(path="amount")]}
    return base.model_copy(update={
        "tool": tool, "args": {"to": "x@y.example", "amount": 500}, "provenance": provenance, "values": values,
    })  # fmt: skip


@pytest.fixture
def engine() -> EmbeddedEngine:
    return EmbeddedEngine(PolicySettings(dir=REPO / "policies"))


def write_policy(root: Path, rego: str, data: dict[str, Any] | None = None) -> Path:
    (root / "stockade").mkdir(parents=True, exist_ok=True)
    (root / "stockade" / "decision.rego").write_text(rego)
    if data is not None:
        (root / "stockade" / "data.json").write_text(json.dumps(data))
    return root


async def test_low_risk_tool_is_allowed_with_capped_limits(engine: EmbeddedEngine) -> None:
    decision = await engine.decide(make_input(limits={"timeout_s": 5, "memory_mb": 100_000}))
    assert decision.outcome is Outcome.ALLOW
    assert decision.obligations.limits.timeout_s == 5
    assert decision.obligations.limits.memory_mb == 1024  # capped by the catalog's maximum
    assert decision.policy_revision == engine.revision


@pytest.mark.parametrize(
    ("caps", "risk", "taint", "outcome", "code"),
    [
        ([], "high", [], Outcome.REQUIRE_APPROVAL, "approval.high_risk"),
        ([], "critical", [], Outcome.REQUIRE_APPROVAL, "approval.high_risk"),
        (["financial"], "low", [], Outcome.REQUIRE_APPROVAL, "approval.financial"),
        (
            ["sends_external"],
            "medium",
            ["untrusted_content"],
            Outcome.REQUIRE_APPROVAL,
            "approval.external_after_untrusted",
        ),
        (
            ["reads_private", "reads_untrusted", "sends_external"],
            "low",
            [],
            Outcome.DENY,
            "capability.combination_denied",
        ),
        (["mind_control"], "low", [], Outcome.DENY, "capability.unknown"),
        ([], "apocalyptic", [], Outcome.DENY, "risk.unknown"),
    ],
)
async def test_shipped_policy_outcomes(
    engine: EmbeddedEngine, caps: list[str], risk: str, taint: list[str], outcome: Outcome, code: str
) -> None:
    decision = await engine.decide(make_input(caps, risk, taint))
    assert decision.outcome is outcome
    assert code in decision.reason_codes


async def test_sending_on_a_clean_session_is_allowed(engine: EmbeddedEngine) -> None:
    decision = await engine.decide(make_input(["sends_external"], "medium"))
    assert decision.outcome is Outcome.ALLOW


PARITY_INPUTS = [
    make_input(),
    make_input([], "high"),
    make_input(["financial", "mutates_state"], "critical"),
    make_input(["sends_external"], "medium", ["untrusted_content"]),
    make_input(["reads_private", "sends_external"]),
    make_input(["bogus"], "nope"),
    make_input(limits={"timeout_s": 3, "pids": 10_000, "cpus": 0.25}),
    make_input(["executes_code"]),
    make_input().model_copy(
        update={
            "tool": make_input().tool.model_copy(
                update={
                    "credentials": [
                        CredentialRequest(name="github", scopes=["repo:read"]),
                        CredentialRequest(name="unknown"),
                    ]
                }
            )
        }
    ),
    make_input().model_copy(update={"rate": RateCounts(session_per_minute=5, agent_tool_per_minute=61)}),
    make_input().model_copy(update={"rate": RateCounts(session_per_minute=120)}),
    make_input([], "high").model_copy(update={"approval": {"status": "approved", "reasons": ["approval.high_risk"]}}),
    make_input(["financial"], "critical").model_copy(
        update={"approval": {"status": "approved", "reasons": ["approval.high_risk"]}}
    ),
    *[
        trifecta_input(sources, taint)
        for sources in (["untrusted:web:c-1"], ["user"], ["untrusted:web:c-1", "user"], ["tool:dir:c-2"], [])
        for taint in ([], ["untrusted_content"])
    ],
]
"""Inputs covering every rule of the shipped policy: engines must agree on all of them."""


@pytest.mark.parametrize("policy_input", PARITY_INPUTS)
def test_compiled_path_and_interpreter_agree(engine: EmbeddedEngine, policy_input: PolicyInput) -> None:
    """Decisions run on the RVM; Rego tests run on the interpreter. They must not diverge."""
    raw = engine.evaluate_raw(policy_input)
    assert raw is not None
    assert json.loads(raw) == engine.evaluate_interpreted(policy_input)


def test_shipped_rego_tests_pass() -> None:
    results = run_rego_tests(REPO / "policies")
    assert len(results) >= 10
    assert [r.name for r in results if not r.passed] == []


def test_a_failing_rego_test_is_reported(tmp_path: Path) -> None:
    root = write_policy(tmp_path, 'package stockade\ndefault decision := {"outcome": "deny"}\n')
    (root / "stockade" / "decision_test.rego").write_text(
        "package stockade_test\nimport data.stockade\n"
        'test_wrongly_expects_allow if { stockade.decision.outcome == "allow" }\n'
        'test_deny if { stockade.decision.outcome == "deny" }\n'
    )
    results = {r.name: r.passed for r in run_rego_tests(root)}
    assert results == {"test_wrongly_expects_allow": False, "test_deny": True}


async def test_runtime_error_in_policy_denies_with_policy_error(tmp_path: Path) -> None:
    root = write_policy(tmp_path, 'package stockade\ndecision := {"outcome": "allow", "x": 1 / count(input.args)}\n')
    engine = EmbeddedEngine(PolicySettings(dir=root))
    decision = await engine.decide(make_input().model_copy(update={"args": {}}))
    assert decision.outcome is Outcome.DENY
    assert decision.reason_codes == ["policy.error"]


async def test_undefined_decision_denies(tmp_path: Path) -> None:
    root = write_policy(tmp_path, 'package stockade\ndecision := {"outcome": "allow"} if input.tool.risk == "x"\n')
    decision = await EmbeddedEngine(PolicySettings(dir=root)).decide(make_input())
    assert decision.outcome is Outcome.DENY
    assert decision.reason_codes == ["policy.error"]


@pytest.mark.parametrize(
    "value",
    [
        '{"outcome": "maybe"}',
        '"allow"',
        '{"outcome": "allow", "obligations": {"limits": {"timeout_s": -1}}}',
        '{"outcome": "allow", "surprise": true}',
    ],
)
async def test_malformed_decision_denies(tmp_path: Path, value: str) -> None:
    root = write_policy(tmp_path, f"package stockade\ndecision := {value}\n")
    decision = await EmbeddedEngine(PolicySettings(dir=root)).decide(make_input())
    assert decision.outcome is Outcome.DENY
    assert decision.reason_codes == ["policy.error"]


def test_syntax_error_refuses_to_load(tmp_path: Path) -> None:
    root = write_policy(tmp_path, "package stockade\ndecision := {\n")
    with pytest.raises(PolicyBundleError, match=r"decision\.rego"):
        EmbeddedEngine(PolicySettings(dir=root))


async def test_reload_with_syntax_error_keeps_the_old_policy(tmp_path: Path) -> None:
    root = tmp_path / "policies"
    shutil.copytree(REPO / "policies", root)
    engine = EmbeddedEngine(PolicySettings(dir=root))
    before = engine.revision
    (root / "stockade" / "broken.rego").write_text("package stockade\nthis is not rego\n")
    with pytest.raises(PolicyBundleError):
        await engine.reload()
    assert engine.revision == before
    assert (await engine.decide(make_input())).outcome is Outcome.ALLOW


async def test_a_reload_lets_the_event_loop_serve_between_modules(tmp_path: Path) -> None:
    """regorus holds the GIL for each call: a reload compiles a module at a time and yields to the
    loop between them, so a router keeps deciding while a large policy compiles (it stalled for
    the whole compile before). Two reloads at once take turns, and calls decide throughout."""
    root = tmp_path / "policies"
    shutil.copytree(REPO / "policies", root)
    engine = EmbeddedEngine(PolicySettings(dir=root))
    ticks = 0
    decided: list[Outcome] = []
    stop = asyncio.Event()

    async def serve() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            decided.append((await engine.decide(make_input())).outcome)
            await asyncio.sleep(0)

    server = asyncio.create_task(serve())
    await asyncio.sleep(0)
    before = ticks
    first, second = await asyncio.gather(engine.reload(), engine.reload())
    during = ticks - before
    stop.set()
    await server
    assert first == second == engine.revision
    assert during >= 2 * len(engine.bundle.modules), during  # served between the steps of both reloads
    assert set(decided) == {Outcome.ALLOW}


async def test_reload_picks_up_a_data_change(tmp_path: Path) -> None:
    root = tmp_path / "policies"
    shutil.copytree(REPO / "policies", root)
    engine = EmbeddedEngine(PolicySettings(dir=root))
    before = engine.revision
    data_file = root / "stockade" / "data.json"
    data = json.loads(data_file.read_text())
    data["catalog"]["auto_allow_risks"] = []  # a security team tightens policy with data only
    data_file.write_text(json.dumps(data))
    assert await engine.reload() != before
    decision = await engine.decide(make_input())
    assert decision.outcome is Outcome.DENY
    assert decision.reason_codes == ["policy.default_deny"]


async def test_oversized_input_is_denied_not_evaluated(tmp_path: Path) -> None:
    engine = EmbeddedEngine(PolicySettings(dir=REPO / "policies", max_input_bytes=4096))
    decision = await engine.decide(make_input().model_copy(update={"args": {"blob": "x" * 10_000}}))
    assert decision.outcome is Outcome.DENY
    assert decision.reason_codes == ["policy.error"]


def test_missing_directory_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(PolicyBundleError, match="STOCKADE_POLICY__DIR"):
        EmbeddedEngine(PolicySettings(dir=tmp_path / "nope"))


def test_invalid_data_json_names_the_file(tmp_path: Path) -> None:
    root = write_policy(tmp_path, 'package stockade\ndefault decision := {"outcome": "deny"}\n')
    (root / "stockade" / "data.json").write_text("{not json")
    with pytest.raises(PolicyBundleError, match=r"stockade/data\.json: invalid JSON at line 1"):
        EmbeddedEngine(PolicySettings(dir=root))


async def test_a_closed_engine_denies(engine: EmbeddedEngine) -> None:
    await engine.aclose()
    decision = await engine.decide(make_input())
    assert (decision.outcome, decision.reason_codes) == (Outcome.DENY, ["policy.error"])


@pytest.mark.parametrize(
    ("file", "edit", "named"),
    [
        ("data.json", lambda d: d["catalog"]["rate_limits"].update(session_per_minute="120"),
         "data.stockade.catalog.rate_limits.session_per_minute"),
        ("data.json", lambda d: d["catalog"]["limits"]["max"].update(memory_mb="1024"),
         "data.stockade.catalog.limits.max.memory_mb"),
        ("reasons/data.json", lambda d: d["rate.exceeded"].update(outcome="denied"),
         "data.stockade.reasons.rate.exceeded.outcome"),
    ],
    ids=["rate_limit_as_a_string", "limit_max_as_a_string", "reason_outcome_misspelt"],
)  # fmt: skip
async def test_a_catalog_the_schema_refuses_is_not_loaded_and_a_reload_keeps_the_old_policy(
    tmp_path: Path, file: str, edit: Any, named: str
) -> None:
    """A typo in the catalog fails open (the rule compares "120" as text and no window fires):
    the engine refuses it at startup and on reload, naming the field, and keeps deciding."""
    root = tmp_path / "policies"
    shutil.copytree(REPO / "policies", root)
    engine = EmbeddedEngine(PolicySettings(dir=root))
    flood = make_input().model_copy(update={"rate": RateCounts(session_per_minute=1000)})
    assert (await engine.decide(flood)).reason_codes == ["rate.exceeded"]
    data_file = root / "stockade" / file
    data = json.loads(data_file.read_text())
    edit(data)
    data_file.write_text(json.dumps(data))
    with pytest.raises(PolicyBundleError, match=re.escape(named)):
        await engine.reload()
    assert (await engine.decide(flood)).reason_codes == ["rate.exceeded"]
    with pytest.raises(PolicyBundleError, match=re.escape(named)):
        EmbeddedEngine(PolicySettings(dir=root))


# The decision is whatever the input carries: what a buggy or hostile rule could compute.
ECHO = "package stockade\n\ndecision := input.args.decision\n"
ALLOW = {"outcome": "allow", "reasons": []}


@pytest.mark.parametrize(
    "decision",
    [
        {**ALLOW, "obligations": {"limits": {"memory_mb": "512"}}},
        {**ALLOW, "obligations": {"limits": {"pids": True}}},
        {**ALLOW, "obligations": {"limits": {"timeout_s": "inf"}}},
        {**ALLOW, "obligations": {"limits": {"timeout_s": 1e308}}},
        {**ALLOW, "obligations": {"limits": {"memory_mb": 1e30}}},  # (an int past 64 bits never reaches policy)
        {**ALLOW, "obligations": {"credentials": [{"name": "gh", "scopes": [], "ttl_s": 10**12}]}},
        {**ALLOW, "obligations": {"credentials": [{"name": "gh", "scopes": [], "ttl_s": "60"}]}},
        {**ALLOW, "obligations": {"egress": [{"host": "*", "port": 443}]}},
        {**ALLOW, "obligations": {"egress": [{"host": "", "port": 443}]}},
        {**ALLOW, "obligations": {"egress": [{"host": "evil.example:8443", "port": 443}]}},
        {**ALLOW, "obligations": {"egress": [{"host": " a.example\n", "port": 443}]}},
        {**ALLOW, "obligations": {"egress": [{"host": "a.example", "port": 443, "methods": ["*"]}]}},
        {"outcome": "require_approval", "reasons": []},
        {"outcome": "deny", "reasons": []},
    ],
    ids=["memory_as_string", "pids_true", "timeout_inf_string", "timeout_1e308", "memory_past_64_bits",
         "ttl_unbounded", "ttl_as_string", "host_wildcard", "host_empty", "host_with_port", "host_whitespace",
         "method_wildcard", "approval_without_reason", "deny_without_reason"],
)  # fmt: skip
async def test_a_decision_policy_could_not_mean_is_denied_as_malformed(
    tmp_path: Path, decision: dict[str, Any]
) -> None:
    engine = EmbeddedEngine(PolicySettings(dir=write_policy(tmp_path, ECHO)))
    decided = await engine.decide(make_input().model_copy(update={"args": {"decision": decision}}))
    assert (decided.outcome, decided.reason_codes) == (Outcome.DENY, ["policy.error"])
    assert "malformed decision" in decided.reasons[0].message


async def test_well_formed_obligations_are_taken_as_policy_wrote_them(tmp_path: Path) -> None:
    engine = EmbeddedEngine(PolicySettings(dir=write_policy(tmp_path, ECHO)))
    obligations = {"limits": {"memory_mb": 512.0, "timeout_s": 5},
                   "egress": [{"host": "API.Example.com.", "port": 443, "methods": ["get"]},
                              {"host": "[2001:DB8:0::1]", "port": 443}, {"host": "::1", "port": 8080},
                              {"host": "my_svc.internal", "port": 80}],
                   "credentials": [{"name": "gh", "scopes": ["repo"], "ttl_s": 300}]}  # fmt: skip
    decided = await engine.decide(
        make_input().model_copy(update={"args": {"decision": {**ALLOW, "obligations": obligations}}})
    )
    assert decided.outcome is Outcome.ALLOW, decided.reasons
    assert decided.obligations.limits.memory_mb == 512
    assert [e.host for e in decided.obligations.egress] == ["api.example.com", "2001:db8::1", "::1", "my_svc.internal"]
    assert decided.obligations.egress[0].methods == ["GET"]


@pytest.mark.parametrize(
    ("rule", "args"),
    [
        # catalogued as a deny, given as an approval reason: a human could approve a deny away
        ('approval_reasons contains {"code": "rate.exceeded", "message": "over"} if input.args.n > 10', {"n": 11}),
        # built at run time, in no catalog: whatever it spells reaches the agent
        ('approval_reasons contains {"code": concat(".", ["team", input.args.kind]), "message": "m"} '
         "if input.args.kind", {"kind": "x"}),
        ('deny_reasons contains {"code": sprintf("team.%s", [input.args.kind]), "message": "m"} if input.args.kind',
         {"kind": "secret_value"}),
    ],
    ids=["deny_code_as_approval", "computed_approval_code", "computed_deny_code"],
)  # fmt: skip
async def test_a_reason_code_the_catalog_does_not_give_for_that_outcome_is_denied_as_malformed(
    tmp_path: Path, rule: str, args: dict[str, Any]
) -> None:
    root = tmp_path / "policies"
    shutil.copytree(REPO / "policies", root)
    (root / "stockade" / "team.rego").write_text(f"package stockade\n\n{rule}\n")
    engine = EmbeddedEngine(PolicySettings(dir=root))
    decided = await engine.decide(make_input().model_copy(update={"args": args}))
    assert (decided.outcome, decided.reason_codes) == (Outcome.DENY, ["policy.error"])
    assert "data.stockade.reasons" in decided.reasons[0].message or "catalogued as deny" in decided.reasons[0].message


# -- values the engine would see otherwise than sent ------------------------------------------------

ALLOWLIST = """package stockade

deny_reasons contains {"code": "team.account_not_allowed", "message": "not an allowlisted account"} if {
    not input.args.account in {18446744073709551615, 9007199254740993}
}
"""


def allowlisting_policy(tmp_path: Path) -> Path:
    """The shipped policy plus a team rule that allows only two accounts, its code catalogued."""
    root = tmp_path / "policies"
    shutil.copytree(REPO / "policies", root)
    (root / "stockade" / "team.rego").write_text(ALLOWLIST)
    catalogue(root, {"team.account_not_allowed": "deny"})
    return root


@pytest.mark.parametrize(
    "args",
    [{"account": 2**64}, {"account": 2**64 + 1}, {"account": -(2**63) - 1}, {"nested": [{"account": 10**400}]},
     {f"k{chr(0xDCFE)}": "rm -rf /", f"k{chr(0xDCFF)}": "ok"}],  # lone surrogates (ruff reads "\udc.." as one key)
    ids=["2**64", "2**64+1", "-2**63-1", "nested_400_digits", "surrogate_keys"],
)  # fmt: skip
async def test_arguments_policy_would_see_otherwise_than_sent_deny_with_policy_error(
    tmp_path: Path, args: dict[str, Any]
) -> None:
    """regorus reads an integer beyond an i64 or a u64 as the nearest float (2**64 + 1 passed an
    allowlist of 2**64 while the tool ran with the number sent); keys with a lone surrogate were
    written as U+FFFD and became one key. The engine refuses to decide on such arguments, however
    the input was built (the router refuses them as bad input first: tests/router/test_bad_input.py)."""
    engine = EmbeddedEngine(PolicySettings(dir=allowlisting_policy(tmp_path)))
    decided = await engine.decide(make_input().model_copy(update={"args": args}))
    assert (decided.outcome, decided.reason_codes) == (Outcome.DENY, ["policy.error"])
    assert "integer beyond 64 bits" in decided.reasons[0].message or "lone surrogate" in decided.reasons[0].message
    validated = PolicyInput.model_validate({**make_input().model_dump(), "args": args})  # built another way
    assert (await engine.decide(validated)).reason_codes == ["policy.error"]


async def test_integers_an_i64_or_a_u64_holds_are_decided_exactly(tmp_path: Path) -> None:
    engine = EmbeddedEngine(PolicySettings(dir=allowlisting_policy(tmp_path)))
    decided = {n: (await engine.decide(make_input().model_copy(update={"args": {"account": n}}))).reason_codes
               for n in (2**64 - 1, 2**64 - 2, 2**53 + 1, 2**53 + 2, -(2**63))}  # fmt: skip
    assert decided == {2**64 - 1: [], 2**64 - 2: ["team.account_not_allowed"], 2**53 + 1: [],
                       2**53 + 2: ["team.account_not_allowed"], -(2**63): ["team.account_not_allowed"]}  # fmt: skip
