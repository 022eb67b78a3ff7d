"""The SDK and framework adapters at their edges: a LangGraph node run again on every resume (each
call runs once, each held call gets its own approval), `sandboxed_tool` parameters the sandbox
could not pass, an async client used from more than one event loop, and policy's reason codes
over HTTP. Against the real HTTP API, policy and sandbox."""

from __future__ import annotations

import asyncio
import datetime
import enum
import gc
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, NewType

import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langgraph.types import Command
from pydantic import BaseModel
from typing_extensions import TypedDict

from router.audit import AuditFilter
from router.client import StockadeClient, sandboxed_tool
from router.client.adapters import _Gate, langchain_tools, run_sync
from router.errors import InvalidCall, InvalidToolSpec, ToolRefused
from router.tools import ToolSpec
from tests.router.test_api import TOKENS
from tests.router.test_frameworks import (
    PAGE,
    REQUEST,
    Stockade,
    graph,
    open_session,
    stockade,
)
from tests.router.test_frameworks import server as served_module_wide

__all__ = ["stockade"]  # the fixture, shared with tests/router/test_frameworks.py


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`stockade serve` as a process (test_frameworks'), for code on event loops of its own."""
    yield from served_module_wide.__wrapped__(tmp_path_factory)


def one_turn(*calls: tuple[str, dict[str, Any]]) -> GenericFakeChatModel:
    """A fake chat model that makes all these tool calls in one turn, then answers."""
    turn = AIMessage(content="", tool_calls=[{"name": n, "args": a, "id": f"c{i}"} for i, (n, a) in enumerate(calls)])
    return GenericFakeChatModel(messages=iter([turn, AIMessage(content="done")]))


async def executions(stockade: Stockade, tool: str) -> list[dict[str, Any]]:
    """The tool's runs in the sandbox, from the audit log: what each returned."""
    events = await stockade.plane.audit.query(AuditFilter(tool=tool, kind="execution"))
    return [json.loads(e.model_dump(mode="json")["result"]["stdout"])["result"] for e in events]


async def run_to_the_end(stockade: Stockade, app: Any, thread: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """Run the graph, granting in stockade and answering each pause with its approval_id."""
    state = await app.ainvoke({"messages": [HumanMessage(REQUEST)]}, thread)
    pauses = 0
    while state.get("__interrupt__") and pauses < 5:
        [interruption] = state["__interrupt__"]
        pauses += 1
        await stockade.approve(interruption.value["approval_id"])
        answer = {interruption.id: {"approval_id": interruption.value["approval_id"]}}
        state = await app.ainvoke(Command(resume=answer), thread)
    return state, pauses


async def test_two_held_calls_in_one_langgraph_turn_each_run_once_with_their_own_approval(
    stockade: Stockade,
) -> None:
    """The node runs again on each resume: the call approved first once came back to the model as
    ``approval.invalid`` ("used, not approved") although it had run."""
    model = one_turn(("drop_table", {"table": "users"}), ("drop_table", {"table": "orders"}))
    app = graph(model, langchain_tools(stockade.agent, stockade.session, stockade.specs))

    state, pauses = await run_to_the_end(stockade, app, {"configurable": {"thread_id": "t-two-held"}})

    assert pauses == 2  # LangGraph surfaces one interrupt of a node at a time
    said = {m.tool_call_id: (m.status, json.loads(str(m.content))) for m in state["messages"]
            if isinstance(m, ToolMessage)}  # fmt: skip
    assert {k: (status, body["dropped"]) for k, (status, body) in said.items()} == {
        "c0": ("success", "users"), "c1": ("success", "orders")}  # fmt: skip
    assert state["messages"][-1].content == "done"
    ran = await executions(stockade, "drop_table")
    assert sorted(e["dropped"] for e in ran) == ["orders", "users"]  # each exactly once
    assert await stockade.plane.audit.query(AuditFilter(tool="drop_table", kind="error")) == []


async def test_an_allowed_call_beside_a_held_one_runs_once_in_a_langgraph_turn(stockade: Stockade) -> None:
    """It once ran again each time the node did: a send_email beside a held call sent twice."""
    model = one_turn(("get_webpage", PAGE), ("drop_table", {"table": "users"}))
    app = graph(model, langchain_tools(stockade.agent, stockade.session, stockade.specs))

    state, pauses = await run_to_the_end(stockade, app, {"configurable": {"thread_id": "t-allowed"}})

    assert pauses == 1
    read, dropped = [m for m in state["messages"] if isinstance(m, ToolMessage)]
    assert (read.status, json.loads(str(read.content))["url"]) == ("success", PAGE["url"])
    assert (dropped.status, json.loads(str(dropped.content))["dropped"]) == ("success", "users")
    assert len(await executions(stockade, "get_webpage")) == 1
    assert len(await executions(stockade, "drop_table")) == 1
    assert [c["tool"] for c in stockade.transport.calls].count("get_webpage") == 1


async def test_a_held_call_refused_on_resume_stays_refused_while_its_neighbour_runs(stockade: Stockade) -> None:
    model = one_turn(("drop_table", {"table": "users"}), ("drop_table", {"table": "orders"}))
    app = graph(model, langchain_tools(stockade.agent, stockade.session, stockade.specs))
    thread = {"configurable": {"thread_id": "t-refuse-one"}}
    state = await app.ainvoke({"messages": [HumanMessage(REQUEST)]}, thread)
    answered: dict[str, str] = {}
    while state.get("__interrupt__"):
        [interruption] = state["__interrupt__"]
        value = interruption.value
        answered[value["args"]["table"]] = value["approval_id"]
        if value["args"]["table"] == "orders":
            await stockade.approve(value["approval_id"])
            answer: dict[str, Any] = {"approval_id": value["approval_id"]}
        else:
            answer = {"approved": False, "approval_id": value["approval_id"], "note": "not users"}
        state = await app.ainvoke(Command(resume={interruption.id: answer}), thread)

    said = {json.loads(m.content)["approval_id"] if m.status == "error" else json.loads(str(m.content))["dropped"]:
            m.status for m in state["messages"] if isinstance(m, ToolMessage)}  # fmt: skip
    assert said == {answered["users"]: "error", "orders": "success"}
    assert [e["dropped"] for e in await executions(stockade, "drop_table")] == ["orders"]


# --- sandboxed_tool ------------------------------------------------------------------------------


class Point(BaseModel):
    x: int
    y: int


class Color(enum.Enum):
    RED = "red"


class Window(TypedDict):
    start: str
    days: list[int]


def sum_point(p: Point) -> int:
    return p.x + p.y


def color_name(c: Color) -> str:
    return c.name


def year_of(d: datetime.date) -> int:
    return d.year


def first(pair: tuple[int, int]) -> int:
    return pair[0]


def grow(tags: set[str]) -> int:
    return len(tags | {"a"})


@pytest.mark.parametrize("function", [sum_point, color_name, year_of, first, grow])
def test_a_parameter_the_sandbox_would_pass_as_plain_json_is_refused_at_decoration(function: Any) -> None:
    """Each once registered and failed on every call: the sandbox passes JSON values, unconverted."""
    parameter = next(iter(function.__annotations__))
    with pytest.raises(InvalidToolSpec, match=rf"parameter '{parameter}' is typed .*plain JSON value"):
        sandboxed_tool(function)


def plain(text: str, n: int = 2, scale: float | None = None, tags: list[str] | None = None,
          weights: dict[str, float] | None = None, mode: Literal["a", "b"] = "a", window: Window | None = None,
          anything: Any = None) -> str:  # fmt: skip
    return text * n


UserId = NewType("UserId", str)


def read_only(names: Sequence[str], counts: Mapping[str, int], user: UserId, extra: object = None) -> int:
    return len(names) + len(counts) + len(user)


def test_read_only_collection_hints_and_new_types_register() -> None:
    """A JSON array is a Sequence, a JSON object a Mapping, a NewType's value its base type's: the
    first version of the check refused them, and tools that worked failed at import."""
    properties = sandboxed_tool(read_only).spec.input_schema["properties"]
    assert (properties["names"]["type"], properties["counts"]["type"], properties["user"]["type"]) == (
        "array", "object", "string")  # fmt: skip


def exits(x: int) -> int:
    if x < 0:
        exit(1)  # noqa: PLR1722  (the point: a name site adds)
    return x


def test_parameters_whose_json_is_their_value_register() -> None:
    tool = sandboxed_tool(plain)
    assert tool.spec.input_schema["additionalProperties"] is False
    assert set(tool.spec.input_schema["properties"]) == {"text", "n", "scale", "tags", "weights", "mode", "window",
                                                         "anything"}  # fmt: skip


def test_names_site_adds_to_builtins_are_refused_like_any_other_outside_name() -> None:
    """``exit``, ``help`` ... are not there in the sandbox, which runs Python without ``site``."""
    with pytest.raises(InvalidToolSpec, match="uses 'exit', defined outside it"):
        sandboxed_tool(exits)


def factorial_tool() -> Any:
    @sandboxed_tool(name="factorial")
    def factorial(n: int) -> int:
        return 1 if n <= 1 else n * factorial(n - 1)

    return factorial


async def test_a_recursive_tool_defined_in_a_function_runs_and_an_extra_argument_is_refused(
    stockade: Stockade,
) -> None:
    tool = factorial_tool()  # once refused: "uses 'factorial' from the function that defines it"
    await stockade.agent.register(tool)

    done = await stockade.agent.call(stockade.session, "factorial", {"n": 5})
    with pytest.raises(InvalidCall) as refused:
        await stockade.agent.call(stockade.session, "factorial", {"n": 5, "extra": 1})

    assert (done.status, done.output) == ("completed", 120)
    assert "extra" in str(refused.value)  # named, not a TypeError in the sandbox
    assert len(await executions(stockade, "factorial")) == 1


# --- the async client on other event loops, and errors over HTTP ---------------------------------------


# The connection left open on asyncio.run's loop cannot be closed once that loop is: it is dropped.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_async_client_works_from_another_event_loop_and_from_invoke(server: str) -> None:
    """``asyncio.run(setup())`` then ``tool.invoke``, then ``ainvoke`` on yet another loop: the
    client's connections of a closed loop once failed the run (``Event loop is closed``, or bound
    to a different event loop)."""
    session = open_session(server)
    client = StockadeClient(server, TOKENS["agent-1"])

    async def setup() -> list[ToolSpec]:
        return [t for t in await client.list_tools() if t.name == "get_webpage"]

    [tool] = langchain_tools(client, session, asyncio.run(setup()))
    call = {"type": "tool_call", "name": "get_webpage", "args": PAGE}
    try:
        invoked = tool.invoke({**call, "id": "sync"})
        awaited = asyncio.run(tool.ainvoke({**call, "id": "async"}))
    finally:
        run_sync(client.aclose())
        gc.collect()  # here, not in another test

    assert [(m.status, json.loads(str(m.content))["url"]) for m in (invoked, awaited)] == [
        ("success", PAGE["url"])] * 2  # fmt: skip


async def test_a_tool_policy_refuses_keeps_its_reason_codes_over_http(stockade: Stockade) -> None:
    spec = {"name": "leak", "description": "x", "risk": "low", "input_schema": {"type": "object"},
            "executor": {"kind": "python", "source": "def main():\n    return 1\n"},
            "sandbox": {"egress": [{"host": "pastebin.example", "port": 443}]}}  # fmt: skip
    async with StockadeClient("http://stockade", TOKENS["root"], transport=stockade.transport) as root:
        with pytest.raises(ToolRefused) as over_http:
            await root.register(spec)
    with pytest.raises(ToolRefused) as in_process:
        await stockade.plane.register(spec)

    assert over_http.value.reasons == in_process.value.reasons == ["egress.not_allowlisted"]


async def test_a_langgraph_rerun_cancelled_while_it_waits_neither_sends_the_call_again_nor_loses_it(
    stockade: Stockade,
) -> None:
    """A node's re-run waits for the same call still in flight; when that waiting re-run was
    cancelled, the cancellation once reached the running call: the re-run sent the call again
    (it ran twice) and the first run's answer was lost (InvalidStateError)."""
    gate = _Gate(stockade.agent, stockade.session)
    key = json.dumps(["t-cancelled", "tools:1", "c0"])
    first = asyncio.create_task(gate.call_once(key, "get_webpage", PAGE, None))
    await asyncio.sleep(0)  # it is running
    rerun = asyncio.create_task(gate.call_once(key, "get_webpage", PAGE, None))
    await asyncio.sleep(0)  # it waits for the first
    rerun.cancel()
    with pytest.raises(asyncio.CancelledError):
        await rerun
    assert (await first).status == "completed"
    assert len(await executions(stockade, "get_webpage")) == 1
    assert [c["tool"] for c in stockade.transport.calls] == ["get_webpage"]
