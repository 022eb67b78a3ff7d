"""The hash chain: canonical JSON and the event hash.

``hash = sha256(canonical JSON of the event without "hash")``, where canonical JSON sorts keys,
uses no whitespace and keeps non-ASCII characters as UTF-8. Each event carries its
predecessor's hash in ``prev_hash``; the first carries 64 zeros.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical(value: Any) -> str:
    """The one serialisation that is hashed and written."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def event_hash(document: dict[str, Any]) -> str:
    """sha256 over the canonical JSON of ``document`` without its ``hash`` field."""
    body = {k: v for k, v in document.items() if k != "hash"}
    return hashlib.sha256(canonical(body).encode()).hexdigest()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
