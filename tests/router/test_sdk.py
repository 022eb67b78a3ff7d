"""The SDK as a library: importing it loads nothing of the server; its public surface is pinned;
both clients have `ControlPlane`'s signatures and behave as it does, against real servers."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

import router
import router.client
from policy import PolicySettings
from router import ApprovalError, ApprovalStatus, ControlPlane, InvalidCall, SessionNotFound, Settings, ToolNotFound
from router.client import ApiUnreachable, IdentityMismatch, StockadeClient, SyncStockadeClient, sandboxed_tool
from router.interfaces.api import create_app
from router.settings import ApiPrincipal, AuditSettings
from tests.conftest import REPO, external_tool
from tests.router.test_api import DROP, TOKENS, principals, serve

# What importing the SDK must never load: the Docker SDK, the Rego engine, Redis, the web framework,
# the pipeline, the sandboxes, the policy package (and JSON Schema, needed on the first spec read only).
SERVER = ("docker", "regorus", "redis", "fastapi", "starlette", "uvicorn", "router.control", "runner", "policy",
          "jsonschema")  # fmt: skip
# Importing it does not log, so it does not load structlog either (reading an output path may).
NOT_ON_IMPORT = (*SERVER, "structlog", "router.logging")
SDK_MODULES = {"router", "router.client", "router.client.clients", "router.client.endpoints", "router.client.errors",
               "router.client.tools", "router.errors", "router.results", "router.states", "router.wire"}  # fmt: skip
TIMED_IMPORT = """\
import json, sys, time
started = time.perf_counter()
{statement}
print(json.dumps({{"seconds": time.perf_counter() - started, "modules": sorted(sys.modules)}}))
"""
# The SDK's dependencies, as it uses them: pydantic loads its machinery (and plugins) for the first model.
DEPENDENCIES = "import httpx\nfrom pydantic import BaseModel\nclass M(BaseModel):\n    x: int"
# Using the SDK (defining a tool, reading specs) may load JSON Schema and the output-path syntax, not the server.
SDK_IN_USE = """\
import json, sys
from router.client import StockadeClient, sandboxed_tool
from router.wire import ToolSpec

@sandboxed_tool(risk="low")
def shout(text: str) -> str:
    "Upper-case a text."
    return text.upper()

StockadeClient("http://127.0.0.1:9", "token")
ToolSpec.model_validate({**shout, "capabilities": ["reads_untrusted"], "untrusted_output": ["$.body"]})
print(json.dumps(sorted(sys.modules)))
"""


def loaded(modules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes)]


def timed_import(statement: str) -> tuple[float, list[str]]:
    """(seconds, modules loaded) for the import ``statement`` in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", TIMED_IMPORT.format(statement=statement)], cwd=REPO,
                          capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
    found = json.loads(done.stdout)
    return found["seconds"], found["modules"]


def test_importing_the_sdk_loads_nothing_of_the_server_and_little_beyond_its_dependencies() -> None:
    """Timed against importing its dependencies alone, at the same time (the fastest of seven runs
    each: noise only adds, and with three a lucky baseline run once failed a busy CI), so the bound
    holds on a slow or busy machine too. Before the split, importing the SDK was importing the
    server: about 900 modules, twice to three times as long."""
    sdk, dependencies = [], []
    for _ in range(7):  # interleaved: both see the same load
        seconds, modules = timed_import("import router.client")
        assert loaded(modules, NOT_ON_IMPORT) == []
        assert {m for m in modules if m == "router" or m.startswith("router.")} == SDK_MODULES
        sdk.append(seconds)
        dependencies.append(timed_import(DEPENDENCIES)[0])
    # Beyond them: asyncio (the async client) and building ~40 wire models, about as much again.
    assert min(sdk) < 2.0 * min(dependencies), (sdk, dependencies)


BUILT_ON_IMPORT = """\
import json, pydantic
import router.client, router.results, router.wire
models = [value for module in (router.results, router.wire) for value in vars(module).values()
          if isinstance(value, type) and issubclass(value, pydantic.BaseModel) and value.__module__ == module.__name__]
before = sorted(model.__name__ for model in models if model.__pydantic_complete__)
spec = router.wire.ToolSpec.model_validate({"name": "t", "description": "d", "input_schema": {"type": "object"},
                                            "executor": {"kind": "external"}, "risk": "low"})
print(json.dumps({"models": len(models), "built_on_import": before, "built_on_use": spec.name == "t"
                  and router.wire.ToolSpec.__pydantic_complete__}))
"""


