"""For services that receive stockade tokens: ask the router whether one is active, and for
exactly the call presenting it."""

from __future__ import annotations

from typing import Any

import httpx


class TokenIntrospector:
    """RFC 7662 client for ``POST /v1/credentials/introspect``. Fails closed: any error, timeout or
    unexpected answer reads as ``{"active": false}``.

    ``audience``: this service's name as the operator configured the credential (its ``audience``,
    or its first host, as ``host`` or ``host:port``): a token minted for another service is then
    inactive here, though it is live. Without it, any live stockade token is active."""

    def __init__(
        self, base_url: str, client_token: str, *, audience: str | None = None, timeout_s: float = 2.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:  # fmt: skip
        self._audience = audience
        self._client = httpx.AsyncClient(
            base_url=base_url, timeout=timeout_s, transport=transport,
            headers={"Authorization": f"Bearer {client_token}"},
        )  # fmt: skip

    async def check(self, token: str, *, call_id: str | None = None, args_sha256: str | None = None) -> dict[str, Any]:
        """The token's introspection; ``active`` is true only if the router says so."""
        form = {"token": token, **({"call_id": call_id} if call_id else {}),
                **({"args_sha256": args_sha256} if args_sha256 else {}),
                **({"audience": self._audience} if self._audience else {})}  # fmt: skip
        try:
            response = await self._client.post("/v1/credentials/introspect", data=form)
            answer = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            answer = None
        if not isinstance(answer, dict) or answer.get("active") is not True:
            return {"active": False}
        return answer

    async def aclose(self) -> None:
        await self._client.aclose()
