"""The Python SDK: the control plane's methods over HTTP (`StockadeClient`), a thin synchronous
wrapper (`SyncStockadeClient`), and adapters that hand registered tools to model APIs.

Results are the same typed models the in-process `ControlPlane` returns; errors are the same
exceptions, rebuilt from the API's problem details by their ``code``. Only idempotent requests
(GET) are retried, on connection errors and 502/503/504: a call is never sent twice.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import textwrap
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

import httpx
from pydantic import TypeAdapter, create_model

from router.approvals import Approval, ApprovalStatus
from router.audit import AuditEvent
from router.errors import FieldProblem, InvalidCall, StockadeError
from router.results import DecisionResult, ToolResult
from router.tools import ToolSpec

T = TypeVar("T")


class ApiError(StockadeError):
    """The API refused the request for a reason with no in-process exception (auth, limits)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def _by_code() -> dict[str, type[StockadeError]]:
    """Every exception stockade defines, by its ``code`` (the problem type the API sends)."""
    found: dict[str, type[StockadeError]] = {}
    pending: list[type[StockadeError]] = [StockadeError]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls is not ApiError:
            found.setdefault(cls.code, cls)
    return found


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        body = response.json()
    except ValueError:
        body = {}
    code = str(body.get("code", f"http.{response.status_code}"))
    detail = str(body.get("detail", response.text[:500]))
    cls = _by_code().get(code)
    if cls is InvalidCall:
        problems = [FieldProblem(str(e.get("field")), str(e.get("problem"))) for e in body.get("errors", [])]
        raise InvalidCall(detail, problems)
    if cls is not None:
        raise cls(detail)
    raise ApiError(response.status_code, code, detail)


