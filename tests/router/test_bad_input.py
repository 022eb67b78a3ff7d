"""Bad input, refused clearly: look-alike tool names, arguments and bodies nested past any limit,
bodies that are not JSON. Through the real control plane and the real HTTP app; each refusal is
a problem document (over HTTP) and a record in the JSONL audit log, and nothing is left broken."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute

from policy import PolicySettings
from router import ControlPlane, Settings
from router.errors import InvalidCall, InvalidToolSpec
from router.interfaces.api import create_app
from router.interfaces.api.app import MAX_BODY_NESTING
from router.settings import ApiPrincipal, AuditSettings
from router.tools import MAX_NESTING, CommandExecutor, command_argv, json_too_deep, nesting_depth
from tests.conftest import REPO, external_tool

TOKENS = {"agent-1": "tok-agent-1", "oncall": "tok-oncall", "root": "tok-root"}
PRINCIPALS = [
    {"name": "agent-1", "role": "agent", "may_register": True},
    {"name": "oncall", "role": "approver"},
    {"name": "root", "role": "admin"},
]
DEPTHS = [1_000, 100_000]


def auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[who]}", "Content-Type": "application/json"}


def nested_text(depth: int) -> str:
    """A JSON list ``depth`` levels deep."""
    return "[" * depth + "]" * depth


def nested_value(depth: int) -> list[Any]:
    """The same as a Python value, built without recursion."""
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


def audit_events(path: Path) -> list[dict[str, Any]]:
    """Every event in the JSONL audit log, read from the file itself."""
    events = []
    for line in path.read_text().splitlines():
        event = json.loads(line)
        if isinstance(event, dict) and "kind" in event:
            events.append(event)
    return events


def rejections(path: Path, session: str) -> list[dict[str, Any]]:
    """The control plane's audit records of calls it refused as invalid in ``session``."""
    return [e for e in audit_events(path) if e["kind"] == "error" and e["outcome"] == "invalid"
            and e["session_id"] == session]  # fmt: skip


def refusals(path: Path) -> list[dict[str, Any]]:
    """The audit records of requests refused at the HTTP door."""
    return [e for e in audit_events(path) if e["kind"] == "error" and e["outcome"] == "refused"]


def assert_problem(response: httpx.Response, status: int | None = None) -> dict[str, Any]:
    """``response`` is an RFC 9457 problem document for a client error (``status`` if given)."""
    assert response.headers["content-type"] == "application/problem+json", response.text[:300]
    body: dict[str, Any] = response.json()
    assert {"type", "title", "detail", "status"} <= set(body)
    assert body["status"] == response.status_code
    assert 400 <= response.status_code < 500
    if status is not None:
        assert response.status_code == status, body
    return body


# -- tool names ------------------------------------------------------------------------------

LOOK_ALIKES = [
    "lookup\n",
    "lookup\r",
    "lookup\r\n",
    "look\u200bup",
    "lookup\u200b",
    " lookup",
    "lookup ",
    "\tlookup",
    "lookup\t",
    "lookup\x00",
    "lookup\u00a0",
    "\uff4cookup",  # a fullwidth l
]


@pytest.mark.parametrize("name", LOOK_ALIKES, ids=repr)
async def test_a_look_alike_tool_name_is_refused_at_register_with_a_clear_message(
    plane: ControlPlane, name: str
) -> None:
    with pytest.raises(InvalidToolSpec) as refused:
        await plane.register(external_tool(name))
    message = str(refused.value)
    assert repr(name) in message  # the name as it was sent, control characters visible
    assert "must start with a letter and use only letters, digits, '_' or '-'" in message
    assert plane.registry.names() == set()


async def test_look_alikes_never_reach_the_tool_they_imitate(plane: ControlPlane, settings: Settings) -> None:
    """With ``lookup`` registered, a call to any look-alike is an audited invalid call, not a call of
    ``lookup``; ``lookup`` itself still works."""
    await plane.register(external_tool("lookup"))
    session = await plane.open_session("agent", "alice@example.com")
    reached, messages = [], []
    for name in LOOK_ALIKES:
        try:
            result = await plane.call(session, name, {})
        except InvalidCall as exc:
            messages.append(str(exc))
        else:
            reached.append((name, result.status))
    assert reached == []
    assert all("is not a valid tool name" in message for message in messages)
    assert len(rejections(settings.audit.path, session)) == len(LOOK_ALIKES)
    assert (await plane.call(session, "lookup", {})).status == "awaiting_report"


