"""The hash chain: canonical JSON and the event hash.

``hash = sha256(canonical JSON of the event without "hash")``, where canonical JSON sorts keys,
uses no whitespace and keeps non-ASCII characters as UTF-8. Each event carries its
predecessor's hash in ``prev_hash``; the first carries 64 zeros.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from typing import Any

from router.text import encodable


def canonical(value: Any) -> str:
    """The one serialisation that is hashed and written."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def event_hash(document: dict[str, Any]) -> str:
    """sha256 over the canonical JSON of ``document`` without its ``hash`` field."""
    body = {k: v for k, v in document.items() if k != "hash"}
    return hashlib.sha256(canonical(body).encode()).hexdigest()


class Unsealed:
    """An event serialised but for its chain fields, which `seal` fills in under the log's lock:
    there, only a few strings are joined and hashed (canonical JSON sorts keys, so the fields
    between the chain fields serialise apart, once, and join in order)."""

    __slots__ = ("_parts", "encodable")

    def __init__(self, document: dict[str, Any]) -> None:
        segments: list[dict[str, Any]] = [{}, {}, {}, {}]
        for key, value in document.items():
            if key not in _CHAIN:
                segments[bisect.bisect(_CHAIN, key)][key] = value
        self._parts = [canonical(segment) if segment else "{}" for segment in segments]
        # Whether UTF-8 can hold the text (a lone surrogate cannot): checked in C, part by part.
        self.encodable = all(part.isascii() or encodable(part) for part in self._parts)

    def seal(self, seq: int, prev_hash: str) -> tuple[str, str]:
        """The event's hash and its canonical JSON, chained as ``seq`` after ``prev_hash``."""
        before_hash, before_prev, before_seq, after_seq = self._parts
        # A head read back from the file is a digest, unless the file was tampered with: then quote it.
        quoted = f'"{prev_hash}"' if _DIGEST.fullmatch(prev_hash) else canonical(prev_hash)
        prev = f'{{"prev_hash":{quoted}}}'
        number = f'{{"seq":{int(seq)}}}'
        digest = hashlib.sha256(_join(before_hash, before_prev, prev, before_seq, number, after_seq).encode())
        hashed = f'{{"hash":"{digest.hexdigest()}"}}'
        return digest.hexdigest(), _join(before_hash, hashed, before_prev, prev, before_seq, number, after_seq)


_CHAIN = ("hash", "prev_hash", "seq")  # sorted
_DIGEST = re.compile(r"[0-9a-f]{64}")


def seal(document: dict[str, Any]) -> tuple[str, str]:
    """The hash of ``document`` (every field but ``hash``) and its canonical JSON with ``hash`` in place."""
    return Unsealed(document).seal(document["seq"], document["prev_hash"])


def _join(*objects: str) -> str:
    """JSON objects' text as one object, keys in the order given."""
    return "{" + ",".join(o[1:-1] for o in objects if o != "{}") + "}"


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
