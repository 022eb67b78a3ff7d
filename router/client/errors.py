"""The SDK's exceptions: the in-process ones (`router.errors`), rebuilt from the API's problem
documents by their ``code``, and three of its own.

    StockadeError (router.errors, and every exception there)
     ├── ApiError            the API refused for a reason with no in-process exception (auth, limits)
     ├── ApiUnreachable      the API could not be reached, or its answer was lost
     └── IdentityMismatch    an identity argument names someone other than the token's principal
                             (also a ValueError); nothing was sent

A schema mismatch the API finds in a request (``request.invalid``, ``request.too_deep``,
``request.too_large``) is an `InvalidCall`, as the in-process pipeline raises for the same input.
"""

from __future__ import annotations

from typing import Any

import httpx

from router.errors import FieldProblem, InvalidCall, StockadeError, ToolRefused

# Problems the API's own layers answer for a request that does not fit (nothing ran): in process,
# the same input is an InvalidCall.
_INVALID_REQUEST = ("request.invalid", "request.too_deep", "request.too_large")


class ApiError(StockadeError):
    """The API refused the request for a reason with no in-process exception (auth, limits)."""

    code = "client.api_error"

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class ApiUnreachable(StockadeError):
    """The API could not be reached, or the connection failed before its answer came; the message
    says whether the request may have been carried out."""

    code = "client.unreachable"


class IdentityMismatch(StockadeError, ValueError):
    """An identity argument (``agent``, ``approver``, ``by``) names someone other than the principal
    the client's token belongs to; over HTTP the server always acts as that principal. Nothing was
    sent."""

    code = "client.identity_mismatch"


def _by_code() -> dict[str, type[StockadeError]]:
    """Every exception the server may raise, by its ``code`` (the problem type the API sends)."""
    found: dict[str, type[StockadeError]] = {}
    pending: list[type[StockadeError]] = [StockadeError]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.__module__ != __name__:  # the SDK's own are never sent
            found.setdefault(cls.code, cls)
    return found


def raise_for(response: httpx.Response) -> None:
    """Raise the exception an error answer stands for (as `ControlPlane` would raise it)."""
    if response.is_success:
        return
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):  # not a problem document: a proxy's page, say
        body = {}
    code = str(body.get("code", f"http.{response.status_code}"))
    detail = str(body.get("detail", response.text[:500]))
    cls = InvalidCall if code in _INVALID_REQUEST else _by_code().get(code)
    if cls is InvalidCall:
        raise InvalidCall(detail, _problems(body.get("errors")))
    if cls is ToolRefused:
        reasons = body.get("reasons")
        raise ToolRefused(detail, [str(r) for r in reasons] if isinstance(reasons, list) else [])
    if cls is not None:
        raise cls(detail)
    raise ApiError(response.status_code, code, detail)


def _problems(errors: Any) -> list[FieldProblem]:
    if not isinstance(errors, list):
        return []
    return [FieldProblem(str(e.get("field")), str(e.get("problem"))) for e in errors if isinstance(e, dict)]
