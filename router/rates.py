"""Rate counters: sliding one-minute windows of calls, per session, agent, tool and agent+tool.

Every ``call`` (allowed or not) is counted before it is decided, so ``input.rate`` includes the
call being decided; ``decide`` shows the counts without adding to them. Policy decides what to
do with the numbers (`policies/stockade/data.json` ``catalog.rate_limits``).

`RateCounter` is the in-process window (`MemoryStore`); `RedisStore` keeps the same windows as
Redis sorted sets, so routers sharing it count together.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping

WINDOW_S = 60.0
_MAX_SCOPES = 100_000  # beyond this, the idlest windows are forgotten first


def scopes(session_id: str, agent: str, tool: str) -> dict[str, str]:
    """The windows a call counts in, by the name policy sees them under in ``input.rate``."""
    return {
        "session_per_minute": f"session:{session_id}",
        "agent_per_minute": f"agent:{agent}",
        "tool_per_minute": f"tool:{tool}",
        "agent_tool_per_minute": f"agent_tool:{agent}:{tool}",
    }


class RateCounter:
    """Sliding windows in this process."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self._window_s = window_s
        self._hits: dict[str, deque[float]] = {}

    def _count(self, key: str, now: float) -> deque[float]:
        hits = self._hits.get(key)
        if hits is None:
            if len(self._hits) >= _MAX_SCOPES:
                self._forget_idlest(now)
            hits = self._hits[key] = deque()
        cutoff = now - self._window_s
        while hits and hits[0] <= cutoff:
            hits.popleft()
        return hits

    def _forget_idlest(self, now: float) -> None:
        cutoff = now - self._window_s
        stale = [k for k, v in self._hits.items() if not v or v[-1] <= cutoff]
        for key in stale or sorted(self._hits, key=lambda k: self._hits[k][-1])[: len(self._hits) // 10]:
            del self._hits[key]

    def hit(self, windows: Mapping[str, str], now: float | None = None) -> dict[str, int]:
        """Count one call in each window; returns the counts including it."""
        at = time.monotonic() if now is None else now
        counts = {}
        for name, key in windows.items():
            hits = self._count(key, at)
            hits.append(at)
            counts[name] = len(hits)
        return counts

    def peek(self, windows: Mapping[str, str], now: float | None = None) -> dict[str, int]:
        """The counts without counting anything."""
        at = time.monotonic() if now is None else now
        return {name: len(self._count(key, at)) for name, key in windows.items()}
