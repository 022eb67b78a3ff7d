"""Approvals bound to the exact action, through the real router and audit log."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from policy import PolicySettings
from router import ApprovalError, ApprovalStatus, ControlPlane, Settings
from router.audit import AuditFilter
from router.settings import AuditSettings, StoreSettings
from tests.conftest import ECHO, REPO, python_tool


@pytest.fixture
def store_url(both_stores: str | None) -> str | None:
    """Every test here runs on the embedded store and on Redis."""
    return both_stores


DROP = python_tool("drop_table", ECHO, risk="critical", capabilities=["mutates_state"], input_schema={
    "type": "object", "properties": {"table": {"type": "string"}}, "required": ["table"]})  # fmt: skip


async def held(plane: ControlPlane, table: str = "users") -> tuple[str, str]:
    await plane.register(DROP)
    session = await plane.open_session("db-agent", "alice@example.com")
    result = await plane.call(session, "drop_table", {"table": table})
    assert (result.status, result.reasons) == ("pending_approval", ["approval.high_risk"])
    assert result.approval_id is not None
    return session, result.approval_id


async def test_an_approved_call_runs_once_and_the_whole_trail_shares_one_decision_id(plane: ControlPlane) -> None:
    session, approval_id = await held(plane)
    [pending] = await plane.list_approvals(ApprovalStatus.PENDING)
    assert (pending.id, pending.tool, pending.agent, json.loads(pending.args)) == (
        approval_id, "drop_table", "db-agent", {"table": "users"})  # fmt: skip
    await plane.approve(approval_id, "oncall@example.com", note="ticket OPS-7")
    result = await plane.call(session, "drop_table", {"table": "users"}, approval_id=approval_id)
    assert result.ok
    assert result.output == {"table": "users"}
    assert (await plane.get_approval(approval_id)).status is ApprovalStatus.USED
    trail = [e.model_dump(mode="json") for e in await plane.audit.query(AuditFilter(decision_id=result.decision_id))]
    assert [(e["kind"], e["outcome"]) for e in trail] == [
        ("decision", "require_approval"), ("approval", "requested"), ("approval", "approved"),
        ("decision", "allow"), ("approval", "redeemed"), ("execution", "ok"),
    ]  # fmt: skip
    assert trail[3]["input"]["approval"]["approver"] == "oncall@example.com"
    with pytest.raises(ApprovalError, match="used"):
        await plane.call(session, "drop_table", {"table": "users"}, approval_id=approval_id)


async def test_an_approval_does_not_release_different_arguments(plane: ControlPlane) -> None:
    session, approval_id = await held(plane, "scratch")
    await plane.approve(approval_id, "oncall@example.com")
    with pytest.raises(ApprovalError, match="another call"):
        await plane.call(session, "drop_table", {"table": "users"}, approval_id=approval_id)
    assert (await plane.get_approval(approval_id)).status is ApprovalStatus.APPROVED  # still good for its own call


async def test_an_approval_does_not_release_the_call_in_another_session(plane: ControlPlane) -> None:
    _, approval_id = await held(plane)
    await plane.approve(approval_id, "oncall@example.com")
    other = await plane.open_session("db-agent", "alice@example.com")
    with pytest.raises(ApprovalError, match="another call"):
        await plane.call(other, "drop_table", {"table": "users"}, approval_id=approval_id)


async def test_the_requesting_agent_cannot_approve_itself(plane: ControlPlane) -> None:
    _, approval_id = await held(plane)
    with pytest.raises(ApprovalError, match="never approves its own"):
        await plane.approve(approval_id, "db-agent")
    assert (await plane.get_approval(approval_id)).status is ApprovalStatus.PENDING


async def test_a_denied_approval_releases_nothing(plane: ControlPlane) -> None:
    session, approval_id = await held(plane)
    await plane.deny_approval(approval_id, "oncall@example.com", note="not today")
    with pytest.raises(ApprovalError, match="denied"):
        await plane.call(session, "drop_table", {"table": "users"}, approval_id=approval_id)
    with pytest.raises(ApprovalError, match="not pending"):
        await plane.approve(approval_id, "someone-else@example.com")


async def test_an_expired_approval_is_refused(tmp_path: Path, store_url: str | None) -> None:
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "a.jsonl"), store=StoreSettings(url=store_url), approval_ttl_s=0.2
    )
    async with ControlPlane.from_settings(settings) as plane:
        session, approval_id = await held(plane)
        await plane.approve(approval_id, "oncall@example.com")
        await asyncio.sleep(0.3)
        with pytest.raises(ApprovalError, match="expired"):
            await plane.call(session, "drop_table", {"table": "users"}, approval_id=approval_id)


async def test_an_approval_never_overrides_a_deny(tmp_path: Path, store_url: str | None) -> None:
    policies = tmp_path / "policies"
    shutil.copytree(REPO / "policies", policies)
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "a.jsonl"),
        store=StoreSettings(url=store_url),
        policy=PolicySettings(dir=policies),
    )
    async with ControlPlane.from_settings(settings) as plane:
        session, approval_id = await held(plane)
        await plane.approve(approval_id, "oncall@example.com")
        data_file = policies / "stockade" / "data.json"
        data: dict[str, Any] = json.loads(data_file.read_text())
        data["catalog"]["denied_capability_sets"].append(["mutates_state"])  # security tightens policy meanwhile
        data_file.write_text(json.dumps(data))
        await plane.reload_policy()
        result = await plane.call(session, "drop_table", {"table": "users"}, approval_id=approval_id)
        assert (result.status, result.reasons) == ("denied", ["capability.combination_denied"])
        assert (await plane.get_approval(approval_id)).status is ApprovalStatus.APPROVED  # not used up by a deny


async def test_unknown_approvals_are_refused_and_audited(plane: ControlPlane) -> None:
    session, _ = await held(plane)
    with pytest.raises(ApprovalError, match="no approval"):
        await plane.call(session, "drop_table", {"table": "users"}, approval_id="a-forged")
    errors = await plane.audit.query(AuditFilter(session_id=session, kind="error"))
    assert [e.result["code"] for e in errors if e.result] == ["approval.invalid"]
