"""The `Store` contract: one suite, run on the embedded store and on a real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis

from router.approvals import Approval, ApprovalStatus, binding
from router.errors import StoreError
from router.store import MemoryStore, PendingExternal, RedisStore, SessionRecord, Store
from router.store.redis import redacted
from tests.conftest import free_port

MakeStore = Callable[..., Awaitable[Store]]


@pytest.fixture
async def make(both_stores: str | None) -> AsyncIterator[MakeStore]:
    """Builds stores of the parametrized kind; all are closed after the test."""
    made: list[Store] = []

    async def build(session_ttl_s: float = 60.0, rate_window_s: float = 60.0) -> Store:
        store: Store
        if both_stores is None:
            store = MemoryStore(session_ttl_s, rate_window_s)
        else:
            store = RedisStore(both_stores, session_ttl_s=session_ttl_s, rate_window_s=rate_window_s)
        made.append(store)
        return store

    yield build
    for store in made:
        await store.aclose()


def record(session_id: str = "s-1", **fields: object) -> SessionRecord:
    values: dict[str, object] = {
        "id": session_id, "agent": "agent-1", "principal": "alice@example.com",
        "trusted_context": ("pay DE89 3704 0044 0532 0130 00",), "opened_at": "2026-11-22T10:00:00Z",
    }  # fmt: skip
    values.update(fields)
    return SessionRecord(**values)  # type: ignore[arg-type]


async def provenance(store: Store, session_id: str, keys_by_arg: dict[str, set[str]]) -> dict[str, list[str]]:
    """The provenance part of a (not counted) call's context; {} if the session is not open."""
    context = await store.call_context(session_id, "tool", keys_by_arg, count=False)
    return {} if context is None else context.provenance


def approval(approval_id: str = "a-1", status: ApprovalStatus = ApprovalStatus.PENDING) -> Approval:
    now = time.time()
    return Approval(
        id=approval_id, decision_id="d-1", session_id="s-1", agent="agent-1", principal="alice@example.com",
        tool="drop_table", args='{"table":"users"}', binding=binding("drop_table", '{"table":"users"}', "s-1"),
        reasons=[{"code": "approval.high_risk", "message": "critical"}], created_at=now, expires_at=now + 60,
        status=status,
    )  # fmt: skip


async def test_a_session_round_trips(make: MakeStore) -> None:
    store = await make()
    await store.create_session(record(taint=frozenset({"untrusted_content"}), call_count=3), {"s:alice"})
    assert await store.load_session("s-1") == record(taint=frozenset({"untrusted_content"}), call_count=3)
    assert await store.load_session("s-unknown") is None


async def test_two_redis_stores_on_one_server_see_the_same_sessions(redis_url: str) -> None:
    first, second = RedisStore(redis_url), RedisStore(redis_url)
    await first.create_session(record(), set())
    await first.record_output("s-1", "untrusted:web:c-1", {"e:eve@evil.example"}, taint="untrusted_content")
    counted = await second.call_context("s-1", "send", {}, count=True)
    assert counted is not None
    assert (counted.session.taint, counted.session.call_count) == ({"untrusted_content"}, 1)
    assert await provenance(second, "s-1", {"to": {"e:eve@evil.example"}}) == {"to": ["untrusted:web:c-1"]}
    await first.aclose()
    await second.aclose()


async def test_an_idle_session_expires_and_use_renews_it(make: MakeStore) -> None:
    store = await make(session_ttl_s=0.4)
    await store.create_session(record("s-used"), set())
    await store.create_session(record("s-idle"), set())
    for _ in range(4):
        await asyncio.sleep(0.15)
        assert await store.load_session("s-used") is not None
    assert await store.live_sessions({"s-used", "s-idle", "s-never"}) == {"s-used"}
    assert await store.load_session("s-idle") is None


