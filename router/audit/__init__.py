"""The audit log: every decision and every output, hash-chained, verifiable and queryable.

The names below are imported on first use (PEP 562): a reader that needs only part of the
package (``router.audit.index`` in a fresh `stockade audit query` process) does not pay for the
writer, the redaction and the runner they bring in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.audit.base import (
        GENESIS_HASH,
        AuditEvent,
        AuditFilter,
        AuditLog,
        EventKind,
        VerifyReport,
        timestamp,
    )
    from router.audit.chain import canonical, line_hash, sha256_hex
    from router.audit.jsonl import JsonlAuditLog

_WHERE = {
    "GENESIS_HASH": "router.audit.base",
    "AuditEvent": "router.audit.base",
    "AuditFilter": "router.audit.base",
    "AuditLog": "router.audit.base",
    "EventKind": "router.audit.base",
    "VerifyReport": "router.audit.base",
    "timestamp": "router.audit.base",
    "canonical": "router.audit.chain",
    "line_hash": "router.audit.chain",
    "sha256_hex": "router.audit.chain",
    "JsonlAuditLog": "router.audit.jsonl",
}

__all__ = [
    "GENESIS_HASH",
    "AuditEvent",
    "AuditFilter",
    "AuditLog",
    "EventKind",
    "JsonlAuditLog",
    "VerifyReport",
    "canonical",
    "line_hash",
    "sha256_hex",
    "timestamp",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'router.audit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come back here
    return value
