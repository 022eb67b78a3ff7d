"""The HTTP application: ``create_app(plane)`` (OpenAPI 3.1 at ``/openapi.json``: `router.interfaces.api.openapi`).

Every ``/v1`` request carries ``Authorization: Bearer <token>``; the token's sha256 names one
configured principal (``STOCKADE_API_PRINCIPALS``) with one role:

=========  =====================================================================================
agent      open sessions (as itself) and, in its own sessions only, decide, call, report, close;
           list tools; register tools if ``may_register``
approver   list, show, approve, deny approvals (never one its own agent identity asked for)
auditor    audit query, one decision's trail, verify; policy status
admin      everything an auditor may, register tools, reload the policy, close any session
=========  =====================================================================================

Unknown or missing tokens get 401, a wrong role 403, another agent's session 404 (its existence
is not revealed); every refusal is audited. Errors are RFC 9457 problems (`router.interfaces.api.problems`).
Bodies over ``api_max_body_bytes`` get 413; requests over ``api_request_timeout_s``, 504. No
recursive parser sees a body that nests too deep: on FastAPI's routes (whose parser, Python's
json, recurses) the body is read at the door first, and one that is not JSON text or nests lists
and objects deeper than `MAX_BODY_NESTING` gets a 422 problem; the per-call routes parse with
pydantic, which does not recurse in Python and stops at about 200 levels, answered the same way.
Each such refusal is audited, as is every body that does not match its schema. A call nested
deeper than its arguments may be (`router.tools.MAX_NESTING`) but not that deep reaches the
control plane, which refuses and audits it with its session.

Services that receive stockade tokens use ``POST /v1/credentials/introspect`` (RFC 7662, with a
token from ``STOCKADE_INTROSPECTION_TOKENS``) and ``GET /.well-known/jwks.json``.
"""

import asyncio
import base64
import binascii
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal, get_args, get_type_hints
from urllib.parse import parse_qs

import structlog
from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from pydantic import AwareDatetime, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema
from starlette.exceptions import HTTPException
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from policy import ReportsLoadStatus
from router import metrics
from router.approvals import Approval, ApprovalStatus
from router.audit.checkpoint import Checkpoint
from router.control import VERSION, ControlPlane
from router.credentials import introspect, jwks
from router.errors import FieldProblem, InvalidCall, StockadeError
from router.interfaces import bearer
from router.interfaces.api import openapi
from router.interfaces.api.openapi import INTROSPECTION, problems
from router.interfaces.api.problems import (
    from_exception,
    from_http_error,
    internal_error,
    invalid_body,
    invalid_request,
    problem,
)
from router.results import DecisionResult, ToolResult
from router.settings import ApiPrincipal
from router.tools import MAX_NESTING, TOOL_NAME, ToolSpec, json_too_deep, show

log = structlog.get_logger("stockade.api")

Role = Literal["agent", "approver", "auditor", "admin"]
_MAX_FORM = 16 * 1024
_UNAUTHENTICATED = "send one Authorization: Bearer <token> header, of a configured principal"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_DATE_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)", re.IGNORECASE)
# Levels of lists and objects a body on FastAPI's routes may nest: twice what a call's arguments
# may, and far below where Python's json (which recurses) would fail.
MAX_BODY_NESTING = 2 * MAX_NESTING


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_PRINTABLE = WithJsonSchema({"type": "string", "minLength": 1, "maxLength": 256, "format": "printable"})


class OpenSession(_Body):
    # Documented as `router.sessions` checks it (call.invalid otherwise). "printable" is Python's
    # str.isprintable, which no regular expression that JSON Schema tools share can state.
    principal: Annotated[str, _PRINTABLE] = Field(description="the human the agent acts for: printable text, not blank")
    trusted_context: list[str] = Field(
        default_factory=list,
        json_schema_extra={"maxItems": 1000},
        description="what the user gave: request, addresses (at most 256 KiB of UTF-8 text in all)",
    )


class SessionOpened(_Body):
    session_id: str


# Documented as the control plane reads them (it refuses anything else with call.invalid, audited
# with the session, so the bodies themselves stay loose): a registered tool's name, and its
# arguments as a JSON object or as that object's JSON text.
_TOOL_NAME = WithJsonSchema({"type": "string", "pattern": f"^{TOOL_NAME.pattern}$"})
_ARGS = WithJsonSchema({"oneOf": [
    {"type": "object"},
    {"type": "string", "contentMediaType": "application/json", "contentSchema": {"type": "object"}},
]})  # fmt: skip
_BASE64 = WithJsonSchema({"type": "string", "contentEncoding": "base64",
                          "pattern": "^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"})  # fmt: skip
# An input file's name, as runner.files.check_input_name takes it: one plain path component.
_INPUT_NAME = r"^(?!\.\.?$)[A-Za-z0-9._+@=-][A-Za-z0-9._+@= -]{0,254}$"


class Decide(_Body):
    tool: Annotated[str, _TOOL_NAME] = Field(description="a registered tool's name")
    args: Annotated[Any, _ARGS] = Field(
        default_factory=dict, description="the tool's arguments: a JSON object, or its JSON text"
    )


class Call(Decide):
    approval_id: str | None = None
    inputs: dict[str, Annotated[str, _BASE64]] = Field(
        default_factory=dict, json_schema_extra={"propertyNames": {"pattern": _INPUT_NAME}},
        description="file name -> base64 content, read-only at /in",
    )  # fmt: skip


