"""stockade as an MCP server (the ``mcp`` SDK's low-level `Server`), over stdio or streamable HTTP.

Each MCP connection is one agent task: it gets its own stockade session, opened (under a lock)
on its first request, for the agent and principal the server was started with, or, over HTTP
with bearer tokens, for the agent the token authenticated (`require_bearer`). Over HTTP a
connection is an MCP session (``Mcp-Session-Id``, handshake-era clients: its stockade session is
closed when the SDK ends the MCP session, on the client's DELETE, after the SDK's idle timeout
with no request in flight and no stream open, or at shutdown) or, for stateless 2026-07-28
clients, the bearer token (one session per agent token for the server's life). The session is
renewed in the background while its connection lasts, however long it idles, and is never
silently replaced: if the store loses it, every call says so, because a fresh session would have
forgotten the untrusted content the model still holds in its context.

``tools/list`` shows the registered tools policy could allow now, with annotations taken from
their capabilities and risk; ``external`` tools are not served (no MCP client can report their
output). Each ``tools/call`` goes through the full pipeline. Denials, held calls and errors come
back as tool results with ``is_error`` set, naming the reason codes and the ``decision_id``,
never as protocol errors: the model can read them. Every refusal is audited: a call the pipeline
refuses by the pipeline, one refused before it (an external tool, a lost session) by
`ControlPlane.record_refusal`.

A held call is completed without anyone carrying an approval id: when the client supports
elicitation the server asks the human in the client ("allow send_email to bob@…?"); the answer
is recorded as the approval's decision (approver: the session's principal, through the named
client; a decline is a no) and the call goes on, or is refused; a dismissal leaves it pending.
Without elicitation, a human approves out of band (``stockade approvals``) and the model calls
again with the same arguments: the router redeems the granted approval.

Every JSON-RPC error a client is sent (a message that is not JSON-RPC, an unknown method, bad
parameters) is audited as a refusal too, over either transport: `audit_requests` (or
`require_bearer`) over HTTP, `stdio_refusals` over stdio.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import mcp_types as types
import structlog
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.connection import Connection
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.approvals import Approval, ApprovalError
from router.control import VERSION, ControlPlane, session_refusals_recorded_by_caller
from router.errors import InvalidCall, SessionNotFound, StockadeError, StoreError, ToolNotFound
from router.interfaces import bearer
from router.interfaces.mcp_stdio import Refused, RequestId
from router.results import ToolResult
from router.text import encodable, json_escape
from router.tools import ExternalExecutor, ToolSpec

log = structlog.get_logger(__name__)

_STDIO = "stdio"
_MAX_CLOSED = 100_000
_SHOWN_VALUE = 300  # characters of an argument value the human is shown (the arguments that matter: all)
_SHOWN_NAME = 64  # characters of an argument name the human is shown
_MAX_QUESTION = 8000
# Characters the human is never shown as themselves: they break a line (a forged "Why:" line),
# hide or reorder text (zero-width, bidi overrides), or render as nothing anyone can check
# (private use, surrogates, unassigned). With every whitespace but the ASCII space, they are shown
# as JSON escapes.
_UNSHOWN = frozenset({"Cc", "Cf", "Zl", "Zp", "Co", "Cs", "Cn"})
_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})
_ELICIT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "approve": {"type": "boolean", "title": "Allow this call?"},
        "note": {"type": "string", "title": "Note for the audit log"},
    },
    "required": ["approve"],
}


def is_loopback(host: str) -> bool:
    """Whether ``host`` is an address only this machine can reach: ``localhost``, or a loopback
    IP literal (127.0.0.0/8, ::1). Never a name that merely starts like one (``127.evil.example``
    resolves wherever its owner likes)."""
    if host in _LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def rebinding_guard(host: str, tokens: Mapping[bytes, str]) -> TransportSecuritySettings | None:
    """For `streamable_http_app`: without tokens (loopback only), a web page the user visits could
    still reach the server through DNS rebinding, so requests must name this host (or a loopback
    name) in Host and Origin. The SDK does so by itself only for 127.0.0.1, localhost and ::1,
    not for 127.0.0.2 and the like. With tokens, none is needed: a page cannot send one."""
    if tokens:
        return None
    names = {f"[{host}]" if ":" in host else host, "127.0.0.1", "localhost", "[::1]"}
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True, allowed_hosts=sorted(f"{n}:*" for n in names),
        allowed_origins=sorted(f"http://{n}:*" for n in names),
    )  # fmt: skip


def _text(text: str, *, error: bool, structured: dict[str, Any] | None = None) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=text)], is_error=error, structured_content=structured
    )


def _refusal(code: str, message: str) -> types.CallToolResult:
    said = {"status": "refused", "reasons": [code], "message": message}
    return _text(json.dumps(said), error=True, structured=said)


async def _refuse(plane: ControlPlane, session: _Session, name: str, code: str, message: str) -> types.CallToolResult:
    """A call refused before the pipeline, audited (as the pipeline audits its own refusals)."""
    await plane.record_refusal(session.agent, f"tools/call {name!r}", message, code=code, session_id=session.id)
    return _refusal(code, message)


async def _refuse_lost(plane: ControlPlane, session: _Session, name: str) -> types.CallToolResult:
    return await _refuse(plane, session, name, "session.lost", _lost(session))


def _lost(session: _Session) -> str:
    return (
        f"stockade session {session.id} is gone (the store lost it, or the connection ended): what this "
        "conversation read is no longer tracked, so no call can be decided safely. Start a new conversation "
        "(reconnect, or restart the MCP server)."
    )


async def _listed(plane: ControlPlane, session: _Session) -> list[ToolSpec]:
    """The tools ``session`` may be shown (`ControlPlane.permitted_tools`).

    Raises:
        MCPError: (`REFUSED_ON_RECORD`, on record) the session is lost, or the store failed.
    """
    if not session.lost:
        try:
            with session_refusals_recorded_by_caller():  # recorded below, once, as session.lost
                return await plane.permitted_tools(session.id)
        except SessionNotFound:  # the store lost it between two renewals: never a fresh one
            session.lost = True
        except StoreError as exc:
            await plane.record_refusal(session.agent, "tools/list", str(exc), code=exc.code, session_id=session.id)
            raise MCPError(REFUSED_ON_RECORD, f"{exc.code}: {exc}") from exc
    message = _lost(session)
    await plane.record_refusal(session.agent, "tools/list", message, code="session.lost", session_id=session.id)
    raise MCPError(REFUSED_ON_RECORD, f"session.lost: {message}")


# The JSON-RPC error this server's own handlers answer a request they refuse with: a code of the
# implementation-defined band (-32000..-32019; the SDK takes -32000 and -32001, -32002 is retired),
# never one the spec may allocate. The handler has put the refusal on record, on its session's
# trail, so the transports' auditing of the errors a client is sent skips it.
REFUSED_ON_RECORD = -32010


def _answer(result: ToolResult) -> types.CallToolResult:
    if result.ok:
        body = result.output if result.output is not None else result.stdout
        text = body if isinstance(body, str) else json.dumps(body)
        return _text(text, error=False, structured=body if isinstance(body, dict) else None)
    said: dict[str, Any] = {"status": result.status, "reasons": result.reasons, "decision_id": result.decision_id}
    if result.approval_id:
        said["approval_id"] = result.approval_id
        said["next"] = "a human must approve this exact call; then call again with the same arguments"
    if result.status == "completed":  # it ran, and failed (timeout, non-zero exit, OOM)
        said |= {"verdict": result.verdict, "stderr": result.stderr[-2000:]}
    return _text(json.dumps(said), error=True, structured=said)


def tool_annotations(spec: ToolSpec) -> types.ToolAnnotations:
    """MCP's behaviour hints, from what the tool declares about itself. A client may run a tool
    it is told is read-only, or not destructive, with less care: each hint errs to the careful
    side, so anything that acts (or whose risk is high or critical) is destructive, never read-only."""
    caps = set(spec.capabilities)
    acts = bool(caps & {"mutates_state", "sends_external", "financial", "executes_code"})
    risky = spec.risk in ("high", "critical")
    return types.ToolAnnotations(
        read_only_hint=not acts and not risky,
        destructive_hint=acts or risky,
        open_world_hint=bool(caps & {"reads_untrusted", "sends_external"}),
    )


def token_names(principals: Any) -> dict[bytes, str]:
    """sha256 digest of each agent principal's token -> its name (settings.api_principals)."""
    return {bytes.fromhex(p.token_sha256): p.name for p in principals if p.role == "agent"}


