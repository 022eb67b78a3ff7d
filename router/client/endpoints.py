"""What each SDK method sends and how its answer is read, written once for both clients.

`Endpoints` has one method per `ControlPlane` method the API serves, with the same signature; each
checks its arguments as far as the client can (identity, path ids, JSON) and returns a `Request`.
`StockadeClient` and `SyncStockadeClient` only send it (`Backoff` says when to try again) and
return what `Request.answer` reads from the response.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

import httpx

from router.client.errors import ApiError, ApiUnreachable, IdentityMismatch, raise_for
from router.errors import ApprovalError, FieldProblem, InvalidCall, SessionNotFound, StockadeError
from router.results import DecisionResult, ToolResult
from router.wire import Approval, ApprovalStatus, AuditEvent, ToolSpec, show

T = TypeVar("T")

# An id that may go into a URL path as one segment: unreserved characters only, and not "." or "..".
_PATH_ID = re.compile(r"[A-Za-z0-9_~-][A-Za-z0-9._~-]{0,199}")
_MAX_NOTE = 2000  # what the API takes; the control plane keeps as much
_RETRY_STATUSES = (502, 503, 504)
# Failures before the request left: it was certainly not carried out.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol)


@dataclass(frozen=True, slots=True)
class Request(Generic[T]):
    """One API request, and how its answer becomes the method's result."""

    method: Literal["GET", "POST", "DELETE"]
    path: str
    read: Callable[[Any], T]
    body: Mapping[str, Any] | None = None
    params: Mapping[str, str | int] | None = None

    def options(self) -> dict[str, Any]:
        """Keyword arguments for ``httpx`` ``request``: the body as JSON text, the query.

        Raises:
            InvalidCall: a body field is not JSON (as the control plane refuses it).
        """
        options: dict[str, Any] = {"params": self.params}
        if self.body is not None:
            options["content"] = _json(self.body)
            options["headers"] = {"Content-Type": "application/json"}
        return options

    def answer(self, response: httpx.Response) -> T:
        """The method's result, or the exception the answer stands for."""
        raise_for(response)
        try:
            document = response.json() if response.content else None
        except ValueError as exc:
            detail = f"{self.method} {self.path} answered with a body that is not JSON: {response.text[:200]!r}"
            raise ApiError(response.status_code, "client.unreadable", detail) from exc
        return self.read(document)

    def unreachable(self, exc: httpx.TransportError) -> ApiUnreachable:
        """The exception for a connection that failed (``exc``), saying whether anything may have run."""
        if isinstance(exc, _NOT_SENT) or self.method == "GET":
            consequence = "nothing was carried out"
        else:
            consequence = "the request may have been carried out: check the audit log before repeating it"
        return ApiUnreachable(f"{self.method} {self.path}: the stockade API could not be reached or did not "
                              f"answer ({type(exc).__name__}: {exc}); {consequence}")  # fmt: skip


class Backoff:
    """When to send a request again: only a GET (a call is never sent twice), after a connection
    failure or a 502, 503 or 504, at most ``retries`` times, waiting 0.1 s, 0.2 s, 0.4 s ..."""

    def __init__(self, request: Request[Any], retries: int) -> None:
        self._left = retries if request.method == "GET" else 0
        self._delay = 0.1

    def delay(self, response: httpx.Response | None) -> float | None:
        """Seconds to wait before trying again after ``response`` (None: the connection failed),
        or None if this outcome stands."""
        if self._left <= 0 or (response is not None and response.status_code not in _RETRY_STATUSES):
            return None
        self._left -= 1
        self._delay *= 2
        return self._delay / 2


