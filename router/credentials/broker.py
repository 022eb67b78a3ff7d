"""The credential broker: turns policy's ``obligations.credentials`` into leases for one call.

Policy is the only way a call gets a credential; the operator's configuration caps it: an
unknown name or a scope the configuration does not list denies the call, and the TTL is the
smaller of policy's and the configuration's ``max_ttl_s``. Every minted value is registered with
the redactor until it expires.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from policy import CredentialGrant
from router.credentials.base import (
    Binding,
    CredentialConfig,
    CredentialError,
    Grant,
    Issuer,
    Lease,
    ScopeDenied,
    UnknownCredential,
)
from router.credentials.secrets import SecretIssuer
from router.credentials.tokens import TokenIssuer
from router.redact import REDACTOR
from router.store.base import Store

_REVOKE_RETRY_S = 0.1  # the pause before the one retry of a lease's revocation that failed


class CredentialBroker:
    """Grants, mints and revokes the credentials of calls."""

    def __init__(self, configs: Iterable[CredentialConfig], store: Store, *, key_rotation_s: float = 3600.0) -> None:
        self._configs = {c.name: c for c in configs}
        max_ttl = max((c.max_ttl_s for c in self._configs.values()), default=300)
        secrets_issuer = SecretIssuer(store, self._configs.values())
        for name, value in secrets_issuer.values.items():
            REDACTOR.add(value.get_secret_value(), name)
        # A token reaching a tool is redacted by its shape whichever router minted it: this one, or
        # another on the same store (whose token a page the tool reads may reflect).
        # (A store of another make that does not say: taken as shared, the side that redacts more.)
        if getattr(store, "shared", True) or any(c.kind == "token" for c in self._configs.values()):
            REDACTOR.redact_tokens()
        self._issuers: dict[str, Issuer] = {
            "token": TokenIssuer(store, rotation_s=key_rotation_s, max_ttl_s=max_ttl),
            "secret": secrets_issuer,
        }

    def grant(self, requested: Sequence[CredentialGrant]) -> list[Grant]:
        """Policy's grants, checked and capped by the operator's configuration.

        Raises:
            UnknownCredential, ScopeDenied: the grant exceeds what the operator configured.
        """
        grants = []
        for request in requested:
            config = self._configs.get(request.name)
            if config is None:
                raise UnknownCredential(f"policy granted credential {request.name!r}, which this router does not "
                                        "have; add it to STOCKADE_CREDENTIALS or drop it from the policy")  # fmt: skip
            extra = sorted(set(request.scopes) - set(config.scopes))
            if extra:
                raise ScopeDenied(f"credential {config.name} may not carry scope(s) {', '.join(extra)}; "
                                  f"configured: {', '.join(config.scopes) or 'none'}")  # fmt: skip
            grants.append(Grant(config, tuple(request.scopes), min(request.ttl_s, config.max_ttl_s)))
        return grants

    async def mint(self, grants: Sequence[Grant], binding: Binding) -> list[Lease]:
        """A lease per grant; if one fails, those already minted are revoked and the error raised."""
        leases: list[Lease] = []
        try:
            for grant in grants:
                lease = await self._issuers[grant.config.kind].mint(grant, binding)
                REDACTOR.add(lease.value.get_secret_value(), grant.config.name, until=lease.expires_at + 60)
                leases.append(lease)
        except BaseException:
            await self.revoke(leases)
            raise
        return leases

    async def revoke(self, leases: Sequence[Lease]) -> list[tuple[Lease, Exception | None]]:
        """Revoke every lease, all at once, each whatever the others do; returns each one's error.
        A failed attempt is tried once more after a short pause (a store's blip must not leave a
        credential live for its whole TTL): however many leases, a store that does not answer
        holds the caller for two of its timeouts, not two per lease."""
        outcomes = await asyncio.gather(*(self._revoke_one(lease) for lease in leases))
        return list(zip(leases, outcomes, strict=True))

    async def _revoke_one(self, lease: Lease) -> Exception | None:
        issuer = self._issuers[lease.grant.config.kind]
        try:
            await issuer.revoke(lease)
        except Exception:  # the TTL is the backstop; the caller audits a failure that lasts
            await asyncio.sleep(_REVOKE_RETRY_S)
            try:
                await issuer.revoke(lease)
            except Exception as exc:
                return exc
        if lease.grant.config.kind == "token":
            # Its value is forgotten, so the search stays as small as the calls in flight; the
            # token as written is still redacted by its shape (`Redactor.redact_tokens`). A token
            # still live is redacted in every form until it expires (`mint`).
            REDACTOR.discard(lease.value.get_secret_value())
        return None

    async def aclose(self) -> None:
        for issuer in self._issuers.values():
            await issuer.aclose()


__all__ = ["CredentialBroker", "CredentialError"]