def test_importing_the_sdk_builds_no_model_until_it_is_used() -> None:
    """Building every wire model's validator at import was a third of importing the SDK (0.49 s ->
    0.36 s, fastest of seven, when they became built on first use). Deterministic where the timed
    test above is not: no model of the wire is built by the import; one is, and works, on first use."""
    done = subprocess.run([sys.executable, "-c", BUILT_ON_IMPORT], cwd=REPO, capture_output=True, text=True,
                          check=True, timeout=120)  # fmt: skip
    found = json.loads(done.stdout)
    assert found["models"] >= 15
    assert found["built_on_import"] == []
    assert found["built_on_use"] is True


def test_using_the_sdk_loads_nothing_of_the_server(tmp_path: Path) -> None:
    script = tmp_path / "uses_the_sdk.py"
    script.write_text(SDK_IN_USE)
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, check=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    modules = json.loads(done.stdout)
    assert loaded(modules, tuple(m for m in SERVER if m != "jsonschema")) == []
    assert {"jsonschema", "router.provenance"} <= set(modules)  # the spec's schema and output paths were checked


def test_the_public_surface_is_exactly_this() -> None:
    assert router.__all__ == [
        "VERSION", "Approval", "ApprovalError", "ApprovalStatus", "AuditError", "ControlPlane", "DecisionResult",
        "DuplicateTool", "InvalidCall", "InvalidToolSpec", "PolicyError", "PolicyUnavailable", "SandboxError",
        "SandboxUnavailable", "SessionNotFound", "Settings", "StockadeError", "ToolNotFound", "ToolResult", "ToolSpec",
    ]  # fmt: skip
    assert router.client.__all__ == [
        "ApiError", "ApiUnreachable", "IdentityMismatch", "SandboxedTool", "StockadeClient", "SyncStockadeClient",
        "anthropic_tools", "langchain_tools", "openai_agents_tools", "openai_tools", "pydantic_ai_toolset",
        "sandboxed_tool",
    ]  # fmt: skip
    for package in (router, router.client):
        for name in package.__all__:
            assert getattr(package, name) is not None, name
    with pytest.raises(AttributeError):
        _ = router.NoSuchThing  # type: ignore[attr-defined]


# -- the same methods as ControlPlane ----------------------------------------------------------

# ControlPlane's public methods the API does not serve, and why.
NOT_OVER_HTTP = {
    "from_settings": "builds a control plane in process",
    "tool": "a RegisteredTool (compiled validator, policy's view) is the server's; list_tools gives the specs",
    "aclose": "the clients have their own aclose/close",
    "expire_sessions": "the server's own sweeper",
    "renew_session": "no route: an HTTP client's calls renew their session",
    "permitted_tools": "no route (MCP shows it); list_tools lists every tool",
    "record_refusal": "the API's own door",
    "readiness": "GET /readyz, for orchestrators",
    "readiness_problems": "GET /readyz, for orchestrators",
    "start": "the server starts its own background work (sweeper, policy watcher)",
}
# The clients' methods that may have no ControlPlane namesake (in process: plane.audit.query()).
CLIENT_ONLY = {"list_tools", "audit_events", "decision_trail", "close"}


def public_methods(cls: type) -> dict[str, Any]:
    return {name: value for name, value in vars(cls).items() if not name.startswith("_") and callable(value)}


def shape(method: Any) -> tuple[list[tuple[str, Any, Any, Any]], Any]:
    """What a caller depends on: each parameter's name, kind, default and annotation, and the result."""
    signature = inspect.signature(method)
    parameters = [(p.name, p.kind, p.default, p.annotation) for p in signature.parameters.values()]
    return parameters, signature.return_annotation


@pytest.mark.parametrize("client", [StockadeClient, SyncStockadeClient])
def test_each_client_method_has_the_signature_of_its_control_plane_namesake(client: type) -> None:
    plane = public_methods(ControlPlane)
    mine = public_methods(client)
    for name, method in plane.items():
        if name not in mine:
            assert name in NOT_OVER_HTTP, (
                f"ControlPlane.{name} is new: give both SDK clients a method with its signature "
                "(router/client/endpoints.py), or say in NOT_OVER_HTTP why not"
            )
            continue
        assert shape(mine[name]) == shape(method), name
        assert inspect.iscoroutinefunction(mine[name]) is (client is StockadeClient), name
    assert set(mine) - set(plane) <= CLIENT_ONLY


