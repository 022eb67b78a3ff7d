"""Adapters that hand registered tools to model APIs and agent frameworks; every call goes
through stockade.

`openai_tools` and `anthropic_tools` only describe the tools. `langchain_tools`,
`pydantic_ai_toolset` and `openai_agents_tools` make each tool a call through stockade in one
session, with the agent's client, and map the call's outcome onto the framework:

=================  =============================  ==========================  ==========================
outcome            LangChain / LangGraph          pydantic-ai                 OpenAI Agents SDK
=================  =============================  ==========================  ==========================
completed          the output                     the output                  the output
denied, error,     ``ToolException``: an error    ``ToolFailed``: a failed    the refusal as the
tool failed        ``ToolMessage``                return, no retry used       output text
invalid arguments  ``ToolException``              ``ModelRetry``              the refusal as text
held               ``interrupt()`` in a graph,    ``ApprovalRequired``        the SDK's approval
                   else a ``ToolException``       (a deferred call)           interruption
=================  =============================  ==========================  ==========================

A refusal is JSON, as over MCP: ``status``, ``reasons`` (reason codes), ``decision_id``, and for a
held call the ``approval_id``; a refusal raised by stockade (bad arguments, unknown tool, an
approval that does not fit) is ``{"status": "refused", "reasons": [code], "message": ...}``. Other
errors (no session, a bad token, the server unreachable) are the application's: they propagate.

Held calls: stockade's approval is the one that counts, and the agent never grants it. A call
policy holds gets an approval in stockade at once; the adapter pauses the run with the framework's
own primitive, carrying the ``approval_id`` (with the tool, arguments, reasons and decision_id). A
human grants it in stockade, as an approver principal with their own credentials (``stockade
approvals approve``, the HTTP API with an approver's token, `StockadeClient.approve`), and the
application then resumes the run the framework's way; the adapter calls again with the
``approval_id``, and stockade runs the call only if that approval was granted for exactly this
call (tool, arguments, session). Resuming without the grant fails closed: the model is told the
approval is not granted. The process that runs the agent holds no approver credential.

Each adapter remembers, by tool and arguments, the calls it saw held; the same call made again
passes their ``approval_id`` (so a plain retry works after a grant, and a call already waiting is
not held twice). That memory is the process's: a run resumed in another process carries the id
itself (a LangGraph resume value, pydantic-ai's ``DeferredToolResults.metadata``). It never stands
in for stockade after a human's refusal in the framework: a call pydantic-ai or the OpenAI Agents
SDK has not approved is asked of stockade every time, and a call refused on a LangGraph resume is
forgotten; stockade then holds it again under the approval it waits for, runs it once granted, or
refuses it.

Every argument reaches stockade under the name the model gave it, whatever the name: none is
taken for a framework's own parameter (LangChain's ``config``, ``run_manager``, ``callbacks``;
pydantic-ai's ``ctx``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections.abc import Coroutine, Generator, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast

from router.errors import StockadeError

if TYPE_CHECKING:
    from agents import FunctionTool, RunContextWrapper, Tool, ToolApprovalItem
    from agents.tool_context import ToolContext
    from langchain_core.tools import BaseTool
    from pydantic_ai import RunContext
    from pydantic_ai import Tool as PydanticAITool
    from pydantic_ai.toolsets import FunctionToolset

    from router.client import StockadeClient, SyncStockadeClient
    from router.results import DecisionResult, ToolResult
    from router.wire import ToolSpec

    Client: TypeAlias = StockadeClient | SyncStockadeClient

T = TypeVar("T")

# Refusals the model can act on (fix the arguments, pick another tool, wait for a human); any other
# StockadeError is the application's to handle.
_MODEL_ERRORS = frozenset({"call.invalid", "tool.not_found", "approval.invalid"})
_NEXT = "a human must approve this exact call in stockade; then call again with the same arguments"


def openai_tools(specs: list[ToolSpec]) -> list[dict[str, Any]]:
    """The tools as OpenAI function-calling definitions (Chat Completions ``tools``)."""
    return [{"type": "function", "function": {"name": s.name, "description": s.description,
                                              "parameters": s.input_schema}} for s in specs]  # fmt: skip


def anthropic_tools(specs: list[ToolSpec]) -> list[dict[str, Any]]:
    """The tools as Anthropic Messages API tool definitions."""
    return [{"name": s.name, "description": s.description, "input_schema": s.input_schema} for s in specs]


def langchain_tools(client: Client, session_id: str, specs: list[ToolSpec]) -> list[BaseTool]:
    """The tools as LangChain tools (``BaseTool``s) whose every call goes through stockade in
    ``session_id`` (the ``langchain`` extra).

    Both ``invoke`` and ``ainvoke`` work, with either client. For ``invoke`` (synchronous code,
    no event loop running in the thread), an async `StockadeClient`'s calls run on the adapters'
    own event loop thread (`run_sync`): keep that client for the tools, and close it with
    ``run_sync(client.aclose())``; a `SyncStockadeClient` needs none of that. In async code, use
    ``ainvoke``.

    A denial, error or bad call raises ``ToolException`` (``handle_tool_error`` is set): invoked
    with a tool call, the model gets a ``ToolMessage`` with ``status="error"`` and the refusal as
    its content. A held call, inside a LangGraph graph (with a checkpointer), calls ``interrupt()``
    with ``{"kind": "stockade.approval", "approval_id", "decision_id", "session_id", "tool",
    "args", "reasons"}``: the graph pauses. Once a human granted the approval in stockade, resume
    with ``Command(resume=...)``:

    - the ``approval_id`` (a string, or ``{"approval_id": ...}``): the call runs with it;
    - ``True`` or ``{"approved": True}``: the same, with the approval this call is waiting for;
    - anything else (``False``, ``{"approved": False, "note": ...}``): a human refused; the model
      gets an error ``ToolMessage`` saying so, and nothing runs.

    LangGraph runs the node again on resume, so a node that makes several tool calls makes the
    others again too: stockade decides and audits each. Outside a graph, a held call raises
    ``ToolException`` naming the ``approval_id``; the same call made again after the grant runs.
    """
    from langchain_core.tools import BaseTool  # noqa: PLC0415  (an optional extra)

    gate = _Gate(client, session_id)

    class StockadeTool(BaseTool):
        """A tool stockade runs, as LangChain's: it is handed the model's arguments whole."""

        def _to_args_and_kwargs(
            self, tool_input: str | dict[str, Any], tool_call_id: str | None
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            # LangChain would spread the arguments as keywords beside its own (config, run_manager,
            # callbacks): an argument so named would be taken for LangChain's, or dropped. One dict,
            # passed positionally, keeps every name as the model gave it.
            return (self._parse_input(tool_input, tool_call_id),), {}

        def _run(self, *given: Any, **_: Any) -> str:
            [args] = given
            return _drive_sync(_langchain_steps(gate, self.name, args), gate, self.name, args)

        async def _arun(self, *given: Any, **_: Any) -> str:
            [args] = given
            return await _drive(_langchain_steps(gate, self.name, args), gate, self.name, args)

    return [
        StockadeTool(
            name=spec.name, description=spec.description, args_schema=spec.input_schema, handle_tool_error=True
        )
        for spec in _sandboxed(specs)
    ]


def pydantic_ai_toolset(client: Client, session_id: str, specs: list[ToolSpec]) -> FunctionToolset[Any]:
    """The tools as a pydantic-ai ``FunctionToolset`` whose every call goes through stockade in
    ``session_id`` (the ``pydantic-ai`` extra). Give the agent ``DeferredToolRequests`` among its
    output types, for held calls.

    A denial, error or unfit approval raises ``ToolFailed``: the model sees a failed tool return and
    the run goes on, using none of the tool's retries (pydantic-ai's retries would end the run after
    a few denials, and asking again does not change a denial). Only arguments stockade rejects raise
    ``ModelRetry``: fixing them is what a retry is for.

    A held call raises ``ApprovalRequired`` with metadata ``{"approval_id", "decision_id",
    "session_id", "tool", "args", "reasons"}``: the run ends with ``DeferredToolRequests``. Once a
    human granted the approval in stockade, run again with ``DeferredToolResults(approvals={id:
    True}, metadata=requests.metadata)``: the tool is called with ``ctx.tool_call_approved`` and
    passes the ``approval_id`` (from that metadata, else from this toolset's memory). Approving in
    pydantic-ai without the grant in stockade gives the model a failed return, and nothing runs; a
    ``ToolDenied`` never reaches the tool (the same call made again is asked of stockade anew).
    """
    from pydantic_ai import ApprovalRequired, ModelRetry, Tool, ToolFailed  # noqa: PLC0415  (an optional extra)
    from pydantic_ai.toolsets import FunctionToolset  # noqa: PLC0415

    gate = _Gate(client, session_id)

    def bind(spec: ToolSpec) -> PydanticAITool[Any]:
        # ctx is positional-only: an argument named ctx is the model's, in args.
        async def run(ctx: RunContext[Any], /, **args: Any) -> str:
            approval_id = None
            if ctx.tool_call_approved:
                metadata = ctx.tool_call_metadata
                if isinstance(metadata, Mapping) and isinstance(metadata.get("approval_id"), str):
                    approval_id = metadata["approval_id"]
            try:
                # Not approved in pydantic-ai: stockade decides afresh (a human may have refused the
                # last deferral with ToolDenied, which never reaches this tool).
                result = await gate.call(spec.name, args, approval_id, recall=ctx.tool_call_approved)
            except StockadeError as exc:
                if exc.code == "call.invalid":
                    raise ModelRetry(_refused(exc)) from exc
                if exc.code in _MODEL_ERRORS:
                    raise ToolFailed(_refused(exc)) from exc
                raise
            if result.status == "pending_approval" and not ctx.tool_call_approved:
                raise ApprovalRequired(metadata=_approval_request(gate, spec.name, args, result))
            if not result.ok:
                raise ToolFailed(json.dumps(_said(result)))
            return _output(result)

        return Tool.from_schema(run, name=spec.name, description=spec.description, json_schema=spec.input_schema,
                                takes_ctx=True)  # fmt: skip

    return FunctionToolset([bind(spec) for spec in _sandboxed(specs)])


class OpenAIAgentsTools(list["Tool"]):
    """The tools of `openai_agents_tools` (a list, for ``Agent(tools=...)``), and the stockade
    approval behind each of the run's approval interruptions."""

    def __init__(self, tools: list[Tool], gate: _Gate) -> None:
        super().__init__(tools)
        self._gate = gate

    def held(self, item: ToolApprovalItem) -> ToolResult | None:
        """The held call behind an interruption (``approval_id``, ``reasons``, ``decision_id``),
        or None if these tools did not hold it."""
        args = _json_object(item.arguments)
        if item.tool_name is None or args is None:
            return None
        return self._gate.held(item.tool_name, args)


def openai_agents_tools(client: Client, session_id: str, specs: list[ToolSpec]) -> OpenAIAgentsTools:
    """The tools as OpenAI Agents SDK ``FunctionTool``s whose every call goes through stockade in
    ``session_id`` (the ``openai-agents`` extra).

    Each tool's ``needs_approval`` asks stockade (``decide``: nothing runs). A call policy would
    hold is made at once, so that stockade holds it with an approval, and the run stops with the
    SDK's approval interruption (``result.interruptions``); `OpenAIAgentsTools.held` gives the
    ``approval_id`` behind an interruption. Once a human granted it in stockade, approve the item
    in the SDK (``state.approve(item)``) and run again from the state: the tool calls with the
    ``approval_id``. ``state.reject(item)`` gives the model the SDK's rejection, and nothing runs;
    approving in the SDK without the grant in stockade gives the model the refusal.

    A denial, error or bad call is the tool's output: the refusal (the Responses API has no error
    flag for a function's output), and the run goes on.
    """
    from agents import FunctionTool  # noqa: PLC0415  (an optional extra)

    gate = _Gate(client, session_id)
    # Calls that ran while needs_approval held them (policy changed between decide and call), by call_id.
    ran: dict[str, ToolResult] = {}

    def bind(spec: ToolSpec) -> FunctionTool:
        # Asked only of a call the SDK has neither approved nor rejected: stockade decides it afresh
        # (a human may have rejected the same call before, in the SDK, which stockade never saw).
        async def needs_approval(_ctx: RunContextWrapper[Any], args: dict[str, Any], call_id: str) -> bool:
            try:
                if (await gate.decide(spec.name, args)).outcome != "require_approval":
                    return False
                # Stockade holds it (again, under the approval it already waits for), or runs it if granted.
                result = await gate.call(spec.name, args, recall=False)
            except StockadeError as exc:
                if exc.code in _MODEL_ERRORS:
                    return False  # the call itself tells the model
                raise
            if result.status == "pending_approval":
                return True
            ran[call_id] = result
            return False

        async def invoke(ctx: ToolContext[Any], raw_args: str) -> str:
            args = _json_object(raw_args)
            if args is None:
                return json.dumps({"status": "refused", "reasons": ["call.invalid"],
                                   "message": "the arguments must be a JSON object"})  # fmt: skip
            result = ran.pop(ctx.tool_call_id, None)
            if result is None:
                try:
                    result = await gate.call(spec.name, args)
                except StockadeError as exc:
                    if exc.code in _MODEL_ERRORS:
                        return _refused(exc)
                    raise
            return _output(result) if result.ok else json.dumps(_said(result))

        return FunctionTool(
            name=spec.name, description=spec.description, params_json_schema=spec.input_schema,
            on_invoke_tool=invoke, strict_json_schema=False, needs_approval=needs_approval,
        )  # fmt: skip

    return OpenAIAgentsTools([bind(spec) for spec in _sandboxed(specs)], gate)


class _Gate:
    """One adapter's calls in one stockade session. Remembers the calls held for approval, by tool
    and arguments, so that the same call made again passes its ``approval_id``."""

    def __init__(self, client: Client, session_id: str) -> None:
        self.client = client
        self.session_id = session_id
        self._held: dict[str, ToolResult] = {}

    def held(self, tool: str, args: Mapping[str, Any]) -> ToolResult | None:
        """The result that held this exact call, while it waits for its approval."""
        return self._held.get(_key(tool, args))

    def forget(self, tool: str, args: Mapping[str, Any]) -> None:
        """A human refused this call in the framework: the same call made again is stockade's to
        decide, not a pause from memory."""
        self._held.pop(_key(tool, args), None)

    async def decide(self, tool: str, args: Mapping[str, Any]) -> DecisionResult:
        from router.client import SyncStockadeClient  # noqa: PLC0415  (the package imports this module)

        if isinstance(self.client, SyncStockadeClient):
            return await asyncio.to_thread(self.client.decide, self.session_id, tool, dict(args))
        return await self.client.decide(self.session_id, tool, dict(args))

    async def call(
        self, tool: str, args: Mapping[str, Any], approval_id: str | None = None, *, recall: bool = True
    ) -> ToolResult:
        """Call ``tool``; without ``approval_id``, with the approval the same call was held for
        (``recall``), else with none: stockade then finds the approval last asked for this exact
        call itself (waiting: held again under it; granted: redeemed; refused: refused).

        Raises:
            StockadeError: as `StockadeClient.call` (``approval.invalid``: the approval is not granted
                for this call; unless it is still pending, the next try is held anew).
        """
        from router.client import SyncStockadeClient  # noqa: PLC0415  (the package imports this module)

        key = _key(tool, args)
        held = self._held.get(key)
        if approval_id is None and held is not None and recall:
            approval_id = held.approval_id
        try:
            if isinstance(self.client, SyncStockadeClient):
                result = await asyncio.to_thread(self.client.call, self.session_id, tool, dict(args),
                                                 approval_id=approval_id)  # fmt: skip
            else:
                result = await self.client.call(self.session_id, tool, dict(args), approval_id=approval_id)
        except StockadeError as exc:
            if exc.code == "approval.invalid" and "is pending" not in str(exc):
                self._held.pop(key, None)  # denied, expired, used, or not this call's
            raise
        if result.status == "pending_approval":
            self._held[key] = result
        else:
            self._held.pop(key, None)
        return result


def _langchain_steps(gate: _Gate, tool: str, args: dict[str, Any]) -> Generator[str | None, ToolResult, str]:
    """One LangChain tool call, as steps for `_drive` and `_drive_sync`: yields the approval_id to
    call with (None: the remembered one, if any), is sent the result; returns the tool's content.
    Framework calls (``interrupt``) stay in the caller's thread and context.

    Raises:
        ToolException: the call did not complete; the model reads why.
        GraphInterrupt: (from ``interrupt``) the graph pauses for a human.
    """
    from langchain_core.tools import ToolException  # noqa: PLC0415  (an optional extra)

    in_graph = _in_langgraph()
    held = gate.held(tool, args) if in_graph else None  # a resumed node: the human's answer decides
    if held is None:
        result = yield None
        if result.status != "pending_approval":
            return _content(result)
        held = result
    if not in_graph:
        raise ToolException(json.dumps(_said(held)))
    from langgraph.types import interrupt  # noqa: PLC0415  (in a graph, langgraph is there)

    answer = interrupt(_approval_request(gate, tool, args, held))
    approval_id = _granted(answer, held)
    if approval_id is None:
        gate.forget(tool, args)
        note = answer.get("note", "") if isinstance(answer, Mapping) else ""
        raise ToolException(json.dumps({"status": "refused", "approval_id": held.approval_id,
                                        "message": f"a human refused this call. {note}".strip()}))  # fmt: skip
    return _content((yield approval_id))


async def _drive(steps: Generator[str | None, ToolResult, str], gate: _Gate, tool: str, args: dict[str, Any]) -> str:
    try:
        approval_id = next(steps)
        while True:
            approval_id = steps.send(await _langchain_call(gate, tool, args, approval_id))
    except StopIteration as done:
        return cast(str, done.value)


def _drive_sync(steps: Generator[str | None, ToolResult, str], gate: _Gate, tool: str, args: dict[str, Any]) -> str:
    try:
        approval_id = next(steps)
        while True:
            approval_id = steps.send(run_sync(_langchain_call(gate, tool, args, approval_id)))
    except StopIteration as done:
        return cast(str, done.value)


async def _langchain_call(gate: _Gate, tool: str, args: dict[str, Any], approval_id: str | None) -> ToolResult:
    from langchain_core.tools import ToolException  # noqa: PLC0415  (an optional extra)

    try:
        return await gate.call(tool, args, approval_id)
    except StockadeError as exc:
        if exc.code in _MODEL_ERRORS:
            raise ToolException(_refused(exc)) from exc
        raise


def _content(result: ToolResult) -> str:
    """A LangChain tool's content for a result that did not wait for approval.

    Raises:
        ToolException: it did not complete.
    """
    from langchain_core.tools import ToolException  # noqa: PLC0415  (an optional extra)

    if not result.ok:
        raise ToolException(json.dumps(_said(result)))
    return _output(result)


def _in_langgraph() -> bool:
    """Whether this runs inside a LangGraph graph's node, where ``interrupt()`` pauses the graph."""
    try:
        from langgraph.runtime import get_runtime  # noqa: PLC0415  (an optional extra)
    except ImportError:
        return False
    try:
        return get_runtime() is not None
    except (RuntimeError, KeyError):  # outside any runnable, or a runnable outside a graph
        return False


def _granted(answer: object, held: ToolResult) -> str | None:
    """The approval_id a LangGraph resume value releases the held call with, or None: refused."""
    if isinstance(answer, str):
        return answer
    if isinstance(answer, Mapping):
        if isinstance(answer.get("approval_id"), str):
            return str(answer["approval_id"])
        return held.approval_id if answer.get("approved") is True else None
    return held.approval_id if answer is True else None


def _approval_request(gate: _Gate, tool: str, args: Mapping[str, Any], held: ToolResult) -> dict[str, Any]:
    """What a framework's pause carries to the human: what to approve in stockade, and why."""
    return {"kind": "stockade.approval", "approval_id": held.approval_id, "decision_id": held.decision_id,
            "session_id": gate.session_id, "tool": tool, "args": dict(args), "reasons": held.reasons}  # fmt: skip


def _said(result: ToolResult) -> dict[str, Any]:
    """What the model is told of a call that did not complete (the same as over MCP)."""
    said: dict[str, Any] = {"status": result.status, "reasons": result.reasons, "decision_id": result.decision_id}
    if result.approval_id:
        said |= {"approval_id": result.approval_id, "next": _NEXT}
    if result.status == "completed":  # it ran, and failed (timeout, non-zero exit, OOM)
        said |= {"verdict": result.verdict, "stderr": result.stderr[-2000:]}
    return said


def _refused(exc: StockadeError) -> str:
    return json.dumps({"status": "refused", "reasons": [exc.code], "message": str(exc)})


def _output(result: ToolResult) -> str:
    body = result.output if result.output is not None else result.stdout
    return body if isinstance(body, str) else json.dumps(body)


def _key(tool: str, args: Mapping[str, Any]) -> str:
    return json.dumps([tool, args], sort_keys=True, separators=(",", ":"), default=str)


def _json_object(raw: str | None) -> dict[str, Any] | None:
    try:
        value = json.loads(raw or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _sandboxed(specs: list[ToolSpec]) -> list[ToolSpec]:
    """``specs``, each one a tool stockade runs.

    Raises:
        ValueError: an ``external`` tool: the application runs it and reports its output
            (`StockadeClient.report`); these adapters only call.
    """
    external = [s.name for s in specs if s.executor.kind == "external"]
    if external:
        raise ValueError(f"{', '.join(external)}: external tools are run by the application, which reports "
                         "their output (StockadeClient.report); give the adapters the tools stockade runs")  # fmt: skip
    return specs


_loop_lock = threading.Lock()


@functools.cache
def _loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="stockade-adapters", daemon=True).start()
    return loop


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` from synchronous code on the adapters' own event loop thread, where the
    LangChain tools run an async client's calls for ``invoke`` (one loop for the process: a client's
    connections must stay on the loop that opened them). Synchronous code closes such a client with
    ``run_sync(client.aclose())``."""
    with _loop_lock:
        loop = _loop()
    return asyncio.run_coroutine_threadsafe(coroutine, loop).result()
