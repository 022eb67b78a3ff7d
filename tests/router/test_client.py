"""The SDK against the real application: the same results and exceptions as in process; the
synchronous wrapper against a real `stockade serve`; the model-API adapters and the decorator."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from policy import PolicySettings
from router import ApprovalError, ApprovalStatus, ControlPlane, InvalidCall, SessionNotFound, Settings, ToolNotFound
from router.client import (
    ApiError,
    StockadeClient,
    SyncStockadeClient,
    anthropic_tools,
    langchain_tools,
    openai_tools,
    sandboxed_tool,
)
from router.interfaces.api import create_app
from router.settings import ApiPrincipal, AuditSettings
from router.tools import ToolSpec
from tests.conftest import REPO
from tests.router.test_api import DROP, TOKENS, principals, serve


@sandboxed_tool(risk="low")
def word_count(text: str, minimum: int = 0) -> int:
    """Count the words in a text."""
    return max(minimum, len(text.split()))


@pytest.fixture
async def clients(tmp_path: Path) -> AsyncIterator[dict[str, StockadeClient]]:
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl"), policy=PolicySettings(dir=REPO / "policies"),
        api_principals=[ApiPrincipal.model_validate(p) for p in principals()],
    )  # fmt: skip
    async with ControlPlane.from_settings(settings) as plane:
        app = create_app(plane)
        made = {who: StockadeClient("http://stockade", TOKENS[who], principal=who, transport=httpx.ASGITransport(app))
                for who in ("agent-1", "agent-2", "oncall", "audit", "root")}  # fmt: skip
        yield made
        for client in made.values():
            await client.aclose()


async def test_the_sdk_runs_the_whole_flow_with_typed_results(clients: dict[str, StockadeClient]) -> None:
    agent, approver, auditor = clients["agent-1"], clients["oncall"], clients["audit"]
    assert (await agent.register(word_count)).name == "word_count"
    await clients["root"].register(DROP)
    session = await agent.open_session("agent-1", "alice@example.com", ["count my words"])
    counted = await agent.call(session, "word_count", {"text": "one two three"})
    assert (counted.status, counted.output) == ("completed", 3)
    assert (await agent.decide(session, "word_count", {"text": "x"})).outcome == "allow"
    held = await agent.call(session, "drop_table", {"t": "users"})
    assert held.status == "pending_approval"
    assert held.approval_id is not None
    [pending] = await approver.list_approvals(ApprovalStatus.PENDING)
    approved = await approver.approve(pending.id, "oncall", "OPS-7")
    assert (approved.status, approved.approver, approved.note) == (ApprovalStatus.APPROVED, "oncall", "OPS-7")
    assert (await agent.call(session, "drop_table", {"t": "users"}, approval_id=held.approval_id)).ok
    trail = await auditor.decision_trail(held.decision_id)
    assert trail[-1].kind == "execution"
    await agent.close_session(session)


async def test_the_sdk_raises_the_in_process_exceptions(clients: dict[str, StockadeClient]) -> None:
    agent = clients["agent-1"]
    await agent.register(word_count)
    session = await agent.open_session("agent-1", "alice@example.com")
    with pytest.raises(InvalidCall) as invalid:
        await agent.call(session, "word_count", {"text": 7})
    assert invalid.value.problems[0].field.startswith("args.text")
    with pytest.raises(ToolNotFound):
        await agent.call(session, "nope", {})
    with pytest.raises(SessionNotFound):
        await clients["agent-2"].call(session, "word_count", {"text": "x"})
    with pytest.raises(ApprovalError):
        await clients["oncall"].approve("a-unknown", "oncall")
    with pytest.raises(ApiError) as forbidden:
        await clients["oncall"].open_session("oncall", "alice")
    assert (forbidden.value.status, forbidden.value.code) == (403, "auth.forbidden")


def test_adapters_describe_tools_for_model_apis() -> None:
    schema = word_count["input_schema"]
    assert schema["required"] == ["text"]
    assert schema["properties"]["minimum"] == {"default": 0, "title": "Minimum", "type": "integer"}
    spec = ToolSpec.model_validate(word_count)
    assert spec == word_count.spec
    assert openai_tools([spec]) == [{"type": "function", "function": {
        "name": "word_count", "description": "Count the words in a text.", "parameters": schema}}]  # fmt: skip
    assert anthropic_tools([spec]) == [{"name": "word_count", "description": "Count the words in a text.",
                                        "input_schema": schema}]  # fmt: skip
    assert spec.executor.source.startswith("def word_count(text, minimum=0):")  # type: ignore[union-attr]


def test_the_sync_client_against_a_real_server(tmp_path: Path) -> None:
    env = {"STOCKADE_AUDIT__PATH": str(tmp_path / "audit.jsonl"), "STOCKADE_API_PRINCIPALS": json.dumps(principals()),
           "STOCKADE_LOG_LEVEL": "error"}  # fmt: skip
    with serve(env, tmp_path / "serve.log") as url, SyncStockadeClient(url, TOKENS["agent-1"]) as client:
        client.register(word_count)
        session = client.open_session("agent-1", "alice@example.com")
        assert client.call(session, "word_count", {"text": "a b"}).output == 2
        assert [t.name for t in client.list_tools()] == ["word_count"]


async def test_langchain_tools_call_through_stockade(clients: dict[str, StockadeClient]) -> None:
    agent = clients["agent-1"]
    await agent.register(word_count)
    await clients["root"].register(DROP)
    session = await agent.open_session("agent-1", "alice@example.com")
    tools = {t.name: t for t in langchain_tools(agent, session, await agent.list_tools())}
    assert await tools["word_count"].ainvoke({"text": "a b c"}) == "3"
    held = json.loads(await tools["drop_table"].ainvoke({"t": "users"}))
    assert (held["status"], held["reasons"]) == ("pending_approval", ["approval.high_risk"])
    assert tools["word_count"].args_schema == word_count["input_schema"]


async def test_the_sdk_endorses_an_output_as_an_approver_and_the_agent_cannot(
    clients: dict[str, StockadeClient],
) -> None:
    """'Pay the bill in this file': the human endorses the read's output; its account and amount
    then go through. The agent's own token may not endorse (it is what an injection steers)."""
    agent, approver = clients["agent-1"], clients["oncall"]
    await clients["root"].register({
        "name": "read_file", "description": "read a shared file", "risk": "low", "capabilities": ["reads_untrusted"],
        "input_schema": {"type": "object"}, "executor": {"kind": "external"}})  # fmt: skip
    await clients["root"].register({
        "name": "pay", "description": "pay", "risk": "medium", "capabilities": ["financial", "sends_external"],
        "destination_args": ["iban"], "amount_args": ["amount"], "executor": {"kind": "external"},
        "input_schema": {"type": "object", "properties": {"iban": {"type": "string"}, "amount": {"type": "number"}}},
    })  # fmt: skip
    session = await agent.open_session("agent-1", "alice@example.com", ["Pay the bill in bill.txt"])
    read = await agent.call(session, "read_file", {"name": "bill.txt"})
    await agent.report(session, read.call_id, {"text": "Pay 1,250.00 EUR to DE89 3704 0044 0532 0130 00"})
    payment = {"iban": "DE89370400440532013000", "amount": 1250}
    assert (await agent.call(session, "pay", payment)).status == "denied"
    with pytest.raises(ApiError) as forbidden:
        await agent.endorse(session, read.call_id, by="agent-1", note="pay the bill")
    assert forbidden.value.status == 403
    source = await approver.endorse(session, read.call_id, by="oncall", note="the user: pay the bill in bill.txt")
    assert source == f"untrusted:read_file:{read.call_id}"
    paid = await agent.call(session, "pay", payment)
    assert (paid.status, paid.reasons) == ("awaiting_report", [])
