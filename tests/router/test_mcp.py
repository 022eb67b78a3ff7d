"""MCP: a client from the `mcp` SDK lists the tools policy could allow and gets allowed, denied and
held results as readable tool results, in process, over stdio and over streamable HTTP."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, StdioServerParameters

from router import ControlPlane, Settings
from router.audit import AuditFilter
from router.mcp import build_server
from router.settings import AuditSettings
from tests.conftest import ECHO, external_tool, python_tool, stockade_server

TOOLS: list[dict[str, Any]] = [
    python_tool("echo", ECHO),
    python_tool("drop_table", ECHO, risk="critical", capabilities=["mutates_state"]),
    python_tool("read_page", ECHO, capabilities=["reads_untrusted"]),  # what it returns is untrusted content
    external_tool(
        "set_password",
        capabilities=["mutates_state"],
        sensitive_args=["word"],
        input_schema={"type": "object", "properties": {"word": {"type": "string"}}},
    ),
]
STOCKADE = str(Path(sys.executable).parent / "stockade")


async def exercise(client: Client) -> None:
    """What every transport must show: the listing, an allowed call, a held one, a bad one."""
    listed = await client.list_tools()
    assert sorted(t.name for t in listed.tools) == ["drop_table", "echo", "read_page", "set_password"]
    ok = await client.call_tool("echo", {"word": "hi"})
    assert (ok.is_error, json.loads(ok.content[0].text)) == (False, {"word": "hi"})  # type: ignore[union-attr]
    held = await client.call_tool("drop_table", {"table": "users"})
    said = json.loads(held.content[0].text)  # type: ignore[union-attr]
    assert (held.is_error, said["status"], said["reasons"]) == (True, "pending_approval", ["approval.high_risk"])
    assert said["approval_id"].startswith("a-")
    page = await client.call_tool("read_page", {"word": "hunter2-from-the-page"})
    assert page.is_error is False
    denied = await client.call_tool("set_password", {"word": "hunter2-from-the-page"})  # the injection's value
    assert json.loads(denied.content[0].text)["reasons"] == ["provenance.untrusted_destination"]  # type: ignore[union-attr]
    unknown = await client.call_tool("nope", {})
    assert (unknown.is_error, json.loads(unknown.content[0].text)["reasons"]) == (True, ["tool.not_found"])  # type: ignore[union-attr]


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    async with ControlPlane.from_settings(Settings(audit=AuditSettings(path=tmp_path / "audit.jsonl"))) as p:
        for tool in TOOLS:
            await p.register(tool)
        yield p


async def test_an_mcp_client_in_process(plane: ControlPlane) -> None:
    server = build_server(plane, agent="claude", principal="alice@example.com")
    async with Client(server) as client:
        await exercise(client)
    decisions = await plane.audit.query(AuditFilter(kind="decision"))
    assert [e.tool for e in decisions] == ["echo", "drop_table", "read_page", "set_password"]  # each one audited


def write_tools(tmp_path: Path) -> Path:
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(TOOLS))
    return path


async def test_an_mcp_client_over_stdio(tmp_path: Path) -> None:
    args = ["mcp", "--agent", "claude", "--principal", "alice@example.com", "--tools", str(write_tools(tmp_path))]
    env = {**os.environ, "STOCKADE_AUDIT__PATH": str(tmp_path / "audit.jsonl"), "STOCKADE_LOG_LEVEL": "error"}
    params = StdioServerParameters(command=STOCKADE, args=args, env=env)
    async with Client(params) as client:
        await exercise(client)
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert {e["agent"] for e in audit if e["kind"] == "decision"} == {"claude"}


@contextlib.contextmanager
def mcp_http(tmp_path: Path) -> Iterator[str]:
    args = ["mcp", "--agent", "claude", "--principal", "alice@example.com", "--tools", str(write_tools(tmp_path)),
            "--http"]  # fmt: skip
    env = {"STOCKADE_AUDIT__PATH": str(tmp_path / "audit.jsonl"), "STOCKADE_LOG_LEVEL": "error"}
    with stockade_server(args, env, tmp_path / "mcp.log", "/mcp") as url:
        yield url + "/mcp"


async def test_an_mcp_client_over_streamable_http(tmp_path: Path) -> None:
    with mcp_http(tmp_path) as url:
        async with Client(url) as client:
            await exercise(client)
