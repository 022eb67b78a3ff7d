"""The HTTP API: roles, ownership, problem details, limits; and two `stockade serve` processes on
one Redis acting as one router."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from policy import PolicySettings
from router import ControlPlane, InvalidCall, Settings
from router.audit import AuditFilter
from router.interfaces.api import audit_query, create_app
from router.settings import ApiPrincipal, AuditSettings
from tests.conftest import ECHO, REPO, external_tool, python_tool, stockade_server

TOKENS = {"agent-1": "tok-agent-1", "agent-2": "tok-agent-2", "oncall": "tok-oncall", "audit": "tok-audit",
          "root": "tok-root", "self-approver": "tok-self"}  # fmt: skip
PRINCIPALS = [
    {"name": "agent-1", "role": "agent", "may_register": True}, {"name": "agent-2", "role": "agent"},
    {"name": "oncall", "role": "approver"}, {"name": "audit", "role": "auditor"}, {"name": "root", "role": "admin"},
    # An approver identity that is also the agent's: it must never approve that agent's calls.
    {"name": "agent-1", "role": "approver", "token": "self-approver"},
]  # fmt: skip
DROP = python_tool("drop_table", ECHO, risk="critical", capabilities=["mutates_state"])


def principals() -> list[dict[str, Any]]:
    return [{k: v for k, v in p.items() if k != "token"} | {
        "token_sha256": hashlib.sha256(TOKENS[str(p.get("token", p["name"]))].encode()).hexdigest()}
        for p in PRINCIPALS]  # fmt: skip


def auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[who]}"}


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, ControlPlane]]:
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl"), policy=PolicySettings(dir=REPO / "policies"),
        api_principals=[ApiPrincipal.model_validate(p) for p in principals()], api_max_body_bytes=64 * 1024,
    )  # fmt: skip
    async with ControlPlane.from_settings(settings) as plane:
        transport = httpx.ASGITransport(create_app(plane))
        async with httpx.AsyncClient(transport=transport, base_url="http://stockade") as client:
            yield client, plane


async def test_missing_unknown_and_wrong_role_tokens_are_refused_and_audited(
    api: tuple[httpx.AsyncClient, ControlPlane],
) -> None:
    client, plane = api
    missing = await client.get("/v1/tools")
    unknown = await client.get("/v1/tools", headers={"Authorization": "Bearer nope"})
    approver_opens = await client.post("/v1/sessions", json={"principal": "alice"}, headers=auth("oncall"))
    agent_audits = await client.get("/v1/audit/events", headers=auth("agent-1"))
    agent_reloads = await client.post("/v1/policy/reload", headers=auth("agent-1"))
    unregistered = await client.post("/v1/tools", json=external_tool("x"), headers=auth("agent-2"))
    assert [r.status_code for r in (missing, unknown, approver_opens, agent_audits, agent_reloads, unregistered)] == [
        401, 401, 403, 403, 403, 403]  # fmt: skip
    assert missing.headers["content-type"] == "application/problem+json"
    assert missing.json()["type"] == "urn:stockade:problem:auth.unauthenticated"
    assert missing.headers["www-authenticate"].startswith("Bearer")
    refusals = [e for e in await plane.audit.query(AuditFilter(kind="error")) if e.outcome == "refused"]
    assert len(refusals) == 6
    assert [e.agent for e in refusals] == [None, None, "oncall", "agent-1", "agent-1", "agent-2"]


async def test_refusals_at_the_door_are_recorded_under_their_problem_code_with_the_client(
    api: tuple[httpx.AsyncClient, ControlPlane],
) -> None:
    """401s and 403s were both recorded as ``auth.refused`` (an auditor could not tell token
    guessing from role probing), and two Authorization headers were served as the first."""
    client, plane = api
    two = httpx.Headers([("Authorization", "Bearer tok-agent-1"), ("Authorization", "Bearer tok-root")])
    doubled = await client.get("/v1/tools", headers=two)
    agent_audits = await client.get("/v1/audit/events", headers=auth("agent-1"))
    assert [doubled.status_code, agent_audits.status_code] == [401, 403]
    assert doubled.json()["code"] == "auth.unauthenticated"
    assert "one Authorization" in doubled.json()["detail"]
    refusals = [e for e in await plane.audit.query(AuditFilter(kind="error")) if e.outcome == "refused"]
    assert [(e.agent, (e.result or {})["code"]) for e in refusals] == [
        (None, "auth.unauthenticated"), ("agent-1", "auth.forbidden")]  # fmt: skip
    assert all((e.result or {})["client"].startswith("127.0.0.1:") for e in refusals), refusals


async def test_a_refused_introspection_is_on_record_like_every_refusal_at_the_door(
    api: tuple[httpx.AsyncClient, ControlPlane],
) -> None:
    client, plane = api
    for guess in ("nope", "tok-root", ""):
        answer = await client.post("/v1/credentials/introspect", data={"token": "x"},
                                   headers={"Authorization": f"Bearer {guess}"})  # fmt: skip
        assert (answer.status_code, answer.json()["error"]) == (401, "invalid_client")
    refusals = [e for e in await plane.audit.query(AuditFilter(kind="error")) if e.outcome == "refused"]
    assert [(e.result["code"], e.result["request"]) for e in refusals] == [
        ("auth.unauthenticated", "POST /v1/credentials/introspect")] * 3  # fmt: skip


async def test_an_agent_works_in_its_own_sessions_only(api: tuple[httpx.AsyncClient, ControlPlane]) -> None:
    client, _ = api
    assert (await client.post("/v1/tools", json=external_tool("echo"), headers=auth("agent-1"))).status_code == 201
    opened = await client.post("/v1/sessions", json={"principal": "alice@example.com"}, headers=auth("agent-1"))
    session = opened.json()["session_id"]
    mine = await client.post(
        f"/v1/sessions/{session}/calls", json={"tool": "echo", "args": {}}, headers=auth("agent-1")
    )
    assert (mine.status_code, mine.json()["status"]) == (200, "awaiting_report")
    attempts = [
        (f"/v1/sessions/{session}/calls", {"tool": "echo", "args": {}}),
        (f"/v1/sessions/{session}/decide", {"tool": "echo"}),
        (f"/v1/sessions/{session}/reports", {"call_id": mine.json()["call_id"], "output": 1}),
    ]
    unknown = await client.post("/v1/sessions/s-000000000000000000000000/calls", json={"tool": "echo", "args": {}},
                                headers=auth("agent-2"))  # fmt: skip
    for path, body in attempts:
        theirs = await client.post(path, json=body, headers=auth("agent-2"))
        assert (theirs.status_code, theirs.json()["code"]) == (404, "session.not_found")  # existence not revealed
        assert theirs.json()["detail"] == unknown.json()["detail"].replace("s-000000000000000000000000", session)
    theirs_closed = await client.delete(f"/v1/sessions/{session}", headers=auth("agent-2"))
    assert theirs_closed.status_code == 404
    assert theirs_closed.json()["detail"] == unknown.json()["detail"].replace("s-000000000000000000000000", session)
    reported = await client.post(f"/v1/sessions/{session}/reports", json={"call_id": mine.json()["call_id"],
                                 "output": {"ok": True}}, headers=auth("agent-1"))  # fmt: skip
    assert reported.json()["status"] == "completed"
    assert (await client.delete(f"/v1/sessions/{session}", headers=auth("agent-1"))).status_code == 204


async def test_held_calls_are_approved_over_http_but_never_by_the_requesting_agent(
    api: tuple[httpx.AsyncClient, ControlPlane],
) -> None:
    client, _ = api
    await client.post("/v1/tools", json=DROP, headers=auth("root"))
    session = (await client.post("/v1/sessions", json={"principal": "alice"}, headers=auth("agent-1"))).json()
    path = f"/v1/sessions/{session['session_id']}/calls"
    held = (
        await client.post(path, json={"tool": "drop_table", "args": {"t": "users"}}, headers=auth("agent-1"))
    ).json()
    assert held["status"] == "pending_approval"
    listed = await client.get("/v1/approvals", params={"status": "pending"}, headers=auth("oncall"))
    assert [a["id"] for a in listed.json()] == [held["approval_id"]]
    own = await client.post(f"/v1/approvals/{held['approval_id']}/approve", json={}, headers=auth("self-approver"))
    assert (own.status_code, own.json()["code"]) == (409, "approval.invalid")
    granted = await client.post(f"/v1/approvals/{held['approval_id']}/approve", json={"note": "OPS-7"},
                                headers=auth("oncall"))  # fmt: skip
    assert granted.json()["approver"] == "oncall"
    retry = {"tool": "drop_table", "args": {"t": "users"}, "approval_id": held["approval_id"]}
    ran = await client.post(path, json=retry, headers=auth("agent-1"))
    assert (ran.json()["status"], ran.json()["output"]) == ("completed", {"t": "users"})
    trail = await client.get(f"/v1/audit/decisions/{held['decision_id']}", headers=auth("audit"))
    assert [e["kind"] for e in trail.json()][:3] == ["decision", "approval", "approval"]
    assert (await client.get("/v1/audit/verify", headers=auth("audit"))).json()["ok"] is True


async def test_an_approver_who_is_the_sessions_agent_cannot_endorse_its_output(
    api: tuple[httpx.AsyncClient, ControlPlane],
) -> None:
    """An approver identity named as the agent is the agent: it may not make what the agent read
    count as trusted, as it may not approve the agent's calls. Refused and on record."""
    client, plane = api
    reader = external_tool("read_file", capabilities=["reads_untrusted"])
    assert (await client.post("/v1/tools", json=reader, headers=auth("root"))).status_code == 201
    session = (await client.post("/v1/sessions", json={"principal": "alice"}, headers=auth("agent-1"))).json()
    path = f"/v1/sessions/{session['session_id']}"
    read = (await client.post(f"{path}/calls", json={"tool": "read_file", "args": {}}, headers=auth("agent-1"))).json()
    reported = await client.post(f"{path}/reports", json={"call_id": read["call_id"], "output": "pay DE89..."},
                                 headers=auth("agent-1"))  # fmt: skip
    assert reported.json()["status"] == "completed"
    own = await client.post(f"{path}/endorsements", json={"call_id": read["call_id"]}, headers=auth("self-approver"))
    assert (own.status_code, own.json()["code"]) == (409, "approval.invalid")
    events = await plane.audit.query(AuditFilter(kind="endorsement"))
    assert [(e.outcome, e.result["by"], e.result.get("code")) for e in events] == [
        ("refused", "agent-1", "endorsement.by_agent")]  # fmt: skip
    loaded = await plane.store.load_session(session["session_id"])
    assert loaded is not None
    assert not loaded.endorsed
    human = await client.post(f"{path}/endorsements", json={"call_id": read["call_id"]}, headers=auth("oncall"))
    assert human.status_code == 201