class StockadeClient:
    """`ControlPlane`'s methods against a stockade server; the agent is the token's principal."""

    def __init__(
        self, base_url: str, token: str, *, timeout_s: float = 600.0, retries: int = 2,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:  # fmt: skip
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout_s, transport=transport,
                                       headers={"Authorization": f"Bearer {token}"})  # fmt: skip
        self._retries = retries

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        attempts = self._retries + 1 if method == "GET" else 1
        for attempt in range(attempts):
            try:
                response = await self._http.request(method, path, **kwargs)
            except httpx.TransportError:
                if attempt + 1 == attempts:
                    raise
                await asyncio.sleep(0.1 * 2**attempt)
                continue
            if response.status_code in (502, 503, 504) and attempt + 1 < attempts:
                await asyncio.sleep(0.1 * 2**attempt)
                continue
            _raise_for(response)
            return response.json() if response.content else None
        raise AssertionError("unreachable")  # pragma: no cover

    async def register(self, spec: ToolSpec | Mapping[str, Any]) -> ToolSpec:
        body = spec.model_dump(mode="json") if isinstance(spec, ToolSpec) else dict(spec)
        return ToolSpec.model_validate(await self._request("POST", "/v1/tools", json=body))

    async def list_tools(self) -> list[ToolSpec]:
        return [ToolSpec.model_validate(t) for t in await self._request("GET", "/v1/tools")]

    async def open_session(self, principal: str, trusted_context: list[str] | None = None) -> str:
        body = {"principal": principal, "trusted_context": trusted_context or []}
        return str((await self._request("POST", "/v1/sessions", json=body))["session_id"])

    async def close_session(self, session_id: str) -> None:
        await self._request("DELETE", f"/v1/sessions/{session_id}")

    async def decide(self, session_id: str, tool: str, args: Any) -> DecisionResult:
        body = {"tool": tool, "args": args}
        return DecisionResult.model_validate(
            await self._request("POST", f"/v1/sessions/{session_id}/decide", json=body)
        )

    async def call(
        self, session_id: str, tool: str, args: Any, *, inputs: Mapping[str, bytes] | None = None,
        approval_id: str | None = None,
    ) -> ToolResult:  # fmt: skip
        body = {"tool": tool, "args": args, "approval_id": approval_id,
                "inputs": {k: base64.b64encode(v).decode() for k, v in (inputs or {}).items()}}  # fmt: skip
        return ToolResult.model_validate(await self._request("POST", f"/v1/sessions/{session_id}/calls", json=body))

    async def report(self, session_id: str, call_id: str, output: Any) -> ToolResult:
        body = {"call_id": call_id, "output": output}
        return ToolResult.model_validate(await self._request("POST", f"/v1/sessions/{session_id}/reports", json=body))

    async def list_approvals(self, status: ApprovalStatus | None = None) -> list[Approval]:
        params = {"status": status.value} if status else {}
        return [Approval.model_validate(a) for a in await self._request("GET", "/v1/approvals", params=params)]

    async def get_approval(self, approval_id: str) -> Approval:
        return Approval.model_validate(await self._request("GET", f"/v1/approvals/{approval_id}"))

    async def approve(self, approval_id: str, note: str = "") -> Approval:
        path = f"/v1/approvals/{approval_id}/approve"
        return Approval.model_validate(await self._request("POST", path, json={"note": note}))

    async def deny_approval(self, approval_id: str, note: str = "") -> Approval:
        path = f"/v1/approvals/{approval_id}/deny"
        return Approval.model_validate(await self._request("POST", path, json={"note": note}))

    async def endorse(self, session_id: str, call_id: str, note: str = "") -> str:
        """Endorse, as a human (an approver's token), the output of the session's call ``call_id``:
        its values count as trusted for this session (docs/policy.md). Returns the source label."""
        path = f"/v1/sessions/{session_id}/endorsements"
        answer = await self._request("POST", path, json={"call_id": call_id, "note": note})
        return str(answer["source"])

    async def audit_events(self, **filters: str | int) -> list[AuditEvent]:
        return [AuditEvent.model_validate(e) for e in await self._request("GET", "/v1/audit/events", params=filters)]

    async def decision_trail(self, decision_id: str) -> list[AuditEvent]:
        return [AuditEvent.model_validate(e) for e in await self._request("GET", f"/v1/audit/decisions/{decision_id}")]

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> StockadeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class SyncStockadeClient:
    """`StockadeClient` for synchronous code: the same methods, run on a private event loop thread."""

    def __init__(self, base_url: str, token: str, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="stockade-client", daemon=True)
        self._thread.start()
        self._client = self._run(self._make(base_url, token, options))

    @staticmethod
    async def _make(base_url: str, token: str, options: dict[str, Any]) -> StockadeClient:
        return StockadeClient(base_url, token, **options)

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._client, name)
        if not inspect.iscoroutinefunction(method):
            raise AttributeError(name)
        return lambda *args, **kwargs: self._run(method(*args, **kwargs))

    def close(self) -> None:
        self._run(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


def sandboxed_tool(**spec: Any) -> Callable[[Callable[..., Any]], dict[str, Any]]:
    """Decorator: a plain Python function (self-contained: imports inside it) as a ``python`` tool
    spec, its JSON Schema taken from the type hints. ``spec``: risk, capabilities, sandbox, ...

        @sandboxed_tool(risk="low")
        def word_count(text: str) -> int:
            "Count the words in a text."
            return len(text.split())

        await client.register(word_count)
    """

    def wrap(function: Callable[..., Any]) -> dict[str, Any]:
        signature = inspect.signature(function)
        fields = {name: (p.annotation if p.annotation is not inspect.Parameter.empty else Any,
                         ... if p.default is inspect.Parameter.empty else p.default)
                  for name, p in signature.parameters.items()}  # fmt: skip
        model = create_model(f"{function.__name__}_args", **fields)  # type: ignore[call-overload]
        schema = TypeAdapter(model).json_schema()
        source = textwrap.dedent(inspect.getsource(function))
        source = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("@sandboxed_tool"))
        return {"name": function.__name__, "description": inspect.getdoc(function) or function.__name__,
                "input_schema": {k: v for k, v in schema.items() if k != "title"},
                "executor": {"kind": "python", "source": source, "entrypoint": function.__name__},
                "risk": "low", **spec}  # fmt: skip

    return wrap


from router.client.adapters import anthropic_tools, langchain_tools, openai_tools  # noqa: E402  (re-exported)

__all__ = [
    "ApiError",
    "StockadeClient",
    "SyncStockadeClient",
    "anthropic_tools",
    "langchain_tools",
    "openai_tools",
    "sandboxed_tool",
]
