"""The built-in token issuer: EdDSA-signed JWTs bound to one call, and their introspection.

Each router signs with its own Ed25519 key, generated in memory and rotated every
``rotation_s``; the private key never leaves the process. Public keys go to the `Store` (the
JWKS), kept as long as a token signed with them can live, so any router (or a service with the
JWKS) can verify any router's tokens. Claims: ``iss`` stockade, ``sub`` the agent, ``aud`` the
target service, ``scope``, ``iat``/``nbf``/``exp``, ``jti`` (the lease id) and ``stockade``: the
binding (decision_id, call_id, session_id, args_sha256). A token is active (RFC 7662) only while
its signature, expiry, lease record (not revoked) and binding all check out.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from jwt.algorithms import OKPAlgorithm
from pydantic import SecretStr

from router.credentials.base import Binding, Grant, Lease
from router.redact import TOKEN_ISSUER
from router.store.base import Store

ISSUER = TOKEN_ISSUER
_CLOCK_SKEW_S = 5


class TokenIssuer:
    """`Issuer` of signed, call-bound JWTs."""

    def __init__(self, store: Store, *, rotation_s: float = 3600.0, max_ttl_s: int = 86400) -> None:
        self._store = store
        self._rotation_s = rotation_s
        self._max_ttl_s = max_ttl_s
        self._key: Ed25519PrivateKey | None = None
        self._kid = ""
        self._key_born = 0.0

    async def _signing_key(self) -> tuple[str, Ed25519PrivateKey]:
        now = time.time()
        if self._key is None or now - self._key_born > self._rotation_s:
            key, kid = Ed25519PrivateKey.generate(), "k-" + secrets.token_hex(8)
            jwk = {**OKPAlgorithm.to_jwk(key.public_key(), as_dict=True), "kid": kid, "alg": "EdDSA", "use": "sig"}
            # Verifiable for as long as the last token it signs can live.
            await self._store.publish_key(kid, json.dumps(jwk), self._rotation_s + self._max_ttl_s + 60)
            self._key, self._kid, self._key_born = key, kid, now
        return self._kid, self._key

    async def mint(self, grant: Grant, binding: Binding) -> Lease:
        kid, key = await self._signing_key()
        now = time.time()
        lease_id = "l-" + secrets.token_hex(12)
        claims = {
            "iss": ISSUER, "sub": binding.agent, "aud": grant.config.audience or grant.config.hosts[0],
            "scope": " ".join(grant.scopes), "iat": int(now), "nbf": int(now) - _CLOCK_SKEW_S,
            "exp": math.ceil(now + grant.ttl_s), "jti": lease_id,
            "stockade": {"decision_id": binding.decision_id, "call_id": binding.call_id,
                         "session_id": binding.session_id, "args_sha256": binding.args_sha256},
        }  # fmt: skip
        # ``exp`` rounds up: verifiers compare whole seconds, and rounding down made a token live
        # anywhere from ttl-1 s to ttl s (dead on arrival at a 1 s TTL). The lease record still
        # ends it at exactly ttl for introspection; an offline verifier may accept it < 1 s longer.
        token = jwt.encode(claims, key, algorithm="EdDSA", headers={"kid": kid})
        lease = Lease(lease_id, grant, binding, SecretStr(token), "stockade-placeholder-" + secrets.token_hex(16),
                      now, now + grant.ttl_s)  # fmt: skip
        await self._store.put_lease(lease_id, json.dumps(lease.record()), grant.ttl_s)
        return lease

    async def revoke(self, lease: Lease) -> None:
        await self._store.revoke_lease(lease.id)

    async def aclose(self) -> None:
        self._key = None


async def jwks(store: Store) -> dict[str, list[dict[str, Any]]]:
    """The public keys that verify live tokens, as a JWKS document."""
    return {"keys": [json.loads(k) for k in (await store.public_keys()).values()]}


INACTIVE: dict[str, Any] = {"active": False}


async def introspect(
    store: Store, token: str, *, call_id: str | None = None, args_sha256: str | None = None,
    audience: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """RFC 7662 introspection: ``{"active": false}`` unless the token is ours, unexpired, its lease
    is live and not revoked, and it is bound to ``call_id`` / ``args_sha256`` and minted for
    ``audience`` when those are given (a service checks that the token was minted for it, and
    for the call presenting it: a token its upstream replays to another service is refused there)."""
    try:
        kid = jwt.get_unverified_header(token).get("kid")
        published = (await store.public_keys()).get(kid) if isinstance(kid, str) else None
        if published is None:
            return INACTIVE
        claims: dict[str, Any] = jwt.decode(
            token, jwt.PyJWK(json.loads(published)).key, algorithms=["EdDSA"], issuer=ISSUER,
            options={"verify_aud": False, "require": ["exp", "jti", "sub"]}, leeway=0,
        )  # fmt: skip
    except jwt.PyJWTError:
        return INACTIVE
    stored = await store.get_lease(claims["jti"])
    if stored is None:
        return INACTIVE
    status, record = stored
    bound = claims.get("stockade", {})
    if status != "active" or record.get("binding", {}).get("call_id") != bound.get("call_id"):
        return INACTIVE
    if call_id is not None and bound.get("call_id") != call_id:
        return INACTIVE
    if args_sha256 is not None and bound.get("args_sha256") != args_sha256:
        return INACTIVE
    if audience is not None and audience not in _audiences(claims.get("aud")):
        return INACTIVE
    return {
        "active": True,
        "token_type": "Bearer",
        "client_id": claims["sub"],
        **{k: claims[k] for k in ("iss", "sub", "aud", "scope", "iat", "nbf", "exp", "jti", "stockade") if k in claims},
    }


def _audiences(aud: object) -> list[str]:
    """The audiences an ``aud`` claim names: one string, or a list of them (RFC 7519 §4.1.3)."""
    if isinstance(aud, str):
        return [aud]
    return [a for a in aud if isinstance(a, str)] if isinstance(aud, list) else []
