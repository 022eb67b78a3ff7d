"""`stockade policy replay` as a security team uses it to review and gate a policy change: real
audit logs written by a real control plane, candidate policies as edited copies of the shipped
ones, the command driven as users run it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from policy import Decision, EmbeddedEngine, PolicyInput, PolicySettings
from router import ControlPlane, Settings
from router.audit import AuditEvent, JsonlAuditLog, timestamp
from router.audit.chain import Unsealed, head_of, line_hash
from router.interfaces.cli import app
from router.replay import compare
from router.settings import AuditSettings, MaskRule
from tests.conftest import REPO, copy_policies, edit_catalog, external_tool

STOCKADE = str(Path(sys.executable).parent / "stockade")

# The recording policy: the shipped one, with an egress host and a credential in its catalog so
# tools asking for them register.
RECORDING_CATALOG: dict[str, Any] = {
    "egress_allowlist": ["api.github.com"],
    "credentials": {"github": {"scopes": ["contents:read"], "ttl_s": 60}},
}
TOOLS = [
    external_tool("lookup"),
    external_tool("transfer", risk="high", capabilities=["mutates_state"]),
    external_tool("run_code", capabilities=["executes_code"]),
    external_tool("fetch_repo", sandbox={"egress": [{"host": "api.github.com", "port": 443, "methods": ["GET"]}]},
                  credentials=[{"name": "github", "scopes": ["contents:read"]}]),
]  # fmt: skip
CALLS = [  # (agent, principal, tool)
    ("billing-bot", "alice@example.com", "lookup"),
    ("billing-bot", "alice@example.com", "transfer"),
    ("billing-bot", "alice@example.com", "transfer"),
    ("ops-bot", "bob@example.com", "run_code"),
    ("ops-bot", "bob@example.com", "fetch_repo"),
    ("ops-bot", "bob@example.com", "lookup"),
]


async def record(audit: Path, policies: Path, calls: list[tuple[str, str, str]] = CALLS) -> str:
    """Decide ``calls`` through a real control plane on ``policies``; its revision."""
    settings = Settings(audit=AuditSettings(path=audit), policy=PolicySettings(dir=policies, watch_interval_s=0))
    async with ControlPlane.from_settings(settings) as plane:
        for spec in TOOLS:
            await plane.register(spec)
        sessions: dict[tuple[str, str], str] = {}
        for agent, principal, tool in calls:
            if (agent, principal) not in sessions:
                sessions[agent, principal] = await plane.open_session(agent, principal)
            await plane.decide(sessions[agent, principal], tool, {})
        return plane.policy.revision


@pytest.fixture
def recorded(tmp_path: Path) -> tuple[Path, Path]:
    """An audit log of `CALLS` and the policy directory that decided them (the baseline)."""
    baseline = copy_policies(tmp_path / "baseline")
    edit_catalog(baseline, **RECORDING_CATALOG)
    audit = tmp_path / "audit.jsonl"
    asyncio.run(record(audit, baseline))
    return audit, baseline


def candidate(tmp_path: Path, name: str, **changes: object) -> Path:
    """A copy of the recording policy with ``changes`` to its catalog."""
    root = copy_policies(tmp_path / name)
    edit_catalog(root, **{**RECORDING_CATALOG, **changes})
    return root


def limits_with(**maxima: float) -> dict[str, Any]:
    """The shipped catalog's ``limits`` with some maxima changed."""
    shipped = json.loads((REPO / "policies/stockade/data.json").read_text())
    limits: dict[str, Any] = shipped["catalog"]["limits"]
    return {"default": limits["default"], "max": {**limits["max"], **maxima}}


def stockade(*args: str, env: dict[str, str] | None = None) -> Result:
    """The ``stockade`` command in this process, as the console script runs it."""
    return CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)


