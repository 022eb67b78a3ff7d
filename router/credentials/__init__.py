"""Credentials minted just in time for one approved call, injected at the egress proxy, revoked
when the call ends, and redacted everywhere."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.credentials.base import (
        Binding,
        CredentialConfig,
        CredentialError,
        CredentialUnavailable,
        Grant,
        Issuer,
        Lease,
        ScopeDenied,
        UnknownCredential,
    )
    from router.credentials.broker import CredentialBroker
    from router.credentials.tokens import introspect, jwks
    from router.redact import REDACTOR, redact

# Imported on first use (PEP 562): the settings need only `CredentialConfig`, and importing the
# package for it must not load the broker (and its HTTP client) in every CLI command.
_HOME = {
    **dict.fromkeys(("Binding", "CredentialConfig", "CredentialError", "CredentialUnavailable", "Grant", "Issuer",
                     "Lease", "ScopeDenied", "UnknownCredential"), "router.credentials.base"),
    "CredentialBroker": "router.credentials.broker",
    "introspect": "router.credentials.tokens",
    "jwks": "router.credentials.tokens",
    "REDACTOR": "router.redact",
    "redact": "router.redact",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:  # so `from router.credentials import broker` goes on to import the submodule
        raise AttributeError(f"module 'router.credentials' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "REDACTOR",
    "Binding",
    "CredentialBroker",
    "CredentialConfig",
    "CredentialError",
    "CredentialUnavailable",
    "Grant",
    "Issuer",
    "Lease",
    "ScopeDenied",
    "UnknownCredential",
    "introspect",
    "jwks",
    "redact",
]