def test_an_argv_item_with_a_newline_after_a_placeholder_is_not_a_placeholder() -> None:
    executor = CommandExecutor(argv=["echo", "{x}", "{x}\n"])
    assert command_argv(executor, {"x": "hi"}) == ("echo", "hi", "{x}\n")


# -- arguments nested too deep, through the control plane --------------------------------------


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("form", ["json text", "json bytes", "python value"])
async def test_arguments_nested_too_deep_are_an_audited_invalid_call_and_the_session_goes_on(
    plane: ControlPlane, settings: Settings, depth: int, form: str
) -> None:
    await plane.register(external_tool("lookup"))
    session = await plane.open_session("agent", "alice@example.com")
    text = '{"q": ' + nested_text(depth) + "}"
    args: Any = {"json text": text, "json bytes": text.encode(), "python value": {"q": nested_value(depth)}}[form]
    for attempt in (plane.call, plane.decide):
        with pytest.raises(InvalidCall) as refused:
            await attempt(session, "lookup", args)
        assert f"nested more than {MAX_NESTING} levels deep" in str(refused.value)
        assert "flatten them" in str(refused.value)
        assert [p.field for p in refused.value.problems] == ["args"]
    recorded = rejections(settings.audit.path, session)
    assert [(e["tool"], e["result"]["code"]) for e in recorded] == [("lookup", "call.invalid")] * 2
    assert all(f"nested more than {MAX_NESTING} levels deep" in e["result"]["message"] for e in recorded)
    after = await plane.call(session, "lookup", {"q": [[["three levels are fine"]]]})
    assert after.status == "awaiting_report"


async def test_arguments_at_the_nesting_limit_are_accepted_and_one_more_level_is_not(
    plane: ControlPlane, settings: Settings
) -> None:
    await plane.register(external_tool("lookup"))
    session = await plane.open_session("agent", "alice@example.com")
    at_limit = {"q": nested_value(MAX_NESTING - 1)}  # the arguments object is level 1
    assert nesting_depth(at_limit, MAX_NESTING) == MAX_NESTING
    assert (await plane.call(session, "lookup", at_limit)).status == "awaiting_report"
    assert (await plane.call(session, "lookup", json.dumps(at_limit))).status == "awaiting_report"
    with pytest.raises(InvalidCall):
        await plane.call(session, "lookup", {"q": nested_value(MAX_NESTING)})
    with pytest.raises(InvalidCall):
        await plane.call(session, "lookup", json.dumps({"q": nested_value(MAX_NESTING)}))


async def test_cyclic_and_shared_arguments_are_refused_without_walking_forever(plane: ControlPlane) -> None:
    await plane.register(external_tool("lookup"))
    session = await plane.open_session("agent", "alice@example.com")
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(InvalidCall, match="nested more than"):
        await plane.call(session, "lookup", {"q": cycle})
    shared: list[Any] = ["x"]
    for _ in range(40):  # 2**40 leaves once written out: more values than the byte cap allows
        shared = [shared, shared]
    with pytest.raises(InvalidCall, match=r"over the \d+-byte cap"):
        await plane.call(session, "lookup", {"q": shared})


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    assert not json_too_deep(json.dumps({"q": nested_text(100_000), "r": '\\"[[[['}))
    assert json_too_deep(json.dumps({"q": nested_value(MAX_NESTING)}))
    assert not json_too_deep(json.dumps({"q": nested_value(MAX_NESTING - 1)}))
    assert json_too_deep('{"q": "unterminated ' + nested_text(10) + '", ' + "[" * 100)


@pytest.mark.parametrize("nesting", [1_000, 100_000])
async def test_an_input_schema_nested_too_deep_is_refused_at_register(plane: ControlPlane, nesting: int) -> None:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(nesting):
        schema = {"type": "object", "properties": {"x": schema}}
    with pytest.raises(InvalidToolSpec, match=f"nested more than {MAX_NESTING} levels deep"):
        await plane.register(external_tool("lookup", input_schema=schema))


# -- the HTTP API --------------------------------------------------------------------------------


