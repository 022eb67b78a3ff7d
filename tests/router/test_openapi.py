"""/openapi.json says what the API does: every check schemathesis has, run against `stockade serve`
on loopback as the role each route is for, finds nothing; and the document names its security
schemes, the problem documents each route answers, a typed tool spec and readable operationIds."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import strategies as st
from schemathesis.engine import Status, events, from_schema
from schemathesis.specs.openapi.checks import ensure_resource_availability, positive_data_acceptance

from policy import PolicySettings
from router import ControlPlane, Settings
from router.interfaces.api import create_app
from router.settings import ApiPrincipal, AuditSettings
from tests.conftest import REPO, external_tool, stockade_server
from tests.router.test_api import TOKENS, auth, principals

INTROSPECTION_TOKEN = "tok-introspect"
EXAMPLES = 20  # per operation and phase: about half a minute here, on two cores
SEED = 1  # fixed, so a failure reproduces; change it to look further
UNAUTHENTICATED = {"/healthz", "/readyz", "/metrics", "/.well-known/jwks.json", "/v1/credentials/introspect"}
# Held for approval by the shipped policy (critical and mutating), so approvals exist to list and decide.
HELD = external_tool("drop_table", risk="critical", capabilities=["mutates_state"])

# "printable" (router.interfaces.api.app.OpenSession): text str.isprintable accepts, which no regular expression
# JSON Schema tools share can state. Letters, marks, numbers, punctuation and symbols are printable.
schemathesis.openapi.format("printable", st.text(st.characters(categories=["L", "M", "N", "P", "S"]), min_size=1,
                                                 max_size=256))  # fmt: skip

# Where a request the schema accepts may still be refused for what no static schema can state, and
# the problem that says so (its code, and the field at fault: None for any):
#   - a tool spec's cross-field checks (arguments named in *_args are input_schema properties, output
#     paths) and what policy refuses to register;
#   - a call's arguments, which the named tool's own input_schema describes, and the tools that exist;
#   - a report or an endorsement naming a call_id the session has no such call for.
# Everywhere else, and for every other answer, positive_data_acceptance and ensure_resource_availability
# hold as schemathesis ships them (run below through these two wrappers; `test_the_exemptions_*`
# shows they still fail what they should).
REFUSED_FOR_STATE: dict[str, tuple[set[str], str | None]] = {
    "registerTool": ({"tool.invalid_spec", "tool.refused_by_policy"}, None),
    "decideCall": ({"call.invalid", "tool.not_found"}, "args"),
    "callTool": ({"call.invalid", "tool.not_found"}, "args"),
    "reportOutput": ({"call.invalid"}, "call_id"),
    "endorseOutput": ({"call.invalid"}, "call_id"),
}


def refused_for_state(operation_id: str | None, body: object) -> bool:
    """Whether ``body`` (an answer to ``operation_id``) refuses what the schema cannot describe."""
    codes, field = REFUSED_FOR_STATE.get(operation_id or "", (set(), None))
    if not isinstance(body, dict) or body.get("code") not in codes:
        return False
    fields = [str(e.get("field")) for e in body.get("errors", [])]
    return field is None or all(f == field or f.startswith((f"{field}.", f"{field}[")) for f in fields)


def _answer(response: schemathesis.Response) -> object:
    try:
        return response.json()
    except ValueError:
        return None


@schemathesis.check
def positive_data_acceptance_but_state(ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> Any:
    """positive_data_acceptance, but for `REFUSED_FOR_STATE`."""
    if refused_for_state(case.operation.definition.raw.get("operationId"), _answer(response)):
        return None
    return positive_data_acceptance(ctx, response, case)


@schemathesis.check
def ensure_resource_availability_but_state(ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> Any:
    """ensure_resource_availability, but for `REFUSED_FOR_STATE` (a call's 404 may be its tool's)."""
    if refused_for_state(case.operation.definition.raw.get("operationId"), _answer(response)):
        return None
    return ensure_resource_availability(ctx, response, case)


def token_for(path: str) -> str:
    """Each route is exercised as the role it is for, so requests get past the door."""
    if path == "/v1/credentials/introspect":
        return INTROSPECTION_TOKEN
    if path.startswith("/v1/approvals") or path.endswith("/endorsements"):
        return TOKENS["oncall"]
    if path.startswith("/v1/sessions"):
        return TOKENS["agent-1"]
    return TOKENS["root"]  # admin: tools, audit, policy


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    """`stockade serve` on loopback (embedded store), with a tool to call and an approval pending."""
    env = {"STOCKADE_API_PRINCIPALS": json.dumps(principals()), "STOCKADE_AUDIT__PATH": str(tmp_path / "audit.jsonl"),
           "STOCKADE_INTROSPECTION_TOKENS": json.dumps([INTROSPECTION_TOKEN]), "STOCKADE_LOG_LEVEL": "error",
           "STOCKADE_POLICY__WATCH_INTERVAL_S": "0"}  # fmt: skip
    with stockade_server(["serve"], env, tmp_path / "serve.log", "/healthz") as url:
        for tool in (external_tool("echo"), HELD):
            assert httpx.post(f"{url}/v1/tools", json=tool, headers=auth("root")).status_code == 201
        opened = httpx.post(f"{url}/v1/sessions", json={"principal": "alice"}, headers=auth("agent-1")).json()
        held = httpx.post(f"{url}/v1/sessions/{opened['session_id']}/calls", json={"tool": "drop_table"},
                          headers=auth("agent-1")).json()  # fmt: skip
        assert held["status"] == "pending_approval"
        yield url


def run_schemathesis(url: str) -> tuple[list[str], Counter[tuple[str, int]]]:
    """Every phase and every check schemathesis has (as ``st run --checks all``) against ``url``:
    the failures found, and how often each operation answered each status."""
    config = schemathesis.Config.from_dict({
        "seed": SEED, "workers": 1, "generation": {"max-examples": EXAMPLES, "database": "none"},
        # All of them; the two replaced by their wrappers above are run through those.
        "checks": {"enabled": True, "positive_data_acceptance": {"enabled": False},
                   "ensure_resource_availability": {"enabled": False}},
    })  # fmt: skip
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=config)

    @schema.auth(refresh_interval=None)  # a token per route, not one cached for all
    class ByRole:
        def get(self, case: schemathesis.Case, _: schemathesis.AuthContext) -> str:
            return token_for(case.operation.path)

        def set(self, case: schemathesis.Case, token: str, _: schemathesis.AuthContext) -> None:
            case.headers = {**(case.headers or {}), "Authorization": f"Bearer {token}"}

    failures: list[str] = []
    statuses: Counter[tuple[str, int]] = Counter()
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished | events.FuzzScenarioFinished):
            for interaction in event.recorder.interactions.values():
                if interaction.response is not None:
                    statuses[(event.recorder.label, interaction.response.status_code)] += 1
            for checks in event.recorder.checks.values():
                failures += [f"{event.recorder.label}: {c.name}: {c.failure_info.failure.title}\n"
                             f"{c.failure_info.failure.message}\n{c.failure_info.code_sample}"
                             for c in checks if c.status is Status.FAILURE and c.failure_info is not None]  # fmt: skip
        elif isinstance(event, events.NonFatalError):
            failures.append(f"error in {event.label}: {event.value!r}")
        elif isinstance(event, events.FatalError):
            failures.append(f"fatal error: {event.exception!r}")
        elif isinstance(event, events.EngineFinished):
            failures += [f"after the run: {f.title}\n{f.message}" for f in event.failures]
    return sorted(set(failures)), statuses


def test_schemathesis_finds_nothing_with_every_check(server: str) -> None:
    failures, statuses = run_schemathesis(server)
    assert failures == [], "\n\n".join(failures)
    answered = {operation for (operation, status), _ in statuses.items() if 200 <= status < 300}
    # Each of these took requests to the end, so the checks saw real answers, not only refusals.
    assert {
        "POST /v1/sessions",
        "POST /v1/sessions/{session_id}/decide",
        "GET /v1/approvals/{approval_id}",
        "GET /v1/audit/events",
        "POST /v1/policy/reload",
        "POST /v1/credentials/introspect",
    } <= answered
    assert any(status == 401 for (_, status) in statuses)


def test_the_exemptions_cover_only_what_no_schema_can_say() -> None:
    """A schema mismatch (request.invalid) or a problem elsewhere in a call is never exempt."""
    assert refused_for_state("callTool", {"code": "call.invalid", "errors": [{"field": "args.to", "problem": "x"}]})
    assert refused_for_state("reportOutput", {"code": "call.invalid"})
    assert refused_for_state("registerTool", {"code": "tool.refused_by_policy"})
    assert not refused_for_state("callTool", {"code": "request.invalid", "errors": [{"field": "body.args"}]})
    assert not refused_for_state("callTool", {"code": "call.invalid", "errors": [{"field": "inputs.a b"}]})
    assert not refused_for_state("callTool", {"code": "call.invalid", "errors": [{"field": "argsx"}]})
    assert not refused_for_state("openSession", {"code": "call.invalid"})
    assert not refused_for_state(None, {"code": "tool.not_found"})


# -- the document ---------------------------------------------------------------------------


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl"), policy=PolicySettings(dir=REPO / "policies"),
        api_principals=[ApiPrincipal.model_validate(p) for p in principals()],
    )  # fmt: skip
    async with ControlPlane.from_settings(settings) as control_plane:
        yield control_plane


@pytest.fixture
async def client(plane: ControlPlane) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(plane)), base_url="http://x") as client:
        yield client


@pytest.fixture
def document(plane: ControlPlane) -> dict[str, Any]:
    return create_app(plane).openapi()


def operations(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            yield method.upper(), path, operation


def test_every_route_that_takes_a_token_says_so_and_documents_its_401(document: dict[str, Any]) -> None:
    schemes = document["components"]["securitySchemes"]
    assert schemes["bearer"] == {**schemes["bearer"], "type": "http", "scheme": "bearer"}
    assert schemes["introspection"] == {**schemes["introspection"], "type": "http", "scheme": "bearer"}
    for method, path, operation in operations(document):
        if path in UNAUTHENTICATED:
            expected = [{"introspection": []}] if path == "/v1/credentials/introspect" else None
            assert operation.get("security") == expected, (method, path)
            continue
        assert operation["security"] == [{"bearer": []}], (method, path)
        refused = operation["responses"]["401"]
        assert refused["content"] == {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
        assert refused["headers"]["WWW-Authenticate"]["required"] is True


def test_errors_are_documented_as_the_problem_documents_the_api_sends(document: dict[str, Any]) -> None:
    problem = document["components"]["schemas"]["Problem"]
    assert set(problem["required"]) == {"type", "title", "status", "detail", "code"}
    assert {"instance", "errors"} <= problem["properties"].keys()
    assert document["components"]["schemas"]["FieldError"]["required"] == ["field", "problem"]
    assert "HTTPValidationError" not in json.dumps(document)  # FastAPI's 422 body, which the API never sends
    for method, path, operation in operations(document):
        for status, response in operation["responses"].items():
            if int(status) < 400 or path in {"/readyz", "/v1/credentials/introspect"}:  # their own bodies
                continue
            assert list(response["content"]) == ["application/problem+json"], (method, path, status)
        assert {"413", "500", "504"} <= operation["responses"].keys(), (method, path)
        if "{" in path:
            assert "400" in operation["responses"], (method, path)  # control characters in the path
    calls = document["paths"]["/v1/sessions/{session_id}/calls"]["post"]["responses"]
    assert {"401", "403", "404", "409", "422", "503"} <= calls.keys()
    assert "403" not in document["paths"]["/v1/tools"]["get"]["responses"]  # every role may list tools


def test_operations_have_readable_stable_ids_and_tags(document: dict[str, Any]) -> None:
    ids = [operation["operationId"] for _, _, operation in operations(document)]
    assert len(ids) == len(set(ids))
    assert all(re.fullmatch(r"[a-z]+(?:[A-Z][a-z0-9]*)*", i) for i in ids), ids
    assert not [i for i in ids if "_v1_" in i or i.endswith(("_get", "_post"))]
    assert {"listTools", "registerTool", "openSession", "callTool", "approveApproval", "reloadPolicy"} <= set(ids)
    assert all(operation.get("tags") for _, _, operation in operations(document))


def test_a_tool_spec_and_a_calls_arguments_are_typed(document: dict[str, Any]) -> None:
    register = document["paths"]["/v1/tools"]["post"]["requestBody"]
    assert register["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ToolSpec"}
    spec = document["components"]["schemas"]["ToolSpec"]
    assert {"name", "input_schema", "risk", "executor"} <= set(spec["required"])
    assert spec["properties"]["name"]["pattern"] == "^[A-Za-z][A-Za-z0-9_-]{0,63}$"
    assert spec["properties"]["input_schema"]["properties"] == {"type": {"const": "object"}}
    args = document["components"]["schemas"]["Decide"]["properties"]["args"]
    assert [alternative["type"] for alternative in args["oneOf"]] == ["object", "string"]
    session_id = document["paths"]["/v1/sessions/{session_id}"]["delete"]["parameters"][0]["schema"]
    assert re.fullmatch(session_id["pattern"], "s-0123")
    assert not re.fullmatch(session_id["pattern"], "a\nb")
    assert not re.fullmatch(session_id["pattern"], "..")


# -- what schemathesis found in the server ------------------------------------------------------


async def test_a_wrong_method_is_told_every_method_the_path_takes(client: httpx.AsyncClient) -> None:
    answer = await client.request("OPTIONS", "/v1/tools", headers=auth("root"))
    assert (answer.status_code, answer.headers["allow"]) == (405, "GET, POST")


@pytest.mark.parametrize("when", ["0.5", "1700000000", "2025-01-31", "2025-01-31T09:00:00", "2025-01-31 09:00Z"])
async def test_audit_times_are_rfc3339_with_an_offset(client: httpx.AsyncClient, when: str) -> None:
    """A number was read as a Unix time, and a time without an offset failed the query (500)."""
    refused = await client.get("/v1/audit/events", params={"since": when}, headers=auth("root"))
    taken = await client.get("/v1/audit/events", params={"since": "2025-01-31T09:00:00+01:00"}, headers=auth("root"))
    assert (refused.status_code, refused.json()["errors"][0]["field"]) == (422, "query.since")
    assert taken.status_code == 200
