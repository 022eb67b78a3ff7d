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


def seal(document: dict[str, Any]) -> tuple[str, str]:
    """The hash of ``document`` (every field but ``hash``) and its canonical JSON with ``hash`` in
    place, serialising the document once rather than once to hash and once to write."""
    # Canonical JSON sorts keys, so the fields before "hash" and after it serialise apart and join.
    head = canonical({k: v for k, v in document.items() if k < "hash"})
    tail = canonical({k: v for k, v in document.items() if k > "hash"})
    digest = hashlib.sha256(_join(head, tail).encode()).hexdigest()
    return digest, _join(_join(head, f'{{"hash":"{digest}"}}'), tail)


def _join(left: str, right: str) -> str:
    """Two JSON objects' text as one object (left's keys first)."""
    if left == "{}":
        return right
    if right == "{}":
        return left
    return f"{left[:-1]},{right[1:]}"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_link(document: dict[str, Any] | None, expected_seq: int, prev: str) -> tuple[str, int]:
    """What is wrong with ``document`` as the event at ``expected_seq`` after ``prev`` ("" if nothing),
    and the seq to blame."""
    if document is None:
        return "line is not a JSON event (truncated or overwritten)", expected_seq
    seq = document.get("seq")
    if not isinstance(seq, int):
        return "event has no integer seq", expected_seq
    if document.get("hash") != event_hash(document):
        return f"event seq {seq} was modified: its hash does not match its content", seq
    if seq != expected_seq:
        kind = "deleted or reordered" if seq > expected_seq else "inserted, duplicated or reordered"
        return f"expected seq {expected_seq}, found {seq}: events were {kind}", expected_seq
    if document.get("prev_hash") != prev:
        return f"event seq {seq} does not link to seq {seq - 1} (prev_hash mismatch)", seq
    return "", seq
