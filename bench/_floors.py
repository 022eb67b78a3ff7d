"""The transports' own round trip, without stockade: a no-op ``add`` tool served by the same
stack `stockade mcp` and `stockade serve` use, for bench/transports.py's floor rows.

- ``mcp``: the ``mcp`` SDK's low-level server over stdio, on the same wire (`stdio_wire`);
- ``http --port N``: uvicorn (its defaults, as ``stockade serve`` runs it) and Starlette, one
  JSON route.

Usage: .venv/bin/python bench/_floors.py mcp | http --port N
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


async def mcp_floor() -> None:
    import mcp_types as types  # noqa: PLC0415
    from mcp.server.lowlevel import Server  # noqa: PLC0415
    from mcp.server.stdio import stdio_server  # noqa: PLC0415

    from router.interfaces.mcp_stdio import stdio_wire  # noqa: PLC0415

    async def list_tools(_: Any, __: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[types.Tool(name="add", input_schema={"type": "object"})])

    async def call_tool(_: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        args = params.arguments or {}
        return types.CallToolResult(content=[types.TextContent(type="text", text=str(args["a"] + args["b"]))])

    server = Server("floor", on_list_tools=list_tools, on_call_tool=call_tool)
    async with stdio_wire() as wire, stdio_server(*(wire or ())) as (read, write):
        await server.run(read, write, server.create_initialization_options())


def http_floor(port: int) -> None:
    import uvicorn  # noqa: PLC0415
    from starlette.applications import Starlette  # noqa: PLC0415
    from starlette.requests import Request  # noqa: PLC0415
    from starlette.responses import JSONResponse, Response  # noqa: PLC0415
    from starlette.routing import Route  # noqa: PLC0415

    async def health(_: Request) -> Response:
        return JSONResponse({"ok": True})

    async def call(request: Request) -> Response:
        body = json.loads(await request.body())
        return Response(json.dumps({"output": body["args"]["a"] + body["args"]["b"]}), media_type="application/json")

    app = Starlette(routes=[Route("/healthz", health), Route("/call", call, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


if __name__ == "__main__":
    if sys.argv[1:2] == ["mcp"]:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(mcp_floor())
    elif sys.argv[1:3] == ["http", "--port"]:
        http_floor(int(sys.argv[3]))
    else:
        sys.exit(__doc__)
