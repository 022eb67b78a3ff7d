"""Decisions over HTTP: decisions/s and p50/p99 of POST /v1/sessions/{id}/decide against one and
two `stockade serve` routers (two share one Redis and one audit log), driven by wrk (a C load
generator: a Python one would take most of a core from the routers), next to ControlPlane.decide()
in process from the same run; and calls of a trivial bwrap tool through two routers (httpx).
Settings are the defaults a user gets (fsync audit appends).

(Named api.py, not http.py: a bench/http.py would shadow the standard library's http package for
every script in this directory.)

Throughput grows with concurrency (larger shared fsync batches, fuller event-loop iterations) at
the cost of latency, so two routers are measured at two connection counts per router.

Usage: .venv/bin/python bench/api.py [--duration S] [--calls N] [--connections C ...] [--json]
       (needs wrk, and redis-server on 127.0.0.1:6379, as scripts/services installs and starts them)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import free_port, report, summarize

from router import ControlPlane, Settings
from router.logging import configure_logging
from router.settings import AuditSettings

REPO = Path(__file__).resolve().parent.parent
STOCKADE = str(Path(sys.executable).parent / "stockade")
TOKEN = "bench-agent-token"  # noqa: S105  (a loopback-only stand-in)
ADMIN = "bench-admin-token"
PRINCIPALS = [
    {"name": "bench", "role": "agent", "token_sha256": hashlib.sha256(TOKEN.encode()).hexdigest()},
    {"name": "root", "role": "admin", "token_sha256": hashlib.sha256(ADMIN.encode()).hexdigest()},
]
DECIDE_TOOL = {"name": "lookup", "description": "look up", "risk": "low", "input_schema": {"type": "object"},
               "executor": {"kind": "external"}}  # fmt: skip
CALL_TOOL = {"name": "count", "description": "count", "risk": "low", "input_schema": {"type": "object"},
             "executor": {"kind": "python", "source": "def main(**kw):\n    return len(kw)\n"}}  # fmt: skip


@contextlib.contextmanager
def routers(count: int, workdir: Path, redis_url: str | None) -> Iterator[list[str]]:
    """``count`` `stockade serve` processes; with ``redis_url`` they share it and one audit log."""
    env = {**os.environ, "STOCKADE_API_PRINCIPALS": json.dumps(PRINCIPALS), "STOCKADE_LOG_LEVEL": "error",
           "STOCKADE_AUDIT__PATH": str(workdir / "audit.jsonl")}  # fmt: skip
    if redis_url:
        env["STOCKADE_STORE__URL"] = redis_url
    servers, urls = [], []
    try:
        for i in range(count):
            port = free_port()
            log = (workdir / f"router-{i}.log").open("wb")
            servers.append(subprocess.Popen([STOCKADE, "serve", "--port", str(port)], env=env,
                                            stdout=subprocess.DEVNULL, stderr=log))  # fmt: skip
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            for _ in range(400):
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                        break
                time.sleep(0.05)
            for tool in (DECIDE_TOOL, CALL_TOOL):
                httpx.post(
                    f"{url}/v1/tools", json=tool, headers={"Authorization": f"Bearer {ADMIN}"}
                ).raise_for_status()
        yield urls
    finally:
        for server in servers:
            server.terminate()
            server.wait(10)


async def load(urls: list[str], path_for: Any, body: dict[str, Any], n: int, concurrency: int) -> dict[str, Any]:
    """``n`` POSTs spread round-robin over ``urls`` by ``concurrency`` clients; latencies and rate."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=60) as client:
        sessions = []
        for url in urls[:1]:  # one session, used through every router (they share the store)
            opened = await client.post(f"{url}/v1/sessions", json={"principal": "alice@example.com"})
            opened.raise_for_status()
            sessions.append(opened.json()["session_id"])
        samples: list[float] = []
        failures: list[int] = []
        counter = iter(range(n))

        async def worker(k: int) -> None:
            for i in counter:
                url = urls[(i + k) % len(urls)]
                started = time.perf_counter()
                response = await client.post(url + path_for(sessions[0]), json=body)
                samples.append(time.perf_counter() - started)
                if response.status_code != 200:
                    failures.append(response.status_code)

        began = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        elapsed = time.perf_counter() - began
    return {"samples": samples, "failures": failures, "rate": n / elapsed}


# wrk's Lua hooks: POST the body, and print the run's figures as one JSON line when it is done.
WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %(token)s"
wrk.body = '%(body)s'
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('{"requests": %%d, "duration_us": %%d, "failed": %%d, "p50_us": %%d, "p99_us": %%d, '
    .. '"mean_us": %%f}\\n', summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout + e.status,
    latency:percentile(50), latency:percentile(99), latency.mean))