async def test_a_session_context_is_bounded_in_bytes_not_only_in_items(
    api: tuple[httpx.AsyncClient, ControlPlane],
) -> None:
    """The context goes into every policy input and decision event of its session: 1,000 strings
    of 30 KiB each would make every one-line call a 30 MiB audit append. Refused, naming the field."""
    _, plane = api
    with pytest.raises(InvalidCall, match="trusted_context holds 262145 bytes") as refused:
        await plane.open_session("agent-1", "alice", ["x" * (128 << 10), "é" * (64 << 10) + "y"])
    assert refused.value.http_status == 422
    session = await plane.open_session("agent-1", "alice", ["x" * (128 << 10), "é" * (64 << 10)])
    await plane.register(external_tool("echo"))
    assert (await plane.call(session, "echo", {})).status == "awaiting_report"


async def test_errors_are_problem_details_naming_the_field(api: tuple[httpx.AsyncClient, ControlPlane]) -> None:
    client, _ = api
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    await client.post("/v1/tools", json=python_tool("typed", ECHO, input_schema=schema), headers=auth("root"))
    session = (await client.post("/v1/sessions", json={"principal": "alice"}, headers=auth("agent-1"))).json()
    calls = f"/v1/sessions/{session['session_id']}/calls"
    wrong = await client.post(calls, json={"tool": "typed", "args": {"n": "seven"}}, headers=auth("agent-1"))
    assert (wrong.status_code, wrong.json()["type"]) == (422, "urn:stockade:problem:call.invalid")
    assert wrong.json()["errors"][0]["field"].startswith("args.n")
    unknown = await client.post(calls, json={"tool": "nope"}, headers=auth("agent-1"))
    assert (unknown.status_code, unknown.json()["code"]) == (404, "tool.not_found")
    extra = await client.post(calls, json={"tool": "typed", "bogus": 1}, headers=auth("agent-1"))
    assert (extra.status_code, extra.json()["code"]) == (422, "request.invalid")
    bad_input = await client.post(calls, json={"tool": "typed", "args": {"n": 1}, "inputs": {"f": "%%%"}},
                                  headers=auth("agent-1"))  # fmt: skip
    assert (bad_input.status_code, bad_input.json()["errors"][0]["field"]) == (422, "inputs.f")
    huge = await client.post(calls, content=b"x" * (65 * 1024), headers={**auth("agent-1"),
                             "content-type": "application/json"})  # fmt: skip
    assert (huge.status_code, huge.json()["code"]) == (413, "request.too_large")
    malformed = await client.post(calls, content=b"{not json", headers={**auth("agent-1"),
                                  "content-type": "application/json"})  # fmt: skip
    assert (malformed.status_code, malformed.json()["errors"][0]["field"]) == (422, "body")