class Report(_Body):
    call_id: str
    output: Any = Field(description="the tool's output: any JSON value")


class ApprovalNote(_Body):
    note: str = Field(default="", max_length=2000)


class EndorsementRequest(_Body):
    call_id: str = Field(min_length=1, max_length=200, description="the earlier call whose output to endorse")
    note: str = Field(default="", max_length=2000, description="why (the user's words), for the audit log")


class Endorsement(_Body):
    session_id: str
    call_id: str
    source: str = Field(description="the endorsed source label, as policy sees it in input.session.endorsed")


class PolicyInForce(_Body):
    revision: str = Field(description="the revision deciding now (R+sha256 for a bundle with manifest revision R)")
    source: str = Field(description="the policy directory or bundle file it was loaded from")
    loaded_at: AwareDatetime = Field(description="when it was loaded")


class PolicyOnDisk(_Body):
    loaded: bool = Field(description="whether the files on disk loaded at the last attempt (then they are in force)")
    error: str | None = Field(default=None, description="why they did not (file:line: message)")
    revision: str | None = Field(
        default=None,
        description="the revision of the files that failed (sha256:<digest> for a bundle file that could not be "
        "read as one); once they load, the revision in force",
    )
    at: AwareDatetime = Field(description="when the router last tried to load them")


class PolicyStatus(_Body):
    revision: str = Field(description="the revision of the policy in force (the last one that loaded)")
    engine: str
    files_problem: str | None = Field(
        default=None, description="why the files on disk did not load at the last try (the revision above decides)"
    )
    in_force: PolicyInForce | None = Field(default=None, description="the policy deciding now")
    on_disk: PolicyOnDisk | None = Field(default=None, description="whether the files on disk loaded at the last try")


class Readiness(_Body):
    ready: bool
    checks: dict[str, bool] = Field(description="policy, store, audit: whether each passes")
    problems: dict[str, str] = Field(description="why each failing check fails (and policy_files, if they do not load)")
    degraded: dict[str, str] = Field(
        default_factory=dict,
        description="checks that pass with a warning: policy, when the files on disk failed to load (the previous "
        "revision stays in force and decides)",
    )


class Introspection(_Body):
    """RFC 7662 §2.2: ``{"active": false}``, or the claims of a live token (router.credentials)."""

    active: bool
    token_type: str | None = None
    client_id: str | None = None
    iss: str | None = None
    sub: str | None = None
    aud: str | None = None
    scope: str | None = None
    iat: int | None = None
    nbf: int | None = None
    exp: int | None = None
    jti: str | None = None
    stockade: dict[str, Any] | None = Field(default=None, description="the call the token is bound to")


class OAuthError(_Body):
    """RFC 6749 §5.2, as the introspection endpoint answers errors (RFC 7662 §2.3)."""

    error: str
    error_description: str


class Verified(_Body):
    """The log checked against its signed checkpoints (see `stockade audit verify`)."""

    ok: bool
    events: int
    head_seq: int
    head_hash: str
    broken_seq: int | None = Field(default=None, description="the first seq that does not check out")
    problem: str = ""
    signed: int = Field(default=0, description="events a signed checkpoint vouches for")
    checkpoints: int = Field(default=0, description="signed checkpoints checked")
    retired: int = Field(default=0, description="events deleted by retention, each range under a signed tombstone")
    notes: list[str] = Field(default_factory=list, description="what was not checked, or not signed yet")


class _Refused(Exception):
    """A request turned away at the door; its (audited) answer is ready."""

    def __init__(self, response: JSONResponse) -> None:
        self.response = response


class Gate:
    """Authentication and roles; every refusal audited. (Session ownership is the control
    plane's: the routes pass the agent along.)"""

    def __init__(self, plane: ControlPlane) -> None:
        self._plane = plane
        self._principals = [(bytes.fromhex(p.token_sha256), p) for p in plane.settings.api_principals]
        self._roles: dict[Callable[..., Any], tuple[Role, ...]] = {}  # each `require` dependency's

    async def refuse(self, request: Request, status: int, reason: str, who: str | None = None) -> _Refused:
        # Recorded under the problem's own code, so an auditor tells token guessing (401) from
        # role probing (403), and with the client's address.
        code = "auth.unauthenticated" if status == 401 else "auth.forbidden"
        client = f"{request.client.host}:{request.client.port}" if request.client is not None else None
        await self._plane.record_refusal(who, f"{request.method} {request.url.path}", reason, code=code,
                                         detail={"client": client} if client else None)  # fmt: skip
        headers = {"WWW-Authenticate": 'Bearer realm="stockade"'} if status == 401 else None
        return _Refused(
            problem(status, code, "Unauthorized" if status == 401 else "Forbidden", reason, headers=headers)
        )

    async def turn_away(
        self, request: Request, response: JSONResponse, reason: str, who: str | None = None
    ) -> JSONResponse:
        """Audit a request refused for what it sent (its body, its route) and answer ``response``.
        ``who``: the caller, if known; else whoever its token names, if anyone."""
        if who is None:
            principal = self.lookup(presented(request))
            who = principal.name if principal is not None else None
        try:  # the problem's own code, so the record says what was refused, not only that it was
            code = str(json.loads(bytes(response.body))["code"])
        except (ValueError, KeyError, TypeError):
            code = "request.refused"
        await self._plane.record_refusal(who, f"{request.method} {request.url.path}", reason, code=code)
        return response

    async def check_body(self, request: Request) -> JSONResponse | None:
        """None if the request's JSON body may be parsed (by FastAPI: Python's json, which
        recurses), else its (audited) problem answer."""
        found = body_problem(await request.body())
        if found is None:
            return None
        code, detail = found
        return await self.turn_away(request, invalid_body(code, detail), f"{code}: {detail}")

    def lookup(self, digest: bytes | None) -> ApiPrincipal | None:
        return bearer.match(digest, self._principals)

    def require(self, *roles: Role) -> Callable[[Request], Awaitable[ApiPrincipal]]:
        """A FastAPI dependency: the caller's principal, if it has one of ``roles``."""

        async def authenticate(request: Request) -> ApiPrincipal:
            principal = self.lookup(presented(request))
            if principal is None:
                raise await self.refuse(request, 401, _UNAUTHENTICATED)
            if principal.role not in roles:
                raise await self.refuse(request, 403, f"role {principal.role} may not do this (needs "
                                        f"{' or '.join(roles)})", principal.name)  # fmt: skip
            return principal

        self._roles[authenticate] = roles
        return authenticate

    def roles(self, dependant: Dependant) -> tuple[Role, ...] | None:
        """The roles a route (its ``dependant``) lets in, if it takes a principal (`require`)."""
        for dependency in dependant.dependencies:
            found = self._roles.get(dependency.call) if dependency.call is not None else None
            found = found if found is not None else self.roles(dependency)
            if found is not None:
                return found
        return None


def allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """The methods the routes on ``scope``'s path take, for a 405's ``Allow``."""
    methods: set[str] = set()
    for route in app.router.routes:
        if isinstance(route, Route) and route.methods and route.matches(scope)[0] is not Match.NONE:
            methods |= route.methods
    return sorted(methods)


def _rfc3339(value: object) -> object:
    if isinstance(value, str) and not _DATE_TIME.fullmatch(value):
        raise ValueError("not an RFC 3339 date-time with an offset, such as 2025-01-31T09:00:00Z")
    return value


# A point in time as the API takes it: RFC 3339 text with its offset ("format": "date-time").
# Alone, pydantic would also read a number as a Unix time, and a time without an offset as naive
# (which the audit log cannot compare with its own times).
Instant = Annotated[AwareDatetime, BeforeValidator(_rfc3339)]


def body_problem(body: bytes) -> tuple[str, str] | None:
    """What is wrong with a JSON body, as (problem code, detail), found before a recursive parser
    sees it: not JSON text, nested deeper than `MAX_BODY_NESTING`, or not valid JSON."""
    if not body:
        return None  # no body: the schema says whether one was needed
    try:
        # What json.loads does with bytes, so the depth is measured on the text it would parse.
        text = body.decode(json.detect_encoding(body), "surrogatepass")
    except UnicodeDecodeError as exc:
        return "request.invalid", f"the body is not JSON text: {exc.reason} at byte {exc.start}; send UTF-8"
    if json_too_deep(text, MAX_BODY_NESTING):
        return "request.too_deep", (
            f"the body nests lists and objects more than {MAX_BODY_NESTING} levels deep: flatten it"
        )
    try:
        json.loads(text)
    except ValueError as exc:  # JSONDecodeError, an integer over Python's digit limit, ...
        return "request.invalid", f"the body is not valid JSON: {exc}"
    return None


def _json_body(request: Request) -> bool:
    """Whether FastAPI would parse the request's body as JSON (no content type counts)."""
    kind = request.headers.get("content-type", "application/json").partition(";")[0].strip().lower()
    return kind == "application/json" or kind.endswith("+json")


def checked_route(gate: Gate) -> type[APIRoute]:
    """FastAPI's route class, with the JSON body read at the door (`Gate.check_body`) before
    FastAPI parses it: deep nesting and unreadable JSON get a problem document, not a 500 or a
    plain 400. Every route with a body takes a principal: a caller without one is refused (401,
    audited) before its body is read, so strangers cost no parsing. Each route's OpenAPI entry
    gets the answers and security this implies (`router.interfaces.api.openapi.describe`)."""

    class CheckedRoute(APIRoute):
        def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
            super().__init__(path, endpoint, **kwargs)
            openapi.describe(self, gate.roles(self.dependant), get_args(Role))

        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()
            if self.body_field is None:
                return handler

            async def checked(request: Request) -> Response:
                if gate.lookup(presented(request)) is None:
                    return (await gate.refuse(request, 401, _UNAUTHENTICATED)).response
                if _json_body(request):
                    refused = await gate.check_body(request)
                    if refused is not None:
                        return refused
                return await handler(request)

            return checked

    return CheckedRoute


def presented(request: Request) -> bytes | None:
    """The sha256 of the request's bearer token, if it sends exactly one Authorization header:
    with several, a proxy in front might check one while this reads another (as MCP over HTTP)."""
    headers = request.headers.getlist("authorization")
    return bearer.presented(headers[0]) if len(headers) == 1 else None


