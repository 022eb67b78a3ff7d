"""Errors over HTTP as RFC 9457 problem details (``application/problem+json``).

Each exception class has a stable ``type`` (``urn:stockade:problem:<code>``) and status (its
``code`` and ``http_status``, `router.errors`); the
``detail`` names the thing and the fix, and ``errors`` lists field problems where there are any.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from router.errors import StockadeError


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
    status = exc.http_status
    errors = [{"field": p.field, "problem": p.problem} for p in getattr(exc, "problems", [])]
    return problem(status, exc.code, type(exc).__name__, str(exc), errors=errors)
