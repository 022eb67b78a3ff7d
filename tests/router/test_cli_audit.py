"""The auditor's `stockade audit` read commands as docs/audit.md describes them: `audit export` takes
the filters of `audit query`, and an install without the `audit` extra (DuckDB) is told how to get
it (exit 2) instead of failing as a bug (exit 70)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from router import Approval, ApprovalStatus, ControlPlane, Settings
from router.audit import AuditEvent, AuditFilter, timestamp
from router.settings import AuditSettings
from tests.conftest import ECHO, python_tool

STOCKADE = str(Path(sys.executable).parent / "stockade")
# `stockade` in a process where DuckDB cannot be imported, as in an install without the `audit` extra:
# neither the package nor its engine module `_duckdb` (the wheel ships both; the audit loads the latter).
WITHOUT_DUCKDB = (
    "import sys; sys.modules['duckdb'] = sys.modules['_duckdb'] = None; "
    "from router.interfaces.cli import app; app(prog_name='stockade')"
)


def run(*args: str, env: dict[str, str], without_duckdb: bool = False) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", WITHOUT_DUCKDB, *args] if without_duckdb else [STOCKADE, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, **env}, check=False)


@pytest.fixture(scope="module")
def signed_log(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A log of decisions on two tools, with the signed checkpoint the router writes as it closes;
    and the settings that name its signing key."""
    root = tmp_path_factory.mktemp("log")
    audit = root / "audit.jsonl"
    key = root / "keys" / "audit-signing.key"

    async def record() -> None:
        settings = Settings(audit=AuditSettings(path=audit, signing_key=key))
        async with ControlPlane.from_settings(settings) as plane:
            await plane.register(python_tool("echo", ECHO))
            await plane.register(python_tool("risky", ECHO, risk="medium"))
            session = await plane.open_session("agent-1", "alice@example.com")
            for tool in ("echo", "risky", "echo", "risky"):
                await plane.decide(session, tool, {"word": tool})

    asyncio.run(record())
    return audit, {"STOCKADE_AUDIT__SIGNING_KEY": str(key), "HOME": str(root)}


