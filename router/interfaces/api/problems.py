"""Errors over HTTP as RFC 9457 problem details (``application/problem+json``).

Each exception class has a stable ``type`` (``urn:stockade:problem:<code>``) and status (its
``code`` and ``http_status``, `router.errors`); the
``detail`` names the thing and the fix, ``errors`` lists field problems where there are any, and
``reasons`` policy's reason codes where policy refused (`ToolRefused`).
`Problem` is the document, as ``/openapi.json`` describes it (`router.interfaces.api.openapi`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from router.errors import StockadeError

MEDIA_TYPE = "application/problem+json"


def _absent_if_unset(schema: dict[str, Any]) -> None:
    schema.pop("default", None)  # the member is left out, not sent as null


class FieldError(BaseModel):
    """One thing wrong with the request: where (``body.tool``, ``args.to``), and what."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    field: str
    problem: str


class Problem(BaseModel):
    """An RFC 9457 problem document: every error the API answers is one (``application/problem+json``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str = Field(description="urn:stockade:problem:<code>", examples=["urn:stockade:problem:session.not_found"])
    title: str
    status: int = Field(description="the HTTP status, repeated")
    detail: str = Field(description="what is wrong and how to fix it")
    instance: str | SkipJsonSchema[None] = Field(
        default=None, description="not sent yet (RFC 9457 §3.1.5)", json_schema_extra=_absent_if_unset
    )
    code: str = Field(description="the stable name of the problem (the reason code, as the Python exceptions)")
    errors: Annotated[list[FieldError], Field(min_length=1)] | SkipJsonSchema[None] = Field(
        default=None, description="the fields at fault, where there are any", json_schema_extra=_absent_if_unset
    )
    reasons: Annotated[list[str], Field(min_length=1)] | SkipJsonSchema[None] = Field(
        default=None, description="policy's reason codes, where policy refused (tool.refused_by_policy)",
        json_schema_extra=_absent_if_unset,
    )  # fmt: skip


def problem(
    status: int, code: str, title: str, detail: str, *, errors: list[dict[str, Any]] | None = None,
    reasons: list[str] | None = None, headers: dict[str, str] | None = None,
) -> JSONResponse:  # fmt: skip
    body = Problem(type=f"urn:stockade:problem:{code}", title=title, status=status, detail=detail, code=code,
                   errors=[FieldError.model_validate(e) for e in errors] if errors else None,
                   reasons=list(reasons) if reasons else None)  # fmt: skip
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status, media_type=MEDIA_TYPE,
                        headers=headers)  # fmt: skip


def from_exception(exc: StockadeError) -> JSONResponse:
    status = exc.http_status
    errors = [{"field": p.field, "problem": p.problem} for p in getattr(exc, "problems", [])]
    reasons = [str(r) for r in getattr(exc, "reasons", [])]
    return problem(status, exc.code, type(exc).__name__, str(exc), errors=errors, reasons=reasons)


def invalid_request(errors: Iterable[Mapping[str, Any]]) -> JSONResponse:
    """422 for a request that does not match its schema (pydantic's errors, ``loc`` from the top
    of the request: ``body``, ``query``, ``path``)."""
    found = [{"field": ".".join(str(p) for p in e["loc"]), "problem": e["msg"]} for e in list(errors)[:20]]
    return problem(422, "request.invalid", "Invalid request", "the request does not match the schema at "
                   "/openapi.json: " + "; ".join(f"{e['field']}: {e['problem']}" for e in found[:5]),
                   errors=found)  # fmt: skip


def invalid_body(code: str, detail: str) -> JSONResponse:
    """422 for a body that cannot be read as JSON at all (``request.invalid``) or nests deeper
    than the API reads (``request.too_deep``)."""
    title = "Nested too deep" if code == "request.too_deep" else "Invalid request"
    return problem(422, code, title, detail, errors=[{"field": "body", "problem": detail}])


# What the HTTP layer underneath answers by itself (no route, wrong method, an unreadable body).
_HTTP_ERRORS = {
    400: ("request.malformed", "Bad request"),
    404: ("request.not_found", "Not found"),
    405: ("request.method_not_allowed", "Method not allowed"),
}


def from_http_error(status: int, detail: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """A problem for an error the HTTP framework raised (Starlette's ``HTTPException``)."""
    code, title = _HTTP_ERRORS.get(status, ("request.refused" if status < 500 else "internal", "Request refused"))
    return problem(status, code, title, detail, headers=dict(headers) if headers else None)


def internal_error() -> JSONResponse:
    """500 for an exception nothing else answered (it is logged where it was caught)."""
    return problem(500, "internal", "Internal error", "the router failed unexpectedly; its log has the details "
                   "and the request was not carried out past what the audit log shows")  # fmt: skip
