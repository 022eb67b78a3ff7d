"""Errors over HTTP as RFC 9457 problem details (``application/problem+json``).

Each exception class has a stable ``type`` (``urn:stockade:problem:<code>``) and status; the
``detail`` names the thing and the fix, and ``errors`` lists field problems where there are any.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from router.approvals import ApprovalError
from router.credentials import CredentialError
from router.errors import (
    AuditError,
    DuplicateTool,
    InvalidCall,
    InvalidToolSpec,
    PolicyError,
    SandboxError,
    SessionNotFound,
    StockadeError,
    StoreError,
    ToolNotFound,
)

# Most specific first: the first class an exception is an instance of decides.
STATUS: list[tuple[type[StockadeError], int]] = [
    (InvalidCall, 422), (ToolNotFound, 404), (DuplicateTool, 409), (InvalidToolSpec, 422),
    (SessionNotFound, 404), (ApprovalError, 409), (CredentialError, 403), (PolicyError, 503),
    (StoreError, 503), (AuditError, 503), (SandboxError, 503), (StockadeError, 500),
]  # fmt: skip


def problem(
    status: int, code: str, title: str, detail: str, *, errors: list[dict[str, Any]] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:  # fmt: skip
    body: dict[str, Any] = {"type": f"urn:stockade:problem:{code}", "title": title, "status": status,
                            "detail": detail, "code": code}  # fmt: skip
    if errors:
        body["errors"] = errors
    return JSONResponse(body, status_code=status, media_type="application/problem+json", headers=headers)


def from_exception(exc: StockadeError) -> JSONResponse:
    status = next(code for cls, code in STATUS if isinstance(exc, cls))
    errors = [{"field": p.field, "problem": p.problem} for p in getattr(exc, "problems", [])]
    return problem(status, exc.code, type(exc).__name__, str(exc), errors=errors)