def test_audit_export_takes_the_filters_of_audit_query_and_its_proof_holds_them(
    signed_log: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    audit, env = signed_log
    target = tmp_path / "echo.jsonl"
    exported = run("audit", "export", "--path", str(audit), "-o", str(target), "--tool", "echo", "--kind", "decision",
                   "--arg", "word=echo", "--json", env=env)  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(records) == 2
    assert {(r["kind"], r["tool"]) for r in records} == {("decision", "echo")}

    queried = run("audit", "query", "--path", str(audit), "--tool", "echo", "--kind", "decision", "--json", env=env)
    assert [json.loads(line)["seq"] for line in queried.stdout.splitlines()] == [r["seq"] for r in records]

    key = Path(env["STOCKADE_AUDIT__SIGNING_KEY"])
    checked = run("audit", "verify-export", str(target), "--public-key", str(key.with_name(key.name + ".pub")),
                  "--json", env=env)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    found = json.loads(checked.stdout)
    assert found["ok"] is True
    assert found["signed_selection"] is True
    assert found["selection"]["filter"] == {"tool": "echo", "kind": "decision", "args": [["word", "echo"]]}


@pytest.mark.parametrize(
    "command",
    [
        ["audit", "query", "--json"],
        ["audit", "sql", "SELECT count(*) FROM events"],
        ["audit", "report", "denials"],
        ["audit", "index"],
        ["audit", "export", "-o", "{tmp}/out.jsonl"],
    ],
    ids=lambda command: " ".join(command[:3]),
)
def test_the_read_commands_without_the_audit_extra_say_how_to_install_it(
    signed_log: tuple[Path, dict[str, str]], tmp_path: Path, command: list[str]
) -> None:
    audit, env = signed_log
    argv = [part.replace("{tmp}", str(tmp_path)) for part in command]
    result = run(*argv, "--path", str(audit), env=env, without_duckdb=True)
    assert result.returncode == 2, result.stdout + result.stderr
    message = " ".join(result.stderr.split())
    assert f"stockade {' '.join(command[:2])}" in message
    assert "needs DuckDB, the `audit` extra" in message
    assert "uv tool install -c requirements.lock '.[audit,otel]'" in message
    assert "internal error" not in message


def test_verifying_a_parquet_export_without_the_audit_extra_says_how_to_install_it(
    signed_log: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    audit, env = signed_log
    target = tmp_path / "all.parquet"
    exported = run("audit", "export", "--path", str(audit), "-o", str(target), "--format", "parquet", env=env)
    assert exported.returncode == 0, exported.stderr
    key = Path(env["STOCKADE_AUDIT__SIGNING_KEY"])
    public = key.with_name(key.name + ".pub")
    assert run("audit", "verify-export", str(target), "--public-key", str(public), env=env).returncode == 0
    result = run("audit", "verify-export", str(target), "--public-key", str(public), env=env, without_duckdb=True)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "uv tool install -c requirements.lock '.[audit,otel]'" in " ".join(result.stderr.split())


async def decided_at_once(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch, approval_id: str, *decisions: tuple[str, bool]
) -> Approval:
    """Decide ``approval_id`` by each (approver, approve) at once, every decision on record before
    any takes effect (as when two approvers click together); the one that took effect."""
    swap = plane.store.swap_approval
    arrived, all_on_record = 0, asyncio.Event()

    async def together(approval: Approval, expected: ApprovalStatus) -> bool:
        nonlocal arrived
        arrived += 1
        if arrived == len(decisions):
            all_on_record.set()
        await all_on_record.wait()
        return await swap(approval, expected)

    with monkeypatch.context() as patched:
        patched.setattr(plane.store, "swap_approval", together)
        results = await asyncio.gather(
            *(plane.approvals.decide(approval_id, approver=who, approve=yes) for who, yes in decisions),
            return_exceptions=True,
        )
    [took_effect] = [r for r in results if isinstance(r, Approval)]
    return took_effect


async def test_the_reports_credit_only_the_decision_that_took_effect(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each decision is on record before it takes effect; one that another decision beat is then
    on record as ``not_applied`` too, and no report credits its approver."""
    audit = tmp_path / "audit.jsonl"
    settings = Settings(audit=AuditSettings(path=audit, signing_key=tmp_path / "keys" / "audit-signing.key"))
    async with ControlPlane.from_settings(settings) as plane:
        await plane.register(python_tool("drop_table", ECHO, risk="critical", capabilities=["mutates_state"]))
        session = await plane.open_session("db-agent", "alice@example.com")
        held = [await plane.call(session, "drop_table", {"table": table}) for table in ("users", "orders")]
        contested, granted = [h.approval_id for h in held]
        assert contested is not None
        assert granted is not None
        either = await decided_at_once(plane, monkeypatch, contested, ("bob", True), ("carol", False))
        first = await decided_at_once(plane, monkeypatch, granted, ("bob", True), ("carol", True))
        # The granted call ran with a credential (written as the router writes one).
        await plane.audit.append(AuditEvent(
            kind="credential", decision_id=first.decision_id, timestamp=timestamp(), session_id=session,
            agent="db-agent", tool="drop_table", call_id="c-1", outcome="minted",
            result={"lease_id": "l-1", "name": "db", "scopes": ["drop"], "ttl_s": 60},
        ))  # fmt: skip
        lost = await plane.audit.query(AuditFilter(kind="approval", outcome="not_applied"))
        assert sorted((e.result or {})["id"] for e in lost) == sorted([contested, granted])  # each beaten once

    def report(name: str) -> list[dict[str, object]]:
        result = run("audit", "report", name, "--path", str(audit), "--json", env={})
        assert result.returncode == 0, result.stderr
        rows: list[dict[str, object]] = json.loads(result.stdout)
        return rows

    decided = [(r["approval_id"], r["approver"], r["outcome"]) for r in report("approvals")]
    assert decided == [(contested, either.approver, either.status.value), (granted, first.approver, "approved")]
    [minted] = report("credentials")
    assert (minted["lease"], minted["approver"]) == ("l-1", first.approver)
