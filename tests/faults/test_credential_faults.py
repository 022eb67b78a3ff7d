"""Credentials when the store stalls: a lease minted before a failure is on the record, one whose
revocation failed stays redacted in every form and is revoked at shutdown, and a router that shares
its store redacts tokens other routers minted."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from policy import PolicySettings
from router import ControlPlane, Settings
from router.audit import AuditFilter
from router.credentials import Binding, CredentialConfig, Grant, introspect
from router.redact import REDACTOR
from router.settings import AuditSettings, StoreSettings
from runner import RunnerSettings
from tests.conftest import copy_policies, edit_catalog, python_tool
from tests.faults.conftest import RedisServer

HOST = "api.example.test"


def _settings(tmp_path: Path, runner_state: Path, url: str, credentials: list[CredentialConfig]) -> Settings:
    policies = copy_policies(tmp_path)
    edit_catalog(policies, egress_allowlist=[HOST],
                 credentials={"api-token": {"scopes": ["read"], "ttl_s": 60}, "api-key": {"ttl_s": 60}})  # fmt: skip
    return Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl"),  # local: the stall is the store's alone
        store=StoreSettings(url=url, timeout_s=0.2),
        policy=PolicySettings(dir=policies),
        runner=RunnerSettings(state_dir=runner_state, pool_size=0),
        credentials=credentials,
    )


def _stall(server: RedisServer, seconds: float) -> threading.Thread:
    """Redis stops answering for ``seconds`` (DEBUG SLEEP), from a thread; started and returned."""

    def sleep() -> None:
        client = redis.Redis.from_url(server.url)
        with contextlib.suppress(redis.exceptions.ConnectionError):  # the test ended and killed Redis
            client.execute_command("DEBUG", "SLEEP", seconds)
        client.close()

    stall = threading.Thread(target=sleep)
    stall.start()
    probe = redis.Redis.from_url(server.url, socket_timeout=0.05)
    try:
        for _ in range(100):  # until the stall runs: a command sent next waits behind it
            try:
                probe.ping()
            except redis.exceptions.TimeoutError:
                break
    finally:
        probe.close()
    return stall


async def test_a_lease_minted_before_the_store_stalled_is_recorded_kept_redacted_and_revoked_at_shutdown(
    tmp_path: Path, runner_state: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call's second credential cannot be minted (Redis stalls as it is stored): the first,
    minted already, is audited as minted; its revocation fails in the same stall and is audited so,
    its value stays redacted in every form while it lives, and the router revokes it on shutdown."""
    monkeypatch.setenv("TEST_API_KEY", "sk-test-operator-key-0123456789")
    settings = _settings(tmp_path, runner_state, redis_server.url, [
        CredentialConfig(name="api-token", kind="token", hosts=[HOST], scopes=["read"], max_ttl_s=60),
        CredentialConfig(name="api-key", kind="secret", hosts=[HOST], value_env="TEST_API_KEY"),
    ])  # fmt: skip
    stalls: list[threading.Thread] = []
    async with ControlPlane.from_settings(settings) as plane:
        put_lease, stored = plane.store.put_lease, 0

        async def stall_at_the_second(lease_id: str, record: str, ttl_s: float) -> Any:
            nonlocal stored
            stored += 1
            if stored == 2:  # the token's lease is stored; Redis stalls under the key's
                stalls.append(await asyncio.to_thread(_stall, redis_server, 3.0))
            return await put_lease(lease_id, record, ttl_s)

        monkeypatch.setattr(plane.store, "put_lease", stall_at_the_second)
        await plane.register(python_tool("fetch", "def main():\n    return 1\n", credentials=[
            {"name": "api-token", "scopes": ["read"]}, {"name": "api-key"}]))  # fmt: skip
        session = await plane.open_session("agent-1", "alice")
        result = await plane.call(session, "fetch", {})
        assert (result.status, result.reasons) == ("denied", ["store.unavailable"])
        [(_, lease)] = list(plane._leases.values())  # kept: its revocation failed
        token = lease.value.get_secret_value()
        for form in (token, base64.b64encode(token.encode()).decode(), token.encode().hex(), token[::-1]):
            assert form not in REDACTOR(f"reflected: {form}")
        await asyncio.to_thread(stalls[0].join)
        assert (await introspect(plane.store, token))["active"] is True  # live until revoked, or its TTL
        credential = [(e.outcome, (e.result or {}).get("lease_id")) for e in
                      await plane.audit.query(AuditFilter(session_id=session, kind="credential"))]  # fmt: skip
        assert credential == [("minted", lease.id), ("revoke_failed", lease.id)]
    async with ControlPlane.from_settings(settings) as again:
        assert (await introspect(again.store, token))["active"] is False  # revoked at the first one's shutdown
        events = await again.audit.query(AuditFilter(session_id=session, kind="credential"))
        assert [(e.outcome, (e.result or {}).get("lease_id")) for e in events][-1] == ("revoked", lease.id)


