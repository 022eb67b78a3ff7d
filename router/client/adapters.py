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
import concurrent.futures
import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Generator, Mapping
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeAlias, TypeVar, cast

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
# The keyword the LangChain tools pass the tool call's id under to their own _run/_arun.
_CALL_ID = "_stockade_tool_call_id"
# How many LangGraph tool calls a gate remembers (outcome, held approval): more than any one
# graph step makes, and few enough to stay small in a long-lived process.
_REMEMBERED = 4096
_REMEMBERED_BYTES = 64 << 20  # of outcomes' text: tool outputs may be large


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

    LangGraph runs the whole node again on resume. In a graph the tools remember each call's
    outcome (its output or refusal) by its thread, task and ``tool_call_id`` (the last
    few thousand), so a call that already completed or was refused is not made again: an allowed
    call beside a held one runs once, and an approved call is not sent again without its approval.

    Several held calls in one turn: LangGraph's ``ToolNode`` runs them together and surfaces the
    first ``interrupt()`` only, so the graph pauses once for each held call, one after the other
    (grant them all in stockade at once if you like; each resume then answers one). Answer each
    with the ``approval_id`` its interrupt carries (``{interrupt.id: {"approval_id": ...}}``, or
    ``{"approved": False, "approval_id": ...}`` to refuse): LangGraph hands a node's answers to its
    interrupts in the order they are asked, which for calls running together is not fixed, and an
    answer naming another held call's approval is kept for that call. A bare ``True`` or ``False``
    goes to whichever held call asks first.

    Outside a graph, a held call raises ``ToolException`` naming the ``approval_id``; the same call
    made again after the grant runs.
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
            # The call's id, under a name of ours (the model's arguments are all in the dict).
            return (self._parse_input(tool_input, tool_call_id),), {_CALL_ID: tool_call_id}

        def _run(self, *given: Any, **options: Any) -> str:
            [args] = given
            call = _graph_call(options.get(_CALL_ID))
            return _drive_sync(_langchain_steps(gate, self.name, args, call), gate, call, self.name, args)

        async def _arun(self, *given: Any, **options: Any) -> str:
            [args] = given
            call = _graph_call(options.get(_CALL_ID))
            return await _drive(_langchain_steps(gate, self.name, args, call), gate, call, self.name, args)

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
        # LangGraph tool calls, by `_graph_call` key: what each came to, the approval each waits for;
        # answers LangGraph handed to another held call, by the approval_id they name.
        self._outcomes = _Recent[_Outcome](weigh=_Outcome.size)
        self._waiting = _Recent["ToolResult"]()
        self._answers = _Recent[object]()
        self._asked = _Recent[bool]()  # the approvals LangGraph calls here waited for, answered or not
        self._running: dict[str, concurrent.futures.Future[ToolResult]] = {}
        self._lock = threading.Lock()  # a synchronous graph runs its tools in threads

    def outcome(self, call: str) -> _Outcome | None:
        """What a LangGraph tool call came to, if it completed or was refused."""
        with self._lock:
            return self._outcomes.get(call)

    def settle(self, call: str, outcome: _Outcome) -> None:
        """Remember what a LangGraph tool call came to: the node's re-runs return it, not call again."""
        with self._lock:
            self._outcomes.put(call, outcome)
            self._waiting.pop(call)

    def waiting(self, call: str) -> ToolResult | None:
        """The result that held a LangGraph tool call, while it waits for a human."""
        with self._lock:
            return self._waiting.get(call)

    def wait(self, call: str, held: ToolResult) -> None:
        """Remember that a LangGraph tool call waits for ``held``'s approval."""
        with self._lock:
            self._waiting.put(call, held)
            self._asked.put(held.approval_id or "", True)

    def keep_answer(self, approval_id: str, answer: object) -> bool:
        """Keep a resume value LangGraph handed one held call for the other held call it names;
        False if no LangGraph call here waited for that approval."""
        with self._lock:
            if self._asked.get(approval_id) is None:
                return False
            self._answers.put(approval_id, answer)
            return True

    def take_answer(self, approval_id: str | None) -> tuple[object] | None:
        """The answer another held call kept for this approval, once."""
        with self._lock:
            found = self._answers.pop(approval_id or "")
        return None if found is None else (found,)

    def held(self, tool: str, args: Mapping[str, Any]) -> ToolResult | None:
        """The result that held this exact call, while it waits for its approval."""
        return self._held.get(_key(tool, args))

    def forget(self, tool: str, args: Mapping[str, Any]) -> None:
        """A human refused this call in the framework: the same call made again is stockade's to
        decide, not a pause from memory."""
        self._held.pop(_key(tool, args), None)

    async def call_once(
        self, call: str | None, tool: str, args: Mapping[str, Any], approval_id: str | None
    ) -> ToolResult:
        """`call` for the LangGraph tool call ``call`` (None: outside a graph). LangGraph does not wait
        for a node's other tool calls once one pauses it, and may run the node again before they
        are done: that run waits for the same call's answer rather than send it again.

        Raises:
            StockadeError: as `call`.
        """
        if call is None:
            return await self.call(tool, args, approval_id)
        key = json.dumps([call, approval_id])
        with self._lock:
            running = self._running.get(key)
            if running is None:
                mine: concurrent.futures.Future[ToolResult] = concurrent.futures.Future()
                mine.set_running_or_notify_cancel()  # only its own outcome ends it: no waiter cancels it
                self._running[key] = mine
        if running is not None:
            try:
                # Shielded: a waiter's cancellation is its own, never the running call's.
                return await asyncio.shield(asyncio.wrap_future(running))
            except _Abandoned:  # the run it waited for was cancelled before its answer came
                return await self.call(tool, args, approval_id)
        try:
            result = await self.call(tool, args, approval_id)
        except Exception as exc:
            mine.set_exception(exc)
            raise
        except BaseException:
            mine.set_exception(_Abandoned())
            raise
        else:
            mine.set_result(result)
        finally:
            with self._lock:
                self._running.pop(key, None)
        return result

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