@dataclass
class _Session:
    id: str
    agent: str
    lost: bool = False
    # Approvals this connection's human was asked about and whose answer is awaited (only an
    # answer to one of these is taken), and all it was ever asked about (each is asked once).
    awaiting: set[str] = field(default_factory=set)
    asked: set[str] = field(default_factory=set)


class _Sessions:
    """One stockade session per MCP connection, kept alive while the connection is."""

    def __init__(self, plane: ControlPlane, principal: str, trusted_context: list[str]) -> None:
        self._plane = plane
        self._principal = principal
        self._trusted = trusted_context
        self._open: dict[str, _Session] = {}
        # Connections whose session was closed (their MCP session ended): asked again, they get
        # session.lost, never a fresh session that forgot what the model read. Oldest forgotten
        # past a bound.
        self._closed: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._keeper: asyncio.Task[None] | None = None

    async def get(self, key: str, agent: str, ends: contextlib.AsyncExitStack | None = None) -> _Session:
        """The connection's session, opened on first use (once: concurrent first requests wait).
        ``ends``: the teardown the SDK unwinds when the connection's MCP session ends; the
        stockade session is closed then, and renewed until then."""
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            session = self._open.get(key)
            if session is None and key in self._closed:
                return _Session(self._closed[key], agent, lost=True)
            if session is None:
                sid = await self._plane.open_session(agent, self._principal, self._trusted)
                session = self._open[key] = _Session(sid, agent)
                if ends is not None:
                    ends.push_async_callback(self._end, key)
                log.info("mcp_session_opened", connection=key if key == _STDIO else "http", session_id=sid)
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.get_running_loop().create_task(self._keep())
        return session

    async def _end(self, key: str) -> None:
        """The connection's MCP session ended: close its stockade session."""
        session = self._open.pop(key, None)
        self._locks.pop(key, None)
        if session is None:
            return
        self._closed[key] = session.id
        while len(self._closed) > _MAX_CLOSED:
            del self._closed[next(iter(self._closed))]
        with contextlib.suppress(StockadeError), session_refusals_recorded_by_caller():  # already expired, or lost
            await self._plane.close_session(session.id)
        log.info("mcp_session_closed", session_id=session.id)

    async def _keep(self) -> None:
        """Renew every connected session well within the idle TTL, however long its connection
        idles: it is closed when its connection ends, not on a clock of its own."""
        interval = min(max(self._plane.settings.session_idle_ttl_s / 3, 0.05), 300.0)
        while self._open:
            await asyncio.sleep(interval)
            for session in list(self._open.values()):
                if session.lost:
                    continue
                try:
                    with session_refusals_recorded_by_caller():  # the next call records session.lost
                        await self._plane.renew_session(session.id, agent=session.agent)
                except SessionNotFound:
                    session.lost = True
                    log.error("mcp_session_lost", session_id=session.id)
                except Exception as exc:  # the store is down: try again next round
                    log.warning("mcp_session_renewal_failed", session_id=session.id, error=str(exc))


