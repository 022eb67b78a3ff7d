"""Errors over HTTP as RFC 9457 problem details (``application/problem+json``).

Each exception class has a stable ``type`` (``urn:stockade:problem:<code>``) and status (its
``code`` and ``http_status``, `router.errors`); the
``detail`` names the thing and the fix, and ``errors`` lists field problems where there are any.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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


def invalid_request(errors: Iterable[Mapping[str, Any]]) -> JSONResponse:
    """422 for a request that does not match its schema (pydantic's errors, ``loc`` from the top
    of the request: ``body``, ``query``, ``path``)."""
    found = [{"field": ".".join(str(p) for p in e["loc"]), "problem": e["msg"]} for e in list(errors)[:20]]
    return problem(422, "request.invalid", "Invalid request", "the request does not match the schema at "
                   "/openapi.json: " + "; ".join(f"{e['field']}: {e['problem']}" for e in found[:5]),
                   errors=found)  # fmt: skip


def internal_error() -> JSONResponse:
    """500 for an exception nothing else answered (it is logged where it was caught)."""
    return problem(500, "internal", "Internal error", "the router failed unexpectedly; its log has the details "
                   "and the request was not carried out past what the audit log shows")  # fmt: skip
