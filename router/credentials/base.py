"""The credential seam: what operators configure, what a call is granted, the `Lease` it gets,
and the `Issuer` Protocol that mints and revokes leases.

A lease's value is a `SecretStr`: it goes to the egress proxy, which puts it into requests to the
credential's hosts, and to the redactor; never to the agent, the sandbox, a log or the audit log.
The sandbox sees only ``placeholder``, in the environment variable ``env_var``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from router.errors import CredentialError, CredentialUnavailable, ScopeDenied, UnknownCredential

_NAME = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
__all__ = [
    "Binding", "CredentialConfig", "CredentialError", "CredentialUnavailable", "Grant", "Issuer", "Lease",
    "ScopeDenied", "UnknownCredential",
]  # fmt: skip


class CredentialConfig(BaseModel):
    """One credential an operator makes available (``STOCKADE_CREDENTIALS``, a JSON list).

    ``token``: stockade mints a signed JWT per call. ``secret``: an API key the operator already
    has, read once at start-up from ``value_env`` or ``value_file``. The egress proxy puts the
    value only into HTTPS requests to ``hosts`` (TLS it verifies itself), unless ``allow_plaintext``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=_NAME)
    kind: Literal["token", "secret"]
    hosts: list[str] = Field(min_length=1, description="hosts (or host:port) the value may go to over HTTPS; "
                             "a host alone means port 443")  # fmt: skip
    allow_plaintext: bool = Field(
        default=False,
        description="also send the value over plain http:// (anyone on the path reads it): to port 80 for a host "
        "alone, or the port given, never to 443",
    )
    scopes: list[str] = Field(default_factory=list, description="the most policy may grant")
    max_ttl_s: int = Field(default=300, ge=1, le=86400)
    audience: str | None = Field(default=None, description="token: the aud claim (default: the first host)")
    value_env: str | None = None
    value_file: Path | None = None

    @model_validator(mode="after")
    def _one_source(self) -> CredentialConfig:
        if self.kind == "secret" and (self.value_env is None) == (self.value_file is None):
            raise ValueError(f"secret credential {self.name} needs exactly one of value_env and value_file")
        if self.kind == "token" and (self.value_env or self.value_file):
            raise ValueError(f"token credential {self.name} is minted by stockade: drop value_env/value_file")
        return self

    @property
    def env_var(self) -> str:
        """Where the sandbox finds the placeholder: ``STOCKADE_CREDENTIAL_<NAME>``."""
        return "STOCKADE_CREDENTIAL_" + re.sub(r"[^A-Z0-9]", "_", self.name.upper())


@dataclass(frozen=True, slots=True)
class Grant:
    """A credential granted to one call: policy's request, capped by the operator's configuration."""

    config: CredentialConfig
    scopes: tuple[str, ...]
    ttl_s: int


@dataclass(frozen=True, slots=True)
class Binding:
    """The one call a lease is for; carried in tokens and checked by introspection."""

    decision_id: str
    call_id: str
    session_id: str
    agent: str
    args_sha256: str


@dataclass(frozen=True, slots=True)
class Lease:
    """A minted credential, alive from ``issued_at`` to ``expires_at`` (epoch seconds) unless revoked."""

    id: str
    grant: Grant
    binding: Binding
    value: SecretStr
    placeholder: str
    issued_at: float
    expires_at: float

    def record(self) -> dict[str, object]:
        """What the store and the audit log keep of the lease: everything but the value."""
        return {
            "lease_id": self.id, "name": self.grant.config.name, "kind": self.grant.config.kind,
            "scopes": list(self.grant.scopes), "ttl_s": self.grant.ttl_s, "hosts": self.grant.config.hosts,
            "issued_at": self.issued_at, "expires_at": self.expires_at,
            "binding": {"decision_id": self.binding.decision_id, "call_id": self.binding.call_id,
                        "session_id": self.binding.session_id, "agent": self.binding.agent,
                        "args_sha256": self.binding.args_sha256},
        }  # fmt: skip


class Issuer(Protocol):
    """Mints and revokes one kind of credential."""

    async def mint(self, grant: Grant, binding: Binding) -> Lease: ...

    async def revoke(self, lease: Lease) -> None:
        """End the lease now (idempotent); its TTL ends it anyway if this never runs."""
        ...

    async def aclose(self) -> None: ...
