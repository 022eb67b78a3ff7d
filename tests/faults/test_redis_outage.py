"""Redis killed with SIGKILL mid-load, with the Redis store and the Redis audit stream: no call is
allowed while it is down, every refusal is audited (spooled, then chained into the stream), none
is lost, and the router recovers without a restart. Redis that comes back without its data is a
chain that went backwards: refused, not silently restarted."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
import redis

from policy import PolicySettings
from router import AuditError, ControlPlane, Settings, StockadeError
from router.audit import AuditEvent, AuditFilter, timestamp
from router.audit.redis import RedisAuditLog
from router.settings import AuditSettings, StoreSettings
from tests.conftest import copy_policies, edit_catalog, external_tool
from tests.faults.conftest import RedisServer


def _settings(tmp_path: Path, url: str, instance: str = "router-a") -> Settings:
    tmp_path.mkdir(parents=True, exist_ok=True)
    policies = tmp_path / "policies"
    if not policies.exists():  # rate limits out of the way: the load here is the test's, not abuse
        copy_policies(tmp_path)
        edit_catalog(policies, rate_limits={"session_per_minute": 10**6, "agent_per_minute": 10**6,
                                            "agent_tool_per_minute": 10**6})  # fmt: skip
    return Settings(
        audit=AuditSettings(backend="redis", path=tmp_path / "unused.jsonl", spool_dir=tmp_path / "spool"),
        store=StoreSettings(url=url, timeout_s=0.5),
        policy=PolicySettings(dir=policies),
        instance=instance,
    )


async def test_redis_killed_mid_load_every_refusal_is_audited_and_nothing_is_allowed(
    tmp_path: Path, persistent_redis: RedisServer
) -> None:
    allowed_before: list[str] = []
    allowed_while_down: list[str] = []
    refused_while_down = 0
    down = asyncio.Event()

    async with ControlPlane.from_settings(_settings(tmp_path, persistent_redis.url)) as plane:
        await plane.register(external_tool("lookup"))
        session = await plane.open_session("agent-1", "alice@example.com")

        async def agent() -> None:
            nonlocal refused_while_down
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                was_down = down.is_set()  # judged at the start: calls in flight at the kill may pass
                try:
                    result = await plane.call(session, "lookup", {"q": "x"})
                except StockadeError:
                    refused_while_down += was_down
                    continue
                if result.status == "awaiting_report":
                    (allowed_while_down if was_down else allowed_before).append(result.decision_id)
                elif was_down:
                    refused_while_down += 1

        async def chaos() -> None:
            await asyncio.sleep(1)
            await asyncio.to_thread(persistent_redis.kill)
            down.set()
            await asyncio.sleep(1.5)

        await asyncio.gather(chaos(), *(agent() for _ in range(4)))
        assert refused_while_down > 20
        assert allowed_while_down == []

        spooled = [json.loads(line) for line in next((tmp_path / "spool").glob("*.jsonl")).read_text().splitlines()]
        assert len(spooled) >= refused_while_down  # each refusal is on disk before the caller hears of it

        # Redis returns (its AOF kept every acknowledged event); the router goes on, no restart.
        persistent_redis.start()
        for _ in range(50):
            if (await plane.readiness())["audit"]:
                break
            await asyncio.sleep(0.1)
        after = await plane.call(session, "lookup", {"q": "y"})
        assert after.status == "awaiting_report", after.reasons

        report = await plane.audit.verify()
        assert report.ok, report.problem
        events = await plane.audit.query(AuditFilter())
    refusals = [e for e in events if e.outcome in ("store_unavailable", "denied") or e.kind == "error"]
    decided = {e.decision_id for e in events if e.kind == "decision"}
    assert len(refusals) >= refused_while_down  # 100% of the refusals are in the stream
    assert _not_in_the_stream_once(spooled, events) == []
    assert set(allowed_before) <= decided  # nothing acknowledged before the kill was lost
    assert not next((tmp_path / "spool").glob("*.jsonl")).read_text()  # the spool is empty again


def _not_in_the_stream_once(spooled: list[dict[str, Any]], events: list[AuditEvent]) -> list[str]:
    """What is wrong with how the spooled events reached the stream. Each must be there once:
    chained in from the spool, in order, or found there already (an append in flight at the kill
    that Redis had run, its answer lost: the AOF kept it; at most one per agent), never twice."""
    problems = []
    numbers = [int(e.labels["spool"].rsplit("#", 1)[1]) for e in events if "spool" in e.labels]
    if numbers != sorted(set(numbers)):
        problems.append(f"drained out of order or twice: {numbers}")
    if len([d for d in spooled if d["seq"] not in numbers]) > 4:
        problems.append("more spooled events found in the stream already than calls were in flight")
    in_stream = Counter((e.kind, e.decision_id, e.timestamp, e.outcome) for e in events)
    problems += [f"spooled event {d['seq']} is in the stream {n} times" for d in spooled
                 if (n := in_stream[(d["kind"], d["decision_id"], d["timestamp"], d["outcome"])]) != 1]  # fmt: skip
    return problems


async def test_the_first_call_after_redis_restarts_is_served_on_a_new_connection(
    tmp_path: Path, persistent_redis: RedisServer
) -> None:
    """Redis restarts with its data between two calls. The pooled connections it dropped are
    replaced before use: the very first call after it is decided and audited, not refused as a
    store failure (redis-py's maintenance notifications had turned that check off)."""
    async with ControlPlane.from_settings(_settings(tmp_path, persistent_redis.url)) as plane:
        await plane.register(external_tool("lookup"))
        session = await plane.open_session("agent-1", "alice@example.com")
        assert (await plane.call(session, "lookup", {})).status == "awaiting_report"

        await asyncio.to_thread(persistent_redis.kill)
        await asyncio.to_thread(persistent_redis.start)
        await asyncio.sleep(0.2)  # the loop reads the closed sockets' ends, as a live router's does

        result = await plane.call(session, "lookup", {})
        assert (result.status, result.reasons) == ("awaiting_report", [])
        assert await plane.readiness_problems() == {"store": None, "audit": None, "policy": None}
        assert [p.read_text() for p in (tmp_path / "spool").glob("*.jsonl")] in ([], [""])  # nothing refused
        report = await plane.audit.verify()
        assert (report.ok, report.events) == (True, 3), report.problem


async def test_redis_back_without_its_data_is_a_chain_that_went_backwards(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with ControlPlane.from_settings(_settings(tmp_path, redis_server.url)) as plane:
        await plane.register(external_tool("lookup"))
        session = await plane.open_session("agent-1", "alice@example.com")
        for _ in range(5):
            assert (await plane.call(session, "lookup", {})).status == "awaiting_report"

        redis_server.kill()
        redis_server.start()  # no persistence: the stream and its head are gone
        await _until_the_store_answers(plane)

        session = await plane.open_session("agent-1", "alice@example.com")
        result = await plane.call(session, "lookup", {})
        assert (result.status, result.reasons) == ("denied", ["audit.unavailable"])
        problems = await plane.readiness_problems()
        assert "went backwards" in (problems["audit"] or "")
        assert (await plane.readiness())["audit"] is False
        assert await plane.audit.query(AuditFilter()) == []  # nothing was chained onto the new head

    # The refusal is on record locally, and a restarted router remembers the chain it extended.
    spool = (tmp_path / "spool" / "router-a.jsonl").read_text().splitlines()
    assert [json.loads(line)["decision_id"] for line in spool].count(result.decision_id) >= 1
    async with ControlPlane.from_settings(_settings(tmp_path, redis_server.url)) as again:
        # The registry went with Redis's data; registering again needs an audit record, refused too.
        with pytest.raises(AuditError, match="not registered"):
            await again.register(external_tool("lookup"))
        assert await again.store.get_tool("lookup") is None
        assert "went backwards" in ((await again.readiness_problems())["audit"] or "")


async def _until_the_store_answers(plane: ControlPlane) -> None:
    """Wait until the router finds its store again (Redis was just started)."""
    for _ in range(50):
        if (await plane.readiness())["store"]:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the store did not come back")


async def test_two_routers_on_one_host_keep_spools_of_their_own(tmp_path: Path, redis_server: RedisServer) -> None:
    async with (
        ControlPlane.from_settings(_settings(tmp_path, redis_server.url)) as one,
        ControlPlane.from_settings(_settings(tmp_path, redis_server.url)) as two,
    ):
        await one.register(external_tool("lookup"))
        await two.register(external_tool("lookup"))
        session = await one.open_session("agent-1", "alice@example.com")
        assert (await two.call(session, "lookup", {})).status == "awaiting_report"
        assert (await one.call(session, "lookup", {})).status == "awaiting_report"
        assert (await one.audit.verify()).events == 3  # the registration (once, shared), two decisions
    locks = sorted(p.name for p in (tmp_path / "spool").glob("*.claim"))
    assert locks == ["router-a.1.jsonl.claim", "router-a.jsonl.claim"]


async def test_a_loss_hidden_by_other_routers_appending_past_it_is_still_seen(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Redis restarts empty; a fresh router (no memory of the old chain) appends past the seq the
    first router had reached. The first router still refuses: its last event is not in the stream."""
    async with ControlPlane.from_settings(_settings(tmp_path / "a", redis_server.url)) as first:
        await first.register(external_tool("lookup"))
        session = await first.open_session("agent-1", "alice@example.com")
        for _ in range(3):
            assert (await first.call(session, "lookup", {})).status == "awaiting_report"

        redis_server.kill()
        redis_server.start()
        await _until_the_store_answers(first)
        async with ControlPlane.from_settings(_settings(tmp_path / "b", redis_server.url, "router-b")) as fresh:
            await fresh.register(external_tool("lookup"))
            other = await fresh.open_session("agent-2", "bob@example.com")
            for _ in range(10):  # 20 events: the head is now far past the first router's seq 6
                assert (await fresh.call(other, "lookup", {})).status == "awaiting_report"

        session = await first.open_session("agent-1", "alice@example.com")
        assert (await first.call(session, "lookup", {})).reasons == ["audit.unavailable"]
        assert "went backwards" in ((await first.readiness_problems())["audit"] or "")


async def test_an_append_that_timed_out_but_landed_is_not_chained_twice(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Redis stalls past the client's timeout and then runs the append it was sent: the caller saw
    a failure and spooled the event, but the stream has it. When the spool is drained, that event
    is found in the stream and not appended again: each event once, in order, the chain intact."""
    log = RedisAuditLog(redis_server.url, timeout_s=0.3, spool_dir=tmp_path / "spool", instance="r1")

    def event(name: str) -> AuditEvent:
        return AuditEvent(kind="decision", decision_id=name, timestamp=timestamp(), outcome="allow")

    await log.append(event("before"))
    await _stall_during(redis_server, log.append(event("timed-out")))
    await log.append(event("after"))
    stream = await log.query(AuditFilter())
    assert [e.decision_id for e in stream] == ["before", "timed-out", "after"]
    assert [e.seq for e in stream] == [1, 2, 3]
    assert (await log.verify()).ok
    await log.aclose()


async def test_an_append_that_landed_is_found_however_many_others_appended_since(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, for an idle router in a busy fleet: more than 10,000 events were appended since
    its last answered append. Its next append learns the head from the script's "moved" answer,
    and the retry chained onto it times out but lands. The drain still finds that entry, by the
    list of entry ids the writer's appends keep, not by reading what the fleet wrote after its
    last known one."""
    idle = RedisAuditLog(redis_server.url, timeout_s=0.3, spool_dir=tmp_path / "idle", instance="r1")
    busy = RedisAuditLog(redis_server.url, spool_dir=tmp_path / "busy", instance="r1")

    def event(name: str) -> AuditEvent:
        return AuditEvent(kind="decision", decision_id=name, timestamp=timestamp(), outcome="allow")

    await idle.append(event("before"))
    for n in range(10_001):
        await busy.append(event(f"busy-{n}"))
    script, attempts = idle._append, 0
    stalling = redis.Redis.from_url(redis_server.url)

    async def stall_before_the_retry(keys: list[str], args: list[str]) -> Any:
        nonlocal attempts
        attempts += 1
        if attempts == 2:  # the first was answered "moved": stall Redis under the retry
            await _until_stalled(redis_server, threading.Thread(target=stalling.execute_command,
                                                                args=("DEBUG", "SLEEP", 2.0)))  # fmt: skip
        return await script(keys, args)

    monkeypatch.setattr(idle, "_append", stall_before_the_retry)
    try:
        with pytest.raises(AuditError):
            await idle.append(event("timed-out"))
        await asyncio.sleep(2)  # the stall ends; Redis runs the retry
        monkeypatch.setattr(idle, "_append", script)
        await idle.append(event("after"))
        # Read through the busy router: the idle one's 0.3 s timeout is for the stall above, and
        # a chunk of 2,000 entries once took longer than that to read on a loaded CI machine.
        stream = await busy.query(AuditFilter())
        mine = [e.decision_id for e in stream if not (e.decision_id or "").startswith("busy-")]
        assert mine == ["before", "timed-out", "after"]
        assert len(stream) == 10_004
        assert (await busy.verify()).ok
    finally:  # closed on every path: a client left open warns in whichever test collects it
        stalling.close()
        await idle.aclose()
        await busy.aclose()
    await busy.aclose()


async def _stall_during(redis_server: RedisServer, append: Coroutine[Any, Any, AuditEvent]) -> None:
    """Run ``append`` while Redis stalls past its client's timeout: it fails, though Redis runs it."""
    stalling = redis.Redis.from_url(redis_server.url)
    stall = threading.Thread(target=stalling.execute_command, args=("DEBUG", "SLEEP", 2.0))
    await _until_stalled(redis_server, stall)
    with pytest.raises(AuditError):
        await append
    stall.join()
    stalling.close()


async def _until_stalled(redis_server: RedisServer, stall: threading.Thread) -> None:
    """Start ``stall`` (a thread that stalls Redis) and return once Redis stopped answering."""
    stall.start()
    probe = redis.Redis.from_url(redis_server.url, socket_timeout=0.05)
    for _ in range(100):  # until the stall is running: a command sent next waits behind it
        try:
            probe.ping()
            await asyncio.sleep(0.01)
        except redis.exceptions.TimeoutError:
            break
    probe.close()
