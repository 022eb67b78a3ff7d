"""Credentials minted just in time for one approved call, injected at the egress proxy, revoked
when the call ends, and redacted everywhere."""

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
