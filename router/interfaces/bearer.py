"""Bearer tokens, as the HTTP API and MCP over HTTP check them: only a token's sha256 is ever
configured (``stockade api-token``), and a presented token is matched against every known digest
in constant time, so timing tells nothing about which entry (or whether any) came close."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def digest(token: str) -> bytes:
    """The sha256 a token is configured by."""
    return hashlib.sha256(token.encode()).digest()


def presented(authorization: str | None) -> bytes | None:
    """The sha256 of the bearer token in an ``Authorization`` header value, if it carries one."""
    scheme, _, token = (authorization or "").partition(" ")
    return digest(token) if scheme.lower() == "bearer" and token else None


def match(found: bytes | None, known: Iterable[tuple[bytes, T]]) -> T | None:
    """What the digest ``found`` is known as, comparing it with every entry of ``known``."""
    matched = None
    for candidate, value in known:
        if found is not None and hmac.compare_digest(found, candidate):
            matched = value
    return matched
