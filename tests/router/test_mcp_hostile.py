"""MCP under a hostile or careless client: what is not a JSON-RPC message is answered and on
record, never silently dropped (a request left hanging, a tool run on text the client never
sent); every JSON-RPC error a client gets is audited on both transports; a human's decline in the
client denies the approval; and tool annotations never understate a tool's risk."""

from __future__ import annotations

import json
import os
import select
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import httpx
import mcp_types as types
import pytest
from mcp import Client

from router import ApprovalStatus, ControlPlane
from router.audit import AuditFilter
from router.errors import ApprovalError
from router.interfaces.mcp import build_server, tool_annotations
from router.wire import ToolSpec
from tests.conftest import ECHO, python_tool
from tests.router.test_mcp import STOCKADE, elicitation, mcp_http, plane, write_tools

__all__ = ["plane"]  # the fixture, shared with test_mcp

HELLO = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18",
         "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}}  # fmt: skip
INITIALIZED = {"jsonrpc": "2.0", "method": "notifications/initialized"}


def refusals(log: Path) -> list[tuple[str | None, str, str]]:
    """(agent, code, request) of each refusal on record in ``log``."""
    events = [json.loads(line) for line in log.read_text().splitlines()]
    return [(e["agent"], e["result"]["code"], e["result"]["request"]) for e in events
            if e["kind"] == "error" and e["outcome"] == "refused"]  # fmt: skip


def call(request_id: int, name: str, arguments: Any) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                       "params": {"name": name, "arguments": arguments}}).encode()  # fmt: skip


