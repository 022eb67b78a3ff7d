"""Text that UTF-8 cannot hold, in every string field a caller or a tool controls: lone surrogates
(``"\\ud800"`` in JSON) and undecodable file names. Each is refused with a problem naming the field,
or recorded escaped; every one leaves an audit record, none answers 500, and the session goes on."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router import ControlPlane, InvalidCall, Settings, StockadeError
from router.interfaces.api import create_app
from router.settings import ApiPrincipal, AuditSettings
from runner import RunnerSettings
from tests.conftest import ECHO, external_tool, python_tool

SURROGATE = "\ud800"
TOKEN = "tok-agent"


@pytest.fixture
async def plane(tmp_path: Path, runner_state: Path) -> AsyncIterator[ControlPlane]:
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl"),
        runner=RunnerSettings(state_dir=runner_state),
        api_principals=[ApiPrincipal(name="agent-1", role="agent", may_register=True,
                                     token_sha256=hashlib.sha256(TOKEN.encode()).hexdigest())],
    )  # fmt: skip
    async with ControlPlane.from_settings(settings) as control_plane:
        await control_plane.register(python_tool("echo", ECHO))
        await control_plane.register(external_tool("lookup"))
        yield control_plane


def events(plane: ControlPlane) -> list[dict[str, Any]]:
    path = plane.settings.audit.path
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def test_a_surrogate_in_any_caller_field_is_refused_audited_and_the_session_goes_on(
    plane: ControlPlane,
) -> None:
    session = await plane.open_session("agent-1", "alice@example.com")
    attempts: dict[str, Any] = {
        "args value": lambda: plane.call(session, "echo", {"x": SURROGATE}),
        "args key": lambda: plane.call(session, "echo", {SURROGATE: 1}),
        "nested args": lambda: plane.call(session, "echo", {"a": [{"b": "ok" + SURROGATE}]}),
        "raw JSON args": lambda: plane.call(session, "echo", '{"x": "\\ud800"}'),
        "tool name": lambda: plane.call(session, "echo" + SURROGATE, {}),
        "approval id": lambda: plane.call(session, "echo", {}, approval_id="a-" + SURROGATE),
        "input name": lambda: plane.call(session, "echo", {}, inputs={"f" + SURROGATE: b"x"}),
        "decide args": lambda: plane.decide(session, "echo", {"x": SURROGATE}),
    }
    before = len(events(plane))
    escaped_past = 0
    for name, attempt in attempts.items():
        with pytest.raises(StockadeError) as refused:
            await attempt()
        assert refused.value.http_status < 500, name
        after = events(plane)
        assert len(after) > before, f"{name}: no audit record"
        escaped_past += any("escaped" in e or "\\ud800" in json.dumps(e) for e in after[before:])
        before = len(after)
    assert escaped_past >= 2  # the refusals that name the bad value record it escaped
    with pytest.raises(InvalidCall, match=r"trusted_context\[0\]"):
        await plane.open_session("agent-1", "alice@example.com", trusted_context=[SURROGATE])
    external = await plane.call(session, "lookup", {})
    with pytest.raises(InvalidCall, match="output"):
        await plane.report(session, external.call_id, {"text": SURROGATE})
    assert (await plane.call(session, "echo", {"x": "fine"})).output == {"x": "fine"}
    assert (await plane.audit.verify()).ok


async def test_a_surrogate_anywhere_in_a_tool_spec_is_refused_over_http_and_audited(plane: ControlPlane) -> None:
    """A schema's property name or pattern, a description: refused as an invalid spec (422,
    naming where), on record, never a 500 from serialising the spec later."""
    app = create_app(plane)
    headers = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    specs = {
        "property name": {"type": "object", "properties": {SURROGATE: {"type": "string"}}},
        "pattern": {"type": "object", "properties": {"q": {"type": "string", "pattern": SURROGATE}}},
    }
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://stockade") as client:
        for where, schema in specs.items():
            before = len(events(plane))
            body = json.dumps(external_tool("odd", input_schema=schema))  # JSON escapes the surrogate: \ud800
            answer = await client.post("/v1/tools", content=body, headers=headers)
            assert (answer.status_code, answer.json()["code"]) == (422, "tool.invalid_spec"), where
            assert "spec.input_schema" in answer.json()["detail"], where
            assert len(events(plane)) > before, f"{where}: no audit record"
        odd = json.dumps(external_tool("odd", description="a" + SURROGATE))
        described = await client.post("/v1/tools", headers=headers, content=odd)
        assert (described.status_code, described.json()["code"]) == (422, "tool.invalid_spec")
    assert "odd" not in plane.registry.names()
    assert (await plane.audit.verify()).ok


async def test_what_a_tool_returns_or_names_is_recorded_escaped_never_a_crash(plane: ControlPlane) -> None:
    source = (
        "import json, sys\n"
        "def main(**kw):\n"
        "    open(b'/out/bad\\xff.txt', 'wb').write(b'x')\n"
        "    open('/out/good.txt', 'w').write('y')\n"
        "    sys.stderr.buffer.write(b'\\xff\\xfe not utf-8')\n"
        "    return json.loads('\"\\\\ud800 lone\"')\n"
    )
    await plane.register(python_tool("hostile", source, sandbox={"outputs": {"max_files": 5, "max_bytes": 100}}))
    session = await plane.open_session("agent-1", "alice@example.com")
    result = await plane.call(session, "hostile", {})
    assert result.status == "completed"
    assert result.output == "\\ud800 lone"  # escaped, exactly as recorded
    assert [a.path for a in result.artifacts] == ["good.txt"]
    json.dumps(result.model_dump(mode="json"), ensure_ascii=False).encode()  # any response can carry it
    [execution] = [e for e in events(plane) if e["kind"] == "execution"]
    assert {"path": "bad\\xff.txt", "why": "name is not valid UTF-8"} in execution["result"]["refused_outputs"]
    assert (await plane.audit.verify()).ok
    assert (await plane.call(session, "echo", {"x": 1})).status == "completed"


async def test_over_http_a_surrogate_gets_a_problem_document_and_an_audit_record(plane: ControlPlane) -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(plane)), base_url="http://stockade",
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as client:  # fmt: skip
        opened = await client.post("/v1/sessions", json={"principal": "alice@example.com"})
        session = opened.json()["session_id"]
        count = len(events(plane))
        body = b'{"tool": "echo", "args": {"x": "\\ud800"}}'
        for route in (f"/v1/sessions/{session}/calls", f"/v1/sessions/{session}/decide"):
            response = await client.post(route, content=body, headers={"Content-Type": "application/json"})
            assert 400 <= response.status_code < 500, response.text
            assert response.headers["content-type"].startswith("application/problem+json")
            # Refused where the body is parsed (a lone surrogate is not valid JSON text to pydantic).
            assert "hex escape" in response.json()["detail"] or "args.x" in response.json()["detail"]
        assert len(events(plane)) >= count + 2
        again = await client.post(f"/v1/sessions/{session}/calls", json={"tool": "echo", "args": {"x": 1}})
        assert again.json()["status"] == "completed"