class Limits:
    """Body size and request time limits, as plain ASGI (Starlette's BaseHTTPMiddleware costs a
    task and a stream per request): 413 for a body declared or sent over ``max_body``, 504 for a
    request not answered within ``timeout_s``. Each is a refusal, audited through ``gate`` (as
    whoever the bearer token names, if anyone) before it is answered."""

    def __init__(self, app: ASGIApp, *, max_body: int, timeout_s: float, gate: Gate | None = None) -> None:
        self._app = app
        self._max_body = max_body
        self._timeout_s = timeout_s
        self._gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self._max_body):
            said = declared[:40].decode("latin-1")
            await self._answer(scope, receive, send, self._too_large(), f"request.too_large: Content-Length {said}")
            return
        received = 0
        started = False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self._max_body:
                raise _TooLarge
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            async with asyncio.timeout(self._timeout_s):  # unlike wait_for (3.11), no task per request
                await self._app(scope, counted, tracked)
        except _TooLarge:
            if not started:
                reason = f"request.too_large: over {self._max_body} bytes sent"
                await self._answer(scope, receive, send, self._too_large(), reason)
        except TimeoutError:
            if not started:
                detail = f"not answered within {self._timeout_s:g}s (STOCKADE_API_REQUEST_TIMEOUT_S)"
                await self._answer(scope, receive, send, problem(504, "request.timeout", "Timed out", detail),
                                   f"request.timeout: {detail}")  # fmt: skip

    async def _answer(self, scope: Scope, receive: Receive, send: Send, response: JSONResponse, reason: str) -> None:
        """Answer ``response``, audited first."""
        if self._gate is not None:
            response = await self._gate.turn_away(Request(scope), response, reason)
        await response(scope, receive, send)

    def _too_large(self) -> JSONResponse:
        return too_large_problem(self._max_body)


def too_large_problem(max_body: int) -> JSONResponse:
    """413 for a body over ``max_body`` bytes, declared or sent."""
    return problem(413, "request.too_large", "Payload too large",
                   f"bodies are limited to {max_body} bytes (STOCKADE_API_MAX_BODY_BYTES)")  # fmt: skip


class _TooLarge(Exception):
    """A streamed body went over the limit."""


Endpoint = Callable[..., Awaitable[BaseModel]]


class PerCallRoutes:
    """The routes every agent call takes (decide, calls, reports), served ahead of FastAPI's stack.

    FastAPI's per-request machinery (dependency solving, response validation, five middleware
    layers) measured ~40% of a router's CPU on these routes (docs/design-notes.md). The endpoints
    stay FastAPI's (they are what ``/openapi.json`` documents, and the functions called here):
    this matches the path, authenticates with the endpoint's own dependency, validates the body
    with the endpoint's own model, answers errors with the same problem documents, and calls the
    endpoint. Everything else goes on to FastAPI (``app``)."""

    def __init__(self, gate: Gate) -> None:
        self.app: ASGIApp | None = None
        self._gate = gate
        self._routes: list[tuple[re.Pattern[str], Endpoint, type[BaseModel], Callable[[Request], Awaitable[Any]]]] = []

    def add(self, path: str, endpoint: Endpoint) -> None:
        """Serve POST ``path`` (``{name}`` segments become keyword arguments) with ``endpoint``, whose
        ``body`` is a pydantic model and whose ``principal`` is an ``Annotated[..., Depends(...)]``."""
        hints = get_type_hints(endpoint, include_extras=True)
        authenticate = hints["principal"].__metadata__[0].dependency
        # Matched whole (fullmatch): "$" would also match before a final newline ("/calls%0A").
        pattern = re.compile(re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(path)))
        self._routes.append((pattern, endpoint, hints["body"], authenticate))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _CONTROL.search(scope["path"]):
            # A decoded %0A or %00 in the path: Starlette's routes would match "/x\n" as "/x"
            # ("$" matches before a final newline), so such a path is refused before any route.
            request = Request(scope, receive)
            detail = f"the path {show(scope['path'])} holds control characters: no route has them"
            refused = await self._gate.turn_away(request, from_http_error(400, detail), f"http.400: {detail}")
            await refused(scope, receive, send)
            return
        if scope["type"] == "http" and scope["method"] == "POST":
            for pattern, endpoint, model, authenticate in self._routes:
                matched = pattern.fullmatch(scope["path"])
                if matched is not None:
                    request = Request(scope, receive)
                    response = await self._serve(
                        request, endpoint, model, authenticate, matched.groupdict(), self._gate
                    )
                    await response(scope, receive, send)
                    return
        if self.app is None:
            raise RuntimeError("PerCallRoutes.app is set when FastAPI builds its middleware stack")
        await self.app(scope, receive, send)

    @staticmethod
    async def _serve(
        request: Request, endpoint: Endpoint, model: type[BaseModel],
        authenticate: Callable[[Request], Awaitable[Any]], path: dict[str, str], gate: Gate,
    ) -> Response:  # fmt: skip
        try:
            principal = await authenticate(request)
            kind = request.headers.get("content-type", "application/json").partition(";")[0].strip().lower()
            if not _json_body(request):
                message = f"send the body as application/json, not {kind}"
                return await gate.turn_away(request, invalid_request([{"loc": ("body",), "msg": message}]),
                                            f"request.invalid: {message}", principal.name)  # fmt: skip
            try:
                # pydantic's parser does not recurse in Python; it stops, and says so, at ~250 levels.
                body = model.model_validate_json(await request.body())
            except ValidationError as exc:
                found = exc.errors(include_url=False)
                errors = [{**e, "loc": ("body", *e["loc"])} for e in found]
                if any(e["type"] == "json_invalid" and "recursion limit" in e["msg"] for e in found):
                    detail = (f"the body nests lists and objects too deep to read: flatten it (a call's arguments "
                              f"may nest {MAX_NESTING} levels)")  # fmt: skip
                    return await gate.turn_away(request, invalid_body("request.too_deep", detail),
                                                f"request.too_deep: {detail}", principal.name)  # fmt: skip
                reason = "request.invalid: " + "; ".join(f"{e['loc']}: {e['msg']}" for e in errors[:5])
                return await gate.turn_away(request, invalid_request(errors), reason[:300], principal.name)
            result = await endpoint(**path, body=body, principal=principal)
        except _Refused as exc:
            return exc.response
        except StockadeError as exc:
            return from_exception(exc)
        except _TooLarge:
            raise  # Limits answers it
        except Exception:
            log.exception("request_failed", path=request.url.path)
            return internal_error()
        return Response(result.model_dump_json(), media_type="application/json")


