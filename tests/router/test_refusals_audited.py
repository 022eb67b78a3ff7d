"""Every refusal is on record before the client hears it: approvals that cannot be decided, an
unknown or closed session, an oversized or timed-out request, a session the API cannot open,
and what the MCP SDK's session manager refuses by itself over streamable HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from policy import PolicySettings
from router import ControlPlane, Settings
from router.interfaces.api import create_app
from router.interfaces.mcp import build_server, is_loopback, require_bearer, token_names
from router.settings import ApiPrincipal, AuditSettings
from tests.conftest import REPO, external_tool
from tests.router.test_api import DROP, auth, principals
from tests.router.test_mcp import TOOLS, served

UNKNOWN = "s-000000000000000000000000"


def refusals(path: Path) -> list[dict[str, Any]]:
    """The refusals in the audit log at ``path``, as written."""
    events = [json.loads(line) for line in path.read_text().splitlines()]
    return [e for e in events if e["kind"] == "error" and e["outcome"] == "refused"]


def codes(path: Path) -> list[tuple[str | None, str]]:
    return [(e["agent"], e["result"]["code"]) for e in refusals(path)]


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Path]]:
    """The HTTP API with a 64 KiB body limit and a 1 s request timeout; its audit log's path."""
    log = tmp_path / "audit.jsonl"
    settings = Settings(
        audit=AuditSettings(path=log), policy=PolicySettings(dir=REPO / "policies"),
        api_principals=[ApiPrincipal.model_validate(p) for p in principals()], api_max_body_bytes=64 * 1024,
        api_request_timeout_s=1.0,
    )  # fmt: skip
    async with ControlPlane.from_settings(settings) as plane:
        transport = httpx.ASGITransport(create_app(plane))
        async with httpx.AsyncClient(transport=transport, base_url="http://stockade") as client:
            yield client, log


