"""The `Store` contract: one suite, run on the embedded store and on a real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis
from pydantic import BaseModel, ConfigDict, create_model

from policy.base import RATE_SCOPES, RateCounts
from router.approvals import Approval, ApprovalStatus, binding
from router.errors import InvalidCall, StoreError
from router.rates import PERIODS
from router.sessions import new_session
from router.store import MemoryStore, PendingExternal, RedisStore, SessionRecord, Store, keys
from router.store.keys import is_session_id
from router.store.redis import _approval_json, redacted
from tests.conftest import free_port

MakeStore = Callable[..., Awaitable[Store]]


@pytest.fixture
async def make(both_stores: str | None) -> AsyncIterator[MakeStore]:
    """Builds stores of the parametrized kind; all are closed after the test."""
    made: list[Store] = []

    async def build(session_ttl_s: float = 60.0, rate_periods: dict[str, float] | None = None) -> Store:
        store: Store
        periods = rate_periods or PERIODS
        if both_stores is None:
            store = MemoryStore(session_ttl_s, periods)
        else:
            store = RedisStore(both_stores, session_ttl_s=session_ttl_s, rate_periods=periods)
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


async def test_another_agents_loads_keep_no_session_alive(make: MakeStore) -> None:
    """A refused request for another agent's session (a report, a close) loads it to find its
    owner: that load must not renew it, or a stranger keeps a victim's sandboxes alive for ever."""
    store = await make(session_ttl_s=0.4)
    await store.create_session(record("s-victim"), set())
    for _ in range(4):
        await asyncio.sleep(0.15)
        await store.load_session("s-victim", agent="intruder")
    assert await store.load_session("s-victim", agent="agent-1") is None  # expired on time
    await store.create_session(record("s-own"), set())
    for _ in range(4):
        await asyncio.sleep(0.15)
        assert await store.load_session("s-own", agent="agent-1") is not None  # its own agent renews it


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


# Each names no session: another's sub-key, a pattern, odd lengths, a non-ASCII digit (Arabic-Indic one).
HOSTILE_IDS = ["s-1:provenance", "s-1:pending", "s-1:*", "s-1 ", "s-", "1", "", "s-" + "a" * 65, "s-\u0661"]


async def test_no_session_id_names_another_sessions_keys(make: MakeStore) -> None:
    """Session ids come from callers: closing ``<id>:provenance`` deleted that session's
    provenance index (a hard deny became an approval request), and ``<id>:pending`` its pending
    reports. An id not shaped as one the router makes names no session, in either store."""
    store = await make()
    await store.create_session(record(), {"s:alice"})
    await store.record_output("s-1", "untrusted:web:c-1", {"e:eve@evil.example"}, taint="untrusted_content")
    pending = PendingExternal("s-1", "c-2", "d-2", "fetch")
    await store.expect_report(pending)
    for hostile in HOSTILE_IDS:
        assert not is_session_id(hostile)
        assert await store.delete_session(hostile) is False
        assert await store.load_session(hostile) is None
        assert await store.call_context(hostile, "send", {"to": {"e:eve@evil.example"}}, count=True) is None
        assert await store.take_report(hostile, "c-2") is None
        assert await store.endorse(hostile, "c-1") is None
        assert await store.add_session_labels(hostile, {"x"}) is False
        assert await store.live_sessions({hostile, "s-1"}) == {"s-1"}
        await store.record_output(hostile, "tool:t:c-3", {"e:eve@evil.example"}, taint=None)  # ignored
        with pytest.raises(InvalidCall, match="session id"):
            await store.create_session(record(hostile), set())
        with pytest.raises(InvalidCall, match="session id"):
            await store.expect_report(PendingExternal(hostile, "c-4", "d-4", "fetch"))
        with pytest.raises(InvalidCall, match="session id"):
            await store.put_approval(approval().model_copy(update={"session_id": hostile}), keep_s=60)
    assert await provenance(store, "s-1", {"to": {"e:eve@evil.example"}}) == {"to": ["untrusted:web:c-1"]}
    loaded = await store.load_session("s-1")
    assert loaded is not None
    assert (loaded.taint, loaded.labels, loaded.call_count) == ({"untrusted_content"}, frozenset(), 0)
    assert await store.take_report("s-1", "c-2") == pending


def test_the_router_makes_session_ids_the_stores_take() -> None:
    assert is_session_id(new_session("agent-1", "alice@example.com", []).id)
    assert is_session_id("s-1")