class Endpoints:
    """The API's requests for `ControlPlane`'s methods. ``principal``: the name of the principal the
    client's token belongs to, if the caller said; identity arguments naming anyone else raise
    `IdentityMismatch` (the server acts as the token's principal, whatever is passed)."""

    def __init__(self, principal: str | None) -> None:
        self.principal = principal

    def register(self, spec: ToolSpec | Mapping[str, Any]) -> Request[ToolSpec]:
        body = spec.model_dump(mode="json") if isinstance(spec, ToolSpec) else dict(spec)
        return Request("POST", "/v1/tools", ToolSpec.model_validate, body)

    def list_tools(self) -> Request[list[ToolSpec]]:
        return Request("GET", "/v1/tools", lambda tools: [ToolSpec.model_validate(t) for t in tools])

    def open_session(self, agent: str, principal: str, trusted_context: list[str] | None = None) -> Request[str]:
        self._check("agent", agent)
        body = {"principal": principal, "trusted_context": [] if trusted_context is None else trusted_context}
        return Request("POST", "/v1/sessions", lambda opened: str(opened["session_id"]), body)

    def close_session(self, session_id: str, *, agent: str | None = None) -> Request[None]:
        self._check("agent", agent)
        return Request("DELETE", f"/v1/sessions/{_session(session_id)}", lambda _: None)

    def decide(
        self, session_id: str, tool: str, args: Mapping[str, Any] | str | bytes, *, agent: str | None = None
    ) -> Request[DecisionResult]:
        self._check("agent", agent)
        body = {"tool": tool, "args": _args(tool, args)}
        return Request("POST", f"/v1/sessions/{_session(session_id)}/decide", DecisionResult.model_validate, body)

    def call(
        self, session_id: str, tool: str, args: Mapping[str, Any] | str | bytes, *,
        inputs: Mapping[str, bytes] | None = None, approval_id: str | None = None, agent: str | None = None,
    ) -> Request[ToolResult]:  # fmt: skip
        self._check("agent", agent)
        body = {"tool": tool, "args": _args(tool, args), "approval_id": approval_id, "inputs": _inputs(inputs or {})}
        return Request("POST", f"/v1/sessions/{_session(session_id)}/calls", ToolResult.model_validate, body)

    def report(self, session_id: str, call_id: str, output: Any, *, agent: str | None = None) -> Request[ToolResult]:
        self._check("agent", agent)
        body = {"call_id": call_id, "output": output}
        return Request("POST", f"/v1/sessions/{_session(session_id)}/reports", ToolResult.model_validate, body)

    def list_approvals(self, status: ApprovalStatus | None = None) -> Request[list[Approval]]:
        params = {} if status is None else {"status": ApprovalStatus(status).value}
        return Request("GET", "/v1/approvals", lambda found: [Approval.model_validate(a) for a in found], None, params)

    def get_approval(self, approval_id: str) -> Request[Approval]:
        return Request("GET", f"/v1/approvals/{_approval(approval_id)}", Approval.model_validate)

    def approve(self, approval_id: str, approver: str, note: str = "") -> Request[Approval]:
        return self._decide_approval(approval_id, approver, note, "approve")

    def deny_approval(self, approval_id: str, approver: str, note: str = "") -> Request[Approval]:
        return self._decide_approval(approval_id, approver, note, "deny")

    def _decide_approval(self, approval_id: str, approver: str, note: str, verb: str) -> Request[Approval]:
        self._check("approver", approver)
        path = f"/v1/approvals/{_approval(approval_id)}/{verb}"
        return Request("POST", path, Approval.model_validate, {"note": note[:_MAX_NOTE]})

    def endorse(self, session_id: str, call_id: str, *, by: str, note: str = "") -> Request[str]:
        self._check("by", by)
        body = {"call_id": call_id, "note": note[:_MAX_NOTE]}
        path = f"/v1/sessions/{_session(session_id)}/endorsements"
        return Request("POST", path, lambda endorsed: str(endorsed["source"]), body)

    def reload_policy(self, *, source: str = "api", by: str | None = None) -> Request[str]:
        self._check("by", by)
        return Request("POST", "/v1/policy/reload", lambda status: str(status["revision"]), None, {"source": source})

    def audit_events(
        self, *, session_id: str | None = None, agent: str | None = None, tool: str | None = None,
        outcome: str | None = None, kind: str | None = None, decision_id: str | None = None,
        since: datetime | None = None, until: datetime | None = None, limit: int = 1000,
        after_seq: int | None = None,
    ) -> Request[list[AuditEvent]]:  # fmt: skip
        given = {"session_id": session_id, "agent": agent, "tool": tool, "outcome": outcome, "kind": kind,
                 "decision_id": decision_id, "since": since.isoformat() if since else None,
                 "until": until.isoformat() if until else None, "limit": limit, "after_seq": after_seq}  # fmt: skip
        params = {name: value for name, value in given.items() if value is not None}
        return Request("GET", "/v1/audit/events", _page, None, params)

    def decision_trail(self, decision_id: str) -> Request[list[AuditEvent]]:
        if not isinstance(decision_id, str) or not _PATH_ID.fullmatch(decision_id):
            raise InvalidCall(f"decision_id {show(decision_id)} is not a decision id",
                              [FieldProblem("decision_id", "not a decision id")])  # fmt: skip
        return Request("GET", f"/v1/audit/decisions/{decision_id}", _events)

    def _check(self, parameter: str, name: str | None) -> None:
        if name is None or self.principal is None or name == self.principal:
            return
        raise IdentityMismatch(
            f"{parameter}={show(name)}, but this client's token is {self.principal!r}'s, and the server acts as "
            f"the token's principal: pass {self.principal!r}, or use a client with {show(name)}'s token"
        )


