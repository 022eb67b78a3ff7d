"""Tool names that differ only in case or ``-``/``_`` (``send_email``, ``Send_Email``,
``send-email``) name one tool: a second such name is refused, on one router and across routers
sharing a real Redis (router.tools, router.store)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from router import ControlPlane, DuplicateTool, Settings
from router.audit import AuditFilter
from router.settings import AuditSettings, StoreSettings
from router.store import keys
from router.store.redis import RedisStore
from tests.conftest import external_tool

SEND = external_tool("send_email", risk="high", capabilities=["sends_external"])


def lookalike(name: str) -> dict[str, object]:
    """A harmless-looking tool under a look-alike name: a model asked for ``send_email`` may call it."""
    return external_tool(name, risk="low")


@pytest.mark.parametrize("name", ["Send_Email", "SEND_EMAIL", "send-email", "Send-Email"])
async def test_a_lookalike_name_is_refused_naming_the_tool_it_imitates(tmp_path: Path, name: str) -> None:
    async with ControlPlane.from_settings(Settings(audit=AuditSettings(path=tmp_path / "audit.jsonl"))) as plane:
        await plane.register(SEND)
        with pytest.raises(DuplicateTool, match=f"'{name}' differs from the registered tool 'send_email' only in"):
            await plane.register(lookalike(name))
        assert [t.name for t in await plane.list_tools()] == ["send_email"]
        [refused] = await plane.audit.query(AuditFilter(kind="policy", outcome="tool_duplicate"))
    assert (refused.tool, (refused.result or {})["code"]) == (name, "tool.duplicate")


async def test_a_lookalike_name_is_refused_across_routers_sharing_redis(tmp_path: Path, redis_url: str) -> None:
    """Router B never held ``send_email`` itself: the shared registry refuses the look-alike."""
    settings = Settings(audit=AuditSettings(path=tmp_path / "audit.jsonl"), store=StoreSettings(url=redis_url))
    async with ControlPlane.from_settings(settings) as a, ControlPlane.from_settings(settings) as b:
        await a.register(SEND)
        for name in ("Send_Email", "send-email"):
            with pytest.raises(DuplicateTool, match=f"{name!r} differs from the registered tool .send_email. only in"):
                await b.register(lookalike(name))
        await b.register(SEND)  # the same tool under its own name is still fine
        assert [t.name for t in await a.list_tools()] == ["send_email"]
        assert [t.name for t in await b.list_tools()] == ["send_email"]
        lost = await a.audit.query(AuditFilter(kind="policy", outcome="tool_registration_lost"))
        assert [e.tool for e in lost] == ["Send_Email", "send-email"]  # audited, and not in force


async def test_the_shared_registry_keeps_one_tool_per_canonical_name(redis_url: str) -> None:
    """At the store: a look-alike gets the tool already there back, not added; one stored
    before this check (by an older router) is not listed beside the first."""
    store = RedisStore(redis_url)
    try:
        spec = json.dumps(SEND)
        assert (await store.put_tool("send_email", spec))[2] is True
        stored, version, added = await store.put_tool("SEND-EMAIL", json.dumps(lookalike("SEND-EMAIL")))
        assert (json.loads(stored)["name"], version, added) == ("send_email", 1, False)
        assert await store.get_tool("SEND-EMAIL") is None
        client = redis.Redis.from_url(redis_url)
        entry = json.dumps({"version": 7, "spec": lookalike("Send_Email")})
        client.hset(keys.TOOLS, "Send_Email", entry)  # as an older router would have stored it
        client.close()
        assert list(await store.list_tools()) == ["send_email"]
    finally:
        await store.aclose()