async def test_redis_closes_only_a_session(redis_url: str) -> None:
    """Closing deletes a session's keys only if its hash is there (checked and deleted in one
    script): an orphaned key, or a key of another kind at a session's name, is left alone."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    store = RedisStore(redis_url)
    try:
        client.hset(keys.pending("s-2"), "c-1", "{}")
        client.set(keys.session("s-3"), "not a session")
        assert await store.delete_session("s-2") is False
        assert await store.delete_session("s-3") is False
        assert client.exists(keys.pending("s-2"), keys.session("s-3")) == 2
        await store.create_session(record("s-4"), {"s:alice"})
        assert await store.delete_session("s-4") is True
        assert client.exists(keys.session("s-4"), keys.provenance("s-4")) == 0
    finally:
        await store.aclose()
        client.close()


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


async def test_an_expired_approval_is_never_decided_or_redeemed(make: MakeStore) -> None:
    """Expiry is the store's to judge, by its own clock: a router whose clock is behind still sees
    an expired approval as pending or approved, and must not decide or redeem it."""
    store = await make()
    past = time.time() - 60
    for approval_id, status in (("a-approved", ApprovalStatus.APPROVED), ("a-pending", ApprovalStatus.PENDING)):
        await store.put_approval(approval(approval_id, status).model_copy(update={"expires_at": past}), keep_s=60)
    used = approval("a-approved", ApprovalStatus.USED)
    assert await store.swap_approval(used, ApprovalStatus.APPROVED) is False
    decided = approval("a-pending", ApprovalStatus.APPROVED)
    assert await store.swap_approval(decided, ApprovalStatus.PENDING) is False
    assert [(a.id, a.status) for a in await store.list_approvals()] == [
        ("a-approved", ApprovalStatus.APPROVED), ("a-pending", ApprovalStatus.PENDING)]  # fmt: skip


async def test_approvals_are_listed_oldest_first_and_dropped_after_their_keep_time(make: MakeStore) -> None:
    store = await make()
    await store.put_approval(approval("a-old"), keep_s=0.3)
    await asyncio.sleep(0.01)
    await store.put_approval(approval("a-new"), keep_s=60)
    assert [a.id for a in await store.list_approvals()] == ["a-old", "a-new"]
    await asyncio.sleep(0.4)
    assert [a.id for a in await store.list_approvals()] == ["a-new"]
    assert await store.get_approval("a-old") is None


async def test_the_approvals_index_sheds_dead_ids_without_anyone_listing(redis_url: str) -> None:
    """Approvals flow in and expire while no one lists them: the index of ids stays the size of
    what is alive, not of everything ever held (each put drops the oldest dead ones)."""
    store = RedisStore(redis_url)
    await store.put_approval(approval("a-kept"), keep_s=60)  # keeps the index itself alive
    for n in range(40):
        await store.put_approval(approval(f"a-{n}"), keep_s=0.05)
    await asyncio.sleep(0.1)
    for n in range(40, 50):
        await store.put_approval(approval(f"a-{n}"), keep_s=60)
    index = redis.Redis.from_url(redis_url)
    try:
        assert index.zcard(keys.APPROVALS) == 11
    finally:
        index.close()
    assert [a.id for a in await store.list_approvals()] == ["a-kept", *(f"a-{n}" for n in range(40, 50))]
    await store.aclose()


def windows(period: str, session: int, agent: int, principal: int, tool: int, agent_tool: int) -> dict[str, int]:
    """One period's five windows, by name."""
    counts = (session, agent, principal, tool, agent_tool)
    return {f"{scope}_per_{period}": n for scope, n in zip(RATE_SCOPES, counts, strict=True)}


def rate_counts(*periods: dict[str, int]) -> RateCounts:
    return RateCounts(**{name: n for period in periods for name, n in period.items()})


async def test_a_counted_call_adds_to_the_call_count_and_every_rate_window(make: MakeStore) -> None:
    """Each call counts in all 15 windows; each period slides on its own (shortened here)."""
    store = await make(rate_periods={"minute": 0.5, "hour": 1.2, "day": 2.4})
    await store.create_session(record("s-1"), set())
    await store.create_session(record("s-2"), set())  # the same agent and principal
    await store.create_session(record("s-3", agent="agent-2", principal="bob@example.com"), set())

    async def context(session_id: str, tool: str, *, count: bool) -> tuple[int, RateCounts]:
        found = await store.call_context(session_id, tool, {}, count=count)
        assert found is not None
        return found.session.call_count, found.rates

    def every_period(*counts: int) -> RateCounts:
        return rate_counts(*(windows(period, *counts) for period in PERIODS))

    assert await context("s-1", "echo", count=True) == (1, every_period(1, 1, 1, 1, 1))
    assert await context("s-1", "echo", count=True) == (2, every_period(2, 2, 2, 2, 2))
    assert await context("s-1", "echo", count=False) == (2, every_period(2, 2, 2, 2, 2))  # decide(): not counted
    assert await context("s-2", "other", count=True) == (1, every_period(1, 3, 3, 1, 1))
    assert await context("s-3", "echo", count=True) == (1, every_period(1, 1, 1, 3, 1))  # another agent, principal
    await asyncio.sleep(0.6)  # past the minute, within the hour
    assert await context("s-1", "echo", count=False) == (
        2, rate_counts(windows("minute", 0, 0, 0, 0, 0), windows("hour", 2, 3, 3, 3, 2), windows("day", 2, 3, 3, 3, 2))
    )  # fmt: skip
    await asyncio.sleep(0.8)  # past the hour (and its one bucket more), within the day
    assert await context("s-1", "echo", count=True) == (
        3, rate_counts(windows("minute", 1, 1, 1, 1, 1), windows("hour", 1, 1, 1, 1, 1), windows("day", 3, 4, 4, 4, 3))
    )  # fmt: skip
    assert await store.call_context("s-unknown", "echo", {}, count=True) is None