# -- and the same behaviour ----------------------------------------------------------------------


@sandboxed_tool(risk="low")
def word_count(text: str) -> int:
    """Count the words in a text."""
    return len(text.split())


READ = external_tool("read_file", capabilities=["reads_untrusted"])


@dataclass
class Side:
    """Who does what: in process, the plane for everyone; over HTTP, a client with each one's token."""

    agent: Any
    approver: Any
    admin: Any


async def run(target: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    result = getattr(target, method)(*args, **kwargs)
    return await result if inspect.isawaitable(result) else result


def settings_for(tmp_path: Path) -> Settings:
    return Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl"), policy=PolicySettings(dir=REPO / "policies"),
        api_principals=[ApiPrincipal.model_validate(p) for p in principals()],
    )  # fmt: skip


@pytest.fixture
def served(tmp_path: Path) -> Iterator[str]:
    env = {"STOCKADE_AUDIT__PATH": str(tmp_path / "served.jsonl"), "STOCKADE_API_PRINCIPALS": json.dumps(principals()),
           "STOCKADE_LOG_LEVEL": "error"}  # fmt: skip
    with serve(env, tmp_path / "serve.log") as url:
        yield url


@pytest.fixture(params=["in_process", "async_client", "sync_client"])
async def side(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Side]:
    if request.param == "sync_client":
        url = request.getfixturevalue("served")
        made = [SyncStockadeClient(url, TOKENS[who], principal=who) for who in ("agent-1", "oncall", "root")]
        yield Side(*made)
        for client in made:
            client.close()
        return
    async with ControlPlane.from_settings(settings_for(tmp_path)) as plane:
        if request.param == "in_process":
            yield Side(plane, plane, plane)
            return
        transport = httpx.ASGITransport(create_app(plane))
        clients = [StockadeClient("http://stockade", TOKENS[who], principal=who, transport=transport)
                   for who in ("agent-1", "oncall", "root")]  # fmt: skip
        yield Side(*clients)
        for client in clients:
            await client.aclose()


async def test_every_method_answers_and_raises_as_the_control_plane_does(side: Side) -> None:
    agent, approver, admin = side.agent, side.approver, side.admin
    assert await run(admin, "register", word_count) == word_count.spec
    for spec in (DROP, READ):
        await run(admin, "register", spec)
    session = await run(agent, "open_session", "agent-1", "alice@example.com", ["count my words"])
    assert session.startswith("s-")

    decided = await run(agent, "decide", session, "word_count", {"text": "x"}, agent="agent-1")
    assert (decided.outcome, decided.reasons) == ("allow", [])
    for args, words in (({"text": "one two three"}, 3), ('{"text": "a b"}', 2), (b'{"text": "a"}', 1)):
        counted = await run(agent, "call", session, "word_count", args, agent="agent-1")
        assert (counted.status, counted.output) == ("completed", words)
    with pytest.raises(InvalidCall) as invalid:
        await run(agent, "call", session, "word_count", {"text": 7})
    assert invalid.value.problems[0].field.startswith("args.text")
    with pytest.raises(InvalidCall) as not_json:
        await run(agent, "call", session, "word_count", {"text": object()})
    assert [p.field for p in not_json.value.problems] == ["args"]
    with pytest.raises(InvalidCall):
        await run(agent, "call", session, "word_count", b"\xff\xfe\xfd")
    with pytest.raises(ToolNotFound):
        await run(agent, "call", session, "nope", {})

    held = await run(agent, "call", session, "drop_table", {"t": "users"})
    assert held.status == "pending_approval"
    assert [a.id for a in await run(approver, "list_approvals", ApprovalStatus.PENDING)] == [held.approval_id]
    approved = await run(approver, "approve", held.approval_id, "oncall", "OPS-7")
    assert (approved.status, approved.approver, approved.note) == (ApprovalStatus.APPROVED, "oncall", "OPS-7")
    with pytest.raises(ApprovalError):
        await run(approver, "approve", held.approval_id, "oncall")
    ran = await run(agent, "call", session, "drop_table", {"t": "users"}, approval_id=held.approval_id)
    assert (ran.status, ran.output) == ("completed", {"t": "users"})
    assert (await run(approver, "get_approval", held.approval_id)).status is ApprovalStatus.USED
    for unknown in ("a-unknown", "../v1/tools", ""):
        with pytest.raises(ApprovalError):
            await run(approver, "get_approval", unknown)
    again = await run(agent, "call", session, "drop_table", {"t": "logs"})
    denied = await run(approver, "deny_approval", again.approval_id, "oncall", "not today")
    assert (denied.status, denied.approver, denied.note) == (ApprovalStatus.DENIED, "oncall", "not today")

    read = await run(agent, "call", session, "read_file", {"name": "bill.txt"})
    assert read.status == "awaiting_report"
    reported = await run(agent, "report", session, read.call_id, {"text": "Pay DE89 3704 0044 0532 0130 00"},
                         agent="agent-1")  # fmt: skip
    assert (reported.status, reported.verdict) == ("completed", "reported")
    with pytest.raises(InvalidCall):
        await run(agent, "report", session, read.call_id, {"text": "again"})
    endorsed = await run(approver, "endorse", session, read.call_id, by="oncall", note="the user: pay this bill")
    assert endorsed == f"untrusted:read_file:{read.call_id}"
    revision = await run(admin, "reload_policy", by="root")
    assert len(revision) == 64

    assert await run(agent, "close_session", session, agent="agent-1") is None
    for closed in (session, "s-../../v1/tools"):
        with pytest.raises(SessionNotFound):
            await run(agent, "call", closed, "word_count", {"text": "x"})
        with pytest.raises(SessionNotFound):
            await run(agent, "close_session", closed)


