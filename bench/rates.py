"""The cost of counting a call in every rate window (15: five scopes by minute, hour, day), next to
the old four one-minute windows, measured in the same run.

Rows:
  - in process: `router.rates.RateCounter.hit` over the 15 windows (bucketed), beside the old
    counter (four exact one-minute deques, copied below as it was);
  - Redis: `RedisStore.call_context(count=True)` (the hot path's one round trip: session,
    provenance and every window), beside the old script (four one-minute sorted sets, copied
    below as it was), on the same server and the same session.

Each call is made by one of a few agents in one of many sessions, to one of a few tools, so the
scopes are as mixed as on a busy router (600 calls a minute in process). It also prints how much
Redis memory one agent's rate keys take after the run: the old minute set holds one member per
call; the new hash at most 61 buckets per period, however many calls.

Usage: .venv/bin/python bench/rates.py [--iterations N] [--redis-url URL] [--json]
The Redis keys it makes carry a random run id and are deleted afterwards; nothing else is touched.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import secrets
import sys
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path

import redis.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import report, summarize

from router.rates import RateCounter, scopes
from router.store import RedisStore, SessionRecord
from router.store import keys as store_keys

# The old in-process counter: four exact one-minute windows (router/rates.py before hour and day).
_OLD_WINDOW_S = 60.0


class OldRateCounter:
    """The baseline: one deque of call times per scope, one minute long."""

    def __init__(self) -> None:
        self._hits: dict[str, deque[float]] = {}

    def hit(self, windows: Mapping[str, str], now: float) -> dict[str, int]:
        counts = {}
        for name, key in windows.items():
            hits = self._hits.get(key)
            if hits is None:
                hits = self._hits[key] = deque()
            cutoff = now - _OLD_WINDOW_S
            while hits and hits[0] <= cutoff:
                hits.popleft()
            hits.append(now)
            counts[name] = len(hits)
        return counts


def old_scopes(session_id: str, agent: str, tool: str) -> dict[str, str]:
    return {
        "session_per_minute": f"session:{session_id}",
        "agent_per_minute": f"agent:{agent}",
        "tool_per_minute": f"tool:{tool}",
        "agent_tool_per_minute": f"agent_tool:{agent}:{tool}",
    }


# The old script (router/store/redis.py before hour and day), unchanged.
_OLD_CALL_CONTEXT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
if redis.call('HGET', KEYS[1], 'agent') ~= ARGV[3] then return {redis.call('HGETALL', KEYS[1])} end
local count = ARGV[2] == '1'
if count then redis.call('HINCRBY', KEYS[1], 'call_count', 1) end
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[1]) end
local sources = {}
for i = 7, #ARGV do sources[i - 6] = redis.call('HGET', KEYS[2], ARGV[i]) end
local counts = {}
local cutoff = tonumber(ARGV[4]) - tonumber(ARGV[5])
for i = 4, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', cutoff)
  if count then
    redis.call('ZADD', KEYS[i], ARGV[4], ARGV[6])
    redis.call('PEXPIRE', KEYS[i], ARGV[5])
  end
  counts[i - 3] = redis.call('ZCARD', KEYS[i])
end
return {redis.call('HGETALL', KEYS[1]), sources, counts}
"""


def workload(run: str, n: int) -> list[tuple[str, str, str, str]]:
    """(session, agent, principal, tool) of each of ``n`` calls: 50 sessions of 4 agents, 5 tools."""
    return [(f"s-{run}-{i % 50}", f"agent-{run}-{i % 50 % 4}", f"alice-{run}@example.com", f"tool{i % 5}")
            for i in range(n)]  # fmt: skip


def measure_memory(n: int, run: str) -> tuple[list[float], list[float]]:
    calls = workload(run, n)
    new, old = RateCounter(), OldRateCounter()
    new_samples, old_samples = [], []
    for i, (session, agent, principal, tool) in enumerate(calls):
        now = i * 0.1  # 600 calls a minute
        t = time.perf_counter()
        old.hit(old_scopes(session, agent, tool), now)
        old_samples.append(time.perf_counter() - t)
        t = time.perf_counter()
        new.hit(scopes(session, agent, principal, tool), now)
        new_samples.append(time.perf_counter() - t)
    return new_samples, old_samples


async def measure_redis(url: str, n: int, run: str) -> tuple[list[float], list[float], dict[str, int | None]]:
    store = RedisStore(url)
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    old_script = client.register_script(_OLD_CALL_CONTEXT)
    calls = workload(run, n)
    try:
        for session, agent, principal, _ in calls[:50]:
            await store.create_session(SessionRecord(session, agent, principal, (), "2026-01-01T00:00:00Z"), ())
        for session, _, _, tool in calls[:50]:  # the store learns each session's agent and principal
            await store.call_context(session, tool, {}, count=False)
        new_samples, old_samples = [], []
        for session, agent, _, tool in calls:
            old_keys = [
                store_keys.session(session),
                store_keys.provenance(session),
                store_keys.pending(session),
                *(f"stockade:rate:old-{run}:{scope}:60" for scope in old_scopes(session, agent, tool).values()),
            ]
            args: list[int | str] = [3_600_000, 1, agent, int(time.time() * 1000), 60_000, secrets.token_hex(8)]
            t = time.perf_counter()
            await old_script(old_keys, args)
            old_samples.append(time.perf_counter() - t)
            t = time.perf_counter()
            await store.call_context(session, tool, {}, count=True)
            new_samples.append(time.perf_counter() - t)
        agent = calls[0][1]
        memory = {
            "old: 1 agent's minute set": await client.memory_usage(f"stockade:rate:old-{run}:agent:{agent}:60", 0),
            "new: 1 agent's hash (minute, hour, day)": await client.memory_usage(store_keys.rate(f"agent:{agent}"), 0),
        }
        return new_samples, old_samples, memory
    finally:
        mine = [key async for key in client.scan_iter(f"stockade:*{run}*", count=1000)]
        for start in range(0, len(mine), 500):
            await client.delete(*mine[start : start + 500])
        await client.aclose()
        await store.aclose()


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5000)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="'' to skip the Redis rows")
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args()
    run = secrets.token_hex(4)
    n = options.iterations
    rows = {}
    new, old = measure_memory(n, run)
    rows["in process: old, 4 one-minute windows"] = summarize(old)
    rows["in process: new, 15 windows (60 buckets each)"] = summarize(new)
    notes: dict[str, object] = {"calls": n, "in-process cost ratio (mean)": _ratio(new, old)}
    if options.redis_url:
        new_r, old_r, memory = await measure_redis(options.redis_url, n, run)
        rows["Redis: old call_context script, 4 windows"] = summarize(old_r)
        rows["Redis: new call_context, 15 windows"] = summarize(new_r)
        notes["Redis cost ratio (mean)"] = _ratio(new_r, old_r)
        notes["Redis bytes after the run"] = memory
    report("counting a call in its rate windows", rows, notes, options.json)


def _ratio(new: list[float], old: list[float]) -> str:
    if not old or math.fsum(old) == 0:
        return "n/a"
    return f"{math.fsum(new) / math.fsum(old):.2f}x"


if __name__ == "__main__":
    asyncio.run(main())