async def test_deleting_a_session_forgets_its_index_and_pending_reports(make: MakeStore) -> None:
    store = await make()
    await store.create_session(record(), {"s:alice"})
    await store.expect_report(PendingExternal("s-1", "c-1", "d-1", "fetch"))
    assert await store.delete_session("s-1") is True
    assert await store.delete_session("s-1") is False
    assert await store.load_session("s-1") is None
    assert await store.call_context("s-1", "tool", {"x": {"s:alice"}}, count=False) is None
    assert await store.take_report("s-1", "c-1") is None
    await store.record_output("s-1", "tool:t:c-2", {"s:late"}, taint="untrusted_content")  # closed: ignored
    assert await store.load_session("s-1") is None


async def test_provenance_names_every_source_once_up_to_the_cap(make: MakeStore) -> None:
    store = await make()
    await store.create_session(record(), {"i:DE89370400440532013000"})
    await store.record_output("s-1", "untrusted:mail:c-1", {"i:DE89370400440532013000", "e:x@y.example"}, taint=None)
    await store.record_output("s-1", "untrusted:mail:c-1", {"e:x@y.example"}, taint=None)
    found = await provenance(store, "s-1", {
        "iban": {"i:DE89370400440532013000"}, "to": {"e:x@y.example"}, "other": {"s:nothing"},
    })  # fmt: skip
    assert found == {"iban": ["untrusted:mail:c-1", "user"], "to": ["untrusted:mail:c-1"]}
    for i in range(40):
        await store.record_output("s-1", f"tool:t:c-{i:02}", {"n:100"}, taint=None)
    assert len((await provenance(store, "s-1", {"amount": {"n:100"}}))["amount"]) == 16
    loaded = await store.load_session("s-1")
    assert loaded is not None
    assert loaded.taint == frozenset()  # no output here was marked as tainting


async def test_a_pending_report_is_taken_once_and_only_in_its_session(make: MakeStore) -> None:
    store = await make()
    await store.create_session(record("s-1"), set())
    await store.create_session(record("s-2"), set())
    pending = PendingExternal("s-1", "c-1", "d-1", "fetch")
    await store.expect_report(pending)
    assert await store.take_report("s-2", "c-1") is None
    assert await store.take_report("s-1", "c-1") == pending
    assert await store.take_report("s-1", "c-1") is None


async def test_approvals_change_status_only_from_the_expected_one(make: MakeStore) -> None:
    store = await make()
    await store.put_approval(approval(), keep_s=60)
    stored = await store.get_approval("a-1")
    assert stored is not None
    assert stored.status is ApprovalStatus.PENDING
    approved = stored.model_copy(update={"status": ApprovalStatus.APPROVED, "approver": "oncall"})
    assert await store.swap_approval(approved, ApprovalStatus.PENDING) is True
    assert await store.swap_approval(approved, ApprovalStatus.PENDING) is False  # no longer pending
    assert await store.get_approval("a-1") == approved
    assert await store.swap_approval(approval("a-unknown"), ApprovalStatus.PENDING) is False


async def test_of_two_concurrent_redeems_exactly_one_wins(make: MakeStore) -> None:
    store = await make()
    await store.put_approval(approval(status=ApprovalStatus.APPROVED), keep_s=60)
    used = approval(status=ApprovalStatus.USED)
    results = await asyncio.gather(*(store.swap_approval(used, ApprovalStatus.APPROVED) for _ in range(10)))
    assert sorted(results) == [False] * 9 + [True]


async def test_approvals_are_listed_oldest_first_and_dropped_after_their_keep_time(make: MakeStore) -> None:
    store = await make()
    await store.put_approval(approval("a-old"), keep_s=0.3)
    await asyncio.sleep(0.01)
    await store.put_approval(approval("a-new"), keep_s=60)
    assert [a.id for a in await store.list_approvals()] == ["a-old", "a-new"]
    await asyncio.sleep(0.4)
    assert [a.id for a in await store.list_approvals()] == ["a-new"]
    assert await store.get_approval("a-old") is None


