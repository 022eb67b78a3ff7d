"""A router picks up a new policy within STOCKADE_POLICY__WATCH_INTERVAL_S from the moment it serves
(docs/policy-authoring.md), before any agent opens a session or registers a tool."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path

import httpx

from policy import PolicySettings
from router import ControlPlane, Settings
from router.settings import AuditSettings
from tests.conftest import copy_policies, edit_catalog, stockade_server


def test_a_freshly_started_server_reloads_a_changed_policy_without_any_session(tmp_path: Path) -> None:
    root = copy_policies(tmp_path)
    token = "tok-audit"
    principals = [{"name": "audit", "role": "auditor", "token_sha256": hashlib.sha256(token.encode()).hexdigest()}]
    env = {"STOCKADE_AUDIT__PATH": str(tmp_path / "audit.jsonl"), "STOCKADE_POLICY__DIR": str(root),
           "STOCKADE_POLICY__WATCH_INTERVAL_S": "0.1", "STOCKADE_API_PRINCIPALS": json.dumps(principals),
           "STOCKADE_LOG_LEVEL": "error"}  # fmt: skip
    headers = {"Authorization": f"Bearer {token}"}
    with stockade_server(["serve"], env, tmp_path / "serve.log", "/healthz") as url:
        before = httpx.get(f"{url}/v1/policy", headers=headers).json()["revision"]
        edit_catalog(root, auto_allow_risks=[])  # a security team pushes a tighter catalog
        deadline = time.monotonic() + 10
        now = before
        while now == before and time.monotonic() < deadline:
            time.sleep(0.1)
            now = httpx.get(f"{url}/v1/policy", headers=headers).json()["revision"]
    assert now != before, "the running server never reloaded the changed policy directory"


async def test_an_entered_control_plane_watches_its_policy_before_any_session(tmp_path: Path) -> None:
    """`stockade mcp` (and any embedding program) enters the plane with ``async with`` and may wait
    a long time for its first client: the policy it decides with must still be the current one."""
    root = copy_policies(tmp_path)
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "a.jsonl"), policy=PolicySettings(dir=root, watch_interval_s=0.05)
    )
    async with ControlPlane.from_settings(settings) as plane:
        before = plane.policy.revision
        edit_catalog(root, auto_allow_risks=[])
        for _ in range(100):
            await asyncio.sleep(0.05)
            if plane.policy.revision != before:
                break
        assert plane.policy.revision != before