@contextlib.asynccontextmanager
async def budgeted(log: Path, *, window_s: float) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the HTTP API of a router whose refusal budget is 5 in each ``window_s``, and whose
    audit log is ``log``; the router is closed (its open windows' counts written) on leaving."""
    settings = Settings(
        audit=AuditSettings(path=log, refusal_burst=5, refusal_window_s=window_s),
        policy=PolicySettings(dir=REPO / "policies"),
        api_principals=[ApiPrincipal.model_validate(p) for p in principals()],
    )  # fmt: skip
    async with ControlPlane.from_settings(settings) as plane:
        transport = httpx.ASGITransport(create_app(plane))
        async with httpx.AsyncClient(transport=transport, base_url="http://stockade") as client:
            yield client


async def test_approvals_that_cannot_be_decided_are_refused_on_record(api: tuple[httpx.AsyncClient, Path]) -> None:
    client, log = api
    await client.post("/v1/tools", json=DROP, headers=auth("root"))
    session = (await client.post("/v1/sessions", json={"principal": "alice"}, headers=auth("agent-1"))).json()
    held = await client.post(f"/v1/sessions/{session['session_id']}/calls",
                             json={"tool": "drop_table", "args": {"t": "users"}}, headers=auth("agent-1"))  # fmt: skip
    approval = held.json()["approval_id"]
    before = len(refusals(log))
    own = await client.post(f"/v1/approvals/{approval}/deny", json={}, headers=auth("self-approver"))
    granted = await client.post(f"/v1/approvals/{approval}/approve", json={}, headers=auth("oncall"))
    again = await client.post(f"/v1/approvals/{approval}/approve", json={}, headers=auth("oncall"))
    unknown = await client.post("/v1/approvals/a-doesnotexist/deny", json={}, headers=auth("oncall"))
    assert [r.status_code for r in (own, granted, again, unknown)] == [409, 200, 409, 409]
    assert [r.json()["code"] for r in (own, again, unknown)] == ["approval.invalid"] * 3
    recorded = refusals(log)[before:]
    assert [(e["agent"], e["result"]["code"], e["result"]["approval_id"]) for e in recorded] == [
        ("agent-1", "approval.self_decision", approval), ("oncall", "approval.not_pending", approval),
        ("oncall", "approval.not_found", "a-doesnotexist"),
    ]  # fmt: skip
    assert [(e["session_id"], e["tool"]) for e in recorded] == [(session["session_id"], "drop_table")] * 2 + [
        (None, None)
    ]


async def test_unknown_closed_and_anothers_sessions_are_all_refused_on_record(
    api: tuple[httpx.AsyncClient, Path],
) -> None:
    client, log = api
    await client.post("/v1/tools", json=external_tool("echo"), headers=auth("agent-1"))
    session = (await client.post("/v1/sessions", json={"principal": "alice"}, headers=auth("agent-1"))).json()
    sid = session["session_id"]
    before = len(refusals(log))
    answers = [
        await client.post(f"/v1/sessions/{UNKNOWN}/calls", json={"tool": "echo"}, headers=auth("agent-1")),
        await client.post(f"/v1/sessions/{UNKNOWN}/decide", json={"tool": "echo"}, headers=auth("agent-1")),
        await client.delete(f"/v1/sessions/{UNKNOWN}", headers=auth("agent-1")),
        await client.delete(f"/v1/sessions/{UNKNOWN}", headers=auth("root")),
        await client.post(f"/v1/sessions/{sid}/calls", json={"tool": "echo"}, headers=auth("agent-2")),
    ]
    assert (await client.delete(f"/v1/sessions/{sid}", headers=auth("agent-1"))).status_code == 204
    answers += [
        await client.post(f"/v1/sessions/{sid}/calls", json={"tool": "echo"}, headers=auth("agent-1")),
        await client.delete(f"/v1/sessions/{sid}", headers=auth("agent-1")),
    ]
    assert [(r.status_code, r.json()["code"]) for r in answers] == [(404, "session.not_found")] * 7
    assert codes(log)[before:] == [
        ("agent-1", "session.not_found"), ("agent-1", "session.not_found"), ("agent-1", "session.not_found"),
        (None, "session.not_found"), ("agent-2", "session.not_found"), ("agent-1", "session.not_found"),
        ("agent-1", "session.not_found"),
    ]  # fmt: skip


async def test_a_session_the_api_cannot_open_is_refused_on_record_naming_the_field(
    api: tuple[httpx.AsyncClient, Path],
) -> None:
    client, log = api
    json_ = {**auth("agent-1"), "Content-Type": "application/json"}
    bodies = [
        b'{"principal":"\\ud800"}', b'{"principal":" "}', b'{"principal":"bob","trusted_context":["ok","\\ud800"]}'
    ]  # fmt: skip
    answers = [await client.post("/v1/sessions", content=body, headers=json_) for body in bodies]
    assert [r.status_code for r in answers] == [422] * 3
    assert [[e["field"] for e in r.json()["errors"]] for r in answers] == [
        ["principal"],
        ["principal"],
        ["trusted_context[1]"],
    ]
    assert codes(log) == [("agent-1", "call.invalid")] * 3


async def test_oversized_bodies_are_refused_on_record(api: tuple[httpx.AsyncClient, Path]) -> None:
    client, log = api

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield b" " * (32 * 1024)

    declared = await client.post("/v1/sessions", content=b" " * (100 * 1024), headers=auth("agent-1"))
    streamed = await client.post("/v1/sessions", content=chunks(), headers=auth("agent-1"))
    per_call = await client.post(f"/v1/sessions/{UNKNOWN}/calls", content=chunks(), headers=auth("agent-2"))
    stranger = await client.post("/v1/sessions", content=b" " * (100 * 1024))  # streamed, it would get 401 first
    assert [(r.status_code, r.json()["code"]) for r in (declared, streamed, per_call, stranger)] == [
        (413, "request.too_large")
    ] * 4
    assert codes(log) == [
        ("agent-1", "request.too_large"), ("agent-1", "request.too_large"), ("agent-2", "request.too_large"),
        (None, "request.too_large"),
    ]  # fmt: skip


async def test_a_request_that_times_out_is_refused_on_record(api: tuple[httpx.AsyncClient, Path]) -> None:
    client, log = api

    async def slow() -> AsyncIterator[bytes]:
        yield b'{"tool": '
        await asyncio.sleep(3)
        yield b'"echo"}'

    answer = await client.post(f"/v1/sessions/{UNKNOWN}/calls", content=slow(), headers=auth("agent-1"))
    assert (answer.status_code, answer.json()["code"]) == (504, "request.timeout")
    assert codes(log) == [("agent-1", "request.timeout")]


async def test_what_the_mcp_sdk_refuses_over_http_is_on_record(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    tokens = {"one": "tok-one", "two": "tok-two"}
    settings = Settings(audit=AuditSettings(path=log), api_principals=[ApiPrincipal.model_validate(
        {"name": n, "role": "agent", "token_sha256": hashlib.sha256(t.encode()).hexdigest()}) for n, t in tokens.items()
    ])  # fmt: skip
    hello = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18",
             "capabilities": {}, "clientInfo": {"name": "x", "version": "1"}}}  # fmt: skip
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "echo", "arguments": {}}}

    def headers(agent: str, session: str | None = None) -> dict[str, str]:
        found = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
                 "Authorization": f"Bearer {tokens[agent]}", "MCP-Protocol-Version": "2025-06-18"}  # fmt: skip
        return found | ({"Mcp-Session-Id": session} if session else {})

    async with ControlPlane.from_settings(settings) as plane:
        for tool in TOOLS:
            await plane.register(tool)
        names = token_names(settings.api_principals)
        server = build_server(plane, agent="claude", principal="alice@example.com", tokens=names)
        app = require_bearer(server.streamable_http_app(host="127.0.0.1"), names, plane)
        async with served(app) as url, httpx.AsyncClient(timeout=30) as http:
            opened = await http.post(url, json=hello, headers=headers("one"))
            mine = opened.headers["mcp-session-id"]
            before = len(refusals(log))
            answers = [
                await http.post(url, json=call, headers=headers("two", mine)),  # another agent's MCP session
                await http.delete(url, headers=headers("two", mine)),
                await http.post(url, json=call, headers=headers("one", "no-such-session")),
                await http.post(url, content=b'{"jsonrpc":', headers=headers("one")),
                await http.post(url, content=b" " * (5 << 20), headers=headers("one")),
            ]
            assert (await http.delete(url, headers=headers("one", mine))).status_code == 200
            answers.append(await http.post(url, json=call, headers=headers("one", mine)))  # closed
    assert [r.status_code for r in answers] == [404, 404, 404, 400, 413, 404]
    assert codes(log)[before:] == [
        ("two", "mcp.session_not_found"), ("two", "mcp.session_not_found"), ("one", "mcp.session_not_found"),
        ("one", "mcp.bad_request"), ("one", "request.too_large"), ("one", "mcp.session_not_found"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("127.evil.example", False), ("127.0.0.1.nip.io", False), ("10.0.0.1", False), ("", False),
     ("0.0.0.0", False)],  # noqa: S104  (a host to judge, not one bound)
)  # fmt: skip
def test_only_loopback_literals_and_localhost_count_as_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


