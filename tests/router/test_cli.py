"""The ``stockade`` command as a user runs it: a real process, real files, real exit codes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters

from router import ControlPlane, Settings
from router.approvals import ApprovalError
from router.audit import AuditFilter
from router.interfaces.local import socket_dir
from router.settings import AuditSettings, StoreSettings
from tests.conftest import ECHO, REPO, python_tool

STOCKADE = str(Path(sys.executable).parent / "stockade")


def json_lines(text: str) -> list[dict[str, object]]:
    """What ``--json`` prints for a stream of events: one JSON object per line."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def run(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [STOCKADE, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_help_lists_the_commands() -> None:
    result = run("--help")
    assert result.returncode == 0
    for command in ("demo", "policy", "audit"):
        assert command in result.stdout
    assert "verify" in run("audit", "--help").stdout


def test_the_top_level_help_says_what_exit_2_means_and_where_approvals_are_found() -> None:
    """As README.md's Command line says: an unreachable store (and a missing extra) exit 2 too, and
    `approvals` works with the embedded store through the running routers' sockets."""
    shown = " ".join(run("--help").stdout.replace("│", " ").split())
    assert "2 bad usage, unreadable input, an unreachable store or a missing extra (`audit`)" in shown
    assert "needs the shared store" not in shown
    assert "through the running routers' local sockets" in shown


def test_policy_test_passes_on_the_shipped_policies() -> None:
    result = run("policy", "test")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS stockade/decision_test.rego::test_low_risk_tool_is_allowed" in result.stdout
    assert " 0 failed" in result.stdout


def test_policy_test_fails_with_exit_1_on_a_failing_test(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "decision.rego").write_text('package p\ndefault decision := {"outcome": "deny"}\n')
    (tmp_path / "p" / "decision_test.rego").write_text(
        'package p_test\nimport data.p\ntest_allows if { p.decision.outcome == "allow" }\n'
    )
    result = run("policy", "test", "--dir", str(tmp_path), "--json")
    assert result.returncode == 1
    assert json.loads(result.stdout) == [
        {
            "file": "p/decision_test.rego",
            "test": "test_allows",
            "passed": False,
            "ms": json.loads(result.stdout)[0]["ms"],
            "error": None,
            "failure": {
                "where": "p/decision_test.rego:3",
                "statement": 'p.decision.outcome == "allow"',
                "values": [{"operand": "p.decision.outcome", "value": "deny", "defined": True, "each_of": False}],
                "note": "",
            },
        }
    ]


def test_policy_test_exit_2_when_the_policy_does_not_load(tmp_path: Path) -> None:
    (tmp_path / "x.rego").write_text("package x\nthis is not rego\n")
    result = run("policy", "test", "--dir", str(tmp_path))
    assert result.returncode == 2
    assert "x.rego" in result.stderr