async def test_a_router_on_a_shared_store_redacts_a_token_another_router_minted(
    tmp_path: Path, runner_state: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A router with no token credential of its own, on a store shared with one that mints tokens:
    a tool that reads a page reflecting the other router's live token hands the agent no token."""
    monkeypatch.setenv("TEST_API_KEY", "sk-test-operator-key-0123456789")
    minting = _settings(tmp_path / "a", runner_state, redis_server.url, [
        CredentialConfig(name="api-token", kind="token", hosts=[HOST], scopes=["read"], max_ttl_s=60)])  # fmt: skip
    async with ControlPlane.from_settings(minting) as other:
        config = CredentialConfig(name="api-token", kind="token", hosts=[HOST], scopes=["read"], max_ttl_s=60)
        [lease] = await other.credentials.mint(
            [Grant(config, ("read",), 60)], Binding("d", "c", "s", "agent", "0" * 64)
        )
        token = lease.value.get_secret_value()
        REDACTOR.discard(token)  # as if minted by another process: this one never saw its value
    # The process-wide redactor as a router of its own starts: tokens by their shape only if asked.
    monkeypatch.setattr(REDACTOR, "_tokens", False)
    secret_only = _settings(tmp_path / "b", runner_state, redis_server.url, [
        CredentialConfig(name="api-key", kind="secret", hosts=[HOST], value_env="TEST_API_KEY")])  # fmt: skip
    async with ControlPlane.from_settings(secret_only) as plane:
        assert (await introspect(plane.store, token))["active"] is True
        reflect = f"def main():\n    return {{'page': 'your token: {token}'}}\n"
        await plane.register(python_tool("read_page", reflect))
        session = await plane.open_session("agent-1", "alice")
        result = await plane.call(session, "read_page", {})
        assert result.status == "completed"
        assert token not in str(result.output)
        assert "[REDACTED:stockade-token]" in str(result.output)


async def test_revoking_many_leases_in_a_store_stall_holds_the_caller_for_two_timeouts_not_two_per_lease(
    tmp_path: Path, runner_state: Path, redis_server: RedisServer
) -> None:
    """A call's leases are revoked all at once, each tried twice: with Redis stalled past the
    store's 0.2 s timeout, eight leases fail in about two timeouts (0.5 s), not eight times that;
    the call's exit and a shutdown are held no longer."""
    settings = _settings(tmp_path, runner_state, redis_server.url, [
        CredentialConfig(name="api-token", kind="token", hosts=[HOST], scopes=["read"], max_ttl_s=60)])  # fmt: skip
    async with ControlPlane.from_settings(settings) as plane:
        config = CredentialConfig(name="api-token", kind="token", hosts=[HOST], scopes=["read"], max_ttl_s=60)
        binding = Binding("d", "c", "s", "agent", "0" * 64)
        leases = await plane.credentials.mint([Grant(config, ("read",), 60)] * 8, binding)
        stall = await asyncio.to_thread(_stall, redis_server, 3.0)
        started = time.perf_counter()
        outcomes = await plane.credentials.revoke(leases)
        took = time.perf_counter() - started
        assert all(problem is not None for _, problem in outcomes)
        assert took < 1.5, took  # one after another, each tried twice: 8 x 0.5 s
        await asyncio.to_thread(stall.join)
        assert all(problem is None for _, problem in await plane.credentials.revoke(leases))
