"""`StockadeClient` (async) and `SyncStockadeClient`: `ControlPlane`'s methods over HTTP.

Each method has the signature of the `ControlPlane` method of the same name and raises the same
exceptions (`router.client.errors`). Identity arguments (``agent``, ``approver``, ``by``) are
there so code moves between the two unchanged; over HTTP the server acts as the principal the
token belongs to. Give its name as ``principal=`` and an argument naming anyone else raises
`IdentityMismatch` before anything is sent (without it, they are not checked and nothing more is
sent: the server records the token's principal).

Only idempotent requests (GET) are retried, on connection errors and 502/503/504: a call is never
sent twice.

A `StockadeClient` may be used from several event loops (``asyncio.run(setup())``, then the
LangChain tools' ``invoke`` on the adapters' loop thread): an ``httpx.AsyncClient``'s connections
belong to the loop that opened them, so it keeps one for each loop it is used on; ``aclose`` closes
them all (those of a loop already closed went with it).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping
from datetime import datetime
from types import TracebackType
from typing import Any, Self, TypeVar

import httpx

from router.client.endpoints import Backoff, Endpoints, Request
from router.results import DecisionResult, ToolResult
from router.wire import Approval, ApprovalStatus, AuditEvent, ToolSpec

T = TypeVar("T")


class StockadeClient:
    """`ControlPlane`'s methods against a stockade server, as the principal ``token`` belongs to.

    Args:
        base_url: the server (``http://127.0.0.1:8080``).
        token: a bearer token of a configured principal (``STOCKADE_API_PRINCIPALS``).
        principal: that principal's name, if known; identity arguments are checked against it.
        timeout_s: per request; a sandboxed call may take as long as its tool's timeout.
        retries: how often a GET is tried again.
        transport: an ``httpx`` transport (``httpx.ASGITransport(app)`` in tests). Without one,
            the client keeps a connection pool per event loop it is used on; a transport given is
            shared by them all, so it must not hold connections bound to one loop (an
            ``httpx.AsyncHTTPTransport`` does: use such a client on one loop only).
    """

    def __init__(
        self, base_url: str, token: str, *, principal: str | None = None, timeout_s: float = 600.0,
        retries: int = 2, transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:  # fmt: skip
        self._base_url = base_url
        self._timeout_s = timeout_s
        self._transport = transport
        self._headers = {"Authorization": f"Bearer {token}"}
        self._api = Endpoints(principal)
        self._retries = retries
        self._by_loop: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self._lock = threading.Lock()  # the loops may run in different threads
        self._closed = False

    @property
    def principal(self) -> str | None:
        """The name of the token's principal, as given to the constructor."""
        return self._api.principal

    def _http(self) -> httpx.AsyncClient:
        """The ``httpx.AsyncClient`` of the running event loop (made on its first request there)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise RuntimeError("this StockadeClient is closed (aclose): make a new one")
            for gone in [other for other in self._by_loop if other.is_closed()]:
                del self._by_loop[gone]  # its connections were closed with that loop
            http = self._by_loop.get(loop)
            if http is None:
                http = self._by_loop[loop] = httpx.AsyncClient(
                    base_url=self._base_url, timeout=self._timeout_s, transport=self._transport, headers=self._headers
                )
            return http

    async def _send(self, request: Request[T]) -> T:
        options = request.options()
        backoff = Backoff(request, self._retries)
        http = self._http()
        while True:
            try:
                response = await http.request(request.method, request.path, **options)
            except httpx.TransportError as exc:
                delay = backoff.delay(None)
                if delay is None:
                    raise request.unreachable(exc) from exc
            else:
                delay = backoff.delay(response)
                if delay is None:
                    return request.answer(response)
            await asyncio.sleep(delay)

    async def register(self, spec: ToolSpec | Mapping[str, Any]) -> ToolSpec:
        """Register a tool (a `ToolSpec`, its JSON as a mapping, or a `sandboxed_tool` function);
        refused (`ToolRefused`) if policy would refuse every call to it."""
        return await self._send(self._api.register(spec))

    async def list_tools(self) -> list[ToolSpec]:
        """Every registered tool (``GET /v1/tools``; in process: ``plane.registry.list()``)."""
        return await self._send(self._api.list_tools())

    async def open_session(self, agent: str, principal: str, trusted_context: list[str] | None = None) -> str:
        """Open a session for ``agent`` (the token's principal) acting for the human ``principal``;
        ``trusted_context``: what the user gave. Returns the session id."""
        return await self._send(self._api.open_session(agent, principal, trusted_context))

    async def close_session(self, session_id: str, *, agent: str | None = None) -> None:
        """Close a session (an agent: its own; an admin: any)."""
        return await self._send(self._api.close_session(session_id, agent=agent))

    async def decide(
        self, session_id: str, tool: str, args: Mapping[str, Any] | str | bytes, *, agent: str | None = None
    ) -> DecisionResult:
        """Decide a call without running it (audited like any other)."""
        return await self._send(self._api.decide(session_id, tool, args, agent=agent))

    async def call(
        self, session_id: str, tool: str, args: Mapping[str, Any] | str | bytes, *,
        inputs: Mapping[str, bytes] | None = None, approval_id: str | None = None, agent: str | None = None,
    ) -> ToolResult:  # fmt: skip
        """Validate, decide, run and audit one tool call; ``inputs`` are files the tool reads under
        ``/in``, ``approval_id`` redeems an approval for exactly this call."""
        request = self._api.call(session_id, tool, args, inputs=inputs, approval_id=approval_id, agent=agent)
        return await self._send(request)

    async def report(self, session_id: str, call_id: str, output: Any, *, agent: str | None = None) -> ToolResult:
        """Record the output of an allowed ``external`` call (once per call_id)."""
        return await self._send(self._api.report(session_id, call_id, output, agent=agent))

    async def list_approvals(self, status: ApprovalStatus | None = None) -> list[Approval]:
        """Approvals, optionally only those in ``status`` (an approver's token)."""
        return await self._send(self._api.list_approvals(status))

    async def get_approval(self, approval_id: str) -> Approval:
        """One approval; `ApprovalError` if unknown."""
        return await self._send(self._api.get_approval(approval_id))

    async def approve(self, approval_id: str, approver: str, note: str = "") -> Approval:
        """Grant a pending approval as ``approver`` (the token's principal, an approver)."""
        return await self._send(self._api.approve(approval_id, approver, note))

    async def deny_approval(self, approval_id: str, approver: str, note: str = "") -> Approval:
        """Refuse a pending approval as ``approver`` (the token's principal, an approver)."""
        return await self._send(self._api.deny_approval(approval_id, approver, note))

    async def endorse(self, session_id: str, call_id: str, *, by: str, note: str = "") -> str:
        """Endorse, as the human ``by`` (an approver's token), the output of the session's call
        ``call_id``: its values count as trusted for this session (docs/policy.md). Returns the
        source label."""
        return await self._send(self._api.endorse(session_id, call_id, by=by, note=note))

    async def reload_policy(self, *, source: str = "api", by: str | None = None) -> str:
        """Reload the policy directory now (an admin's token; ``source``: ``api`` or ``cli``).
        Returns the revision in force; `PolicyError` if the files do not load."""
        return await self._send(self._api.reload_policy(source=source, by=by))

    async def audit_events(
        self, *, session_id: str | None = None, agent: str | None = None, tool: str | None = None,
        outcome: str | None = None, kind: str | None = None, decision_id: str | None = None,
        since: datetime | None = None, until: datetime | None = None, limit: int = 1000,
        after_seq: int | None = None,
    ) -> list[AuditEvent]:  # fmt: skip
        """Audit events matching every filter given, oldest first (an auditor's token); at most
        ``limit``, after ``after_seq`` (a page: pass the last event's seq for the next)."""
        return await self._send(self._api.audit_events(
            session_id=session_id, agent=agent, tool=tool, outcome=outcome, kind=kind, decision_id=decision_id,
            since=since, until=until, limit=limit, after_seq=after_seq,
        ))  # fmt: skip

    async def decision_trail(self, decision_id: str) -> list[AuditEvent]:
        """Every audit event of one decision: request, approval, credentials, egress, execution."""
        return await self._send(self._api.decision_trail(decision_id))

    async def aclose(self) -> None:
        """Close the client's connections, on every event loop it was used on."""
        current = asyncio.get_running_loop()
        with self._lock:
            by_loop, self._by_loop, self._closed = self._by_loop, {}, True
        for loop, http in by_loop.items():
            if loop is current:
                await http.aclose()
            elif loop.is_running():  # another thread's loop (the adapters' own): close them there
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(http.aclose(), loop))
            # a loop that no longer runs cannot close its connections; they go with it

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class SyncStockadeClient:
    """`StockadeClient` for synchronous code: the same methods, arguments and exceptions, over a
    blocking ``httpx.Client`` (``transport``: an ``httpx.BaseTransport``)."""

    def __init__(
        self, base_url: str, token: str, *, principal: str | None = None, timeout_s: float = 600.0,
        retries: int = 2, transport: httpx.BaseTransport | None = None,
    ) -> None:  # fmt: skip
        self._http = httpx.Client(base_url=base_url, timeout=timeout_s, transport=transport,
                                  headers={"Authorization": f"Bearer {token}"})  # fmt: skip
        self._api = Endpoints(principal)
        self._retries = retries

    @property
    def principal(self) -> str | None:
        """The name of the token's principal, as given to the constructor."""
        return self._api.principal

    def _send(self, request: Request[T]) -> T:
        options = request.options()
        backoff = Backoff(request, self._retries)
        while True:
            try:
                response = self._http.request(request.method, request.path, **options)
            except httpx.TransportError as exc:
                delay = backoff.delay(None)
                if delay is None:
                    raise request.unreachable(exc) from exc
            else:
                delay = backoff.delay(response)
                if delay is None:
                    return request.answer(response)
            time.sleep(delay)

    def register(self, spec: ToolSpec | Mapping[str, Any]) -> ToolSpec:
        """As `StockadeClient.register`."""
        return self._send(self._api.register(spec))

    def list_tools(self) -> list[ToolSpec]:
        """As `StockadeClient.list_tools`."""
        return self._send(self._api.list_tools())

    def open_session(self, agent: str, principal: str, trusted_context: list[str] | None = None) -> str:
        """As `StockadeClient.open_session`."""
        return self._send(self._api.open_session(agent, principal, trusted_context))

    def close_session(self, session_id: str, *, agent: str | None = None) -> None:
        """As `StockadeClient.close_session`."""
        return self._send(self._api.close_session(session_id, agent=agent))

    def decide(
        self, session_id: str, tool: str, args: Mapping[str, Any] | str | bytes, *, agent: str | None = None
    ) -> DecisionResult:
        """As `StockadeClient.decide`."""
        return self._send(self._api.decide(session_id, tool, args, agent=agent))

    def call(
        self, session_id: str, tool: str, args: Mapping[str, Any] | str | bytes, *,
        inputs: Mapping[str, bytes] | None = None, approval_id: str | None = None, agent: str | None = None,
    ) -> ToolResult:  # fmt: skip
        """As `StockadeClient.call`."""
        return self._send(self._api.call(session_id, tool, args, inputs=inputs, approval_id=approval_id, agent=agent))

    def report(self, session_id: str, call_id: str, output: Any, *, agent: str | None = None) -> ToolResult:
        """As `StockadeClient.report`."""
        return self._send(self._api.report(session_id, call_id, output, agent=agent))

    def list_approvals(self, status: ApprovalStatus | None = None) -> list[Approval]:
        """As `StockadeClient.list_approvals`."""
        return self._send(self._api.list_approvals(status))

    def get_approval(self, approval_id: str) -> Approval:
        """As `StockadeClient.get_approval`."""
        return self._send(self._api.get_approval(approval_id))

    def approve(self, approval_id: str, approver: str, note: str = "") -> Approval:
        """As `StockadeClient.approve`."""
        return self._send(self._api.approve(approval_id, approver, note))

    def deny_approval(self, approval_id: str, approver: str, note: str = "") -> Approval:
        """As `StockadeClient.deny_approval`."""
        return self._send(self._api.deny_approval(approval_id, approver, note))

    def endorse(self, session_id: str, call_id: str, *, by: str, note: str = "") -> str:
        """As `StockadeClient.endorse`."""
        return self._send(self._api.endorse(session_id, call_id, by=by, note=note))

    def reload_policy(self, *, source: str = "api", by: str | None = None) -> str:
        """As `StockadeClient.reload_policy`."""
        return self._send(self._api.reload_policy(source=source, by=by))

    def audit_events(
        self, *, session_id: str | None = None, agent: str | None = None, tool: str | None = None,
        outcome: str | None = None, kind: str | None = None, decision_id: str | None = None,
        since: datetime | None = None, until: datetime | None = None, limit: int = 1000,
        after_seq: int | None = None,
    ) -> list[AuditEvent]:  # fmt: skip
        """As `StockadeClient.audit_events`."""
        return self._send(self._api.audit_events(
            session_id=session_id, agent=agent, tool=tool, outcome=outcome, kind=kind, decision_id=decision_id,
            since=since, until=until, limit=limit, after_seq=after_seq,
        ))  # fmt: skip

    def decision_trail(self, decision_id: str) -> list[AuditEvent]:
        """As `StockadeClient.decision_trail`."""
        return self._send(self._api.decision_trail(decision_id))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
