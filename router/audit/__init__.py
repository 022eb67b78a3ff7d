"""The audit log: every decision and every output, hash-chained, verifiable and queryable."""

from router.audit.base import GENESIS_HASH, AuditEvent, AuditFilter, AuditLog, EventKind, VerifyReport, timestamp
from router.audit.chain import canonical, line_hash, sha256_hex
from router.audit.jsonl import JsonlAuditLog

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