def _langchain_steps(
    gate: _Gate, tool: str, args: dict[str, Any], call: str | None
) -> Generator[str | None, ToolResult, str]:
    """One LangChain tool call, as steps for `_drive` and `_drive_sync`: yields the approval_id to
    call with (None: the remembered one, if any), is sent the result (or thrown the `StockadeError`);
    returns the tool's content. Framework calls (``interrupt``) stay in the caller's thread and
    context. In a LangGraph node, a call's outcome is remembered (`_Gate.settle`) and replayed when
    the node runs again. ``call``: the call's key in a LangGraph node (`_graph_call`), or None.

    Raises:
        ToolException: the call did not complete; the model reads why.
        GraphInterrupt: (from ``interrupt``) the graph pauses for a human.
    """
    from langchain_core.tools import ToolException  # noqa: PLC0415  (an optional extra)

    if call is None:
        return (yield from _langchain_call(gate, tool, args, None))
    done = gate.outcome(call)
    if done is not None:
        return done.replay()
    try:
        content = yield from _langchain_call(gate, tool, args, call)
    except ToolException as exc:
        gate.settle(call, _Outcome(refusal=str(exc)))
        raise
    gate.settle(call, _Outcome(content=content))
    return content


def _langchain_call(
    gate: _Gate, tool: str, args: dict[str, Any], call: str | None
) -> Generator[str | None, ToolResult, str]:
    """`_langchain_steps` without the memory of outcomes; ``call``: the LangGraph call's key, or
    None outside a graph."""
    from langchain_core.tools import ToolException  # noqa: PLC0415  (an optional extra)

    # A resumed node: the human's answer decides.
    held = (gate.waiting(call) or gate.held(tool, args)) if call is not None else None
    if held is None:
        result = yield from _ask(None)
        if result.status != "pending_approval":
            return _content(result)
        held = result
    if call is None:
        raise ToolException(json.dumps(_said(held)))
    gate.wait(call, held)
    answer = _answer(gate, held, _approval_request(gate, tool, args, held))
    approval_id = _granted(answer, held)
    if approval_id is None:
        gate.forget(tool, args)
        note = answer.get("note", "") if isinstance(answer, Mapping) else ""
        raise ToolException(json.dumps({"status": "refused", "approval_id": held.approval_id,
                                        "message": f"a human refused this call. {note}".strip()}))  # fmt: skip
    return _content((yield from _ask(approval_id)))


def _ask(approval_id: str | None) -> Generator[str | None, ToolResult, ToolResult]:
    """One call to stockade, made by the driver: the result, or a refusal the model reads.

    Raises:
        ToolException: stockade refused the call in a way the model can act on (`_MODEL_ERRORS`).
    """
    from langchain_core.tools import ToolException  # noqa: PLC0415  (an optional extra)

    try:
        return (yield approval_id)
    except StockadeError as exc:
        if exc.code in _MODEL_ERRORS:
            raise ToolException(_refused(exc)) from exc
        raise