@contextmanager
def stdio_server(tmp_path: Path, capabilities: dict[str, Any] | None = None) -> Iterator[tuple[IO[bytes], IO[bytes]]]:
    """``stockade mcp`` over pipes, initialized (by a client with ``capabilities``): its stdin and
    stdout, for raw lines."""
    args = ["mcp", "--agent", "claude", "--principal", "alice@example.com", "--tools", str(write_tools(tmp_path))]
    env = {**os.environ, "STOCKADE_AUDIT__PATH": str(tmp_path / "audit.jsonl"), "STOCKADE_LOG_LEVEL": "error"}
    with (tmp_path / "mcp.log").open("wb") as stderr:
        server = subprocess.Popen([STOCKADE, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                  env=env)  # fmt: skip
    assert server.stdin is not None
    assert server.stdout is not None
    try:
        hello = {**HELLO, "params": {**HELLO["params"], "capabilities": capabilities or {}}}
        send(server.stdin, json.dumps(hello).encode())
        assert answer(server.stdout)["id"] == 1
        send(server.stdin, json.dumps(INITIALIZED).encode())
        yield server.stdin, server.stdout
    finally:
        server.stdin.close()
        server.wait(30)
        server.stdout.close()


def send(stdin: IO[bytes], line: bytes) -> None:
    stdin.write(line + b"\n")
    stdin.flush()


def answer(stdout: IO[bytes], within: float = 30) -> dict[str, Any]:
    """The server's next message; fails if none comes within ``within`` seconds."""
    ready, _, _ = select.select([stdout], [], [], within)
    assert ready, "the server never answered"
    said: dict[str, Any] = json.loads(stdout.readline())
    return said


def test_a_line_that_is_no_json_rpc_message_is_answered_and_audited_over_stdio(tmp_path: Path) -> None:
    """The SDK drops such a line without a word: a request in it hung forever, unaudited, and a
    line that is not UTF-8 ran the tool on U+FFFD the client never sent. Each gets a JSON-RPC
    error (with its id, read even from a cut-off line), on record first; a response to no request
    gets none, and is on record too; the connection goes on."""
    lines = {
        2: call(2, "echo", {"x": "\udcff"}).replace(b"\\udcff", b"\xff\xfe"),  # not UTF-8
        3: b'{"jsonrpc":"2.0","id":3,"method":',  # cut off
        4: call(4, "echo", {"x": "\ud800"}),  # a lone surrogate (json.dumps escapes it)
        5: call(5, "echo", {"x": "@"}).replace(b'"@"', b"[" * 50_000 + b"]" * 50_000),  # deeper than any parser goes
        6: b'{"jsonrpc":"2.0","id":6}',  # JSON, but no JSON-RPC message
    }
    with stdio_server(tmp_path) as (stdin, stdout):
        for request_id, line in lines.items():
            send(stdin, line)
            said = answer(stdout)
            assert said["id"] == request_id, said
            assert said["error"]["code"] == (-32600 if request_id == 6 else -32700), said
        send(stdin, b"not json at all")
        said = answer(stdout)
        assert (said["id"], said["error"]["code"]) == (None, -32700)
        send(stdin, b'{"jsonrpc":"2.0","id":999,"result":{}}')  # answers nothing the server asked
        send(stdin, call(100, "echo", {"ok": 1}))
        alive = answer(stdout)  # the forged response got no answer: the next line is the call's
        assert (alive["id"], alive["result"]["structuredContent"]) == (100, {"ok": 1})
    codes = [(agent, code) for agent, code, _ in refusals(tmp_path / "audit.jsonl")]
    assert codes == [("claude", "mcp.bad_request")] * 7
    requests = [request for _, _, request in refusals(tmp_path / "audit.jsonl")]
    assert requests == [f"stdio (JSON-RPC id {i})" for i in (2, 3, 4, 5, 6)] + ["stdio", "stdio (JSON-RPC id 999)"]


def test_json_rpc_errors_the_sdk_answers_are_audited_over_stdio(tmp_path: Path) -> None:
    with stdio_server(tmp_path) as (stdin, stdout):
        send(stdin, call(7, "echo", [1]))  # arguments must be an object
        assert answer(stdout)["error"]["code"] == -32602
        send(stdin, b'{"jsonrpc":"2.0","id":8,"method":"tools/nope","params":{}}')
        assert answer(stdout)["error"]["code"] == -32601
    assert refusals(tmp_path / "audit.jsonl") == [
        ("claude", "mcp.invalid_params", "stdio (JSON-RPC id 7)"),
        ("claude", "mcp.method_not_found", "stdio (JSON-RPC id 8)"),
    ]


async def test_what_the_sdk_refuses_over_http_without_tokens_is_audited_as_the_agent(tmp_path: Path) -> None:
    """Without tokens (loopback only) nothing was audited: neither a 4xx the SDK answers nor a
    JSON-RPC error it sends with a 200. Each is on record, as the --agent."""
    log = tmp_path / "audit.jsonl"
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    with mcp_http(tmp_path) as url:
        async with httpx.AsyncClient(timeout=30) as http:
            opened = await http.post(url, json=HELLO, headers=headers)
            headers |= {"Mcp-Session-Id": opened.headers["mcp-session-id"], "Mcp-Protocol-Version": "2025-06-18"}
            await http.post(url, json=INITIALIZED, headers=headers)
            before = len(refusals(log))
            answers = [
                await http.post(url, content=call(7, "echo", [1]), headers=headers),
                await http.post(url, json={"jsonrpc": "2.0", "id": 8, "method": "tools/nope"}, headers=headers),
                await http.post(url, content=call(9, "echo", {"ok": 1}), headers=headers),  # allowed: not a refusal
                await http.post(url, content=b'{"jsonrpc":', headers=headers),
                await http.post(url, content=call(10, "echo", {}), headers={**headers, "Host": "evil.example"}),
            ]
    assert [r.status_code for r in answers] == [200, 200, 200, 400, 421]  # the last: a rebound page's Host
    found = refusals(log)[before:]
    assert [(agent, code) for agent, code, _ in found] == [
        ("claude", "mcp.invalid_params"), ("claude", "mcp.method_not_found"), ("claude", "mcp.bad_request"),
        ("claude", "mcp.refused"),
    ]  # fmt: skip
    assert found[0][2].endswith("(JSON-RPC id 7)")
    assert found[1][2].endswith("(JSON-RPC id 8)")


async def test_a_decline_in_the_client_denies_the_approval_for_good(plane: ControlPlane) -> None:
    """An explicit decline was taken as a dismissal: the approval stayed pending, the human was
    never asked again, and an approver could still grant what the human had declined."""
    asked: list[str] = []
    decline = types.ElicitResult(action="decline")
    server = build_server(plane, agent="claude", principal="alice@example.com")
    info = types.Implementation(name="test-ide", version="9.9")
    async with Client(server, elicitation_callback=elicitation(decline, asked), client_info=info) as client:
        refused = await client.call_tool("drop_table", {"table": "users"})
        again = await client.call_tool("drop_table", {"table": "users"})
    assert refused.structured_content is not None
    assert (refused.is_error, refused.structured_content["reasons"]) == (True, ["approval.denied"])
    assert again.structured_content is not None
    assert again.structured_content["reasons"] == ["approval.denied"]
    assert len(asked) == 1
    assert await plane.list_approvals(ApprovalStatus.PENDING) == []
    [denied] = await plane.list_approvals(ApprovalStatus.DENIED)
    with pytest.raises(ApprovalError):
        await plane.approve(denied.id, "oncall@example.com")  # nobody grants what the human declined
    decisions = [e for e in await plane.audit.query(AuditFilter(kind="approval")) if e.outcome == "denied"]
    [decision] = decisions
    assert decision.result is not None
    assert decision.result["approver"] == "alice@example.com (via test-ide 9.9)"
    assert decision.result["note"] == "declined in test-ide 9.9 (MCP elicitation)"


def test_annotations_never_understate_a_tools_risk() -> None:
    """A client may run a tool it is told is read-only or not destructive with less care: a
    critical tool that declared no capability was read-only, a financial or code-running one not
    destructive. Anything that acts, or is high or critical risk, is destructive, never read-only."""
    declared: dict[str, dict[str, Any]] = {
        "plain": {},
        "reader": {"capabilities": ["reads_untrusted"]},
        "critical": {"risk": "critical"},
        "high": {"risk": "high"},
        "payer": {"risk": "medium", "capabilities": ["financial"]},
        "runner": {"capabilities": ["executes_code"]},
        "sender": {"capabilities": ["sends_external"]},
        "writer": {"capabilities": ["mutates_state"]},
    }
    hints = {
        name: tool_annotations(ToolSpec.model_validate(python_tool(name, ECHO, **overrides)))
        for name, overrides in declared.items()
    }
    assert {name: (h.read_only_hint, h.destructive_hint) for name, h in hints.items()} == {
        "plain": (True, False), "reader": (True, False), "critical": (False, True), "high": (False, True),
        "payer": (False, True), "runner": (False, True), "sender": (False, True), "writer": (False, True),
    }  # fmt: skip


MODERN = {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {},
          "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"}}  # fmt: skip