@dataclass
class Api:
    client: httpx.AsyncClient
    plane: ControlPlane
    app: Any
    audit: Path


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    principals = [ApiPrincipal.model_validate({**p, "token_sha256": hashlib.sha256(TOKENS[str(p["name"])].encode())
                                               .hexdigest()}) for p in PRINCIPALS]  # fmt: skip
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl"), policy=PolicySettings(dir=REPO / "policies"),
        api_principals=principals, api_max_body_bytes=4 << 20,
    )  # fmt: skip
    async with ControlPlane.from_settings(settings) as plane:
        app = create_app(plane)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://stockade") as client:
            yield Api(client, plane, app, settings.audit.path)


async def open_session(api: Api) -> str:
    registered = await api.client.post("/v1/tools", json=external_tool("lookup"), headers=auth("root"))
    assert registered.status_code == 201
    opened = await api.client.post("/v1/sessions", json={"principal": "alice@example.com"}, headers=auth("agent-1"))
    session: str = opened.json()["session_id"]
    return session


async def call_works(api: Api, session: str) -> bool:
    response = await api.client.post(f"/v1/sessions/{session}/calls", json={"tool": "lookup", "args": {"q": [1]}},
                                     headers=auth("agent-1"))  # fmt: skip
    return response.status_code == 200 and response.json()["status"] == "awaiting_report"


@pytest.mark.parametrize("depth", DEPTHS)
async def test_arguments_nested_deep_over_http_are_refused_at_the_door_with_an_audit_record(
    api: Api, depth: int
) -> None:
    session = await open_session(api)
    body = '{"tool": "lookup", "args": {"q": ' + nested_text(depth) + "}}"
    for route in ("calls", "decide"):
        response = await api.client.post(f"/v1/sessions/{session}/{route}", content=body, headers=auth("agent-1"))
        problem = assert_problem(response, 422)
        assert problem["type"] == "urn:stockade:problem:request.too_deep"
        assert f"too deep to read: flatten it (a call's arguments may nest {MAX_NESTING} levels)" in problem["detail"]
    recorded = refusals(api.audit)
    assert [(e["agent"], e["result"]["request"]) for e in recorded] == [
        ("agent-1", f"POST /v1/sessions/{session}/calls"),
        ("agent-1", f"POST /v1/sessions/{session}/decide"),
    ]
    assert all(e["result"]["message"].startswith("request.too_deep") for e in recorded)
    assert await call_works(api, session)


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, *DEPTHS])
async def test_arguments_sent_as_a_json_string_nested_deep_are_refused_by_the_control_plane(
    api: Api, depth: int
) -> None:
    """``args`` may be a string of JSON: it is parsed by the control plane, which refuses it and
    audits the refusal with its session (this used to be an unaudited 500, a RecursionError)."""
    session = await open_session(api)
    args = json.dumps({"q": nested_value(depth - 1)}) if depth < 1_000 else '{"q": ' + nested_text(depth) + "}"
    response = await api.client.post(f"/v1/sessions/{session}/calls", json={"tool": "lookup", "args": args},
                                     headers=auth("agent-1"))  # fmt: skip
    problem = assert_problem(response, 422)
    assert problem["type"] == "urn:stockade:problem:call.invalid"
    assert f"nested more than {MAX_NESTING} levels deep" in problem["detail"]
    assert problem["errors"] == [{"field": "args", "problem": f"nested more than {MAX_NESTING} levels deep"}]
    assert [e["result"]["code"] for e in rejections(api.audit, session)] == ["call.invalid"]
    assert await call_works(api, session)