async def test_a_flood_of_refusals_is_written_up_to_a_burst_and_counted_past_it(tmp_path: Path) -> None:
    """One client sending bad requests as fast as it can once made the router write (and fsync)
    an audit event for each: some 400 a second, filling the disk and queueing real calls' appends.
    Refusals of one kind are written one by one up to the burst of their window, then counted:
    the events plus the counts are every refusal, nothing more, nothing less."""
    log = tmp_path / "audit.jsonl"
    async with budgeted(log, window_s=0.5) as client:
        for _ in range(60):
            assert (await client.get("/v1/tools", headers={"Authorization": "Bearer wrong"})).status_code == 401
        await asyncio.sleep(0.7)  # the window closes: its count is written by itself
        first = refusals(log)
        for _ in range(3):  # a new window: written one by one again
            assert (await client.get("/v1/tools", headers={"Authorization": "Bearer wrong"})).status_code == 401
        assert (await client.delete(f"/v1/sessions/{UNKNOWN}", headers=auth("agent-1"))).status_code == 404
    unauthenticated = [e for e in refusals(log) if e["agent"] is None]
    one_by_one = [e for e in unauthenticated if "count" not in e["result"]]
    counted = [e for e in unauthenticated if "count" in e["result"]]
    assert (len(first), len(one_by_one), len(counted)) == (6, 8, 1)
    assert len(one_by_one) + sum(e["result"]["count"] for e in counted) == 63
    assert counted[0]["result"]["code"] == "auth.unauthenticated"
    assert codes(log)[-1] == ("agent-1", "session.not_found")  # another kind has a burst of its own


async def test_a_flood_of_refused_approval_decisions_is_under_the_same_budget(tmp_path: Path) -> None:
    """An approver's refused decisions (here: approval ids that do not exist) were once written
    one by one however many came, outside the budget every other refusal is under."""
    log = tmp_path / "audit.jsonl"
    async with budgeted(log, window_s=30) as client:
        for i in range(40):
            answer = await client.post(f"/v1/approvals/a-{i:020x}/approve", json={}, headers=auth("oncall"))
            assert (answer.status_code, answer.json()["code"]) == (409, "approval.invalid")
        assert codes(log) == [("oncall", "approval.not_found")] * 5
    # On shutdown the open window's count is written: the events plus the count are every refusal.
    counted = [e for e in refusals(log) if "count" in e["result"]]
    assert [(e["agent"], e["result"]["code"], e["result"]["count"]) for e in counted] == [
        ("oncall", "approval.not_found", 35)
    ]