async def test_a_rate_window_keeps_buckets_not_calls(redis_url: str) -> None:
    """Hundreds of calls leave at most 61 buckets per period in a scope's Redis hash."""
    store = RedisStore(redis_url, rate_periods={"minute": 0.3, "hour": 0.6, "day": 60.0})
    try:
        await store.create_session(record(), set())
        for _ in range(300):
            await store.call_context("s-1", "echo", {}, count=True)
        await asyncio.sleep(0.35)  # the shortened minute, and one of its buckets, pass
        found = await store.call_context("s-1", "echo", {}, count=True)
        assert found is not None
        assert (found.rates.agent_per_minute, found.rates.agent_per_day) == (1, 301)
    finally:
        await store.aclose()
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        fields = client.hgetall("stockade:rate:agent:agent-1")
    finally:
        client.close()
    for period in ("m", "h", "d"):
        buckets = {int(k[2:]): int(v) for k, v in fields.items() if k.startswith(f"{period}:") and k[2:].isdigit()}
        assert 1 <= len(buckets) <= 61, (period, buckets)
        assert max(buckets) - min(buckets) <= 60  # only the buckets still in the window
        assert sum(buckets.values()) == int(fields[f"{period}:n"])
    assert (int(fields["m:n"]), int(fields["d:n"])) == (1, 301)


async def test_policy_labels_stay_with_the_session(make: MakeStore) -> None:
    store = await make()
    await store.create_session(record(), set())
    assert await store.add_session_labels("s-1", ["read_customer_records"])
    assert await store.add_session_labels("s-1", ["read_customer_records", "pii:eu"])
    loaded = await store.load_session("s-1")
    assert loaded is not None
    assert loaded.labels == {"read_customer_records", "pii:eu"}
    context = await store.call_context("s-1", "echo", {}, count=True)
    assert context is not None
    assert context.session.labels == {"read_customer_records", "pii:eu"}
    assert not await store.add_session_labels("s-unknown", ["x"])
    assert await store.load_session("s-unknown") is None  # not created by labelling it


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
    scopes = ["agent:agent-1", "agent_tool:agent-1:fetch", "principal:alice@example.com", "session:s-1",
              "tool:fetch"]  # fmt: skip
    assert sorted(found) == sorted([
        "stockade:approval:a-1", "stockade:approvals", *(f"stockade:rate:{scope}" for scope in scopes),
        "stockade:session:s-1", "stockade:session:s-1:pending", "stockade:session:s-1:provenance",
    ])  # fmt: skip
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
    assert (foreign.session.agent, foreign.provenance, foreign.rates) == ("agent-1", {}, RateCounts())
    own = await store.call_context("s-1", "echo", {"x": {"s:alice"}}, count=True, agent="agent-1")
    assert own is not None
    assert (own.session.call_count, own.rates.session_per_day) == (1, 1)  # the intruder's was not counted
    assert own.provenance == {"x": ["user"]}


def test_an_approval_without_files_is_stored_as_routers_before_input_binding_read_it() -> None:
    """Routers sharing one store are upgraded one at a time: an approval without input files is
    stored without the new field, which the previous version's model (extra fields forbidden)
    would refuse, and every approval listing on those routers would fail. One with files carries
    them (an older router cannot bind them, and refuses it rather than run other files)."""
    fields = {name: (info.annotation, info) for name, info in Approval.model_fields.items() if name != "inputs"}
    before = create_model("ApprovalBefore", __config__=ConfigDict(extra="forbid", frozen=True), **fields)  # type: ignore[call-overload]
    plain = Approval(id="a-1", decision_id="d", session_id="s", agent="a", principal="p", tool="t", args="{}",
                     binding=binding("t", "{}", "s"), reasons=[], created_at=1.0, expires_at=2.0)  # fmt: skip
    assert isinstance(before.model_validate_json(_approval_json(plain)), BaseModel)
    assert Approval.model_validate_json(_approval_json(plain)) == plain
    files = plain.model_copy(update={"inputs": [{"name": "x.txt", "sha256": "0" * 64, "size": 1}]})
    assert Approval.model_validate_json(_approval_json(files)) == files
    with pytest.raises(ValueError, match="inputs"):
        before.model_validate_json(_approval_json(files))