async def test_json_rpc_errors_the_2026_transport_answers_with_a_4xx_are_audited_by_their_code(
    tmp_path: Path,
) -> None:
    """The 2026-07-28 transport answers an unknown method with a 404 and bad parameters with a
    400: they were audited by the status alone, an unknown method as an unknown session
    (``mcp.session_not_found``) and bad parameters as ``mcp.bad_request``, not as documented."""
    log = tmp_path / "audit.jsonl"

    def headers(method: str, name: str | None = None) -> dict[str, str]:
        said = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
                "MCP-Protocol-Version": "2026-07-28", "Mcp-Method": method}  # fmt: skip
        return said | ({"Mcp-Name": name} if name else {})

    unknown = {"jsonrpc": "2.0", "id": 11, "method": "nope/x", "params": {"_meta": MODERN}}
    listed = {"jsonrpc": "2.0", "id": 12, "method": "tools/call",
              "params": {"name": "echo", "arguments": [1], "_meta": MODERN}}  # fmt: skip
    with mcp_http(tmp_path) as url:
        before = len(refusals(log))
        async with httpx.AsyncClient(timeout=30) as http:
            answers = [
                await http.post(url, json=unknown, headers=headers("nope/x")),
                await http.post(url, json=listed, headers=headers("tools/call", "echo")),
            ]
    assert [(r.status_code, r.json()["error"]["code"]) for r in answers] == [(404, -32601), (400, -32602)]
    assert [(agent, code) for agent, code, _ in refusals(log)[before:]] == [
        ("claude", "mcp.method_not_found"), ("claude", "mcp.invalid_params"),
    ]  # fmt: skip


async def test_a_client_cannot_name_itself_into_another_approver(plane: ControlPlane) -> None:
    """The client's name went into the approver's as it came, printable characters only: a client
    naming itself ``ide) approved by secops (via x`` made the record read as secops's approval."""
    yes = types.ElicitResult(action="accept", content={"approve": True})
    server = build_server(plane, agent="claude", principal="alice@example.com")
    info = types.Implementation(name="ide\u202e) approved by secops (via x", version="1\n2")
    async with Client(server, elicitation_callback=elicitation(yes, []), client_info=info) as client:
        done = await client.call_tool("drop_table", {"table": "users"})
    assert done.is_error is False
    [granted] = [e for e in await plane.audit.query(AuditFilter(kind="approval")) if e.outcome == "approved"]
    assert granted.result is not None
    assert granted.result["approver"] == "alice@example.com (via ide___approved_by_secops__via_x 1_2)"


def test_a_late_answer_to_a_question_withdrawn_with_its_call_is_on_record(tmp_path: Path) -> None:
    """A call cancelled while its human was asked: the server withdraws the question, and the
    human's yes that came after it was handed to the SDK, which dropped it without a record."""
    with stdio_server(tmp_path, {"elicitation": {}}) as (stdin, stdout):
        send(stdin, call(40, "drop_table", {"table": "users"}))
        asked = answer(stdout)
        assert asked["method"] == "elicitation/create"
        send(stdin, json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled",
                                "params": {"requestId": 40}}).encode())  # fmt: skip
        withdrawn = answer(stdout)
        assert (withdrawn["method"], withdrawn["params"]["requestId"]) == ("notifications/cancelled", asked["id"])
        send(stdin, json.dumps({"jsonrpc": "2.0", "id": asked["id"],
                                "result": {"action": "accept", "content": {"approve": True}}}).encode())  # fmt: skip
        send(stdin, call(41, "echo", {"ok": 1}))
        alive = answer(stdout)  # the late answer got no answer: the next line is the call's
        assert (alive["id"], alive["result"]["structuredContent"]) == (41, {"ok": 1})
    assert refusals(tmp_path / "audit.jsonl") == [
        ("claude", "mcp.bad_request", f"stdio (JSON-RPC id {json.dumps(asked['id'])})"),
    ]
    events = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [e["outcome"] for e in events if e["kind"] == "approval"] == ["requested"]  # nothing granted
