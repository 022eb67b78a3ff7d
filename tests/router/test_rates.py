"""Rate limits: the sliding windows, and a limit tripping through the router."""

from __future__ import annotations

from pathlib import Path

import pytest

from policy import PolicySettings
from router import ControlPlane, Settings
from router.rates import RateCounter, scopes
from router.settings import AuditSettings, StoreSettings
from tests.conftest import ECHO, copy_policies, edit_catalog, python_tool


@pytest.fixture
def store_url(both_stores: str | None) -> str | None:
    """Every test here runs on the embedded store and on Redis."""
    return both_stores


def test_windows_slide() -> None:
    counter = RateCounter(window_s=60)
    windows = scopes("s-1", "agent", "echo")
    assert counter.hit(windows, now=0)["session_per_minute"] == 1
    assert counter.hit(windows, now=30)["session_per_minute"] == 2
    assert counter.hit(windows, now=59.9)["agent_tool_per_minute"] == 3
    assert counter.peek(windows, now=60.5)["session_per_minute"] == 2  # the call at 0 left the window
    assert counter.peek(windows, now=200)["agent_per_minute"] == 0


def test_windows_are_separate_per_scope() -> None:
    counter = RateCounter()
    counter.hit(scopes("s-1", "a", "echo"), now=1)
    counts = counter.hit(scopes("s-2", "a", "other"), now=2)
    assert counts == {"session_per_minute": 1, "agent_per_minute": 2, "tool_per_minute": 1,
                      "agent_tool_per_minute": 1}  # fmt: skip


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