end
"""


def wrk(urls: list[str], session: str, body: dict[str, Any], seconds: float, connections: int,
        workdir: Path) -> dict[str, float]:  # fmt: skip
    """One wrk process per router, all at once, for ``seconds``: decisions/s summed over them, and
    the highest p50/p99 of any (each wrk sees only its own router's latencies)."""
    script = workdir / "decide.lua"
    script.write_text(WRK_SCRIPT % {"token": TOKEN, "body": json.dumps(body)})
    runs = [subprocess.Popen(["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "-s", str(script),
                              f"{url}{decide_path(session)}"], stdout=subprocess.PIPE, text=True)
            for url in urls]  # fmt: skip
    figures = []
    for run in runs:
        out, _ = run.communicate(timeout=seconds + 60)
        if run.returncode != 0:
            raise SystemExit(f"wrk failed ({run.returncode}): {out[-500:]}")
        figures.append(json.loads(out.strip().splitlines()[-1]))
    failed = sum(f["failed"] for f in figures)
    if failed:
        raise SystemExit(f"{failed} decide requests failed or were not answered 2xx")
    requests = sum(f["requests"] for f in figures)
    return {
        "n": requests,
        "p50_ms": max(f["p50_us"] for f in figures) / 1000,
        "p99_ms": max(f["p99_us"] for f in figures) / 1000,
        "mean_ms": max(f["mean_us"] for f in figures) / 1000,
        "per_s": sum(f["requests"] / (f["duration_us"] / 1e6) for f in figures),
    }


async def open_session(url: str) -> str:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        opened = await client.post(f"{url}/v1/sessions", json={"principal": "alice@example.com"})
        opened.raise_for_status()
        session: str = opened.json()["session_id"]
        return session


async def in_process(n: int) -> list[float]:
    with tempfile.TemporaryDirectory(dir=REPO) as tmp:
        async with ControlPlane.from_settings(Settings(audit=AuditSettings(path=Path(tmp) / "a.jsonl"))) as plane:
            await plane.register(DECIDE_TOOL)
            session = await plane.open_session("bench", "alice@example.com")
            samples = []
            for _ in range(n):
                started = time.perf_counter()
                await plane.decide(session, "lookup", {"q": "x"})
                samples.append(time.perf_counter() - started)
            return samples


def decide_path(session: str) -> str:
    return f"/v1/sessions/{session}/decide"


def call_path(session: str) -> str:
    return f"/v1/sessions/{session}/calls"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of wrk load per configuration")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--connections", type=int, nargs="+", default=[16, 32],
                        help="wrk connections per router (one router: the first; two routers: each)")  # fmt: skip
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("bench/api.py needs wrk: run scripts/services (or apt-get install wrk)")
    configure_logging("console", "warning")
    rows: dict[str, dict[str, float]] = {}
    rates: dict[str, float] = {}
    rows["baseline: ControlPlane.decide() in process, sequential"] = summarize(await in_process(2000))
    decide = {"tool": "lookup", "args": {"q": "x"}}
    two: dict[int, float] = {}
    for count, redis_url in ((1, None), (2, opts.redis_url)):
        with tempfile.TemporaryDirectory(dir=REPO) as tmp, routers(count, Path(tmp), redis_url) as urls:
            session = await open_session(urls[0])  # one session, used through every router (they share the store)
            wrk(urls, session, decide, 2, opts.connections[0], Path(tmp))  # warm-up
            for connections in opts.connections if count == 2 else opts.connections[:1]:
                name = f"HTTP decide, {count} router{'s' if count > 1 else ''}, wrk {connections} conn. each"
                rows[name] = wrk(urls, session, decide, opts.duration, connections, Path(tmp))
                rates[name] = rows[name]["per_s"]
                if count == 2:
                    two[connections] = rows[name]["per_s"]
            if count == 2:
                calls = await load(urls, call_path, {"tool": "count", "args": {"a": 1}}, opts.calls, 4)
                if calls["failures"]:
                    raise SystemExit(f"{len(calls['failures'])} calls failed: {set(calls['failures'])}")
                rows["HTTP call of a bwrap tool, 2 routers, 4 clients"] = {**summarize(calls["samples"]),
                                                                           "per_s": calls["rate"]}  # fmt: skip
                rates["HTTP call of a bwrap tool, 2 routers, 4 clients"] = calls["rate"]
    best = max(two, key=two.__getitem__)
    report("decisions over HTTP", rows, {
        "durability": "fsync per audit append (the default); routers are `stockade serve` processes on loopback",
        "store": "1 router: embedded; 2 routers: one Redis, one shared audit log",
        **{f"throughput, {k}": f"{v:.0f}/s" for k, v in rates.items()},
        "latency": "HTTP decide rows: the higher p50/p99/mean of the routers' wrk runs; per s: decisions/s",
        "target": f">= 3000 decisions/s with two routers: {'met' if two[best] >= 3000 else 'NOT met'} "
        f"({two[best]:.0f}/s at {best} connections each; "
        + ", ".join(f"{v:.0f}/s at {c}" for c, v in two.items()) + "; routers, Redis and wrk share the 2 cores)",
    }, opts.json)  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
