"""Rate counters: how many calls each rate window holds (``input.rate``, `policy.base.RateCounts`).

A window is a scope (this session, this agent, this principal, this tool, this agent's calls to
this tool) over a period (a minute, an hour, a day): ``agent_per_hour``. Every ``call`` (allowed
or not) is counted before it is decided, so ``input.rate`` includes the call being decided;
``decide`` shows the counts without adding to them. Policy decides what to do with the numbers
(`policies/stockade/data.json` ``catalog.rate_limits``).

How exact the counts are: no window keeps one entry per call (a busy agent would need a day's
worth). Each period is cut into ``BUCKETS`` (60) buckets (a second each for the minute, a minute
for the hour, 24 minutes for the day), and a window counts the current bucket and the 60 before
it. A call therefore stays counted for at least the whole period and at most one bucket longer
(61 s, 61 min, 24 h 24 min): a count is never below the exact sliding count, and above it only
by calls made in the one bucket just before the period. A limit may release up to 1/60 of its
period late, never early.

`RateCounter` keeps the windows in this process (`MemoryStore`); `RedisStore` keeps the same
buckets in Redis (one hash per scope), on Redis's clock, so routers sharing it count together.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping

from policy.base import RATE_SCOPES, RateCounts

PERIODS: dict[str, float] = {"minute": 60.0, "hour": 3600.0, "day": 86400.0}
"""Each period's length in seconds, by name."""

BUCKETS = 60
"""Buckets per period; a window counts this many plus the current one."""

_MAX_SCOPES = 100_000  # beyond this, the idlest scopes are forgotten first
_MINTED = ("session:", "principal:")  # scopes a caller makes at will (`RateCounter._forget_idlest`)


def scopes(session_id: str, agent: str, principal: str, tool: str) -> dict[str, str]:
    """What a call counts in: the scope's name (`policy.base.RATE_SCOPES`) -> its key (tool names
    hold no ``:``, so ``agent_tool`` keys cannot collide)."""
    return {
        "session": f"session:{session_id}",
        "agent": f"agent:{agent}",
        "principal": f"principal:{principal}",
        "tool": f"tool:{tool}",
        "agent_tool": f"agent_tool:{agent}:{tool}",
    }


class _Buckets:
    """One bucketed window: [bucket index, calls] oldest first, only for buckets with calls."""

    __slots__ = ("buckets", "total", "width")

    def __init__(self, period_s: float) -> None:
        self.width = period_s / BUCKETS
        self.buckets: deque[list[int]] = deque()
        self.total = 0

    def count(self, now: float, add: bool) -> int:
        current = int(now // self.width)
        buckets = self.buckets
        oldest = current - BUCKETS
        while buckets and buckets[0][0] < oldest:
            self.total -= buckets.popleft()[1]
        if add:
            if buckets and buckets[-1][0] >= current:  # a clock stepping back counts in the newest
                buckets[-1][1] += 1
            else:
                buckets.append([current, 1])
            self.total += 1
        return self.total


class _Scope:
    """Every window of one scope, and when it last counted a call."""

    __slots__ = ("day", "hour", "last", "minute")

    def __init__(self, periods: Mapping[str, float]) -> None:
        self.minute = _Buckets(periods["minute"])
        self.hour = _Buckets(periods["hour"])
        self.day = _Buckets(periods["day"])
        self.last = -math.inf


_NAMES = {scope: (f"{scope}_per_minute", f"{scope}_per_hour", f"{scope}_per_day") for scope in RATE_SCOPES}


class RateCounter:
    """Every scope's windows in this process. ``periods``: each period's length in seconds (tests
    shorten them)."""

    def __init__(self, periods: Mapping[str, float] = PERIODS) -> None:
        self._periods = dict(periods)
        self._longest = max(self._periods.values()) * (1 + 1 / BUCKETS)
        self._scopes: dict[str, _Scope] = {}

    def _new_scope(self, key: str, now: float) -> _Scope:
        if len(self._scopes) >= _MAX_SCOPES:
            self._forget_idlest(now)
        scope = self._scopes[key] = _Scope(self._periods)
        return scope

    def _forget_idlest(self, now: float) -> None:
        # A scope untouched for longer than the longest window counts nothing: forgetting it
        # changes no count. Only if there are none does a busy router forget live scopes (their
        # counts then start again from 0: an undercount, bounded by memory), a tenth at a time:
        # the idlest of those a caller can make at will (`_MINTED`: a new session, a principal
        # named in the request) first. A flood of fresh sessions or principals, which makes
        # such scopes, so never forgets the windows it cannot escape by making more of them: an
        # agent's, a tool's, an agent's calls to a tool.
        cutoff = now - self._longest
        stale = [k for k, v in self._scopes.items() if v.last <= cutoff]
        if not stale:
            ranked = sorted(self._scopes, key=lambda k: (not k.startswith(_MINTED), self._scopes[k].last))
            stale = ranked[: len(self._scopes) // 10]
        for key in stale:
            del self._scopes[key]

    def _counts(self, scope_keys: Mapping[str, str], now: float | None, add: bool) -> RateCounts:
        at = time.monotonic() if now is None else now
        counts: dict[str, int] = {}
        known = self._scopes
        for name, key in scope_keys.items():
            scope = known.get(key) or self._new_scope(key, at)
            if add:
                scope.last = at
            minute, hour, day = _NAMES[name]
            counts[minute] = scope.minute.count(at, add)
            counts[hour] = scope.hour.count(at, add)
            counts[day] = scope.day.count(at, add)
        return RateCounts.model_validate(counts)

    def hit(self, scope_keys: Mapping[str, str], now: float | None = None) -> RateCounts:
        """Count one call in every window of each scope (`scopes`); returns the counts including it."""
        return self._counts(scope_keys, now, add=True)

    def peek(self, scope_keys: Mapping[str, str], now: float | None = None) -> RateCounts:
        """The counts without counting anything."""
        return self._counts(scope_keys, now, add=False)