async def test_per_call_routes_answer_like_the_rest_of_the_api(
    api: tuple[httpx.AsyncClient, ControlPlane], monkeypatch: pytest.MonkeyPatch
) -> None:
    """decide, calls and reports are served ahead of FastAPI's stack (`PerCallRoutes`): the same
    refusals, problems, documents and OpenAPI entries as every other route."""
    client, plane = api
    await client.post("/v1/tools", json=external_tool("echo"), headers=auth("root"))
    session = (await client.post("/v1/sessions", json={"principal": "alice"}, headers=auth("agent-1"))).json()
    decide = f"/v1/sessions/{session['session_id']}/decide"
    anonymous = await client.post(decide, json={"tool": "echo"})
    auditor = await client.post(decide, json={"tool": "echo"}, headers=auth("audit"))
    assert [anonymous.status_code, auditor.status_code] == [401, 403]
    assert anonymous.headers["www-authenticate"].startswith("Bearer")
    refused = [e for e in await plane.audit.query(AuditFilter(kind="error")) if e.outcome == "refused"]
    assert [(e.agent, e.result["request"]) for e in refused] == [(None, f"POST {decide}"), ("audit", f"POST {decide}")]
    wrong_type = await client.post(decide, json={"tool": 7}, headers=auth("agent-1"))
    assert (wrong_type.status_code, wrong_type.json()["errors"][0]["field"]) == (422, "body.tool")
    missing = await client.post(decide, json={}, headers=auth("agent-1"))
    assert missing.json()["errors"][0] == {"field": "body.tool", "problem": "Field required"}
    as_text = await client.post(decide, content=b'{"tool": "echo"}', headers={**auth("agent-1"),
                                "content-type": "text/plain"})  # fmt: skip
    assert (as_text.status_code, as_text.json()["detail"]) == (
        422, "the request does not match the schema at /openapi.json: body: send the body as application/json, "
        "not text/plain")  # fmt: skip
    allowed = await client.post(decide, json={"tool": "echo", "args": {"q": "x"}}, headers=auth("agent-1"))
    assert (allowed.status_code, allowed.headers["content-type"]) == (200, "application/json")
    assert set(allowed.json()) == {"decision_id", "outcome", "reasons"}
    assert (await client.get(decide, headers=auth("agent-1"))).status_code == 405  # other methods: FastAPI's
    schema = (await client.get("/openapi.json")).json()["paths"]["/v1/sessions/{session_id}/decide"]["post"]
    assert schema["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Decide"}
    assert "DecisionResult" in json.dumps(schema["responses"]["200"])

    async def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(plane, "decide", broken)  # a fault no real input reaches
    failed = await client.post(decide, json={"tool": "echo"}, headers=auth("agent-1"))
    assert (failed.status_code, failed.headers["content-type"], failed.json()["code"]) == (
        500, "application/problem+json", "internal")  # fmt: skip