@pytest.mark.parametrize("number", [2**64, 2**64 + 1, -(2**63) - 1, 10**400])
async def test_an_integer_beyond_64_bits_is_an_audited_invalid_call_naming_its_field(api: Api, number: int) -> None:
    """The embedded engine reads such an integer as the nearest float: 2**64 + 1 passed a rule that
    allows only 2**64, while the tool would have run with the number sent. Refused as bad input,
    by field, on the body's arguments and on arguments sent as a JSON string; 64-bit ones pass."""
    session = await open_session(api)
    for args in ({"account": {"id": [number]}}, json.dumps({"account": {"id": [number]}})):
        response = await api.client.post(f"/v1/sessions/{session}/calls", headers=auth("agent-1"),
                                         content=json.dumps({"tool": "lookup", "args": args}))  # fmt: skip
        problem = assert_problem(response, 422)
        assert problem["type"] == "urn:stockade:problem:call.invalid"
        assert problem["errors"] == [{"field": "args.account.id[0]", "problem": "an integer beyond 64 bits, which "
                                      "policy cannot compare exactly: send it as a string"}]  # fmt: skip
        assert str(number)[:15] not in response.text  # a value is never quoted back (a mask may erase it)
    assert [e["result"]["code"] for e in rejections(api.audit, session)] == ["call.invalid"] * 2
    for fits in (2**64 - 1, -(2**63)):
        response = await api.client.post(f"/v1/sessions/{session}/calls", headers=auth("agent-1"),
                                         content=json.dumps({"tool": "lookup", "args": {"account": fits}}))  # fmt: skip
        assert response.status_code == 200, response.text


async def test_arguments_past_their_limit_but_within_the_bodys_reach_the_control_plane(api: Api) -> None:
    """Between the arguments' limit and the body's, the control plane refuses the call and audits
    it with its session and tool."""
    session = await open_session(api)
    args = {"q": nested_value(MAX_NESTING + 10)}
    response = await api.client.post(f"/v1/sessions/{session}/calls", json={"tool": "lookup", "args": args},
                                     headers=auth("agent-1"))  # fmt: skip
    assert assert_problem(response, 422)["type"] == "urn:stockade:problem:call.invalid"
    assert [(e["tool"], e["result"]["code"]) for e in rejections(api.audit, session)] == [("lookup", "call.invalid")]
    assert refusals(api.audit) == []
    assert await call_works(api, session)


# Every POST route, with the principal that may use it, and what it does with a JSON body.
JSON_ROUTES = {
    "/v1/tools": "root",
    "/v1/sessions": "agent-1",
    "/v1/sessions/{session_id}/decide": "agent-1",
    "/v1/sessions/{session_id}/calls": "agent-1",
    "/v1/sessions/{session_id}/reports": "agent-1",
    "/v1/approvals/{approval_id}/approve": "oncall",
    "/v1/approvals/{approval_id}/deny": "oncall",
    "/v1/sessions/{session_id}/endorsements": "oncall",
}
# Routes that read no JSON body: a body sent there is never parsed.
BODYLESS_ROUTES = {"/v1/policy/reload", "/v1/credentials/introspect"}


def post_routes(app: Any) -> set[str]:
    return {r.path for r in app.routes if isinstance(r, APIRoute) and "POST" in r.methods}


@pytest.mark.parametrize("depth", DEPTHS)
async def test_deep_bodies_on_every_post_route_get_a_problem_document_and_an_audit_record(api: Api, depth: int) -> None:
    assert post_routes(api.app) == set(JSON_ROUTES) | BODYLESS_ROUTES  # a new route must be listed here
    session = await open_session(api)
    bodies = {"array": nested_text(depth), "object": '{"a": ' * depth + "1" + "}" * depth,
              "in a field": '{"tool": "lookup", "args": {}, "note": ' + nested_text(depth) + "}"}  # fmt: skip
    answered = []
    for template, who in JSON_ROUTES.items():
        path = template.format(session_id=session, approval_id="a-1")
        for shape, body in bodies.items():
            response = await api.client.post(path, content=body, headers=auth(who))
            problem = assert_problem(response, 422)
            assert problem["type"] == "urn:stockade:problem:request.too_deep", (path, shape)
            assert "flatten it" in problem["detail"]
            answered.append(path)
    for path in BODYLESS_ROUTES:
        response = await api.client.post(path, content=nested_text(depth), headers=auth("root"))
        assert response.status_code < 500
    recorded = [e for e in refusals(api.audit) if e["result"]["message"].startswith("request.too_deep")]
    assert len(recorded) == len(answered) == len(JSON_ROUTES) * len(bodies)
    assert await call_works(api, session)