async def test_a_counted_call_adds_to_the_call_count_and_every_rate_window(make: MakeStore) -> None:
    store = await make(rate_window_s=0.5)
    await store.create_session(record("s-1"), set())
    await store.create_session(record("s-2"), set())  # the same agent

    async def context(session_id: str, tool: str, *, count: bool) -> tuple[int, dict[str, int]]:
        found = await store.call_context(session_id, tool, {}, count=count)
        assert found is not None
        return found.session.call_count, found.rates

    assert await context("s-1", "echo", count=True) == (
        1,
        {"session_per_minute": 1, "agent_per_minute": 1, "tool_per_minute": 1, "agent_tool_per_minute": 1},
    )
    assert await context("s-1", "echo", count=True) == (
        2,
        {"session_per_minute": 2, "agent_per_minute": 2, "tool_per_minute": 2, "agent_tool_per_minute": 2},
    )
    assert await context("s-1", "echo", count=False) == (
        2,
        {  # decide(): seen, not counted
            "session_per_minute": 2,
            "agent_per_minute": 2,
            "tool_per_minute": 2,
            "agent_tool_per_minute": 2,
        },
    )
    assert await context("s-2", "other", count=True) == (
        1,
        {"session_per_minute": 1, "agent_per_minute": 3, "tool_per_minute": 1, "agent_tool_per_minute": 1},
    )
    await asyncio.sleep(0.6)
    assert await context("s-1", "echo", count=False) == (
        2,
        {  # the window slid; the count stays
            "session_per_minute": 0,
            "agent_per_minute": 0,
            "tool_per_minute": 0,
            "agent_tool_per_minute": 0,
        },
    )
    assert await store.call_context("s-unknown", "echo", {}, count=True) is None


async def test_every_redis_key_is_prefixed_and_expires(redis_url: str) -> None:
    store = RedisStore(redis_url)
    try:
        await store.create_session(record(), {"s:alice"})
        await store.record_output("s-1", "untrusted:web:c-1", {"h:evil.example"}, taint="untrusted_content")
        await store.expect_report(PendingExternal("s-1", "c-1", "d-1", "fetch"))
        await store.put_approval(approval(), keep_s=60)
        await store.call_context("s-1", "fetch", {"to": {"h:evil.example"}}, count=True)
    finally:
        await store.aclose()
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        found = {key: client.pttl(key) for key in client.scan_iter("*")}
    finally:
        client.close()
    assert sorted(found) == [
        "stockade:approval:a-1", "stockade:approvals", "stockade:rate:agent:agent-1:60",
        "stockade:rate:agent_tool:agent-1:fetch:60", "stockade:rate:session:s-1:60", "stockade:rate:tool:fetch:60",
        "stockade:session:s-1", "stockade:session:s-1:pending", "stockade:session:s-1:provenance",
    ]  # fmt: skip
    assert all(ttl > 0 for ttl in found.values()), found


async def test_an_unreachable_redis_is_a_store_error_naming_it_without_its_password() -> None:
    port = free_port()
    store = RedisStore(f"redis://:hunter2@127.0.0.1:{port}/0", timeout_s=0.5)
    try:
        with pytest.raises(StoreError, match=rf"127\.0\.0\.1:{port}") as caught:
            await store.load_session("s-1")
        assert "hunter2" not in str(caught.value)
    finally:
        await store.aclose()
    assert redacted("redis://user:pw@host:6379/0") == "redis://user:***@host:6379/0"


def test_a_malformed_store_url_is_refused() -> None:
    with pytest.raises(StoreError, match="redis://"):
        RedisStore("http://localhost:6379")


async def test_another_agents_claim_counts_and_reveals_nothing(make: MakeStore) -> None:
    store = await make()
    await store.create_session(record(), {"s:alice"})
    foreign = await store.call_context("s-1", "echo", {"x": {"s:alice"}}, count=True, agent="intruder")
    assert foreign is not None
    assert (foreign.session.agent, foreign.provenance, foreign.rates) == ("agent-1", {}, {})
    own = await store.call_context("s-1", "echo", {"x": {"s:alice"}}, count=True, agent="agent-1")
    assert own is not None
    assert (own.session.call_count, own.rates["session_per_minute"]) == (1, 1)  # the intruder's was not counted
    assert own.provenance == {"x": ["user"]}
