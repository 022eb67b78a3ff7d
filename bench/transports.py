"""Per-call overhead of each way an agent framework reaches stockade, for the same tool.

One trivial python tool (bwrap tier) is called through: the in-process `ControlPlane` (the
baseline), MCP over stdio (`stockade mcp`, the official `mcp` client), MCP over streamable HTTP
(`stockade mcp --http`, with a bearer token) and the HTTP API (`stockade serve`, httpx). The
servers are real processes with the embedded store and their own fsynced audit logs. Each round
calls the tool once through each (rotating the order); a transport's overhead is the median of
its per-round difference to the in-process call, which cancels the sandbox's own jitter.
Targets: MCP stdio within +1 ms, the HTTP API within +2 ms.

The floor rows are the same stacks without stockade (bench/_floors.py): the ``mcp`` SDK's own
client and low-level server on the same stdio wire, and httpx against uvicorn and Starlette,
each serving a no-op tool. What a transport costs over its floor is stockade's.

Usage: .venv/bin/python bench/transports.py [--iterations N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import httpx
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import free_port, report, summarize

from policy import PolicySettings
from router import ControlPlane, Settings
from router.logging import configure_logging
from router.settings import AuditSettings

REPO = Path(__file__).resolve().parent.parent
STOCKADE = str(Path(sys.executable).parent / "stockade")
TOOL = {
    "name": "add", "description": "add two integers", "risk": "low",
    "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                     "required": ["a", "b"]},
    "executor": {"kind": "python", "source": "def main(a, b):\n    return a + b\n"},
}  # fmt: skip
ARGS = {"a": 2, "b": 3}
FLOOR_STDIO = "floor: mcp SDK server, no-op tool (stdio)"
FLOOR_HTTP = "floor: uvicorn + Starlette, no-op route (httpx)"
Call = Callable[[], Awaitable[None]]


@contextlib.contextmanager
def process(argv: list[str], env: dict[str, str], log: Path) -> Iterator[str]:
    """A `stockade` server on a free port; its base URL once it answers."""
    port = free_port()
    with log.open("wb") as stderr:
        server = subprocess.Popen([*argv, "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(url + "/healthz", timeout=1)
                break
            if server.poll() is not None:
                raise RuntimeError(f"{argv[1]} exited: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        yield url
    finally:
        server.terminate()
        server.wait(20)


@contextlib.asynccontextmanager
async def transports(tmp: Path) -> AsyncIterator[dict[str, Call]]:
    """Each transport as a ready call of the tool (each in its own session)."""
    token = secrets.token_urlsafe(24)
    principals = [{"name": "bench", "role": "agent", "token_sha256": hashlib.sha256(token.encode()).hexdigest()}]
    tools = tmp / "tools.json"
    tools.write_text(json.dumps([TOOL]))
    # The shipped policy with rate limits no benchmark run reaches (60 calls a minute per tool).
    policies = tmp / "policies"
    shutil.copytree(REPO / "policies", policies)
    data_file = policies / "stockade" / "data.json"
    data = json.loads(data_file.read_text())
    data["catalog"]["rate_limits"] = dict.fromkeys(data["catalog"]["rate_limits"], 1000000)
    data_file.write_text(json.dumps(data))

    def env(name: str) -> dict[str, str]:
        return {**os.environ, "STOCKADE_AUDIT__PATH": str(tmp / name / "audit.jsonl"), "STOCKADE_LOG_LEVEL": "error",
                "STOCKADE_API_PRINCIPALS": json.dumps(principals), "STOCKADE_POLICY__DIR": str(policies)}  # fmt: skip

    mcp_args = ["mcp", "--agent", "bench", "--principal", "alice@example.com", "--tools", str(tools)]
    settings = Settings(audit=AuditSettings(path=tmp / "inproc" / "audit.jsonl"), policy=PolicySettings(dir=policies))
    async with contextlib.AsyncExitStack() as stack:
        plane = await stack.enter_async_context(ControlPlane.from_settings(settings))
        await plane.register(TOOL)
        session = await plane.open_session("bench", "alice@example.com")

        async def in_process() -> None:
            result = await plane.call(session, "add", ARGS)
            assert result.output == 5, result

        stdio = await stack.enter_async_context(
            Client(StdioServerParameters(command=STOCKADE, args=mcp_args, env=env("stdio")))
        )

        async def mcp_stdio() -> None:
            result = await stdio.call_tool("add", ARGS)
            assert result.content[0].text == "5", result  # type: ignore[union-attr]

        mcp_url = stack.enter_context(process([STOCKADE, *mcp_args, "--http"], env("mcp-http"), tmp / "mcp.log"))
        http2 = await stack.enter_async_context(create_mcp_http_client(headers={"Authorization": f"Bearer {token}"}))
        over_http = await stack.enter_async_context(Client(streamable_http_client(mcp_url + "/mcp", http_client=http2)))

        async def mcp_http() -> None:
            result = await over_http.call_tool("add", ARGS)
            assert result.content[0].text == "5", result  # type: ignore[union-attr]

        api_url = stack.enter_context(process([STOCKADE, "serve", "--tools", str(tools)], env("api"), tmp / "api.log"))
        api = await stack.enter_async_context(
            httpx.AsyncClient(base_url=api_url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        )
        opened = (await api.post("/v1/sessions", json={"principal": "alice@example.com"})).json()
        calls = f"/v1/sessions/{opened['session_id']}/calls"

        async def http_api() -> None:
            result = (await api.post(calls, json={"tool": "add", "args": ARGS})).json()
            assert result["output"] == 5, result

        # The floors: the same stacks serving a no-op tool, without stockade.
        floors = str(REPO / "bench" / "_floors.py")
        bare_stdio = await stack.enter_async_context(
            Client(StdioServerParameters(command=sys.executable, args=[floors, "mcp"]))
        )

        async def mcp_stdio_floor() -> None:
            result = await bare_stdio.call_tool("add", ARGS)
            assert result.content[0].text == "5", result  # type: ignore[union-attr]

        floor_url = stack.enter_context(process([sys.executable, floors, "http"], os.environ.copy(), tmp / "floor.log"))
        bare_http = await stack.enter_async_context(httpx.AsyncClient(base_url=floor_url, timeout=60))

        async def http_floor() -> None:
            result = (await bare_http.post("/call", json={"tool": "add", "args": ARGS})).json()
            assert result["output"] == 5, result

        yield {
            "in-process ControlPlane.call()": in_process,
            "MCP stdio (stockade mcp)": mcp_stdio,
            "MCP streamable HTTP (stockade mcp --http)": mcp_http,
            "HTTP API (stockade serve)": http_api,
            FLOOR_STDIO: mcp_stdio_floor,
            FLOOR_HTTP: http_floor,
        }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    configure_logging("console", "warning")
    with tempfile.TemporaryDirectory(dir=REPO) as tmp:  # on the project's disk, not a tmpfs
        async with transports(Path(tmp)) as ways:
            names = list(ways)
            samples: dict[str, list[float]] = {name: [] for name in names}
            for call in ways.values():  # warm-up: first sandboxes, connections, caches
                for _ in range(3):
                    await call()
            for i in range(opts.iterations):
                # One call each per round, in a rotating order: the rounds pair the transports'
                # calls under the same machine state, so a per-round difference cancels the noise
                # of the sandbox itself (several ms here) that a difference of p50s would keep.
                for name in names[i % len(names) :] + names[: i % len(names)]:
                    started = time.perf_counter()
                    await ways[name]()
                    samples[name].append(time.perf_counter() - started)
    rows = {name: summarize(s) for name, s in samples.items()}
    base_name = names[0]
    over = {
        name: statistics.median(t - b for t, b in zip(samples[name], samples[base_name], strict=True)) * 1000
        for name in names[1:]
        if name not in (FLOOR_STDIO, FLOOR_HTTP)
    }
    stdio = over["MCP stdio (stockade mcp)"]
    api = over["HTTP API (stockade serve)"]
    report("per-call overhead by transport (same tool, bwrap)", rows, {
        "baseline": f"in-process p50 {rows[base_name]['p50_ms']:.2f} ms",
        "overhead over in-process (median of paired per-round differences)":
            ", ".join(f"{name.split(' (')[0]} {ms:+.2f} ms" for name, ms in over.items()),
        "floor: the same stack's own round trip, a no-op tool, no stockade (p50)":
            f"MCP stdio (mcp SDK client and server) {rows[FLOOR_STDIO]['p50_ms']:.2f} ms, "
            f"HTTP (httpx, uvicorn, Starlette) {rows[FLOOR_HTTP]['p50_ms']:.2f} ms",
        "target": f"MCP stdio <= +1 ms: {'met' if stdio <= 1 else 'NOT met'} ({stdio:+.2f}); "
                  f"HTTP API <= +2 ms: {'met' if api <= 2 else 'NOT met'} ({api:+.2f})",
    }, opts.json)  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
