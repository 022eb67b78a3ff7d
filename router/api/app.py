"""The HTTP application: ``create_app(plane)``.

``POST /v1/credentials/introspect`` follows RFC 7662: a form-encoded ``token`` (and, as
extensions, ``call_id`` and ``args_sha256`` to check the token's binding), answered with
``{"active": true, ...claims}`` or ``{"active": false}``. Callers (the services tokens are
presented to) authenticate with a bearer token from ``STOCKADE_INTROSPECTION_TOKENS``, compared
in constant time; with none configured, every caller is refused. ``GET
/.well-known/jwks.json`` publishes the public keys that verify live tokens.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from router.control import VERSION, ControlPlane
from router.credentials import introspect, jwks

_MAX_FORM = 16 * 1024


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def create_app(plane: ControlPlane) -> FastAPI:
    """The HTTP API over ``plane``."""
    app = FastAPI(title="stockade", version=VERSION)
    allowed = [_digest(t.get_secret_value()) for t in plane.settings.introspection_tokens]

    def authorized(request: Request) -> bool:
        scheme, _, presented = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not presented:
            return False
        digest = _digest(presented)
        # Every configured token is compared, so the time taken says nothing about which matched.
        return sum(hmac.compare_digest(digest, a) for a in allowed) > 0

    @app.post("/v1/credentials/introspect")
    async def introspect_token(request: Request) -> JSONResponse:
        if not authorized(request):
            return JSONResponse({"error": "invalid_client", "error_description": "send a bearer token from "
                                 "STOCKADE_INTROSPECTION_TOKENS"}, status_code=401,
                                headers={"WWW-Authenticate": 'Bearer realm="stockade"'})  # fmt: skip
        body = await request.body()
        if len(body) > _MAX_FORM:
            return JSONResponse({"error": "invalid_request", "error_description": "form over 16 KiB"}, 413)
        form = {k: v[0] for k, v in parse_qs(body.decode("utf-8", "replace")).items()}
        if not form.get("token"):
            return JSONResponse({"error": "invalid_request", "error_description": "form field token is required"},
                                status_code=400)  # fmt: skip
        result: dict[str, Any] = await introspect(
            plane.store, form["token"], call_id=form.get("call_id"), args_sha256=form.get("args_sha256")
        )
        return JSONResponse(result, headers={"Cache-Control": "no-store"})

    @app.get("/.well-known/jwks.json")
    async def published_keys() -> dict[str, list[dict[str, Any]]]:
        return await jwks(plane.store)

    return app