async def test_a_body_on_fastapis_routes_may_nest_up_to_its_limit(api: Api) -> None:
    """At the limit the body is parsed (and judged by its schema); one level more is refused at
    the door, before Python's recursive parser sees it."""
    at_limit = {"principal": "alice", "trusted_context": [], "x": nested_value(MAX_BODY_NESTING - 1)}
    over = {"principal": "alice", "trusted_context": [], "x": nested_value(MAX_BODY_NESTING)}
    parsed = await api.client.post("/v1/sessions", json=at_limit, headers=auth("agent-1"))
    assert assert_problem(parsed, 422)["type"] == "urn:stockade:problem:request.invalid"  # "x" is not a field
    refused = await api.client.post("/v1/sessions", json=over, headers=auth("agent-1"))
    problem = assert_problem(refused, 422)
    assert problem["type"] == "urn:stockade:problem:request.too_deep"
    assert f"more than {MAX_BODY_NESTING} levels deep" in problem["detail"]


async def test_a_deep_body_from_a_stranger_is_refused_as_unauthenticated(api: Api) -> None:
    for path in ("/v1/tools", "/v1/sessions", "/v1/sessions/s-1/calls"):
        response = await api.client.post(
            path, content=nested_text(100_000), headers={"Content-Type": "application/json"}
        )
        assert assert_problem(response, 401)["type"] == "urn:stockade:problem:auth.unauthenticated"
    assert [e["agent"] for e in refusals(api.audit)] == [None, None, None]


BAD_BODIES = {
    "not UTF-8": b'{"principal": "\xff\xfe"}',
    "not JSON": b'{"principal": ',
    "trailing data": b'{"principal": "a"} {',
    "an integer past Python's digit limit": b'{"principal": ' + b"9" * 5000 + b"}",
    "an unterminated deep array": b"[" * 100_000,
    "deep inside a string and then deep for real": b'{"principal": "' + b"[" * 1000 + b'", "x": ' + b"[" * 1000,
}


@pytest.mark.parametrize("body", list(BAD_BODIES.values()), ids=list(BAD_BODIES))
async def test_bodies_that_are_not_json_get_a_problem_document_on_every_kind_of_route(api: Api, body: bytes) -> None:
    session = await open_session(api)
    for path in ("/v1/sessions", "/v1/tools", f"/v1/sessions/{session}/calls", "/v1/approvals/a-1/deny"):
        who = {"/v1/tools": "root", "/v1/approvals/a-1/deny": "oncall"}.get(path, "agent-1")
        response = await api.client.post(path, content=body, headers=auth(who))
        assert_problem(response, 422)
    assert len(refusals(api.audit)) == 4
    assert await call_works(api, session)


async def test_a_body_streamed_past_the_size_limit_gets_the_413_problem_on_every_kind_of_route(api: Api) -> None:
    """No Content-Length, so the limit is found while the body is read (by the door, by FastAPI or
    by the per-call routes): the 413 problem, not a 500."""
    session = await open_session(api)

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(5):
            yield b"[" * (1 << 20)

    for path, who in (("/v1/tools", "root"), ("/v1/sessions", "agent-1"), (f"/v1/sessions/{session}/calls", "agent-1")):
        response = await api.client.post(path, content=chunks(), headers=auth(who))
        assert assert_problem(response, 413)["type"] == "urn:stockade:problem:request.too_large"
    assert await call_works(api, session)


async def test_unknown_routes_wrong_methods_and_control_characters_in_paths_get_problem_documents(api: Api) -> None:
    session = await open_session(api)
    assert assert_problem(await api.client.get("/v1/nothing", headers=auth("root")), 404)["type"] == (
        "urn:stockade:problem:request.not_found")  # fmt: skip
    assert assert_problem(await api.client.put("/v1/sessions", headers=auth("root")), 405)["type"] == (
        "urn:stockade:problem:request.method_not_allowed")  # fmt: skip
    # A decoded %0A would otherwise match ".../calls" ("$" matches before a final newline).
    for path in (f"/v1/sessions/{session}/calls%0A", "/v1/tools%0A", "/v1/sessions%00"):
        response = await api.client.post(path, json={"tool": "lookup", "args": {}}, headers=auth("agent-1"))
        assert assert_problem(response, 400)["type"] == "urn:stockade:problem:request.malformed"
    assert len(refusals(api.audit)) == 5
    assert await call_works(api, session)


