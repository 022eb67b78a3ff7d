"""Rate limits: the sliding windows, and a limit tripping through the router."""

from __future__ import annotations

from pathlib import Path

import pytest

from policy import PolicySettings
from policy.base import RATE_WINDOWS, RateCounts
from router import ControlPlane, Settings, rates
from router.rates import RateCounter, scopes
from router.settings import AuditSettings, StoreSettings
from tests.conftest import ECHO, copy_policies, edit_catalog, python_tool


@pytest.fixture
def store_url(both_stores: str | None) -> str | None:
    """Every test here runs on the embedded store and on Redis."""
    return both_stores


def test_the_input_rate_object_has_every_window() -> None:
    assert tuple(RateCounts.model_fields) == RATE_WINDOWS
    assert len(RATE_WINDOWS) == 15
    assert "agent_per_hour" in RATE_WINDOWS
    assert "principal_per_day" in RATE_WINDOWS
    assert "tool_per_minute" in RATE_WINDOWS
    assert set(RateCounts().model_dump()) == set(RATE_WINDOWS)  # all present in input.rate, 0 when uncounted


def test_a_call_counts_for_its_period_and_at_most_one_bucket_longer() -> None:
    counter = RateCounter()
    windows = scopes("s-1", "agent", "alice", "echo")
    assert counter.hit(windows, now=0.5).session_per_minute == 1  # in the second [0, 1)
    assert counter.hit(windows, now=30).session_per_minute == 2
    assert counter.hit(windows, now=59.9).agent_tool_per_minute == 3
    assert counter.peek(windows, now=60.4).session_per_minute == 3  # 59.9 s on: exact
    assert counter.peek(windows, now=60.9).session_per_minute == 3  # 60.4 s on: its bucket is still in
    assert counter.peek(windows, now=61).session_per_minute == 2  # 61 buckets on: gone
    assert counter.peek(windows, now=200).agent_per_minute == 0
    assert counter.peek(windows, now=200).agent_per_hour == 3
    # The hour's buckets are minutes, the day's 24 minutes.
    assert counter.peek(windows, now=3659).agent_per_hour == 3
    assert counter.peek(windows, now=3660).agent_per_hour == 0  # all three were in the minute [0, 60)
    assert counter.peek(windows, now=86400 + 1440 - 1).principal_per_day == 3
    assert counter.peek(windows, now=86400 + 1440).principal_per_day == 0


def test_windows_are_separate_per_scope() -> None:
    counter = RateCounter()
    counter.hit(scopes("s-1", "a", "alice", "echo"), now=1)
    counter.hit(scopes("s-3", "b", "alice", "echo"), now=1)
    counts = counter.hit(scopes("s-2", "a", "bob", "other"), now=2)
    assert {k: v for k, v in counts.model_dump().items() if k.endswith("_per_day")} == {
        "session_per_day": 1, "agent_per_day": 2, "principal_per_day": 1, "tool_per_day": 1, "agent_tool_per_day": 1,
    }  # fmt: skip
    assert counter.peek(scopes("s-9", "c", "alice", "echo"), now=3).principal_per_hour == 2


def test_a_full_counter_forgets_scopes_idle_for_longer_than_a_day_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rates, "_MAX_SCOPES", 1000)  # the bound, made small enough to reach
    counter = RateCounter({"minute": 1.0, "hour": 2.0, "day": 4.0})
    busy = scopes("s-busy", "a", "alice", "echo")
    for i in range(1000):
        counter.hit({"session": f"session:s-{i}"}, now=1)
    counter.hit(busy, now=8)  # full: nothing is idle for longer than a "day" yet, the idlest tenth goes
    counter.hit(busy, now=9)
    counter.hit({"session": "session:s-new"}, now=10)  # full again: the scopes last used at 1 are stale
    assert counter.peek(busy, now=10).agent_per_day == 2
    assert counter.peek({"session": "session:s-999"}, now=10).session_per_day == 0
    assert len(counter._scopes) < 20


async def test_a_rate_limit_trips_and_decide_does_not_count(tmp_path: Path, store_url: str | None) -> None:
    policies = copy_policies(tmp_path)
    edit_catalog(policies, rate_limits={"agent_tool_per_minute": 2})
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "a.jsonl"),
        store=StoreSettings(url=store_url),
        policy=PolicySettings(dir=policies),
    )
    async with ControlPlane.from_settings(settings) as plane:
        await plane.register(python_tool("echo", ECHO, executor={"kind": "external"}))
        session = await plane.open_session("agent-1", "alice@example.com")
        for _ in range(5):
            assert (await plane.decide(session, "echo", {})).outcome == "allow"  # dry runs are not counted
        assert (await plane.call(session, "echo", {})).status == "awaiting_report"
        assert (await plane.call(session, "echo", {})).status == "awaiting_report"
        third = await plane.call(session, "echo", {})
        assert (third.status, third.reasons) == ("denied", ["rate.exceeded"])
        other = await plane.open_session("agent-2", "bob@example.com")
        assert (await plane.call(other, "echo", {})).status == "awaiting_report"  # another agent's own window


async def test_hour_and_day_limits_in_the_catalog_trip(tmp_path: Path, store_url: str | None) -> None:
    """The shipped rule reads every window ``catalog.rate_limits`` names: per-hour and per-day
    limits, per agent and per principal, now fire."""
    policies = copy_policies(tmp_path)
    edit_catalog(policies, rate_limits={"agent_per_hour": 3, "principal_per_day": 4})
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "a.jsonl"),
        store=StoreSettings(url=store_url),
        policy=PolicySettings(dir=policies),
    )
    async with ControlPlane.from_settings(settings) as plane:
        await plane.register(python_tool("echo", ECHO, executor={"kind": "external"}))
        first = await plane.open_session("agent-1", "alice@example.com")
        second = await plane.open_session("agent-1", "alice@example.com")
        statuses = [(await plane.call(s, "echo", {})).status for s in (first, second, first, second)]
        assert statuses == ["awaiting_report"] * 3 + ["denied"]  # the agent's hour, across its sessions
        other = await plane.open_session("agent-2", "alice@example.com")
        refused = await plane.call(other, "echo", {})  # alice's fifth call today, through another agent
        assert (refused.status, refused.reasons) == ("denied", ["rate.exceeded"])
        bob = await plane.open_session("agent-2", "bob@example.com")
        assert (await plane.call(bob, "echo", {})).status == "awaiting_report"


def test_a_flood_of_fresh_sessions_and_principals_never_forgets_an_agents_windows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full counter with nothing stale forgets live scopes; an agent that floods it with calls in
    fresh sessions under fresh principals (each makes two scopes) must not make it forget its own
    agent and agent-tool windows, the ones it cannot escape by opening sessions (review finding:
    a per-day limit reset by 50,500 calls on the embedded store)."""
    monkeypatch.setattr(rates, "_MAX_SCOPES", 1000)
    counter = RateCounter({"minute": 1.0, "hour": 2.0, "day": 400.0})
    paying = scopes("s-main", "mallory", "alice", "pay")
    for at in range(5):
        counter.hit(paying, now=at)
    for i in range(5000):  # later than every call to "pay": its windows are the idlest of all
        counter.hit(scopes(f"s-{i}", "mallory", f"p{i}", "other"), now=10 + i / 100)
    counts = counter.peek(paying, now=70)
    assert (counts.agent_tool_per_day, counts.tool_per_day, counts.agent_per_day) == (5, 5, 5005)
    assert len(counter._scopes) <= 1000