def _session(session_id: object) -> str:
    """``session_id`` for a URL path; one that cannot be an id is not found, as in process."""
    return _path_id(session_id, SessionNotFound(f"no open session {show(session_id)}"))


def _approval(approval_id: object) -> str:
    return _path_id(approval_id, ApprovalError(f"no approval {show(approval_id)} (unknown, or no longer kept)"))


def _path_id(value: object, missing: StockadeError) -> str:
    if not isinstance(value, str) or not _PATH_ID.fullmatch(value):
        raise missing
    return value


def _args(tool: str, args: Mapping[str, Any] | str | bytes) -> Any:
    """Arguments as the API takes them: a JSON value, or JSON text (which the server parses, as in process)."""
    if not isinstance(args, bytes):
        return args
    try:
        return args.decode(json.detect_encoding(args))
    except UnicodeDecodeError as exc:
        raise InvalidCall(f'arguments for {tool!r} are not valid JSON: send a JSON object such as {{"x": 1}}',
                          [FieldProblem("args", "not valid JSON")]) from exc  # fmt: skip


def _inputs(inputs: Mapping[str, bytes]) -> dict[str, str]:
    encoded = {}
    for name, data in inputs.items():
        if not isinstance(data, bytes):
            raise InvalidCall(f"input {name!r} must be bytes", [FieldProblem(f"inputs[{name!r}]", "not bytes")])
        encoded[name] = base64.b64encode(data).decode()
    return encoded


def _json(body: Mapping[str, Any]) -> bytes:
    """``body`` as JSON (ASCII: a lone surrogate travels escaped, for the server to refuse by name).

    Raises:
        InvalidCall: naming the first field that is not JSON.
    """
    try:
        return json.dumps(body, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError, RecursionError):
        pass
    for field, value in body.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidCall(
                f"{field} is not JSON-serialisable ({type(exc).__name__}: {str(exc)[:200]}): use strings, numbers, "
                "booleans, null, lists and objects only",
                [FieldProblem(field, "not JSON-serialisable")],
            ) from exc
    raise AssertionError("unreachable: a body whose every field is JSON is JSON")  # pragma: no cover


def _events(events: Any) -> list[AuditEvent]:
    return [AuditEvent.model_validate(e) for e in events]


def _page(page: Any) -> list[AuditEvent]:
    """One page of /v1/audit/events (``{"events": [...], "next_after_seq": n}``): its events; pass
    the last one's seq as ``after_seq`` for the next page."""
    return _events(page["events"])