async def test_health_readiness_policy_status_and_openapi(api: tuple[httpx.AsyncClient, ControlPlane]) -> None:
    client, plane = api
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    ready = await client.get("/readyz")
    assert (ready.status_code, ready.json()["checks"]) == (200, {"policy": True, "store": True, "audit": True})
    status = (await client.get("/v1/policy", headers=auth("audit"))).json()
    assert {k: status[k] for k in ("revision", "engine", "files_problem")} == {
        "revision": plane.policy.revision,
        "engine": "embedded",
        "files_problem": None,
    }
    assert status["on_disk"]["loaded"] is True
    assert status["in_force"]["revision"] == plane.policy.revision
    schema = (await client.get("/openapi.json")).json()
    assert schema["openapi"].startswith("3.1")
    assert "/v1/sessions/{session_id}/calls" in schema["paths"]


async def test_audit_queries_without_the_audit_extra_are_an_audited_503_naming_the_install(
    api: tuple[httpx.AsyncClient, ControlPlane], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DuckDB is the optional `audit` extra: a router installed without it still serves calls, and
    answers its auditors a problem saying what to install, never a 500 (README, Install)."""
    client, plane = api
    monkeypatch.setitem(sys.modules, "duckdb", None)  # what an install without the extra finds
    monkeypatch.setitem(sys.modules, "_duckdb", None)  # (its engine module, which the audit loads, too)
    answers = [
        await client.get("/v1/audit/events", headers=auth("audit")),
        await client.get("/v1/audit/events", headers={**auth("audit"), "Accept": "application/x-ndjson"}),
        await client.get("/v1/audit/decisions/d-1", headers=auth("root")),
    ]
    for answer in answers:
        assert (answer.status_code, answer.headers["content-type"]) == (503, "application/problem+json")
        assert answer.json()["code"] == "audit.query_unavailable"
        assert "uv tool install -c requirements.lock '.[audit,otel]'" in answer.json()["detail"]
    refusals = [e for e in await plane.audit.query(AuditFilter(kind="error")) if e.outcome == "refused"]
    assert [(e.agent, (e.result or {})["code"], (e.result or {})["request"]) for e in refusals] == [
        ("audit", "audit.query_unavailable", "GET /v1/audit/events"),
        ("audit", "audit.query_unavailable", "GET /v1/audit/events"),
        ("root", "audit.query_unavailable", "GET /v1/audit/decisions/d-1"),
    ]
    assert (await client.get("/readyz")).status_code == 200  # calls are still decided and recorded


# -- two routers ----------------------------------------------------------------------------


@contextlib.contextmanager
def serve(env: dict[str, str], log: Path, *args: str) -> Iterator[str]:
    """`stockade serve` as a process, ready."""
    with stockade_server(["serve", *args], env, log, "/healthz") as url:
        yield url


def test_two_routers_on_one_redis_act_as_one(tmp_path: Path, redis_url: str) -> None:
    env = {"STOCKADE_STORE__URL": redis_url, "STOCKADE_AUDIT__PATH": str(tmp_path / "audit.jsonl"),
           "STOCKADE_API_PRINCIPALS": json.dumps(principals()), "STOCKADE_LOG_LEVEL": "error"}  # fmt: skip
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "echo.json").write_text(json.dumps(external_tool("echo")))  # one spec per file
    one_log, two_log = tmp_path / "one.log", tmp_path / "two.log"
    with serve(env, one_log, "--tools", str(tools)) as one, serve(env, two_log, "--tools", str(tools)) as two:
        # Registered through one router only: the other serves it from the shared registry.
        assert httpx.post(f"{one}/v1/tools", json=DROP, headers=auth("root")).status_code == 201
        listed = httpx.get(f"{two}/v1/tools", headers=auth("agent-1")).json()
        assert sorted(t["name"] for t in listed) == ["drop_table", "echo"]
        refused = httpx.post(f"{two}/v1/tools", json={**DROP, "risk": "low"}, headers=auth("root"))
        assert (refused.status_code, refused.json()["code"]) == (409, "tool.duplicate")
        session = httpx.post(f"{one}/v1/sessions", json={"principal": "alice"}, headers=auth("agent-1")).json()
        calls = f"/v1/sessions/{session['session_id']}/calls"
        held = httpx.post(f"{two}{calls}", json={"tool": "drop_table", "args": {}}, headers=auth("agent-1")).json()
        assert held["status"] == "pending_approval"
        approved = httpx.post(f"{one}/v1/approvals/{held['approval_id']}/approve", json={}, headers=auth("oncall"))
        assert approved.status_code == 200
        ran = httpx.post(f"{two}{calls}", json={"tool": "drop_table", "args": {}, "approval_id": held["approval_id"]},
                         headers=auth("agent-1"), timeout=30).json()  # fmt: skip
        assert ran["status"] == "completed"
        again = httpx.post(f"{one}{calls}", json={"tool": "drop_table", "args": {}, "approval_id": held["approval_id"]},
                           headers=auth("agent-1"))  # fmt: skip
        assert (again.status_code, again.json()["code"]) == (409, "approval.invalid")  # used, on the other router
        verify = httpx.get(f"{two}/v1/audit/verify", headers=auth("audit")).json()
        assert verify["ok"] is True
        # two registrations (echo once, by the first router to start; drop_table), the refused
        # duplicate, then the held call's require_approval and request, approved, allow, redeemed,
        # ran; the refused reuse
        assert verify["events"] == 10


async def test_metrics_count_calls_and_time_decisions(api: tuple[httpx.AsyncClient, ControlPlane]) -> None:
    client, _ = api
    await client.post("/v1/tools", json=external_tool("metered"), headers=auth("root"))
    session = (await client.post("/v1/sessions", json={"principal": "alice"}, headers=auth("agent-1"))).json()
    for _ in range(3):
        await client.post(f"/v1/sessions/{session['session_id']}/calls", json={"tool": "metered"},
                          headers=auth("agent-1"))  # fmt: skip
    text = (await client.get("/metrics")).text
    counted = [line for line in text.splitlines() if line.startswith("stockade_calls_total{")]
    assert 'stockade_calls_total{status="awaiting_report",tool="metered"} 3.0' in counted
    assert "stockade_decision_seconds_bucket{" in text
    assert "stockade_audit_append_seconds_count" in text


async def test_audit_streams_a_client_stops_reading_keep_no_one_elses_query_waiting(tmp_path: Path) -> None:
    """Two NDJSON streams whose clients never read held both query slots while they waited on
    the socket: every other auditor's query waited out the request timeout (504). A slot is held
    while a chunk is read now, not while it is sent."""
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl", durability="relaxed"),
        policy=PolicySettings(dir=REPO / "policies"), api_principals=[ApiPrincipal.model_validate(p)
                                                                      for p in principals()],
        api_request_timeout_s=10,
    )  # fmt: skip
    async with ControlPlane.from_settings(settings) as plane:
        for n in range(6000):  # ~9 MB: far more than the sockets' buffers hold
            await plane.record_refusal("agent-9", f"GET /pad/{n}", "padding " + "p" * 1500)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(create_app(plane), log_level="error"))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        for _ in range(200):
            if server.started:
                break
            await asyncio.sleep(0.05)
        port = sock.getsockname()[1]
        stuck = []
        for _ in range(2):
            reading, writing = await asyncio.open_connection("127.0.0.1", port)
            writing.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            writing.write(b"GET /v1/audit/events?limit=100000 HTTP/1.1\r\nHost: stockade\r\n"
                          b"Accept: application/x-ndjson\r\nAuthorization: Bearer tok-audit\r\n\r\n")  # fmt: skip
            await writing.drain()
            stuck.append((reading, writing))  # never read
        await asyncio.sleep(1.5)  # both streams are blocked on their sockets by now
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                started = time.monotonic()
                page = await client.get("/v1/audit/events", params={"limit": 1}, headers=auth("root"))
                waited = time.monotonic() - started
            assert page.status_code == 200, page.text
            assert waited < 5
            assert len(page.json()["events"]) == 1
        finally:
            for _, writing in stuck:
                writing.close()
            server.should_exit = True
            await serving


async def test_an_audit_page_ends_at_its_byte_budget_and_the_cursor_still_covers_every_event_once(
    api: tuple[httpx.AsyncClient, ControlPlane], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page was built whole in memory, however large its events (1 MiB arguments and outputs:
    several GB at the page limit). It now also ends at `MAX_PAGE_BYTES` of event text (never with
    no event), and the cursor goes on from there."""
    client, _ = api
    await client.post("/v1/tools", json=external_tool("lookup"), headers=auth("root"))
    session = (await client.post("/v1/sessions", json={"principal": "alice"}, headers=auth("agent-1"))).json()
    for n in range(12):
        await client.post(f"/v1/sessions/{session['session_id']}/calls", headers=auth("agent-1"),
                          json={"tool": "lookup", "args": {"q": f"{n}" + "x" * 3000}})  # fmt: skip
    everything = (await client.get("/v1/audit/events", params={"limit": 1000}, headers=auth("audit"))).json()
    assert everything["next_after_seq"] is None
    monkeypatch.setattr(audit_query, "MAX_PAGE_BYTES", 10_000)  # about three of these events
    seen: list[int] = []
    cursor: int | None = 0
    pages = 0
    while cursor is not None:
        answer = await client.get("/v1/audit/events", params={"after_seq": cursor, "limit": 1000},
                                  headers=auth("audit"))  # fmt: skip
        page = answer.json()
        assert page["events"], "a page is never empty while events remain"
        assert len(answer.content) < 10_000 + 8_000  # the budget, and at most the event that passed it
        seen += [e["seq"] for e in page["events"]]
        cursor, pages = page["next_after_seq"], pages + 1
    assert seen == [e["seq"] for e in everything["events"]]
    assert pages > 4