def _answer(gate: _Gate, held: ToolResult, request: dict[str, Any]) -> object:
    """The human's answer to a held call in a LangGraph node (``interrupt``). LangGraph hands the
    node's answers to its ``interrupt()`` calls in the order they are made, which for tool calls
    running together is not fixed: an answer that names another held call's approval is kept for
    that call, and this one asks again."""
    from langgraph.types import interrupt  # noqa: PLC0415  (in a graph, langgraph is there)

    while True:
        kept = gate.take_answer(held.approval_id)
        if kept is not None:
            return kept[0]
        answer = interrupt(request)
        named = _named(answer)
        if named is None or named == held.approval_id or not gate.keep_answer(named, answer):
            return answer


async def _drive(
    steps: Generator[str | None, ToolResult, str], gate: _Gate, call: str | None, tool: str, args: dict[str, Any]
) -> str:
    try:
        approval_id = next(steps)
        while True:
            try:
                result = await gate.call_once(call, tool, args, approval_id)
            except StockadeError as exc:
                approval_id = steps.throw(exc)
            else:
                approval_id = steps.send(result)
    except StopIteration as done:
        return cast(str, done.value)


def _drive_sync(
    steps: Generator[str | None, ToolResult, str], gate: _Gate, call: str | None, tool: str, args: dict[str, Any]
) -> str:
    try:
        approval_id = next(steps)
        while True:
            try:
                result = run_sync(gate.call_once(call, tool, args, approval_id))
            except StockadeError as exc:
                approval_id = steps.throw(exc)
            else:
                approval_id = steps.send(result)
    except StopIteration as done:
        return cast(str, done.value)


class _Outcome(NamedTuple):
    """What a LangChain tool call came to: its content, or the refusal its ``ToolException`` says."""

    content: str | None = None
    refusal: str | None = None

    def size(self) -> int:
        """About how many bytes it holds."""
        return len(self.content or "") + len(self.refusal or "")

    def replay(self) -> str:
        """The content again, or the same refusal.

        Raises:
            ToolException: the call did not complete.
        """
        from langchain_core.tools import ToolException  # noqa: PLC0415  (an optional extra)

        if self.refusal is not None:
            raise ToolException(self.refusal)
        return self.content or ""


class _Abandoned(Exception):
    """A LangGraph tool call's run was cancelled before its answer came (`_Gate.call_once`)."""


class _Recent(Generic[T]):
    """The last `_REMEMBERED` entries put, by key, weighing `_REMEMBERED_BYTES` at most as
    ``weigh`` weighs them (the oldest go first; the newest stays, whatever it weighs)."""

    def __init__(self, weigh: Callable[[T], int] | None = None) -> None:
        self._entries: OrderedDict[str, tuple[T, int]] = OrderedDict()
        self._weigh = weigh
        self._weight = 0

    def get(self, key: str) -> T | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def put(self, key: str, value: T) -> None:
        self.pop(key)
        weight = 0 if self._weigh is None else self._weigh(value)
        self._entries[key] = (value, weight)
        self._weight += weight
        while len(self._entries) > 1 and (len(self._entries) > _REMEMBERED or self._weight > _REMEMBERED_BYTES):
            _, (_, dropped) = self._entries.popitem(last=False)
            self._weight -= dropped

    def pop(self, key: str) -> T | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._weight -= entry[1]
        return entry[0]


def _graph_call(call_id: str | None) -> str | None:
    """The key of a tool call made in a LangGraph node: its thread, task and ``tool_call_id``
    (stable across the node's re-runs, never another step's call); None outside a graph."""
    if call_id is None or not _in_langgraph():
        return None
    from langgraph.config import get_config  # noqa: PLC0415  (in a graph, langgraph is there)

    configurable = get_config().get("configurable", {})
    return json.dumps([str(configurable.get("thread_id")), str(configurable.get("checkpoint_ns")), call_id])


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
        if answer.get("approved") is False:
            return None
        if isinstance(answer.get("approval_id"), str):
            return str(answer["approval_id"])
        return held.approval_id if answer.get("approved") is True else None
    return held.approval_id if answer is True else None


def _named(answer: object) -> str | None:
    """The approval_id a LangGraph resume value names, if any."""
    if isinstance(answer, str):
        return answer
    if isinstance(answer, Mapping) and isinstance(answer.get("approval_id"), str):
        return str(answer["approval_id"])
    return None


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
