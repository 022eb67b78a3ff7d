"""What ``/openapi.json`` says beyond what FastAPI reads off the routes, so that it says what the
router does: the bearer schemes, the problem documents each route can answer, the path segments
the router reads, and operationIds that stay put.

Every route gets, when it is registered (`describe`, called by the app's route class):

==========================  ================================================================
every route                 413 (a body over the limit), 500, 504 (`router.interfaces.api.app.Limits`)
a body or parameters        422 (not JSON, nested too deep, or not matching the schema)
a path parameter            400 (a path with control characters: no route has them)
a principal required        the ``bearer`` security scheme; 401 with ``WWW-Authenticate``;
                            403 unless every role may call it
==========================  ================================================================

Each route adds what its own work can answer (`problems`: 404, 409, 503 ...). Every problem is
`router.interfaces.api.problems.Problem` under ``application/problem+json``; FastAPI's own 422 document
(``HTTPValidationError``), which the API never sends, is not described.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from fastapi.routing import APIRoute

from router.interfaces.api.problems import MEDIA_TYPE, FieldError, Problem

BEARER = "bearer"
"""The security scheme of ``/v1``: a token whose sha256 names a principal (STOCKADE_API_PRINCIPALS)."""
INTROSPECTION = "introspection"
"""The security scheme of token introspection: a token from STOCKADE_INTROSPECTION_TOKENS."""

SECURITY_SCHEMES: dict[str, dict[str, Any]] = {
    BEARER: {"type": "http", "scheme": "bearer",
             "description": "an API token of a configured principal (STOCKADE_API_PRINCIPALS; `stockade api-token`)"},
    INTROSPECTION: {"type": "http", "scheme": "bearer",
                    "description": "a token from STOCKADE_INTROSPECTION_TOKENS (services checking stockade tokens)"},
}  # fmt: skip

TAGS = [
    {"name": "tools", "description": "the tool registry"},
    {"name": "sessions", "description": "an agent's sessions, and the calls it makes in them"},
    {"name": "approvals", "description": "a human's decisions: held calls, endorsed outputs"},
    {"name": "audit", "description": "the audit log, and the policy in force"},
    {"name": "credentials", "description": "for services that receive stockade tokens"},
    {"name": "operations", "description": "health, readiness and metrics"},
]

# A path segment as the router reads it: no control characters (refused with 400 before any route)
# and no '/' (it ends the segment); not "." or "..", which clients resolve before they send.
PATH_SEGMENT = r"^(?!\.\.?$)[^/\x00-\x1f\x7f]+$"

Responses = dict[int | str, dict[str, Any]]

_WHY = {
    400: "the path holds control characters: no route has them",
    401: "no bearer token of a configured principal (the refusal is audited)",
    403: "the principal's role may not do this (the refusal is audited)",
    404: "not found, or not the caller's",
    409: "in conflict with what is there",
    413: "the body is over STOCKADE_API_MAX_BODY_BYTES",
    422: "the request is not JSON, nests too deep, or does not match the schema (the refusal is audited)",
    500: "the router failed unexpectedly; its log has the details",
    503: "the store, audit log, policy or sandbox is unavailable: retry later",
    504: "not answered within STOCKADE_API_REQUEST_TIMEOUT_S",
}
_REF = "#/components/schemas/{model}"
CHALLENGE = {
    "WWW-Authenticate": {"description": 'the challenge: Bearer realm="stockade"', "required": True,
                         "schema": {"type": "string"}},
}  # fmt: skip


def problems(*answers: int | tuple[int, str]) -> Responses:
    """FastAPI ``responses`` for statuses answered with a problem document: ``404``, or
    ``(404, "no open session of yours with that id")`` to say when."""
    found: Responses = {}
    content = {MEDIA_TYPE: {"schema": {"$ref": _REF.format(model=Problem.__name__)}}}
    for answer in answers:
        status, why = answer if isinstance(answer, tuple) else (answer, _WHY[answer])
        found[status] = {"description": why, "content": content}
        if status == 401:
            found[status]["headers"] = CHALLENGE
    return found


def operation_id(route: APIRoute) -> str:
    """The endpoint's name in camelCase (``list_tools``: ``listTools``); FastAPI warns of a duplicate."""
    head, *rest = route.name.split("_")
    return head + "".join(word.capitalize() for word in rest)


def describe(route: APIRoute, roles: Collection[str] | None, every_role: Collection[str]) -> None:
    """Add to ``route`` the answers every route like it can give (the table above) and, if it
    takes a principal with one of ``roles``, its security requirement. What the route declared
    itself is kept."""
    dependant = route.dependant
    defaults: list[int] = [413, 500, 504]
    if route.body_field is not None or dependant.path_params or dependant.query_params:
        defaults.append(422)
    if dependant.path_params:
        defaults.append(400)
    if roles is not None:
        defaults.append(401)
        if not set(every_role) <= set(roles):
            defaults.append(403)
        route.openapi_extra = {"security": [{BEARER: []}], **(route.openapi_extra or {})}
    declared = {int(status) for status in route.responses}
    answers = problems(*(s for s in defaults if s not in declared))
    route.responses = dict(sorted({**route.responses, **answers}.items(), key=lambda item: str(item[0])))


def complete(
    document: dict[str, Any], checks: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None
) -> dict[str, Any]:
    """``document`` (FastAPI's) with the problem schemas and the security schemes in its
    components, and each path parameter described as the router reads it (`PATH_SEGMENT`).
    ``checks``: keywords to add to properties of component schemas (model, then property), for
    what a model's validators check beyond its types."""
    components = document.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for model_name, properties in (checks or {}).items():
        for name, keywords in properties.items():
            schemas[model_name]["properties"][name].update(keywords)
    for model in (Problem, FieldError):
        schemas[model.__name__] = model.model_json_schema(ref_template=_REF)
        schemas[model.__name__].pop("$defs", None)
    components["securitySchemes"] = SECURITY_SCHEMES
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                if parameter["in"] == "path":
                    parameter["schema"].setdefault("pattern", PATH_SEGMENT)
    return document
