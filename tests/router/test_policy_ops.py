"""Operating policy: hot reload in a running control plane, replay, and the CLI around them."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from policy import PolicySettings
from router import ControlPlane, Settings
from router.audit import AuditEvent, AuditFilter
from router.errors import AuditError
from router.settings import AuditSettings
from tests.conftest import ECHO, copy_policies, edit_catalog, python_tool, stockade_server

STOCKADE = str(Path(sys.executable).parent / "stockade")


async def test_a_reload_the_audit_log_cannot_take_is_not_made(tmp_path: Path) -> None:
    """A reload swapped the policy, then its record failed unnoticed: a widened policy decided calls
    with no reload on record, and the API said 200 (review finding). The record is written before the
    new policy takes effect; if it cannot be, the old policy stays and the caller is told."""
    root = copy_policies(tmp_path)
    settings = Settings(audit=AuditSettings(path=tmp_path / "a.jsonl"), policy=PolicySettings(dir=root))
    async with ControlPlane.from_settings(settings) as plane:
        before = plane.policy.revision
        edit_catalog(root, auto_allow_risks=["low", "medium", "high", "critical"])  # a widening edit
        append = plane.audit.append

        async def failing(event: AuditEvent) -> AuditEvent:
            raise AuditError("disk full")

        plane.audit.append = failing  # type: ignore[method-assign]
        with pytest.raises(AuditError, match="could not be audited"):
            await plane.reload_policy(source="api", by="admin@example.com")
        assert plane.policy.revision == before  # not in force
        plane.audit.append = append  # type: ignore[method-assign]
        after = await plane.reload_policy(source="api", by="admin@example.com")
        assert after != before
        [reloaded] = await plane.audit.query(AuditFilter(kind="policy", outcome="reloaded"))
        assert (reloaded.result or {})["previous_revision"] == before
        assert (reloaded.result or {})["revision"] == after


async def test_a_changed_policy_is_picked_up_and_a_broken_one_is_refused(tmp_path: Path) -> None:
    root = copy_policies(tmp_path)
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "a.jsonl"), policy=PolicySettings(dir=root, watch_interval_s=0.1)
    )
    async with ControlPlane.from_settings(settings) as plane:
        await plane.register(python_tool("echo", ECHO))
        session = await plane.open_session("agent-1", "alice@example.com")
        first = plane.policy.revision
        assert (await plane.decide(session, "echo", {})).outcome == "allow"

        edit_catalog(root, auto_allow_risks=[])  # a security team tightens the policy, in data
        for _ in range(50):
            await asyncio.sleep(0.1)
            if plane.policy.revision != first:
                break
        assert (await plane.decide(session, "echo", {})).reasons == ["policy.default_deny"]

        second = plane.policy.revision
        (root / "stockade" / "broken.rego").write_text("package stockade\n\nthis is not rego\n")
        for _ in range(50):
            await asyncio.sleep(0.1)
            if await plane.audit.query(AuditFilter(kind="policy", outcome="reload_refused")):
                break
        assert plane.policy.revision == second  # the last good policy stays in force
        [failure] = await plane.audit.query(AuditFilter(kind="policy", outcome="reload_refused"))
        assert (failure.result or {})["kept_revision"] == second
        assert (failure.result or {})["source"] == "watcher"
        assert "broken.rego" in (failure.result or {})["message"]
        assert "backtrace" not in (failure.result or {})["message"].lower()
        assert (await plane.decide(session, "echo", {})).reasons == ["policy.default_deny"]
        problems = await plane.readiness_problems()
        assert "broken.rego" in (problems["policy_files"] or "")
        assert await plane.readiness() == {"policy": True, "store": True, "audit": True}  # still serving

        # Every reload is an event: the one that took the tightened catalog, with both revisions.
        [reloaded] = await plane.audit.query(AuditFilter(kind="policy", outcome="reloaded"))
        assert (reloaded.result or {})["previous_revision"] == first
        assert (reloaded.result or {})["revision"] == second
        (root / "stockade" / "broken.rego").unlink()
        assert await plane.reload_policy(source="cli", by="admin@example.com") == second
        assert "policy_files" not in await plane.readiness_problems()
        events = await plane.audit.query(AuditFilter(kind="policy"))
        # The watcher may also notice the fixed directory and reload after the CLI: pick the CLI's.
        [by_cli] = [e for e in events if (e.result or {}).get("source") == "cli"]  # (not the registration)
        assert (by_cli.outcome, by_cli.agent) == ("reloaded", "admin@example.com")


async def record_some_decisions(audit: Path) -> None:
    async with ControlPlane.from_settings(Settings(audit=AuditSettings(path=audit))) as plane:
        await plane.register(python_tool("echo", ECHO))
        await plane.register(python_tool("risky", ECHO, risk="medium"))
        session = await plane.open_session("agent-1", "alice@example.com")
        for tool in ("echo", "risky", "risky", "echo"):
            await plane.decide(session, tool, {})


def test_replay_shows_what_a_candidate_policy_would_change(tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    asyncio.run(record_some_decisions(audit))
    candidate = copy_policies(tmp_path)
    edit_catalog(candidate, auto_allow_risks=["low"])  # medium-risk tools no longer pass unattended
    done = subprocess.run([STOCKADE, "policy", "replay", "--policy", str(candidate), "--path", str(audit), "--json"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["replayed"] == 4
    assert [(c["tool"], c["was"], c["now"]) for c in report["changed"]] == [("risky", "allow", "deny")] * 2
    assert report["by_reason"] == {"policy.default_deny": 2}


def test_cli_explain_and_check(tmp_path: Path) -> None:
    policy_input = {"subject": {"agent": "a", "principal": "p"}, "session": {"id": "s"},
                    "tool": {"name": "t", "capabilities": ["financial"], "risk": "low"}, "args": {},
                    "now": "2026-11-22T10:00:00Z"}  # fmt: skip
    (tmp_path / "in.json").write_text(json.dumps(policy_input))
    explained = subprocess.run([STOCKADE, "policy", "explain", "--input", str(tmp_path / "in.json")],
                               capture_output=True, text=True, check=False)  # fmt: skip
    assert explained.returncode == 0, explained.stderr
    assert "approval.financial" in explained.stdout
    assert "stockade/provenance.rego:" in explained.stdout  # the rule area that holds unchecked payments
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.rego").write_text("package x\n\ny := crypto.x509.parse_certificates(input.pem)\n")
    checked = subprocess.run([STOCKADE, "policy", "check", "--dir", str(bad)], capture_output=True, text=True,
                             check=False)  # fmt: skip
    assert checked.returncode == 1
    assert "crypto.x509.parse_certificates is not provided by regorus" in checked.stderr


async def test_the_watcher_survives_a_file_it_cannot_read_and_reports_it(tmp_path: Path) -> None:
    """A file that vanishes or cannot be read mid-reload (an editor's swap, a checkout) is an audited
    refusal that readiness reports, never the end of the watcher."""
    root = copy_policies(tmp_path)
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "a.jsonl"), policy=PolicySettings(dir=root, watch_interval_s=0.05)
    )
    async with ControlPlane.from_settings(settings) as plane:
        await plane.register(python_tool("echo", ECHO))
        session = await plane.open_session("agent-1", "alice@example.com")
        before = plane.policy.revision
        (root / "stockade" / "unreadable.rego").symlink_to("/proc/self/mem")  # reading it fails (EIO)
        for _ in range(100):
            await asyncio.sleep(0.05)
            if "policy_files" in await plane.readiness_problems():
                break
        assert "unreadable.rego" in ((await plane.readiness_problems())["policy_files"] or "")
        [refused] = await plane.audit.query(AuditFilter(kind="policy", outcome="reload_refused"))
        assert "cannot be read" in (refused.result or {})["message"]
        assert plane.policy.revision == before

        (root / "stockade" / "unreadable.rego").unlink()
        edit_catalog(root, auto_allow_risks=[])
        for _ in range(100):
            await asyncio.sleep(0.05)
            if plane.policy.revision != before:
                break
        assert (await plane.decide(session, "echo", {})).reasons == ["policy.default_deny"]  # still watching
        assert "policy_files" not in await plane.readiness_problems()


def test_reloads_over_http_and_from_the_cli_are_audited_and_reported(tmp_path: Path) -> None:
    """A running `stockade serve`: a refused reload (files that do not load) is an audited 503 problem;
    GET /v1/policy and /readyz say the files on disk are broken while the old policy serves; the CLI
    reload is audited as such, with its caller."""
    root = copy_policies(tmp_path)
    token = "tok-admin"
    principals = [{"name": "root", "role": "admin", "token_sha256": hashlib.sha256(token.encode()).hexdigest()}]
    env = {"STOCKADE_AUDIT__PATH": str(tmp_path / "audit.jsonl"), "STOCKADE_POLICY__DIR": str(root),
           "STOCKADE_POLICY__WATCH_INTERVAL_S": "0", "STOCKADE_API_PRINCIPALS": json.dumps(principals),
           "STOCKADE_LOG_LEVEL": "error"}  # fmt: skip
    headers = {"Authorization": f"Bearer {token}"}
    with stockade_server(["serve"], env, tmp_path / "serve.log", "/healthz") as url:
        before = httpx.get(f"{url}/v1/policy", headers=headers).json()["revision"]
        (root / "stockade" / "broken.rego").write_text("package stockade\n\nthis is not rego\n")
        refused = httpx.post(f"{url}/v1/policy/reload", headers=headers)
        assert refused.status_code == 503
        assert refused.headers["content-type"].startswith("application/problem+json")
        status = httpx.get(f"{url}/v1/policy", headers=headers).json()
        assert status["revision"] == before
        assert "broken.rego" in status["files_problem"]
        ready = httpx.get(f"{url}/readyz")
        assert ready.status_code == 200  # the last good policy serves
        assert ready.json()["problems"]["policy_files"].startswith("the files on disk do not load")
        assert "broken.rego" not in ready.text  # said to auditors (GET /v1/policy), not to anyone

        (root / "stockade" / "broken.rego").unlink()
        edit_catalog(root, auto_allow_risks=[])
        cli = subprocess.run([STOCKADE, "policy", "reload", "--url", url, "--json"], capture_output=True,
                             text=True, env={**os.environ, "STOCKADE_API_TOKEN": token}, check=False)  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        after = json.loads(cli.stdout)["revision"]
        assert after != before
        assert httpx.get(f"{url}/v1/policy", headers=headers).json()["files_problem"] is None
        wrong = subprocess.run([STOCKADE, "policy", "reload", "--url", url], capture_output=True, text=True,
                               env={**os.environ, "STOCKADE_API_TOKEN": "not-a-token"}, check=False)  # fmt: skip
        assert wrong.returncode == 1
    events = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    reloads = [(e["outcome"], e["result"]["source"], e["agent"]) for e in events if e["kind"] == "policy"]
    assert reloads == [("reload_refused", "api", "root"), ("reloaded", "cli", "root")]
    [refusal] = [e for e in events if e["kind"] == "policy" and e["outcome"] == "reload_refused"]
    assert refusal["result"]["kept_revision"] == before