async def test_a_look_alike_name_registered_over_http_gets_a_problem_naming_it(api: Api) -> None:
    response = await api.client.post("/v1/tools", json=external_tool("lookup\n"), headers=auth("root"))
    problem = assert_problem(response, 422)
    assert problem["type"] == "urn:stockade:problem:tool.invalid_spec"
    assert "'lookup\\n'" in problem["detail"]


# -- a schema's regular expressions --------------------------------------------------------------


async def test_a_backtracking_pattern_is_matched_in_linear_time_not_for_hours(
    plane: ControlPlane, settings: Settings
) -> None:
    """^(a+)+$ against 'aaa…!' doubles its cost with each 'a' under Python's re (27 of them froze
    the router 8.5 s; 35, for hours). Matched by RE2, thousands take no time, and the call is an
    ordinary refusal naming the field, on record."""
    keyed = {"type": "object", "properties": {"q": {"type": "string", "pattern": "^(a+)+$"}},
             "patternProperties": {"^(b+)+$": {"type": "integer"}}, "additionalProperties": False}  # fmt: skip
    await plane.register(external_tool("lookup", input_schema=keyed))
    session = await plane.open_session("agent", "alice@example.com")
    started = time.perf_counter()
    with pytest.raises(InvalidCall) as refused:
        await plane.call(session, "lookup", {"q": "a" * 5_000 + "!"})
    with pytest.raises(InvalidCall) as by_key:
        await plane.call(session, "lookup", {"b" * 5_000 + "!": 1})
    assert time.perf_counter() - started < 1.0
    assert [p.field for p in refused.value.problems] == ["args.q"]
    assert "does not match" in refused.value.problems[0].problem
    assert "Additional properties are not allowed" in by_key.value.problems[0].problem
    assert (await plane.call(session, "lookup", {"q": "aaa", "bbb": 1})).status == "awaiting_report"
    with pytest.raises(InvalidCall):  # a key the pattern matches is held to its schema
        await plane.call(session, "lookup", {"bb": "not an integer"})
    assert [e["result"]["code"] for e in rejections(settings.audit.path, session)] == ["call.invalid"] * 3


async def test_patterns_follow_ecma_262_where_pythons_re_does_not(plane: ControlPlane) -> None:
    """JSON Schema patterns are ECMA-262 regular expressions: $ ends the text (Python's re also
    matches before a final newline) and \\d is an ASCII digit (Python's re: any Unicode digit)."""
    digits = {"type": "object", "properties": {"n": {"type": "string", "pattern": "^\\d{3}$"}}}
    await plane.register(external_tool("code", input_schema=digits))
    session = await plane.open_session("agent", "alice@example.com")
    assert (await plane.call(session, "code", {"n": "123"})).status == "awaiting_report"
    for hostile in ("123\n", "١٢٣"):
        with pytest.raises(InvalidCall):
            await plane.call(session, "code", {"n": hostile})


@pytest.mark.parametrize(
    ("schema", "refusal"),
    [
        ({"type": "object", "properties": {"q": {"type": "string", "pattern": "^(?=.*x).*$"}}},
         "input_schema.properties.q.pattern: '^(?=.*x).*$' cannot be matched in linear time"),
        ({"type": "object", "patternProperties": {"(a)\\1": {}}},
         "input_schema.patternProperties: '(a)\\\\1' cannot be matched in linear time"),
        ({"type": "object", "patternProperties": {"^x": {}}, "unevaluatedProperties": False},
         "unevaluatedProperties with patternProperties"),
    ],
)  # fmt: skip
async def test_a_pattern_without_a_linear_time_match_is_refused_at_registration(
    plane: ControlPlane, schema: dict[str, Any], refusal: str
) -> None:
    with pytest.raises(InvalidToolSpec) as refused:
        await plane.register(external_tool("odd", input_schema=schema))
    assert refusal in str(refused.value)
    assert "odd" not in plane.registry.names()


async def test_a_pattern_in_data_is_not_taken_for_a_schemas(plane: ControlPlane) -> None:
    """A default or an enum value is data: a {"pattern": ...} in it is no regular expression."""
    schema = {"type": "object", "properties": {"rule": {"type": "object", "default": {"pattern": "(?=x)"},
                                                        "enum": [{"pattern": "(?<=y)"}]}}}  # fmt: skip
    await plane.register(external_tool("rules", input_schema=schema))