def build_server(
    plane: ControlPlane,
    *,
    agent: str,
    principal: str,
    trusted_context: list[str] | None = None,
    tokens: Mapping[bytes, str] | None = None,
    elicitation: bool = True,
) -> Server[Any]:
    """An MCP server whose tools are ``plane``'s, called as ``agent`` acting for ``principal``.

    ``tokens``: over HTTP, sha256 of each accepted bearer token -> the agent it authenticates
    (every request must carry one: wrap the HTTP app with `require_bearer`); the connection's
    session is that agent's. ``elicitation``: ask the human in the client to decide held calls.
    """
    sessions = _Sessions(plane, principal, trusted_context or [])

    async def session_for(ctx: ServerRequestContext[Any, Any]) -> _Session:
        key, name = _who(ctx, agent, tokens)
        # Only an HTTP MCP session ends before the server does: its stockade session ends with it.
        # (stdio's is the process's; a stateless client's is its token's, for the server's life.)
        ends = _session_end(ctx) if key != _STDIO and not key.endswith("\0") else None
        return await sessions.get(key, name, ends)

    async def list_tools(
        ctx: ServerRequestContext[Any, Any], __: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        session = await session_for(ctx)
        allowed = [s for s in await _listed(plane, session) if not isinstance(s.executor, ExternalExecutor)]
        return types.ListToolsResult(tools=[
            types.Tool(name=s.name, description=s.description, input_schema=s.input_schema,
                       annotations=tool_annotations(s))
            for s in allowed
        ])  # fmt: skip

    async def call_tool(
        ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult | types.InputRequiredResult:
        session = await session_for(ctx)
        name, args = params.name, dict(params.arguments or {})
        if session.lost:
            return await _refuse_lost(plane, session, name)
        # A session found not open is refused below as session.lost, on its trail: recorded once.
        with session_refusals_recorded_by_caller():
            return await call(ctx, session, name, args, params)

    async def call(
        ctx: ServerRequestContext[Any, Any], session: _Session, name: str, args: dict[str, Any],
        params: types.CallToolRequestParams,
    ) -> types.CallToolResult | types.InputRequiredResult:  # fmt: skip
        try:
            try:
                spec = (await plane.tool(name)).spec
            except (ToolNotFound, InvalidCall):  # no such tool: the pipeline refuses it, audited, as for any client
                return _answer(await plane.call(session.id, name, args, agent=session.agent))
            if isinstance(spec.executor, ExternalExecutor):
                message = f"{name} is an external tool: it is not served over MCP"
                return await _refuse(plane, session, name, "tool.not_served", message)
            if params.request_state is not None or params.input_responses:  # an answer (2026-07-28 flow)
                await _take_answer(ctx, plane, session, principal, params, elicitation=elicitation)
            result = await plane.call(session.id, name, args, agent=session.agent)
            if result.status == "pending_approval" and elicitation and _can_elicit(ctx):
                assert result.approval_id is not None  # noqa: S101  (a held result has one)
                approval = await plane.get_approval(result.approval_id)
                question = _question(approval, session, principal, spec)
                if approval.id in session.asked or question is None:  # asked once; or it cannot be shown
                    return _answer(result)
                session.asked.add(approval.id)
                session.awaiting.add(approval.id)
                ask = types.ElicitRequestFormParams(message=question, requested_schema=_ELICIT_SCHEMA)
                if not ctx.session.can_send_request:  # the client asks, then sends the call again
                    return types.InputRequiredResult(
                        input_requests={"approval": types.ElicitRequest(params=ask)}, request_state=approval.id
                    )
                answer = await _elicit(ctx, session, approval.id, ask)
                if answer is not None:
                    session.awaiting.discard(approval.id)
                    if await _decide(ctx, plane, approval, principal, answer):
                        # Approved: the retry redeems it. Refused: it is refused (approval.denied), audited.
                        result = await plane.call(session.id, name, args, agent=session.agent)
        except SessionNotFound:  # the store lost it between two renewals: never a fresh one
            session.lost = True
            return await _refuse_lost(plane, session, name)
        except StockadeError as exc:  # bad arguments, unknown tool, a refused approval: the model can fix these
            return _refusal(exc.code, str(exc))
        return _answer(result)

    def input_schema(name: str) -> Mapping[str, Any] | None:
        # What the SDK checks a stateless HTTP call's Mcp-Param-* headers against. Without it,
        # the SDK runs tools/list (a policy decision per tool) before every such call: ~8 ms.
        try:
            return plane.registry.get(name).spec.input_schema
        except StockadeError:  # unknown here (or a bad name): the call itself says so
            return None

    return Server("stockade", version=VERSION, on_list_tools=list_tools, on_call_tool=call_tool,
                  get_tool_input_schema=input_schema)  # fmt: skip


def _who(ctx: ServerRequestContext[Any, Any], agent: str, tokens: Mapping[bytes, str] | None) -> tuple[str, str]:
    """The connection key and the agent, for this request (see `build_server`)."""
    request = ctx.request
    headers = getattr(request, "headers", None)
    if headers is None:
        return _STDIO, agent
    name = agent
    if tokens is not None:
        # The agent require_bearer authenticated, never a header read again here: a request with
        # several Authorization headers must not be authenticated by one and served as another.
        name = _authenticated(request) or ""
        if not name:  # require_bearer turns these away first; never serve one unauthenticated
            raise PermissionError("no authenticated agent: wrap the HTTP app with require_bearer")
    # Handshake-era clients name their MCP session; a 2026-07-28 client over HTTP is stateless,
    # so its task is its bearer token's (one session per agent token, for the server's life).
    # (A stateless request's Mcp-Session-Id means nothing to the SDK: never a key, or a client
    # could fork fresh, untainted sessions at will.)
    mcp_session = None if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS else headers.get("mcp-session-id")
    return (f"{name}\0{mcp_session}" if mcp_session else f"{name}\0"), name


def _can_elicit(ctx: ServerRequestContext[Any, Any]) -> bool:
    return ctx.session.check_client_capability(types.ClientCapabilities(elicitation=types.ElicitationCapability()))


def _session_end(ctx: ServerRequestContext[Any, Any]) -> contextlib.AsyncExitStack | None:
    """The teardown the SDK unwinds when this request's connection (over HTTP: its MCP session)
    ends, however it ends: the client's DELETE, the SDK's idle timeout, the server's shutdown."""
    # The SDK documents Connection.exit_stack as the place for per-connection cleanup, but hands
    # low-level handlers no public path to the Connection: the request's ServerSession holds it.
    connection = getattr(ctx.session, "_connection", None)
    if isinstance(connection, Connection):
        return connection.exit_stack
    log.error("mcp_session_end_unavailable", reason="this mcp SDK exposes no connection teardown")
    return None


def _authenticated(request: object) -> str | None:
    """The agent `require_bearer` authenticated this HTTP request as (the ASGI scope's user)."""
    scope = getattr(request, "scope", None)
    user = scope.get("user") if isinstance(scope, Mapping) else None
    return user.access_token.client_id if isinstance(user, AuthenticatedUser) else None


def _visible(text: str) -> str:
    """``text`` with every character that could break, hide or reorder a line of the question
    written as a JSON escape (see `_UNSHOWN`; any whitespace but the ASCII space too)."""
    return "".join(
        json_escape(c) if c != " " and (c.isspace() or unicodedata.category(c) in _UNSHOWN) else c for c in text
    )


def _non_ascii(text: str, limit: int = 8) -> str:
    """The distinct characters of ``text`` beyond ASCII, by code point and name, so a human asked
    about a destination can tell one written with a Cyrillic "a" (U+0430) from ``example.com``."""
    found = list(dict.fromkeys(c for c in text if ord(c) > 0x7F))
    shown = ", ".join(f"U+{ord(c):04X} {unicodedata.name(c, 'unnamed')}" for c in found[:limit])
    return shown + (f" and {len(found) - limit} more" if len(found) > limit else "")


def _shown_name(name: str) -> str:
    """An argument name as the human sees it: as it is if it is a plain identifier, else quoted
    and escaped (so no name can pose as ``x = "..."`` or as another line), cut past a bound."""
    if len(name) <= _SHOWN_NAME and _PLAIN_NAME.fullmatch(name):
        return name
    shown = json.dumps(name[:_SHOWN_NAME], ensure_ascii=False)  # escaped with its line (`_visible`)
    return shown + f"… ({len(name)} characters)" if len(name) > _SHOWN_NAME else shown


def _question(approval: Approval, session: _Session, principal: str, spec: ToolSpec) -> str | None:
    """What the human is asked: who, which tool, why it was held, then every argument (the ones
    that decide where things go, how much, or what is set in full and first; others cut per
    value, so no argument can be pushed out of view), one line each. Nothing the caller chose can
    add a line or hide text: names and values are escaped (`_visible`). None if it cannot be
    shown whole."""
    args = json.loads(approval.args)
    key = {*spec.destination_args, *spec.amount_args, *spec.sensitive_args}
    why = "; ".join(r.get("message") or r["code"] for r in approval.reasons)
    lines = [f"stockade holds a call by {session.agent} for {principal}: {approval.tool}", f"Why: {why}"]
    for name in sorted(args, key=lambda n: (n not in key, n)):
        value = json.dumps(args[name], ensure_ascii=False)
        if name not in key and len(value) > _SHOWN_VALUE:
            value = value[:_SHOWN_VALUE] + f"… ({len(value)} characters)"
        lines.append(f"  {_shown_name(name)} = {value}")
        if name in key and (foreign := _non_ascii(value)):
            lines.append(f"    (not ASCII: {foreign})")  # a lookalike letter is named, not only shown
    lines += [f"  file /in/{_shown_name(i['name'])}: {i['size']} bytes, sha256 {i['sha256']}" for i in approval.inputs]
    lines.append("Allow it, once?")
    question = "\n".join(_visible(line) for line in lines)
    return question if len(question) <= _MAX_QUESTION else None


async def _elicit(
    ctx: ServerRequestContext[Any, Any], session: _Session, approval_id: str, ask: types.ElicitRequestFormParams
) -> types.ElicitResult | None:
    """Ask the human now, in the client; None if the client could not (out-of-band approval remains)."""
    try:
        return await ctx.session.elicit_form(ask.message, _ELICIT_SCHEMA, related_request_id=ctx.request_id)
    except asyncio.CancelledError:
        # The call was cancelled while its human was asked: no call awaits that answer now, and the
        # next retry asks again (else the approval would be left to an approver out of band only).
        session.asked.discard(approval_id)
        session.awaiting.discard(approval_id)
        raise
    except Exception as exc:
        log.warning("mcp_elicitation_failed", approval_id=approval_id, error=f"{type(exc).__name__}: {exc}")
        return None


async def _take_answer(
    ctx: ServerRequestContext[Any, Any], plane: ControlPlane, session: _Session, principal: str,
    params: types.CallToolRequestParams, *, elicitation: bool,
) -> None:  # fmt: skip
    """Record the answer a client sent back with a retried call, only if this server asked this
    connection's human about that approval and is awaiting the answer (a client cannot answer a
    question it was not asked, or answer for another call); any other is ignored, audited."""
    answer = (params.input_responses or {}).get("approval")
    approval_id = params.request_state if isinstance(params.request_state, str) else ""
    if not elicitation or approval_id not in session.awaiting or not isinstance(answer, types.ElicitResult):
        await plane.record_refusal(
            session.agent,
            f"tools/call {params.name} with an answer for {approval_id[:64]!r}",
            "an elicitation answer this server did not ask this connection for: ignored",
            code="approval.unsolicited_answer",
        )
        return
    session.awaiting.discard(approval_id)
    approval = await plane.get_approval(approval_id)
    # Whatever its status now: an answer to an approval that expired or was decided meanwhile is
    # refused on the record (approval.not_pending) with the human's words, never dropped unheard;
    # the call then goes on (held again, and asked again).
    with contextlib.suppress(ApprovalError):
        await _decide(ctx, plane, approval, principal, answer)


async def _decide(
    ctx: ServerRequestContext[Any, Any], plane: ControlPlane, approval: Approval, principal: str,
    answer: types.ElicitResult,
) -> bool:  # fmt: skip
    """Record the human's answer as the approval's decision: a yes grants it, a no or an explicit
    decline denies it. False if they did not decide (dismissed, or an answer without a yes or no:
    it stays pending, for an approver out of band)."""
    content = answer.content or {}
    client = ctx.session.client_params.client_info if ctx.session.client_params else None
    via = f"{_label(client.name)} {_label(client.version)}" if client else "an MCP client"
    approver = f"{principal} (via {via})"
    if answer.action == "decline":  # the human said no to the question itself: never grantable after
        await plane.deny_approval(approval.id, approver, f"declined in {via} (MCP elicitation)")
        return True
    if answer.action != "accept" or not isinstance(content.get("approve"), bool):
        # No audit event fits a question left unanswered (the approval's own trail records
        # decisions only): logged, and the approval stays pending, as it was.
        log.info("approval_dismissed", approval_id=approval.id, action=answer.action, via=via)
        return False
    note = f"answered in {via} (MCP elicitation)"
    said = content.get("note")
    if isinstance(said, str) and said.strip():
        # As the client sent it, but for what no note may hold (a NUL, a lone surrogate).
        note += ": " + "".join(c for c in said.strip()[:1000] if c != "\x00" and encodable(c))
    if content["approve"]:
        await plane.approve(approval.id, approver, note)
    else:
        await plane.deny_approval(approval.id, approver, note)
    return True


_NOT_LABEL = re.compile(r"[^A-Za-z0-9._+-]")


def _label(text: str, limit: int = 64) -> str:
    """A client-given name or version as it appears in an approver's name: one word of letters,
    digits and ``._+-`` (anything else an underscore), bounded. A client naming itself
    ``ide) approved by secops (via x`` made the record read as if someone else approved."""
    return _NOT_LABEL.sub("_", text[:limit]) or "?"


def _token_agent(header: str | None, tokens: Mapping[bytes, str]) -> str | None:
    """The agent whose token the ``Authorization`` header carries, if any."""
    return bearer.match(bearer.presented(header), tokens.items())


def require_bearer(
    app: ASGIApp, tokens: Mapping[bytes, str], plane: ControlPlane | None = None,
    refused: Mapping[str, str] | None = None,
) -> ASGIApp:  # fmt: skip
    """Wrap the streamable-HTTP app: a request without exactly one ``Authorization`` header with a
    known agent's bearer token gets 401, one whose agent may not act for the server's principal
    (``refused``: agent -> why, from its ``acts_for``) 403, both audited on ``plane``. A known one
    is the request's user (the ASGI scope's ``user``): the agent `build_server` serves it as, and
    the credential the SDK binds each MCP session to (another agent's token cannot use or end it)."""

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            # Read once, here: the identity this finds is the one the request is served as (`who`
            # reads it from the scope), so several Authorization headers are refused, never one
            # checked and another used.
            headers = [v for k, v in scope.get("headers") or [] if k.lower() == b"authorization"]
            header = headers[0].decode("latin-1") if len(headers) == 1 else ""
            name = _token_agent(header, tokens) if len(headers) == 1 else None
            why = (refused or {}).get(name) if name is not None else None
            if name is None or why is not None:
                what = f"{scope.get('method', '?')} {scope.get('path', '?')}"
                if name is None:
                    reason = ("more than one Authorization header" if len(headers) > 1 else
                              "unknown bearer token" if header else "missing bearer token")  # fmt: skip
                    status, code, title = 401, "auth.unauthenticated", "Unauthorized"
                    detail = ("send one Authorization: Bearer <token> header, of an agent principal "
                              "(STOCKADE_API_PRINCIPALS)")  # fmt: skip
                else:
                    reason = detail = str(why)
                    status, code, title = 403, "auth.forbidden", "Forbidden"
                if plane is not None:
                    await plane.record_refusal(name, what, f"MCP over HTTP: {reason}", code=code)
                body = json.dumps({"type": f"urn:stockade:problem:{code}", "title": title, "status": status,
                                   "detail": detail}).encode()  # fmt: skip
                response = [
                    (b"content-type", b"application/problem+json"),
                    (b"content-length", str(len(body)).encode()),
                ]
                if status == 401:
                    response.append((b"www-authenticate", b'Bearer realm="stockade"'))
                await send({"type": "http.response.start", "status": status, "headers": response})
                await send({"type": "http.response.body", "body": body})
                return
            scope = {**scope, "user": AuthenticatedUser(AccessToken(token="", client_id=name, scopes=[]))}
            if plane is not None:
                audited = _Audited(send, plane, name, scope)
                await app(scope, receive, audited.send)
                await audited.flush()
                return
        await app(scope, receive, send)

    return guarded


def audit_requests(app: ASGIApp, plane: ControlPlane, agent: str) -> ASGIApp:
    """Wrap the streamable-HTTP app served without tokens (loopback only): what the SDK refuses
    (a 4xx, or a JSON-RPC error in a 200) is on record as ``agent``'s, as `require_bearer` puts
    it on record as each token's agent."""

    async def audited(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        wrapped = _Audited(send, plane, agent, scope)
        await app(scope, receive, wrapped.send)
        await wrapped.flush()

    return audited


def stdio_refusals(plane: ControlPlane, agent: str) -> Refused:
    """For `stdio_wire`: each JSON-RPC error the stdio client is sent, and each response it sends
    to no request, on record as ``agent``'s refusal (the SDK itself records none)."""

    async def refused(given: RequestId | None, code: int, message: str) -> None:
        if code == REFUSED_ON_RECORD:  # a handler's own refusal, on record already
            return
        what = "stdio" if given is None else f"stdio (JSON-RPC id {json.dumps(given)[:80]})"
        await plane.record_refusal(
            agent, what, f"MCP over stdio: JSON-RPC {code}: {message}", code=_jsonrpc_refusal(code)
        )

    return refused


# What a JSON-RPC error the client is sent means (any other code, such as an internal error: mcp.error).
_JSONRPC_REFUSALS = {
    -32700: "mcp.bad_request",  # not JSON (or not UTF-8)
    -32600: "mcp.bad_request",  # not a JSON-RPC message; over stdio, also a response to no request
    -32601: "mcp.method_not_found",
    -32602: "mcp.invalid_params",  # the method's parameters do not validate (or it came before initialize)
}


_METHOD_NOT_FOUND, _INVALID_PARAMS = -32601, -32602


def _jsonrpc_refusal(code: int) -> str:
    return _JSONRPC_REFUSALS.get(code, "mcp.error")


# A JSON-RPC error at the start of a line of a 2xx body: a JSON answer, or an SSE event's data line.
# Anchored at a message's start, so no JSON inside a result (a tool's output) can pose as one.
_SENT_ERROR = re.compile(
    rb'^(?:data: ?)?\{"jsonrpc":"2\.0","id":(?P<id>-?\d+|"(?:[^"\\]|\\.)*"|null),"error":'
    rb'\{"code":(?P<code>-?\d+),"message":"(?P<message>(?:[^"\\]|\\.)*)',
    re.MULTILINE,
)
_HEAD = 4096  # bytes of a body part read for JSON-RPC errors: a message's head is all that tells one


# What the SDK's session manager means by each refusal it answers by itself (anything else 4xx: mcp.refused).
_SDK_REFUSALS = {
    400: "mcp.bad_request",  # not JSON-RPC, a bad or missing header
    404: "mcp.session_not_found",  # an unknown, closed or another token's Mcp-Session-Id
    405: "mcp.method_not_allowed",
    406: "mcp.not_acceptable",
    413: "request.too_large",
    415: "mcp.unsupported_media_type",
}


class _Audited:
    """``send``, for a request the SDK serves as ``agent``: a 4xx it answers (the SDK's session
    manager refuses by itself, past `require_bearer`), and each JSON-RPC error it answers in a
    2xx (an unknown method, bad parameters), is on record before the client gets it. A 4xx's
    start is held until its first body part, whose JSON-RPC error message (if any) goes into the
    record; `flush` sends a start the SDK never followed with a body."""

    def __init__(self, send: Send, plane: ControlPlane, agent: str, scope: Scope) -> None:
        self._send, self._plane, self._agent, self._scope = send, plane, agent, scope
        self._held: Message | None = None
        # Whether the next body part starts a message (the body's first, or one after a finished
        # SSE event); only there can a JSON-RPC error start.
        self._at_start = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._at_start = message["status"] < 400
            if 400 <= message["status"] < 500:
                self._held = message
                return
        if self._held is not None and message["type"] == "http.response.body":
            await self._release(message.get("body", b""))
        elif self._at_start and message["type"] == "http.response.body":
            body = message.get("body", b"")
            for sent in _SENT_ERROR.finditer(body, 0, _HEAD):
                await self._record_error(sent)
            self._at_start = body.endswith(b"\n") or not body
        await self._send(message)

    async def flush(self) -> None:
        if self._held is not None:
            await self._release(b"")
            await self._send({"type": "http.response.body", "body": b""})

    def _what(self) -> str:
        scope = self._scope
        session = next((v for k, v in scope.get("headers") or [] if k.lower() == b"mcp-session-id"), b"")
        what = f"{scope.get('method', '?')} {scope.get('path', '?')}"
        if session:
            what += f" (Mcp-Session-Id {session[:80].decode('latin-1')!r})"
        return what

    async def _record_error(self, sent: re.Match[bytes]) -> None:
        code = int(sent["code"])
        if code == REFUSED_ON_RECORD:  # a handler's own refusal, on record already
            return
        message = sent["message"].decode("utf-8", "replace")
        with contextlib.suppress(ValueError):  # cut off at the head's end, mid-escape: as it is
            message = str(json.loads(f'"{message}"'))
        what = f"{self._what()} (JSON-RPC id {sent['id'][:80].decode('utf-8', 'replace')})"
        reason = f"MCP over HTTP: JSON-RPC {code}: {message[:300]}"
        await self._plane.record_refusal(self._agent, what, reason, code=_jsonrpc_refusal(code))

    async def _release(self, body: bytes) -> None:
        start, self._held = self._held, None
        assert start is not None  # noqa: S101  (called only while a start is held)
        status = int(start["status"])
        code, said = _error_of(body)
        if code == REFUSED_ON_RECORD:  # a handler's own refusal, on record already
            await self._send(start)
            return
        reason = f"MCP over HTTP: {status}: {said}" if said else f"MCP over HTTP: {status}"
        # An unknown method or bad parameters is named by its JSON-RPC code: the 2026-07-28 transport
        # answers those with a 404 and a 400 too, which are no unknown session nor bad request.
        # Otherwise the status says it (an unknown session's 404 carries -32600 too).
        named = _JSONRPC_REFUSALS[code] if code in (_METHOD_NOT_FOUND, _INVALID_PARAMS) else None
        await self._plane.record_refusal(
            self._agent, self._what(), reason, code=named or _SDK_REFUSALS.get(status, "mcp.refused")
        )
        await self._send(start)


def _error_of(body: bytes) -> tuple[int | None, str]:
    """The code and message of a JSON-RPC error answer (the message bounded), else no code and
    the body's start as text."""
    try:
        error = json.loads(body)["error"]
        code = error.get("code")
        return (code if type(code) is int else None), str(error["message"])[:300]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, body[:300].decode("utf-8", "replace")
