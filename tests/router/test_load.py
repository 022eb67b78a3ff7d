"""A bounded load test on loopback: two `stockade serve` routers on one Redis, a fixed number of
concurrent decisions and bwrap calls; every one must succeed. The figures are printed (the
benchmark, bench/api.py, is where they are measured at length)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ECHO, python_tool
from tests.router.test_api import TOKENS, auth, principals, serve

DECISIONS, CALLS, CONCURRENCY = 600, 30, 8


async def drive(urls: list[str], path: str, body: dict[str, object], n: int) -> tuple[list[float], list[int], float]:
    samples: list[float] = []
    statuses: list[int] = []
    jobs = iter(range(n))
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKENS['agent-1']}"}, timeout=60) as client:

        async def worker() -> None:
            for i in jobs:
                started = time.perf_counter()
                response = await client.post(urls[i % len(urls)] + path, json=body)
                samples.append(time.perf_counter() - started)
                statuses.append(response.status_code)

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return samples, statuses, n / (time.perf_counter() - began)


def figures(name: str, samples: list[float], rate: float) -> str:
    cut = statistics.quantiles(samples, n=100)
    return f"{name}: {rate:.0f}/s, p50 {cut[49] * 1000:.1f} ms, p99 {cut[98] * 1000:.1f} ms"


async def test_two_routers_under_a_fixed_load(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {"STOCKADE_STORE__URL": redis_url, "STOCKADE_AUDIT__PATH": str(tmp_path / "audit.jsonl"),
           "STOCKADE_API_PRINCIPALS": json.dumps(principals()), "STOCKADE_LOG_LEVEL": "error"}  # fmt: skip
    with serve(env, tmp_path / "one.log") as one, serve(env, tmp_path / "two.log") as two:
        async with httpx.AsyncClient() as admin:
            for url in (one, two):
                for tool in (
                    python_tool("echo", ECHO),
                    {**python_tool("lookup", ECHO), "executor": {"kind": "external"}},
                ):
                    assert (await admin.post(f"{url}/v1/tools", json=tool, headers=auth("root"))).status_code == 201
            opened = await admin.post(f"{one}/v1/sessions", json={"principal": "alice"}, headers=auth("agent-1"))
        session = opened.json()["session_id"]
        decided, decide_statuses, decide_rate = await drive(
            [one, two], f"/v1/sessions/{session}/decide", {"tool": "lookup", "args": {}}, DECISIONS
        )
        called, call_statuses, call_rate = await drive(
            [one, two], f"/v1/sessions/{session}/calls", {"tool": "echo", "args": {"n": 1}}, CALLS)  # fmt: skip
        async with httpx.AsyncClient() as auditor:
            verified = (await auditor.get(f"{two}/v1/audit/verify", headers=auth("audit"))).json()
    assert set(decide_statuses) == {200}
    assert set(call_statuses) == {200}
    assert verified["ok"] is True
    assert verified["events"] >= DECISIONS + 2 * CALLS  # every decision and every run, one chain
    with capsys.disabled():
        print(f"\n  load, 2 routers, {CONCURRENCY} clients: " + figures("decide", decided, decide_rate) + "; "
              + figures("call (bwrap)", called, call_rate))  # fmt: skip
