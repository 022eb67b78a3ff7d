"""stockade as an MCP server (the ``mcp`` SDK's low-level `Server`), over stdio or streamable HTTP.

One MCP server is one agent task: it opens one stockade session for the agent and principal it
was started with (``stockade mcp --agent claude --principal alice@example.com``) and every MCP
client of it works in that session. ``tools/list`` shows the registered tools that policy could
allow now; each ``tools/call`` goes through the full pipeline. Denials, held calls and errors
come back as tool results with ``is_error`` set, naming the reason codes and the ``decision_id``
(and the ``approval_id`` of a held call), never as protocol errors: the model can read them.
"""

from __future__ import annotations

import json
from typing import Any

import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server

from router.control import VERSION, ControlPlane
from router.errors import StockadeError
from router.results import ToolResult


def _text(text: str, *, error: bool) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=error)


def _answer(result: ToolResult) -> types.CallToolResult:
    if result.ok:
        body = result.output if result.output is not None else result.stdout
        return _text(body if isinstance(body, str) else json.dumps(body), error=False)
    said: dict[str, Any] = {"status": result.status, "reasons": result.reasons, "decision_id": result.decision_id}
    if result.approval_id:
        said["approval_id"] = result.approval_id
        said["next"] = "a human must approve; then call again with the same arguments"
    if result.status == "completed":  # it ran, and failed (timeout, non-zero exit, OOM)
        said |= {"verdict": result.verdict, "stderr": result.stderr[-2000:]}
    return _text(json.dumps(said), error=True)


def build_server(
    plane: ControlPlane, *, agent: str, principal: str, trusted_context: list[str] | None = None
) -> Server[Any]:
    """An MCP server whose tools are ``plane``'s, called as ``agent`` acting for ``principal``."""
    state: dict[str, str] = {}

    async def session() -> str:
        if "id" not in state:
            state["id"] = await plane.open_session(agent, principal, trusted_context or [])
        return state["id"]

    async def list_tools(
        _: ServerRequestContext[Any, Any], __: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        allowed = await plane.permitted_tools(await session())
        return types.ListToolsResult(tools=[
            types.Tool(name=s.name, description=s.description, input_schema=s.input_schema) for s in allowed
        ])  # fmt: skip

    async def call_tool(_: ServerRequestContext[Any, Any], params: types.CallToolRequestParams) -> types.CallToolResult:
        try:
            result = await plane.call(await session(), params.name, dict(params.arguments or {}))
        except StockadeError as exc:  # bad arguments, unknown tool, a refused approval: the model can fix these
            return _text(json.dumps({"status": "refused", "reasons": [exc.code], "message": str(exc)}), error=True)
        return _answer(result)

    return Server("stockade", version=VERSION, on_list_tools=list_tools, on_call_tool=call_tool)