def test_policy_eval_prints_the_decision(tmp_path: Path) -> None:
    policy_input = {
        "subject": {"agent": "a", "principal": "p"},
        "session": {"id": "s"},
        "tool": {"name": "t", "capabilities": ["financial"], "risk": "low"},
        "args": {},
        "now": "2026-11-22T10:00:00Z",
    }
    (tmp_path / "in.json").write_text(json.dumps(policy_input))
    result = run("policy", "eval", "--input", str(tmp_path / "in.json"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["outcome"] == "require_approval"


def test_demo_then_verify_and_query_its_audit_log(tmp_path: Path) -> None:
    audit = tmp_path / "demo.jsonl"
    demo = run("demo", "--audit-path", str(audit), cwd=tmp_path)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "every step behaved as described" in demo.stdout

    verify = run("audit", "verify", "--path", str(audit), "--json")
    assert verify.returncode == 0
    assert json.loads(verify.stdout)["ok"] is True

    denied = json_lines(run("audit", "query", "--path", str(audit), "--outcome", "deny", "--json").stdout)
    assert [e["tool"] for e in denied] == ["send_email"]  # the injection; the refused tool never had a call
    refused = json_lines(run("audit", "query", "--path", str(audit), "--outcome", "tool_refused", "--json").stdout)
    assert [e["tool"] for e in refused] == ["forward_everything"]
    table = run("audit", "query", "--path", str(audit), "--tool", "spin")
    assert "timeout" in table.stdout

    content = audit.read_text().splitlines(keepends=True)
    first_run = next(i for i, line in enumerate(content) if '"verdict":"ok"' in line)
    content[first_run] = content[first_run].replace('"verdict":"ok"', '"verdict":"error"', 1)
    audit.write_text("".join(content))
    broken = run("audit", "verify", "--path", str(audit))
    assert broken.returncode == 1
    assert "BROKEN" in broken.stdout
    assert f"seq {first_run + 1}" in broken.stdout


def test_audit_commands_explain_a_missing_log(tmp_path: Path) -> None:
    result = run("audit", "verify", "--path", str(tmp_path / "none.jsonl"))
    assert result.returncode == 2
    assert "STOCKADE_AUDIT__PATH" in result.stderr


def test_audit_query_rejects_a_bad_time(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("")
    result = run("audit", "query", "--path", str(tmp_path / "a.jsonl"), "--since", "yesterday")
    assert result.returncode == 2
    assert "ISO 8601" in result.stderr


def test_settings_come_from_the_environment(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("")
    result = run("audit", "verify", "--json", env={"STOCKADE_AUDIT__PATH": str(tmp_path / "a.jsonl")}, cwd=REPO)
    assert result.returncode == 0
    assert json.loads(result.stdout)["events"] == 0


def test_a_setting_that_does_not_validate_is_a_usage_error_naming_the_variable(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("")
    bad = {"STOCKADE_AUDIT__BACKEND": "bogus", "STOCKADE_API_PRINCIPALS": '[{"name": 3}]'}
    for args in (("audit", "verify"), ("approvals", "list"), ("policy", "test")):
        result = run(*args, env=bad)
        assert result.returncode == 2, (args, result.stderr)
        assert "Traceback" not in result.stderr
        assert "invalid settings: " in result.stderr
        assert "STOCKADE_AUDIT__BACKEND: Input should be 'jsonl' or 'redis'" in result.stderr
        assert "STOCKADE_API_PRINCIPALS (at 0.name)" in result.stderr
    for broken in ({"STOCKADE_API_PRINCIPALS": "notjson"}, {"STOCKADE_AUDIT": "{bad"}):
        result = run("approvals", "list", env=broken)
        assert (result.returncode, "Traceback" in result.stderr) == (2, False), result.stderr
        assert f"invalid settings: {next(iter(broken))} is not valid JSON" in result.stderr


# What a command loaded, printed by the process itself at exit.
LOADED_AT_EXIT = """\
import atexit, json, sys
atexit.register(lambda: sys.stderr.write("\\nloaded " + json.dumps(sorted(sys.modules)) + "\\n"))
from router.interfaces.cli import app
sys.argv = ["stockade", *sys.argv[1:]]
app()
"""


def test_an_auditor_given_a_path_starts_without_the_settings_or_the_control_plane(tmp_path: Path) -> None:
    """``audit query --path`` reads neither the STOCKADE_* settings (an unrelated bad one does not
    stop it) nor loads the settings' models, the control plane or the engines: a fresh query
    process starts in about half the time it took when every command built the settings first."""
    audit = tmp_path / "demo.jsonl"
    assert run("demo", "--audit-path", str(audit), cwd=tmp_path).returncode == 0
    result = subprocess.run(
        [sys.executable, "-c", LOADED_AT_EXIT, "audit", "query", "--path", str(audit), "--outcome", "deny", "--json"],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
        env={**os.environ, "STOCKADE_AUDIT__BACKEND": "bogus"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert [e["tool"] for e in json_lines(result.stdout)] == ["send_email"]
    loaded = json.loads(result.stderr.rsplit("\nloaded ", 1)[1])
    heavy = ("router.settings", "pydantic_settings", "router.control", "router.wire", "policy.config", "regorus",
             "docker", "redis", "fastapi")  # fmt: skip
    assert [m for m in loaded if m in heavy or m.startswith(tuple(h + "." for h in heavy))] == []


# -- approvals ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def shared_store_plane(tmp_path: Path, redis_url: str) -> AsyncIterator[tuple[ControlPlane, str, dict[str, str]]]:
    """A router at the shared store (Redis), ``drop_table`` registered and a session of db-agent
    open; and the environment the CLI needs to decide at the same store and log."""
    audit = tmp_path / "audit.jsonl"
    settings = Settings(audit=AuditSettings(path=audit), store=StoreSettings(url=redis_url))
    async with ControlPlane.from_settings(settings) as plane:
        await plane.register(python_tool("drop_table", ECHO, risk="critical", capabilities=["mutates_state"]))
        session = await plane.open_session("db-agent", "alice@example.com")
        yield plane, session, {"STOCKADE_STORE__URL": redis_url, "STOCKADE_AUDIT__PATH": str(audit)}


async def test_an_approver_lists_shows_and_decides_held_calls_from_the_command_line(
    tmp_path: Path, redis_url: str
) -> None:
    async with shared_store_plane(tmp_path, redis_url) as (plane, session, env):
        held = await plane.call(session, "drop_table", {"table": "users", "note": "[red]not markup[/red]"})
        other = await plane.call(session, "drop_table", {"table": "orders"})
        assert held.approval_id is not None
        assert other.approval_id is not None

        listed = run("approvals", "list", "--status", "pending", "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        assert [a["id"] for a in json.loads(listed.stdout)] == [held.approval_id, other.approval_id]
        shown = run("approvals", "show", held.approval_id, env=env)
        assert shown.returncode == 0, shown.stderr
        for expected in ('"table": "users"', "[red]not markup[/red]", "approval.high_risk", "db-agent"):
            assert expected in shown.stdout

        own = run("approvals", "approve", held.approval_id, "--approver", "db-agent", env=env)
        assert (own.returncode, "never approves its own" in own.stderr) == (1, True)
        granted = run("approvals", "approve", held.approval_id, "--approver", "oncall", "--note", "OPS-7",
                      "--json", env=env)  # fmt: skip
        assert granted.returncode == 0, granted.stderr
        assert json.loads(granted.stdout)["status"] == "approved"
        again = run("approvals", "deny", held.approval_id, "--approver", "oncall", env=env)
        assert (again.returncode, "not pending" in again.stderr) == (1, True)
        refused = run("approvals", "deny", other.approval_id, "--approver", "oncall", env=env)
        assert refused.returncode == 0, refused.stderr
        assert run("approvals", "show", "a-unknown", env=env).returncode == 1

        ran = await plane.call(session, "drop_table", {"table": "users", "note": "[red]not markup[/red]"},
                               approval_id=held.approval_id)  # fmt: skip
        assert ran.ok
        trail = await plane.audit.query(AuditFilter(decision_id=held.decision_id, kind="approval"))
        assert [(e.outcome, e.labels.get("via")) for e in trail] == [
            ("requested", None), ("approved", "cli"), ("redeemed", None)]  # fmt: skip
        assert (await plane.audit.verify()).ok  # the CLI and the router wrote one chain


async def test_a_decision_at_the_shared_store_records_who_made_it_and_refuses_unusable_names(
    tmp_path: Path, redis_url: str
) -> None:
    """At the shared store no router checks who decides: the record held only the name typed
    (any OS user with the store's URL could sign as anyone, unseen). And a name or note the
    audit log and the policy cannot take (control characters, a 60,000-character name, a lone
    surrogate, which then failed the call's policy on every retry) was taken."""
    audit = tmp_path / "audit.jsonl"
    async with shared_store_plane(tmp_path, redis_url) as (plane, session, env):
        held = await plane.call(session, "drop_table", {"table": "users"})
        assert held.approval_id is not None
        for approver, note in (("oncall\x1b[2J", ""), ("x" * 513, ""), ("oncall", "n" * 2001), ("on\ncall", "")):
            refused = run("approvals", "approve", held.approval_id, "--approver", approver, "--note", note, env=env)
            assert refused.returncode == 1, refused.stderr
            assert ("approver must be a name" in refused.stderr) != (approver == "oncall")
        with pytest.raises(ApprovalError, match="approver must be a name"):
            await plane.approve(held.approval_id, "on\ud800call")  # the SDK's path: refused too
        granted = run("approvals", "approve", held.approval_id, "--approver", "oncall", "--json", env=env)
        assert granted.returncode == 0, granted.stderr
        trail = await plane.audit.query(AuditFilter(decision_id=held.decision_id, kind="approval"))
    [approved] = [e for e in trail if e.outcome == "approved"]
    assert approved.result is not None
    peer = approved.result["peer"]
    assert (peer["uid"], peer["login"], peer["host"]) == (os.getuid(), pwd.getpwuid(os.getuid()).pw_name,
                                                          socket.gethostname())  # fmt: skip
    assert peer["pid"] != os.getpid()  # the CLI's own process
    assert peer["exe"] is not None
    events = [json.loads(line) for line in audit.read_text().splitlines()]
    invalid = [e for e in events if e["kind"] == "error" and e["result"]["code"] == "approval.invalid"]
    assert len(invalid) == 5
    assert all(len(json.dumps(e)) < 4000 for e in invalid)  # the 513-character name is not kept whole


async def test_an_approvers_decisions_from_the_command_line_go_to_the_redis_audit_stream(
    tmp_path: Path, redis_url: str
) -> None:
    """With the Redis audit backend, `stockade approvals` wrote its events to a local JSONL file
    no auditor reads: a denial was missing from the shared trail."""
    audit = tmp_path / "audit.jsonl"
    settings = Settings(audit=AuditSettings(path=audit, backend="redis"), store=StoreSettings(url=redis_url))
    env = {"STOCKADE_STORE__URL": redis_url, "STOCKADE_AUDIT__PATH": str(audit), "STOCKADE_AUDIT__BACKEND": "redis"}
    async with ControlPlane.from_settings(settings) as plane:
        await plane.register(python_tool("drop_table", ECHO, risk="critical", capabilities=["mutates_state"]))
        session = await plane.open_session("db-agent", "alice@example.com")
        held = await plane.call(session, "drop_table", {"table": "users"})
        other = await plane.call(session, "drop_table", {"table": "orders"})
        assert held.approval_id is not None
        assert other.approval_id is not None
        for verb, approval in (("approve", held.approval_id), ("deny", other.approval_id)):
            done = await asyncio.to_thread(run, "approvals", verb, approval, "--approver", "oncall", env=env)
            assert done.returncode == 0, done.stderr
        own = await asyncio.to_thread(run, "approvals", "approve", held.approval_id, "--approver", "db-agent", env=env)
        assert own.returncode == 1, own.stderr
        trails = [
            await plane.audit.query(AuditFilter(decision_id=d.decision_id, kind="approval")) for d in (held, other)
        ]
        assert [[(e.outcome, e.labels.get("via")) for e in trail] for trail in trails] == [
            [("requested", None), ("approved", "cli")], [("requested", None), ("denied", "cli")]]  # fmt: skip
        refusals = [e for e in await plane.audit.query(AuditFilter(kind="error")) if e.outcome == "refused"]
        assert [e.agent for e in refusals] == ["db-agent"]  # the refused self-approval, on the shared record too
        assert (await plane.audit.verify()).ok
    assert not audit.exists()  # nothing went to a file of its own


def test_approvals_with_the_embedded_store_and_no_router_running_say_where_they_looked(tmp_path: Path) -> None:
    result = run("approvals", "list", env={"STOCKADE_AUDIT__PATH": str(tmp_path / "audit.jsonl")})
    assert result.returncode == 2
    assert "no running router" in result.stderr
    assert "no running router keeps approvals" in result.stderr
    assert "STOCKADE_STORE__URL" in result.stderr


async def test_approvals_reach_an_mcp_server_with_the_embedded_store(tmp_path: Path) -> None:
    """The documented Claude Code / Cursor setup: one `stockade mcp` process, embedded store, no
    elicitation; a human approves from another terminal, and the model's retry completes."""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([python_tool("drop_table", ECHO, risk="critical", capabilities=["mutates_state"])]))
    env = {"STOCKADE_AUDIT__PATH": str(tmp_path / "audit.jsonl"), "STOCKADE_LOG_LEVEL": "error"}
    args = ["mcp", "--agent", "claude", "--principal", "alice@example.com", "--tools", str(tools), "--no-elicitation"]
    params = StdioServerParameters(command=STOCKADE, args=args, env={**os.environ, **env})
    async with Client(params) as client:
        held = json.loads((await client.call_tool("drop_table", {"table": "users"})).content[0].text)  # type: ignore[union-attr]
        assert held["status"] == "pending_approval"
        sockets = socket_dir(Settings(audit=AuditSettings(path=tmp_path / "audit.jsonl")))
        socket = next(sockets.glob("*.sock"))
        assert socket.stat().st_mode & 0o777 == 0o600
        assert sockets.stat().st_mode & 0o777 == sockets.parent.stat().st_mode & 0o777 == 0o700

        listed = await asyncio.to_thread(run, "approvals", "list", "--status", "pending", "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        assert [a["id"] for a in json.loads(listed.stdout)] == [held["approval_id"]]
        own = await asyncio.to_thread(run, "approvals", "approve", held["approval_id"], "--approver", "claude", env=env)
        assert (own.returncode, "never approves its own" in own.stderr) == (1, True)
        unknown = await asyncio.to_thread(run, "approvals", "show", "a-unknown", env=env)
        assert (unknown.returncode, "no approval" in unknown.stderr) == (1, True)
        granted = await asyncio.to_thread(
            run, "approvals", "approve", held["approval_id"], "--approver", "oncall", "--note", "OPS-8", env=env
        )
        assert granted.returncode == 0, granted.stderr

        done = await client.call_tool("drop_table", {"table": "users"})  # the model's plain retry
        assert (done.is_error, done.structured_content) == (False, {"table": "users"})
    assert not list(sockets.glob("*.sock"))  # removed when the server stopped
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    approvals = [(e["outcome"], (e.get("result") or {}).get("approver")) for e in audit if e["kind"] == "approval"]
    assert approvals == [("requested", None), ("approved", "oncall"), ("redeemed", "oncall")]