# What the registry checks of a tool spec beyond its types (router.wire.ToolSpec's validators), as
# far as JSON Schema can say it: the rest (arguments named in *_args are input_schema properties,
# output paths, what policy refuses) is answered with 422 tool.invalid_spec or tool.refused_by_policy.
_SPEC_CHECKS: dict[str, dict[str, dict[str, Any]]] = {ToolSpec.__name__: {
    "name": {"pattern": f"^{TOOL_NAME.pattern}$"},
    "input_schema": {"required": ["type"], "properties": {"type": {"const": "object"}},
                     "description": "a JSON Schema (draft 2020-12) of the arguments: an object"},
}}  # fmt: skip


class _Api(FastAPI):
    """FastAPI with `Limits` outermost, `PerCallRoutes` ahead of its own stack, and the OpenAPI
    document completed (`router.interfaces.api.openapi`)."""

    def __init__(self, *, per_call: PerCallRoutes, gate: Gate, max_body: int, timeout_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.per_call = per_call
        self._gate = gate
        self._max_body, self._timeout_s = max_body, timeout_s

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            self.openapi_schema = openapi.complete(super().openapi(), _SPEC_CHECKS)
        return self.openapi_schema

    def build_middleware_stack(self) -> ASGIApp:
        self.per_call.app = super().build_middleware_stack()
        return Limits(self.per_call, max_body=self._max_body, timeout_s=self._timeout_s, gate=self._gate)


def create_app(plane: ControlPlane, *, close_plane: bool = False) -> FastAPI:
    """The HTTP API over ``plane``; ``close_plane``: close it when the server shuts down."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # The policy watcher and the session sweeper run from the server's start, not from the
        # first session: a router nobody has called yet must still pick up a policy push.
        plane.start()
        yield
        if close_plane:
            await plane.aclose()

    gate = Gate(plane)
    per_call = PerCallRoutes(gate)
    app = _Api(
        title="stockade", version=VERSION, lifespan=lifespan, per_call=per_call, gate=gate,
        max_body=plane.settings.api_max_body_bytes, timeout_s=plane.settings.api_request_timeout_s,
        # FastAPI's OpenTelemetry hooks look for a configured provider on every request; stockade
        # reports through /metrics and its audit log instead.
        telemetry={"tracing": False, "metrics": False, "logs": False},
        generate_unique_id_function=openapi.operation_id, openapi_tags=openapi.TAGS,
        # One schema per model, as requests are validated: POST /v1/tools takes the ToolSpec it answers.
        separate_input_output_schemas=False,
    )  # fmt: skip
    app.router.route_class = checked_route(gate)
    _errors(app, plane, gate)
    _sessions(app, plane, gate, per_call)
    _approvals(app, plane, gate)
    _audit(app, plane, gate)
    _checkpoints(app, plane, gate)
    _credentials(app, plane)
    return app


def _errors(app: FastAPI, plane: ControlPlane, gate: Gate) -> None:
    @app.exception_handler(_Refused)
    async def refused(_: Request, exc: _Refused) -> JSONResponse:
        return exc.response

    @app.exception_handler(StockadeError)
    async def stockade_error(_: Request, exc: StockadeError) -> JSONResponse:
        return from_exception(exc)

    @app.exception_handler(RequestValidationError)
    async def schema_mismatch(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        reason = "request.invalid: " + "; ".join(f"{e['loc']}: {e['msg']}" for e in errors[:5])
        return await gate.turn_away(request, invalid_request(errors), reason[:300])

    @app.exception_handler(_TooLarge)
    async def too_large(request: Request, __: _TooLarge) -> JSONResponse:
        # A body streamed past the limit while a route read it: the 413 `Limits` answers (it
        # reaches `Limits` only after FastAPI's stack has answered 500 otherwise), audited as there.
        limit = plane.settings.api_max_body_bytes
        return await gate.turn_away(request, too_large_problem(limit), f"request.too_large: over {limit} bytes sent")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # No route, a wrong method, or a body FastAPI could not read: a problem document too.
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Starlette names the methods of the first route on the path only
            headers["Allow"] = ", ".join(allowed_methods(app, request.scope))
        response = from_http_error(exc.status_code, str(exc.detail), headers)
        if exc.status_code >= 500:
            return response
        return await gate.turn_away(request, response, f"http.{exc.status_code}: {exc.detail}"[:300])

    @app.exception_handler(Exception)
    async def unexpected(request: Request, _: Exception) -> JSONResponse:
        # Starlette logs the exception itself (it re-raises it to the server after answering).
        return internal_error()

    @app.get("/healthz", tags=["operations"])
    async def get_health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", tags=["operations"], response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format 0.0.4"}})  # fmt: skip
    async def get_metrics() -> Response:
        for tier, sandbox in plane.sandboxes.items():
            warm = getattr(sandbox, "warm", None)
            if isinstance(warm, int):
                metrics.POOL_READY.labels(tier).set(warm)
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/readyz", tags=["operations"], response_model=Readiness,
             responses={503: {"model": Readiness, "description": "not ready: a check fails"}})  # fmt: skip
    async def get_readiness() -> JSONResponse:
        found = await plane.readiness_problems()
        checks = {name: found[name] is None for name in ("policy", "store", "audit")}
        ready = all(checks.values())
        # Files on disk that fail to load leave the router ready (200), reported as degraded: the
        # previous revision stays in force and decides every call as it did before the bad push.
        # Unready would gain nothing (a restart cannot load the files either, and would drop the
        # good policy) and would cost everything: every replica reads the same files, so an
        # orchestrator would take them all out of service at once over one broken edit.
        # Why they failed is not said here: anyone who reaches the port may ask, and the engine's
        # error quotes the policy's source (an allow-list, a name). GET /v1/policy says it, to auditors.
        degraded: dict[str, str] = {}
        if policy_files_problem(plane) is not None and checks["policy"]:
            degraded["policy"] = (f"the files on disk failed to load ({_WHY_POLICY}); the previous revision "
                                  f"{plane.policy.revision} stays in force")  # fmt: skip
        problems = {name: why for name, why in found.items() if why is not None}
        if "policy_files" in problems:
            problems["policy_files"] = f"the files on disk do not load ({_WHY_POLICY}); the last good policy decides"
        body = Readiness(ready=ready, checks=checks, degraded=degraded, problems=problems)
        return JSONResponse(body.model_dump(), status_code=200 if ready else 503)


def _sessions(app: FastAPI, plane: ControlPlane, gate: Gate, per_call: PerCallRoutes) -> None:
    Agent = Annotated[ApiPrincipal, Depends(gate.require("agent"))]
    Registrar = Annotated[ApiPrincipal, Depends(gate.require("agent", "admin"))]
    Owner = Annotated[ApiPrincipal, Depends(gate.require("agent", "admin"))]
    Anyone = Annotated[ApiPrincipal, Depends(gate.require("agent", "approver", "auditor", "admin"))]

    # The spec is validated by the registry (its problems name the fields: tool.invalid_spec), so
    # FastAPI takes any object; the document says what the registry takes.
    @app.post("/v1/tools", status_code=201, tags=["tools"], responses=problems(
        (403, "the role may not register tools, or the agent is not may_register"),
        (409, "a tool of that name is registered"),
        (422, "the spec is invalid (tool.invalid_spec), policy would refuse every call to it "
              "(tool.refused_by_policy), or the body is not JSON or nests too deep"),
    ))  # fmt: skip
    async def register_tool(
        spec: Annotated[dict[str, Any], WithJsonSchema({"$ref": f"#/components/schemas/{ToolSpec.__name__}"})],
        principal: Registrar, request: Request,
    ) -> ToolSpec:  # fmt: skip
        if principal.role == "agent" and not principal.may_register:
            raise await gate.refuse(request, 403, f"agent {principal.name} may not register tools", principal.name)
        return await plane.register(spec)

    @app.get("/v1/tools", tags=["tools"], responses=problems(503))
    async def list_tools(_: Anyone) -> list[ToolSpec]:
        return await plane.list_tools()  # with those other routers added to the shared store

    @app.post("/v1/sessions", status_code=201, tags=["sessions"], responses=problems(403, 503))
    async def open_session(body: OpenSession, principal: Agent, request: Request) -> SessionOpened:
        refusal = principal.refuses_to_act_for(body.principal, plane.settings.principal_config(body.principal))
        if refusal is not None:
            await plane.record_refusal(principal.name, "POST /v1/sessions", refusal)
            raise _Refused(problem(403, "auth.forbidden", "Forbidden", refusal))
        try:
            opened = await plane.open_session(principal.name, body.principal, body.trusted_context)
        except InvalidCall as exc:  # a principal or trusted_context the session cannot hold: audited as any 422
            reason = f"{exc.code}: " + "; ".join(str(p) for p in exc.problems[:5]) if exc.problems else str(exc)
            raise _Refused(await gate.turn_away(request, from_exception(exc), reason[:300], principal.name)) from exc
        return SessionOpened(session_id=opened)

    @app.delete("/v1/sessions/{session_id}", status_code=204, tags=["sessions"],
                responses=problems((404, "no open session with that id (of the agent's own)"), 503))  # fmt: skip
    async def close_session(session_id: str, principal: Owner) -> None:
        # An admin may close any session; an agent only its own.
        await plane.close_session(session_id, agent=None if principal.role == "admin" else principal.name)

    def each_call(path: str, *answers: int | tuple[int, str]) -> Callable[[Endpoint], Endpoint]:
        """Register ``endpoint`` with FastAPI (and its OpenAPI) and serve it through `PerCallRoutes`."""

        def register(endpoint: Endpoint) -> Endpoint:
            per_call.add(path, app.post(path, tags=["sessions"], responses=problems(*answers))(endpoint))
            return endpoint

        return register

    no_session = (404, "no open session of the agent's with that id, or no tool of that name")
    invalid_call = (422, "the call is malformed (call.invalid: its arguments, inputs or tool name), or the body "
                    "is not JSON, nests too deep or does not match the schema")  # fmt: skip

    @each_call("/v1/sessions/{session_id}/decide", no_session, invalid_call, 503)
    async def decide_call(session_id: str, body: Decide, principal: Agent) -> DecisionResult:
        return await plane.decide(session_id, body.tool, body.args, agent=principal.name)

    unapproved = (409, "approval_id is not an approval granted for exactly this call")

    @each_call("/v1/sessions/{session_id}/calls", no_session, unapproved, invalid_call, 503)
    async def call_tool(session_id: str, body: Call, principal: Agent) -> ToolResult:
        inputs = {}
        for name, encoded in body.inputs.items():
            try:
                inputs[name] = base64.b64decode(encoded, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise InvalidCall(f"inputs[{name[:60]!r}] is not base64", [FieldProblem(f"inputs.{name[:60]}",
                                  "not base64: encode file contents with base64")]) from exc  # fmt: skip
        return await plane.call(session_id, body.tool, body.args, inputs=inputs, approval_id=body.approval_id,
                                agent=principal.name)  # fmt: skip

    no_report = (422, "no call awaiting a report with that id (call.invalid), the output is over the cap, or the "
                 "body is not JSON, nests too deep or does not match the schema")  # fmt: skip

    @each_call(
        "/v1/sessions/{session_id}/reports", (404, "no open session of the agent's with that id"), no_report, 503
    )
    async def report_output(session_id: str, body: Report, principal: Agent) -> ToolResult:
        return await plane.report(session_id, body.call_id, body.output, agent=principal.name)


def _approvals(app: FastAPI, plane: ControlPlane, gate: Gate) -> None:
    Approver = Annotated[ApiPrincipal, Depends(gate.require("approver"))]

    unusable = (409, "no approval with that id, or it is not pending, or it was asked for by the approver's "
                "own agent identity")  # fmt: skip

    @app.get("/v1/approvals", tags=["approvals"], responses=problems(503))
    async def list_approvals(_: Approver, status: ApprovalStatus | None = None) -> list[Approval]:
        return await plane.list_approvals(status)

    @app.get("/v1/approvals/{approval_id}", tags=["approvals"],
             responses=problems((409, "no approval with that id (unknown, or no longer kept)"), 503))  # fmt: skip
    async def get_approval(approval_id: str, _: Approver) -> Approval:
        return await plane.get_approval(approval_id)

    @app.post("/v1/approvals/{approval_id}/approve", tags=["approvals"], responses=problems(unusable, 503))
    async def approve_approval(approval_id: str, body: ApprovalNote, principal: Approver) -> Approval:
        return await plane.approve(approval_id, principal.name, body.note)

    @app.post("/v1/approvals/{approval_id}/deny", tags=["approvals"], responses=problems(unusable, 503))
    async def deny_approval(approval_id: str, body: ApprovalNote, principal: Approver) -> Approval:
        return await plane.deny_approval(approval_id, principal.name, body.note)

    @app.post("/v1/sessions/{session_id}/endorsements", status_code=201, tags=["approvals"], responses=problems(
        (404, "no open session with that id"), (409, "the approver is the session's own agent"),
        (422, "the call left no output in the session, or the body is not JSON, nests too deep or does not match "
              "the schema"), 503,
    ))  # fmt: skip
    async def endorse_output(session_id: str, body: EndorsementRequest, principal: Approver) -> Endorsement:
        """A human endorses the output of an earlier call of the session (see ControlPlane.endorse)."""
        source = await plane.endorse(session_id, body.call_id, by=principal.name, note=body.note)
        return Endorsement(session_id=session_id, call_id=body.call_id, source=source)


def _checkpoints(app: FastAPI, plane: ControlPlane, gate: Gate) -> None:
    Auditor = Annotated[ApiPrincipal, Depends(gate.require("auditor", "admin"))]

    @app.get("/v1/audit/checkpoints", tags=["audit"], responses=problems(503))
    async def list_audit_checkpoints(
        _: Auditor,
        after_size: Annotated[int, Query(ge=0, description="only checkpoints of larger trees")] = 0,
        limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
    ) -> list[Checkpoint]:
        """The log's signed checkpoints (tree heads), oldest first: size, Merkle root, time, the
        checkpoint before, key id and Ed25519 signature. Keep the latest: `stockade audit verify
        --checkpoint` checks that the log still matches it."""
        found = [c for c in await plane.audit.checkpoints() if c.size > after_size]
        return found[:limit]


def _audit(app: FastAPI, plane: ControlPlane, gate: Gate) -> None:
    Auditor = Annotated[ApiPrincipal, Depends(gate.require("auditor", "admin"))]
    Admin = Annotated[ApiPrincipal, Depends(gate.require("admin"))]

    from router.interfaces.api.audit_query import add_query_routes  # noqa: PLC0415  (it imports this module)

    add_query_routes(app, plane, gate)

    @app.get("/v1/audit/verify", tags=["audit"], responses=problems(503))
    async def verify_audit_log(_: Auditor) -> Verified:
        report = await plane.audit.verify()
        return Verified(ok=report.ok, events=report.events, head_seq=report.head_seq, head_hash=report.head_hash,
                        broken_seq=report.broken_seq, problem=report.problem, signed=report.signed,
                        checkpoints=report.checkpoints, retired=report.retired, notes=list(report.notes))  # fmt: skip

    @app.get("/v1/policy", tags=["audit"])
    async def get_policy_status(_: Auditor) -> PolicyStatus:
        """The policy in force, and whether the files on disk loaded at the last try."""
        return policy_status(plane)

    @app.post("/v1/policy/reload", tags=["audit"], responses=problems((503, "the policy did not load, or its reload "
                                                                           "could not be audited: the old one stays in "
                                                                           "force")))  # fmt: skip
    async def reload_policy(principal: Admin, source: Literal["api", "cli"] = "api") -> PolicyStatus:
        """Reload the policy directory or bundle now; audited (``kind: policy``) whether it loads or not."""
        await plane.reload_policy(source=source, by=principal.name)
        return policy_status(plane)


_WHY_POLICY = "GET /v1/policy says why"


def policy_files_problem(plane: ControlPlane) -> str | None:
    """Why the policy files on disk did not load at the last try (None: they did): the engine's
    own record, else what the control plane's watcher met reading them."""
    status = plane.policy.load_status if isinstance(plane.policy, ReportsLoadStatus) else None
    if status is not None and status.error is not None:
        return status.error
    return plane.policy_problem


def policy_status(plane: ControlPlane) -> PolicyStatus:
    """``GET /v1/policy``: the revision in force and what became of the files on disk."""
    engine = plane.policy
    status = engine.load_status if isinstance(engine, ReportsLoadStatus) else None
    in_force = on_disk = None
    if status is not None:
        in_force = PolicyInForce(revision=status.revision, source=status.source, loaded_at=status.loaded_at)
        problem = policy_files_problem(plane)
        on_disk = PolicyOnDisk(
            loaded=problem is None, error=problem, at=status.attempted_at,
            revision=status.revision if problem is None else status.failed_revision,
        )  # fmt: skip
    return PolicyStatus(revision=engine.revision, engine=plane.settings.policy.engine,
                        files_problem=plane.policy_problem, in_force=in_force, on_disk=on_disk)  # fmt: skip


# RFC 7662 §2.1: the form a service posts (the route reads it itself: FastAPI's form parsing
# needs python-multipart, and the answers are OAuth's, not problem documents).
_INTROSPECTION_REQUEST = {"required": True, "content": {"application/x-www-form-urlencoded": {"schema": {
    "type": "object", "required": ["token"], "properties": {
        "token": {"type": "string", "minLength": 1, "description": "the token to check"},
        "call_id": {"type": "string", "description": "active only if the token was minted for this call"},
        "args_sha256": {"type": "string", "description": "active only if minted for arguments of this sha256"},
        "audience": {"type": "string", "description": "active only if minted for this audience (the service's "
                     "name as the credential's `audience`, or its first host)"},
    },
}}}}  # fmt: skip


def _credentials(app: FastAPI, plane: ControlPlane) -> None:
    introspectors = [(bearer.digest(t.get_secret_value()), True) for t in plane.settings.introspection_tokens]
    oauth_error = {"model": OAuthError}

    @app.post("/v1/credentials/introspect", tags=["credentials"], response_model=Introspection,
              openapi_extra={"security": [{INTROSPECTION: []}], "requestBody": _INTROSPECTION_REQUEST},
              responses={400: {**oauth_error, "description": "the form has no token"},
                         401: {**oauth_error, "description": "no token from STOCKADE_INTROSPECTION_TOKENS",
                               "headers": openapi.CHALLENGE},
                         413: {**oauth_error, **problems(413)[413], "description": "the form is over 16 KiB (OAuth "
                               "error), or the body over STOCKADE_API_MAX_BODY_BYTES (problem document)"},
                         **problems(503)})  # fmt: skip
    async def introspect_token(request: Request) -> JSONResponse:
        digest = presented(request)
        # Every configured token is compared, so the time taken says nothing about which matched.
        if bearer.match(digest, introspectors) is None:
            # On record as every refusal at the door is: guessing introspection tokens leaves a trace.
            await plane.record_refusal(None, "POST /v1/credentials/introspect", "no introspection token",
                                       code="auth.unauthenticated")  # fmt: skip
            return JSONResponse({"error": "invalid_client", "error_description": "send a bearer token from "
                                 "STOCKADE_INTROSPECTION_TOKENS"}, status_code=401,
                                headers={"WWW-Authenticate": 'Bearer realm="stockade"'})  # fmt: skip
        body = await request.body()
        if len(body) > _MAX_FORM:
            await plane.record_refusal(None, "POST /v1/credentials/introspect", "form over 16 KiB",
                                       code="request.too_large")  # fmt: skip
            return JSONResponse({"error": "invalid_request", "error_description": "form over 16 KiB"}, 413)
        form = {k: v[0] for k, v in parse_qs(body.decode("utf-8", "replace")).items()}
        if not form.get("token"):
            await plane.record_refusal(None, "POST /v1/credentials/introspect", "form field token is required",
                                       code="request.invalid")  # fmt: skip
            return JSONResponse({"error": "invalid_request", "error_description": "form field token is required"},
                                status_code=400)  # fmt: skip
        result: dict[str, Any] = await introspect(
            plane.store, form["token"], call_id=form.get("call_id"), args_sha256=form.get("args_sha256"),
            audience=form.get("audience"),
        )  # fmt: skip
        return JSONResponse(result, headers={"Cache-Control": "no-store"})

    @app.get("/.well-known/jwks.json", tags=["credentials"], responses=problems(503))
    async def get_jwks() -> dict[str, list[dict[str, Any]]]:
        return await jwks(plane.store)