def replay_json(audit: Path, baseline: Path, policy: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    result = stockade("policy", "replay", "--policy", str(policy), "--baseline", str(baseline), "--path", str(audit),
                      "--json", *extra)  # fmt: skip
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


def test_the_same_policy_changes_nothing(recorded: tuple[Path, Path]) -> None:
    audit, baseline = recorded
    code, report = replay_json(audit, baseline, baseline, "--fail-on", "any")
    assert (code, report["replayed"], report["changed"], report["skipped"]) == (0, len(CALLS), [], 0)
    assert report["other_revisions"] == 0


def test_a_lower_limit_is_a_narrowed_change_of_every_call_that_runs(
    recorded: tuple[Path, Path], tmp_path: Path
) -> None:
    """What an outcome-only replay called "0 would change": every call still runs, with less time
    (the held transfers too: they run once approved)."""
    audit, baseline = recorded
    tighter = candidate(tmp_path, "tighter", limits=limits_with(timeout_s=5))
    code, report = replay_json(audit, baseline, tighter)
    assert code == 0  # no gate asked for
    assert report["by_direction"] == {"widened": 0, "narrowed": 6, "mixed": 0, "changed": 0}
    assert {tuple(c["differs"]) for c in report["changed"]} == {("limits.timeout_s 10→5",)}
    assert {(c["was"], c["now"]) for c in report["changed"]} == {("allow", "allow"), ("require_approval",) * 2}
    assert report["groups"]["agent"]["ops-bot"] == {**report["groups"]["agent"]["ops-bot"], "count": 3, "narrowed": 3}
    assert report["groups"]["principal"]["alice@example.com"]["count"] == 3
    assert report["groups"]["tool"]["transfer"]["count"] == 2
    [sample] = report["groups"]["tool"]["run_code"]["samples"]
    assert (sample["tool"], sample["agent"], sample["principal"]) == ("run_code", "ops-bot", "bob@example.com")
    assert sample["differences"] == [{"field": "limits.timeout_s", "direction": "narrowed", "was": "10", "now": "5"}]
    assert report["by_reason"] == {"(none)": 4, "approval.high_risk": 2}


def test_fail_on_widened_stops_a_widening_until_it_is_accepted(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    """Auto-allowing high risk lets the held transfers through: CI fails until the team reviews the
    written accept file and passes it."""
    audit, baseline = recorded
    looser = candidate(tmp_path, "looser", auto_allow_risks=["low", "medium", "high"], approval_risks=["critical"])
    accept = tmp_path / "accepted.json"
    code, report = replay_json(audit, baseline, looser, "--fail-on", "widened", "--write-accept", str(accept))
    assert code == 1
    assert report["by_direction"]["widened"] == 2
    assert {tuple(c["differs"]) for c in report["changed"]} == {
        ("outcome require_approval→allow", "reasons approval.high_risk→(none)")}  # fmt: skip
    assert report["gate"]["gated"] == 2
    assert all(c["gated"] and not c["accepted"] for c in report["changed"])
    written = json.loads(accept.read_text())
    assert [(e["tool"], e["field"], e["direction"], e["seen"]) for e in written] == [
        ("transfer", "outcome", "widened", 2), ("transfer", "reasons", "changed", 2)]  # fmt: skip

    code, report = replay_json(audit, baseline, looser, "--fail-on", "widened", "--accept", str(accept))
    assert code == 0
    assert report["gate"]["gated"] == 0
    assert all(c["accepted"] and not c["gated"] for c in report["changed"])


def test_a_gate_stops_only_its_direction(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    audit, baseline = recorded
    tighter = candidate(tmp_path, "tighter", limits=limits_with(memory_mb=128))
    assert replay_json(audit, baseline, tighter, "--fail-on", "widened")[0] == 0
    assert replay_json(audit, baseline, tighter, "--fail-on", "narrowed")[0] == 1
    assert replay_json(audit, baseline, tighter, "--fail-on", "widened,narrowed")[0] == 1
    assert replay_json(audit, baseline, tighter, "--fail-on", "any")[0] == 1


def test_a_change_that_widens_and_narrows_is_mixed_and_gated_both_ways(
    recorded: tuple[Path, Path], tmp_path: Path
) -> None:
    audit, baseline = recorded
    both = candidate(tmp_path, "both", auto_allow_risks=["low", "medium", "high"], approval_risks=["critical"],
                     limits=limits_with(timeout_s=5))  # fmt: skip
    code, report = replay_json(audit, baseline, both, "--fail-on", "widened")
    assert code == 1
    assert report["by_direction"] == {"widened": 0, "narrowed": 4, "mixed": 2, "changed": 0}
    assert report["gate"]["gated"] == 2  # the transfers: the narrowed limit alone does not stop the gate
    accepted = tmp_path / "accept.jsonl"  # JSON lines, a class: the transfers may now run unattended
    accepted.write_text('{"tool": "transfer", "field": "outcome", "direction": "widened"}\n')
    assert replay_json(audit, baseline, both, "--fail-on", "widened", "--accept", str(accepted))[0] == 0
    # The narrowing of the same changes is not accepted by that entry.
    assert replay_json(audit, baseline, both, "--fail-on", "narrowed", "--accept", str(accepted))[0] == 1


def test_an_accept_entry_by_decision_id_accepts_that_decision_only(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    audit, baseline = recorded
    looser = candidate(tmp_path, "looser", auto_allow_risks=["low", "medium", "high"], approval_risks=["critical"])
    _, report = replay_json(audit, baseline, looser)
    first, second = (c["decision_id"] for c in report["changed"])
    accept = tmp_path / "accept.json"
    accept.write_text(json.dumps({"accept": [{"decision_id": first, "note": "reviewed in SEC-12"}]}))
    code, report = replay_json(audit, baseline, looser, "--fail-on", "widened", "--accept", str(accept))
    assert (code, report["gate"]["gated_ids"]) == (1, [second])
    accept.write_text(json.dumps([{"decision_id": first}, {"agent": "billing-*", "field": "outcome"}]))
    assert replay_json(audit, baseline, looser, "--fail-on", "widened", "--accept", str(accept))[0] == 0


def test_a_host_added_to_the_egress_allowlist_is_widened(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    """The baseline decides every input itself: the candidate allowing the host is compared with a
    baseline that denies it, whatever was recorded."""
    audit, _ = recorded
    without_host = candidate(tmp_path, "without", egress_allowlist=[])
    with_host = candidate(tmp_path, "with")
    code, report = replay_json(audit, without_host, with_host, "--fail-on", "widened")
    assert code == 1
    [change] = report["changed"]
    assert (change["tool"], change["direction"], change["was"], change["now"]) == (
        "fetch_repo",
        "widened",
        "deny",
        "allow",
    )
    assert change["differs"] == ["outcome deny→allow", "reasons egress.not_allowlisted→(none)"]
    assert report["other_revisions"] == len(CALLS)  # recorded under the recording policy, not this baseline


def test_credential_ttl_and_scopes_are_compared(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    audit, baseline = recorded
    longer = candidate(tmp_path, "longer", credentials={"github": {"scopes": ["contents:read"], "ttl_s": 300}})
    _, report = replay_json(audit, baseline, longer)
    [change] = report["changed"]
    assert (change["tool"], change["direction"], change["differs"]) == (
        "fetch_repo", "widened", ["credentials.github.ttl_s 60→300"])  # fmt: skip
    fewer = candidate(tmp_path, "fewer", credentials={"github": {"scopes": [], "ttl_s": 60}})
    _, report = replay_json(audit, baseline, fewer)
    [change] = report["changed"]
    assert (change["direction"], change["now"], change["now_reasons"]) == (
        "narrowed", "deny", ["credential.scope_not_allowlisted"])  # fmt: skip


def test_a_weaker_sandbox_tier_is_widened_in_the_catalogs_tier_order(
    recorded: tuple[Path, Path], tmp_path: Path
) -> None:
    audit, baseline = recorded
    docker = candidate(tmp_path, "docker", min_tier_by_capability={"executes_code": "docker"})
    _, report = replay_json(audit, baseline, docker)
    [change] = report["changed"]
    assert (change["tool"], change["direction"], change["differs"]) == (
        "run_code", "widened", ["sandbox.min_tier gvisor→docker"])  # fmt: skip
    # The same change, read in a catalog that ranks docker above gvisor, is a stronger tier.
    ranked = candidate(tmp_path, "ranked", tiers=["bwrap", "gvisor", "docker"],
                       min_tier_by_capability={"executes_code": "docker"})  # fmt: skip
    _, report = replay_json(audit, baseline, ranked)
    assert [c["direction"] for c in report["changed"]] == ["narrowed"]


def test_a_log_spanning_revisions_shows_only_the_candidates_change(tmp_path: Path) -> None:
    """Decisions recorded under an older policy differ from the baseline's; compared with the
    baseline only the candidate's change shows; compared with the record, the drift is named."""
    audit = tmp_path / "audit.jsonl"
    policies = copy_policies(tmp_path / "live")
    edit_catalog(policies, **RECORDING_CATALOG, auto_allow_risks=["low", "medium", "high"], approval_risks=[])
    old = asyncio.run(record(audit, policies))  # the transfers were allowed then
    edit_catalog(policies, auto_allow_risks=["low", "medium"], approval_risks=["high", "critical"])
    new = asyncio.run(record(audit, policies))  # and held since
    assert old != new
    tighter = candidate(tmp_path, "tighter", limits=limits_with(timeout_s=5))

    _, report = replay_json(audit, policies, tighter)
    assert report["replayed"] == 2 * len(CALLS)
    assert report["revisions"] == {old: len(CALLS), new: len(CALLS)}
    assert report["other_revisions"] == len(CALLS)
    assert report["by_direction"] == {"widened": 0, "narrowed": 12, "mixed": 0, "changed": 0}
    assert {tuple(c["differs"]) for c in report["changed"]} == {("limits.timeout_s 10→5",)}

    _, recorded = replay_json(audit, policies, tighter, "--against-recorded")
    assert recorded["mode"] == "recorded"
    assert recorded["other_revisions"] == len(CALLS)
    drifted = [c for c in recorded["changed"] if c["recorded_revision"] == old and c["tool"] == "transfer"]
    assert [(c["was"], c["now"], c["direction"]) for c in drifted] == [("allow", "require_approval", "narrowed")] * 2

    said = stockade("policy", "replay", "--policy", str(tighter), "--baseline", str(policies), "--path", str(audit),
                    "--against-recorded")  # fmt: skip
    assert f"{len(CALLS)} of {2 * len(CALLS)} decisions were recorded under other revisions" in said.stdout


def append_chained(audit: Path, items: list[dict[str, Any] | bytes]) -> None:
    """Append to ``audit`` what a writer with the file could, keeping its hash chain whole: each
    dict sealed as the log seals an event, each bytes value behind a chain head of its own."""
    last = audit.read_bytes().splitlines()[-1]
    head = head_of(last)
    assert head is not None
    seq, prev = head[0], line_hash(last).hex()
    with audit.open("ab") as log:
        for item in items:
            seq += 1
            if isinstance(item, dict):
                _, line = Unsealed(item).seal(seq, prev)
            else:
                line = b'{"seq":%d,"prev_hash":"%s",' % (seq, prev.encode()) + item
            log.write(line + b"\n")
            prev = line_hash(line).hex()


def test_hostile_log_content_is_counted_as_skipped(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    """Lines a writer chained but that are no decision to replay are skipped and named; a gate
    passes over them only when told how many it may."""
    audit, baseline = recorded
    event = json.loads(next(line for line in audit.read_text().splitlines() if '"kind":"decision"' in line))
    no_subject = {**event, "decision_id": "d-no-subject", "input": {k: v for k, v in event["input"].items()
                                                                     if k != "subject"}}  # fmt: skip
    wrong_type = {**event, "decision_id": "d-wrong-type", "input": {**event["input"], "rate": {"agent_per_hour": "x"}}}
    no_input = {**event, "decision_id": "d-no-input", "input": None}
    not_an_event = {"kind": "decision", "decision_id": "d-partial"}
    unknown_field = {**event, "decision_id": "d-extra", "surprise": True}
    append_chained(audit, [b"not json at all", b'"kind":"decision","x":"\xff"}', no_subject, wrong_type, no_input,
                           not_an_event, unknown_field, b'"kind":"decision"'])  # fmt: skip
    code, report = replay_json(audit, baseline, baseline, "--fail-on", "any", "--allow-skipped", "8")
    assert (code, report["replayed"], report["changed"]) == (0, len(CALLS), [])
    assert report["skipped_by"] == {"unreadable_line": 3, "invalid_input": 2, "malformed_event": 3}
    assert report["skipped"] == 8
    invalid = [s for s in report["skipped_samples"] if s["why"] == "invalid_input"]
    assert [s["decision_id"] for s in invalid] == ["d-no-subject", "d-wrong-type"]
    assert "subject" in invalid[0]["detail"]

    code, report = replay_json(audit, baseline, baseline, "--fail-on", "any", "--allow-skipped", "7")
    assert code == 1
    assert [f["code"] for f in report["gate"]["failures"]] == ["skipped"]
    assert "8 events could not be replayed" in report["gate"]["failures"][0]["message"]


def test_the_human_report_shows_tables_and_samples_and_never_reads_markup(tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    baseline = copy_policies(tmp_path / "baseline")
    edit_catalog(baseline, **RECORDING_CATALOG)
    asyncio.run(record(audit, baseline, [("[bold]bot[/bold]", "[red]eve[/red]@example.com", "lookup")]))
    tighter = candidate(tmp_path, "tighter", limits=limits_with(timeout_s=5))
    result = stockade("policy", "replay", "--policy", str(tighter), "--path", str(audit), "--fail-on", "narrowed",
                      env={"STOCKADE_POLICY__DIR": str(baseline)})  # fmt: skip
    assert result.exit_code == 1
    assert "1 decisions replayed, 1 would change, 0 skipped" in result.stdout
    assert "widened 0 · narrowed 1 · mixed 0 · changed 0" in result.stdout
    assert "[bold]bot[/bold]" in result.stdout  # the agent, as recorded
    assert "[red]eve[/red]@example.com" in result.stdout
    assert "lookup allow→allow: limits.timeout_s 10→5" in result.stdout
    assert "gate --fail-on narrowed: 1 changes not accepted" in result.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--fail-on", "wider"], "--fail-on 'wider' is not a direction to gate on"),
        (["--accept", "{missing}"], "--accept {missing}: cannot be read"),
        (["--accept", "{bad}"], "--accept {bad}: entry 1 has unknown key 'tol'"),
        (["--accept", "{empty_entry}"], "entry 1 names nothing to match"),
        (["--policy", "{nowhere}"], "--policy {nowhere}: policy directory {nowhere} does not exist"),
        (["--baseline", "{broken}"], "--baseline {broken}: "),
        (["--path", "{nowhere}"], "no audit log at {nowhere}"),
        (["--since", "yesterday"], "--since 'yesterday' is not an ISO 8601 time"),
    ],
)
def test_bad_input_exits_2_naming_the_option(
    recorded: tuple[Path, Path], tmp_path: Path, args: list[str], says: str
) -> None:
    audit, baseline = recorded
    places = {"missing": tmp_path / "missing.json", "bad": tmp_path / "bad.json", "nowhere": tmp_path / "nowhere",
              "empty_entry": tmp_path / "empty.json", "broken": tmp_path / "broken"}  # fmt: skip
    places["bad"].write_text('[{"tol": "transfer"}]')
    places["empty_entry"].write_text("[{}]")
    (places["broken"] / "stockade").mkdir(parents=True)
    (places["broken"] / "stockade" / "x.rego").write_text("package stockade\n\nthis is not rego\n")
    fill = {name: str(path) for name, path in places.items()}
    options = {"--policy": str(baseline), "--baseline": str(baseline), "--path": str(audit)}
    for i in range(0, len(args), 2):
        options[args[i]] = args[i + 1].format(**fill)
    argv = [part for option, value in options.items() for part in (option, value)]
    result = stockade("policy", "replay", *argv)
    assert result.exit_code == 2, result.output
    assert says.format(**fill) in " ".join(result.stderr.split())


def test_the_installed_command_gates_a_widening(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    """As CI runs it: the console script, the baseline from STOCKADE_POLICY__DIR, exit 1."""
    audit, baseline = recorded
    looser = candidate(tmp_path, "looser", auto_allow_risks=["low", "medium", "high"], approval_risks=["critical"])
    env = {"PATH": str(Path(sys.executable).parent), "STOCKADE_POLICY__DIR": str(baseline),
           "STOCKADE_AUDIT__PATH": str(audit)}  # fmt: skip
    done = subprocess.run([STOCKADE, "policy", "replay", "--policy", str(looser), "--fail-on", "widened"],
                          capture_output=True, text=True, env=env, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "2 would change" in done.stdout
    assert "transfer (widened): outcome require_approval→allow" in done.stderr


def decision(outcome: str = "allow", **obligations: Any) -> Decision:
    return Decision.model_validate({"outcome": outcome, "obligations": obligations})


TOOL_INPUT = PolicyInput.model_validate({
    "subject": {"agent": "a", "principal": "p"}, "session": {"id": "s"}, "args": {}, "now": "2026-11-22T10:00:00Z",
    "tool": {"name": "t", "capabilities": [], "risk": "low", "tier": "docker", "limits": {"timeout_s": 30}},
})  # fmt: skip


@pytest.mark.parametrize(
    ("was", "now", "expected"),
    [
        ({"egress": [{"host": "a.test", "port": 443, "methods": ["GET"]}]},
         {"egress": [{"host": "a.test", "port": 443, "methods": ["POST"]}]},
         [("egress.a.test:443", "mixed", "GET", "POST")]),
        ({"egress": [{"host": "a.test", "port": 443, "methods": ["GET"]}]},
         {"egress": [{"host": "A.test", "port": 443}, {"host": "b.test", "port": 80, "methods": ["GET"]}]},
         [("egress.a.test:443", "widened", "GET", "any method"), ("egress.b.test:80", "widened", "none", "GET")]),
        ({"credentials": [{"name": "gh", "scopes": ["read", "write"]}]},
         {"credentials": [{"name": "gh", "scopes": ["read"], "ttl_s": 30}, {"name": "s3", "scopes": ["get"]}]},
         [("credentials.gh.scopes", "narrowed", "read,write", "read"), ("credentials.gh.ttl_s", "narrowed", "60", "30"),
          ("credentials.s3", "widened", "none", "get for 60s")]),
        ({"limits": {"timeout_s": 20}}, {"limits": {}}, [("limits.timeout_s", "widened", "20", "tool's (30)")]),
        ({"limits": {"memory_mb": 64}}, {"limits": {}}, [("limits.memory_mb", "changed", "64", "unset")]),
        ({"sandbox": {"min_tier": "gvisor"}}, {"sandbox": {}}, [("sandbox.min_tier", "widened", "gvisor", "none")]),
        ({"sandbox": {"min_tier": "bwrap"}}, {"sandbox": {}}, [("sandbox.min_tier", "changed", "bwrap", "none")]),
        ({"sandbox": {"mode": "fresh"}}, {"sandbox": {"mode": "session"}},
         [("sandbox.mode", "widened", "fresh", "session")]),
        ({"session_labels": ["pii"]}, {"session_labels": []}, [("session_labels", "changed", "pii", "(none)")]),
    ],
)  # fmt: skip
def test_obligations_are_compared_with_a_direction(
    was: dict[str, Any], now: dict[str, Any], expected: list[tuple[str, str, str, str]]
) -> None:
    differences = compare(decision(**was), decision(**now), TOOL_INPUT, ("bwrap", "docker", "gvisor"))
    assert [(d.field, d.direction, d.was, d.now) for d in differences] == expected


def test_a_deny_on_either_side_compares_no_obligations() -> None:
    """A denied call runs nothing, so what it would have been given does not matter."""
    was = decision("deny")
    now = decision("allow", limits={"timeout_s": 5})
    assert [(d.field, d.direction) for d in compare(was, now, TOOL_INPUT, ())] == [("outcome", "widened")]


def test_a_log_written_directly_replays_like_the_control_planes(tmp_path: Path) -> None:
    """Decision events appended by another writer (a replica, an import) replay alike."""
    policy_input = TOOL_INPUT.model_copy(update={"tool": TOOL_INPUT.tool.model_copy(update={"risk": "high"})})
    log = JsonlAuditLog(tmp_path / "audit.jsonl")

    async def write() -> None:
        await log.append(AuditEvent(kind="decision", decision_id="d-1", timestamp=timestamp(), tool="t",
                                    outcome="require_approval", input=policy_input.model_dump(mode="json"),
                                    result={"outcome": "require_approval", "reasons": []}))  # fmt: skip
        await log.aclose()

    asyncio.run(write())
    shipped = copy_policies(tmp_path / "shipped")
    looser = candidate(tmp_path, "looser", auto_allow_risks=["low", "medium", "high"], approval_risks=["critical"])
    _, report = replay_json(tmp_path / "audit.jsonl", shipped, looser)
    assert [(c["decision_id"], c["was"], c["now"]) for c in report["changed"]] == [("d-1", "require_approval", "allow")]


# -- what a gate may trust ------------------------------------------------------------------

PAY = external_tool("pay", input_schema={"type": "object", "properties": {"amount": {"type": "number"}}})


def pay_policy(tmp_path: Path, name: str, over: int) -> Path:
    """The shipped policy plus a rule that reads an argument: a payment over ``over`` is denied."""
    root = copy_policies(tmp_path / name)
    (root / "stockade" / "pay.rego").write_text(
        'package stockade\n\ndeny_reasons contains {"code": "risk.high", "message": "a large payment"} if {\n'
        f'\tinput.tool.name == "pay"\n\tinput.args.amount > {over}\n}}\n'
    )
    return root


async def record_payments(audit: Path, policies: Path, mask: list[MaskRule]) -> None:
    settings = Settings(audit=AuditSettings(path=audit, mask=mask),
                        policy=PolicySettings(dir=policies, watch_interval_s=0))  # fmt: skip
    async with ControlPlane.from_settings(settings) as plane:
        await plane.register(PAY)
        session = await plane.open_session("billing-bot", "alice@example.com")
        for amount in (50, 500):
            await plane.decide(session, "pay", {"amount": amount})


def test_a_masked_input_is_skipped_never_decided_on_its_hash(tmp_path: Path) -> None:
    """A hashed amount is a string to the policy: both sides would deny it alike and a widening
    (500 let through) would pass the gate. The masked decisions are skipped and the gate fails."""
    baseline, looser = pay_policy(tmp_path, "baseline", 100), pay_policy(tmp_path, "looser", 1000)
    plain, masked = tmp_path / "plain.jsonl", tmp_path / "masked.jsonl"
    asyncio.run(record_payments(plain, baseline, []))
    asyncio.run(record_payments(masked, baseline, [MaskRule(path="/input/args/amount", hash=True)]))
    assert '"amount":"hmac-sha256:' in masked.read_text()

    code, report = replay_json(plain, baseline, looser, "--fail-on", "widened")
    assert (code, report["by_direction"]["widened"]) == (1, 1)

    code, report = replay_json(masked, baseline, looser, "--fail-on", "widened")
    assert (code, report["replayed"], report["skipped_by"]) == (1, 0, {"masked_input": 2})
    assert [f["code"] for f in report["gate"]["failures"]] == ["nothing_replayed", "skipped"]
    assert "/input/args/amount" in report["skipped_samples"][0]["detail"]
    said = stockade("policy", "replay", "--policy", str(looser), "--baseline", str(baseline), "--path", str(masked),
                    "--fail-on", "widened")  # fmt: skip
    assert said.exit_code == 1
    assert "failed (nothing_replayed)" in said.stderr
    assert "2 masked_input" in said.stdout


def test_a_decision_the_baseline_no_longer_reproduces_is_unfaithful_and_fails_the_gate(tmp_path: Path) -> None:
    """Recorded under the baseline's own revision, a decision must come out the same on it: one
    that does not (its input was altered on the way to the log) is counted, and a gate fails."""
    shipped = copy_policies(tmp_path / "shipped")
    engine = EmbeddedEngine(PolicySettings(dir=shipped, watch_interval_s=0))
    revision = engine.revision
    asyncio.run(engine.aclose())
    policy_input = TOOL_INPUT.model_copy(update={"tool": TOOL_INPUT.tool.model_copy(update={"risk": "high"})})
    log = JsonlAuditLog(tmp_path / "audit.jsonl")

    async def write() -> None:  # the shipped policy holds a high-risk call for approval; this says allow
        await log.append(AuditEvent(kind="decision", decision_id="d-1", timestamp=timestamp(), tool="t",
                                    outcome="allow", input=policy_input.model_dump(mode="json"),
                                    result={"outcome": "allow", "reasons": []},
                                    bundles={"policies": {"revision": revision}}))  # fmt: skip
        await log.aclose()

    asyncio.run(write())
    code, report = replay_json(tmp_path / "audit.jsonl", shipped, shipped, "--fail-on", "widened")
    assert (code, report["replayed"], report["unfaithful"]) == (1, 1, 1)
    assert [f["code"] for f in report["gate"]["failures"]] == ["unfaithful"]
    assert report["unfaithful_samples"][0]["decision_id"] == "d-1"
    assert "outcome allow→require_approval" in report["unfaithful_samples"][0]["detail"]


def test_a_gate_that_replayed_nothing_fails(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    audit, baseline = recorded
    code, report = replay_json(audit, baseline, baseline, "--fail-on", "widened", "--since", "2999-01-01T00:00:00Z")
    assert (code, report["replayed"]) == (1, 0)
    assert [f["code"] for f in report["gate"]["failures"]] == ["nothing_replayed"]
    code, report = replay_json(audit, baseline, baseline, "--since", "2999-01-01T00:00:00Z")
    assert code == 0  # no gate asked for: a report of nothing


def test_an_edited_log_is_refused_with_its_own_exit_code(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    """A line changed in place (a deny made an allow) is not replayed as if recorded; neither is
    a file that is no audit log at all."""
    audit, baseline = recorded
    lines = audit.read_bytes().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if b'"tool":"transfer"' in line and b'"kind":"decision"' in line)
    lines[at] = lines[at].replace(b'"outcome":"require_approval"', b'"outcome":"allow"', 1)
    audit.write_bytes(b"".join(lines))
    result = stockade("policy", "replay", "--policy", str(baseline), "--baseline", str(baseline), "--path",
                      str(audit), "--fail-on", "widened")  # fmt: skip
    assert result.exit_code == 3, result.output
    said = " ".join(result.stderr.split())
    assert f"the hash chain is broken at seq {at + 1}" in said
    assert "was modified or replaced" in said

    other = tmp_path / "notes.txt"
    other.write_text("not an audit log\n")
    result = stockade("policy", "replay", "--policy", str(baseline), "--baseline", str(baseline), "--path", str(other))
    assert result.exit_code == 3
    assert "not a chained event" in " ".join(result.stderr.split())