# -- identity over HTTP ----------------------------------------------------------------------------


class CountingTransport(httpx.ASGITransport):
    """The real application, counting the requests that reach it."""

    sent = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent += 1
        return await super().handle_async_request(request)


async def test_an_identity_other_than_the_tokens_is_refused_before_anything_is_sent(tmp_path: Path) -> None:
    async with ControlPlane.from_settings(settings_for(tmp_path)) as plane:
        transport = CountingTransport(create_app(plane))
        agent = StockadeClient("http://stockade", TOKENS["agent-1"], principal="agent-1", transport=transport)
        approver = StockadeClient("http://stockade", TOKENS["oncall"], principal="oncall", transport=transport)
        unnamed = StockadeClient("http://stockade", TOKENS["oncall"], transport=transport)
        await agent.register(DROP)
        session = await agent.open_session("agent-1", "alice@example.com")
        held = await agent.call(session, "drop_table", {"t": "users"})
        sent = transport.sent
        attempts = [
            agent.open_session("agent-2", "alice@example.com"),
            agent.call(session, "drop_table", {"t": "users"}, agent="agent-2"),
            agent.close_session(session, agent="root"),
            approver.approve(str(held.approval_id), "agent-1", "I approve my own call"),
            approver.endorse(session, held.call_id, by="alice@example.com"),
        ]
        for attempt in attempts:
            with pytest.raises(IdentityMismatch, match=r"token is '(oncall|agent-1)'") as refused:
                await attempt
            assert isinstance(refused.value, ValueError)
        assert transport.sent == sent
        # Without principal=, nothing is checked, and the server records the token's principal.
        approved = await unnamed.approve(str(held.approval_id), "someone-else", "OPS-7")
        assert (approved.approver, approved.note) == ("oncall", "OPS-7")
        for client in (agent, approver, unnamed):
            await client.aclose()


def test_the_sync_client_refuses_an_identity_and_reports_an_unreachable_server() -> None:
    with SyncStockadeClient("http://127.0.0.1:9", TOKENS["oncall"], principal="oncall", retries=1) as client:
        with pytest.raises(IdentityMismatch):
            client.approve("a-1", "agent-1")  # refused before any connection is tried
        with pytest.raises(ApiUnreachable, match="nothing was carried out"):
            client.approve("a-1", "oncall")
        with pytest.raises(ApiUnreachable, match="nothing was carried out"):
            client.list_approvals()


@pytest.mark.parametrize("name", ["Settings", "ControlPlane", "ToolSpec", "ApprovalError", "StockadeError"])
def test_each_public_name_imports_first_in_a_fresh_interpreter(name: str) -> None:
    """No import order is needed: `from router import Settings` alone once hit a cycle."""
    done = subprocess.run([sys.executable, "-c", f"from router import {name}"], capture_output=True, text=True,
                          timeout=120, check=False, cwd="/")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
