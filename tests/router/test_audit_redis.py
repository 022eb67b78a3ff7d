"""The Redis audit stream: routers on different hosts append to one verifiable chain."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis

from router import AuditError, ControlPlane, Settings
from router.audit import AuditEvent, AuditFilter, timestamp
from router.audit.redis import STREAM, RedisAuditLog
from router.settings import AuditSettings, StoreSettings
from tests.conftest import external_tool


def event(i: int, writer: str) -> AuditEvent:
    return AuditEvent(kind="decision", decision_id=f"d-{writer}-{i}", timestamp=timestamp(), outcome="allow",
                      agent=writer, tool="echo")  # fmt: skip


async def test_two_writers_interleave_into_one_chain(redis_url: str) -> None:
    one, two = RedisAuditLog(redis_url), RedisAuditLog(redis_url)
    try:
        await asyncio.gather(*(log.append(event(i, name)) for i in range(50) for name, log in (("a", one), ("b", two))))
        report = await one.verify()
        assert (report.ok, report.events) == (True, 100)
        assert len(await two.query(AuditFilter(agent="b"))) == 50
        assert [e.seq for e in await one.query(AuditFilter(limit=3))] == [1, 2, 3]
    finally:
        await one.aclose()
        await two.aclose()


async def test_a_deleted_entry_breaks_the_chain_where_it_was(redis_url: str) -> None:
    log = RedisAuditLog(redis_url)
    try:
        for i in range(5):
            await log.append(event(i, "a"))
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        third = client.xrange(STREAM)[2][0]
        client.xdel(STREAM, third)
        client.close()
        report = await log.verify()
        assert (report.ok, report.broken_seq) == (False, 3)
        assert "deleted" in report.problem
    finally:
        await log.aclose()


async def test_a_control_plane_audits_into_the_stream(tmp_path: Path, redis_url: str) -> None:
    settings = Settings(audit=AuditSettings(backend="redis", path=tmp_path / "unused.jsonl"),
                        store=StoreSettings(url=redis_url))  # fmt: skip
    async with ControlPlane.from_settings(settings) as plane:
        await plane.register(external_tool("echo"))
        session = await plane.open_session("agent", "alice@example.com")
        result = await plane.call(session, "echo", {})
        trail = await plane.audit.query(AuditFilter(decision_id=result.decision_id))
        assert [e.kind for e in trail] == ["decision"]
        assert (await plane.audit.verify()).ok
    assert not (tmp_path / "unused.jsonl").exists()


def test_the_stream_needs_the_stores_redis() -> None:
    with pytest.raises(AuditError, match="STOCKADE_STORE__URL"):
        ControlPlane.from_settings(Settings(audit=AuditSettings(backend="redis")))
