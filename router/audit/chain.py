"""The hash chain, as written: one line per event, hashed as bytes.

A line is ``{"seq":N,"prev_hash":"<hex>",<the event's other fields>}``: the chain fields first,
then the rest of the event as canonical JSON (sorted keys, no whitespace, non-ASCII kept as
UTF-8). An event's ``hash`` is the RFC 6962 leaf hash of its line's bytes (without the newline),
``SHA-256(0x00 || line)``, so the same digest chains the events and is the leaf of the log's
Merkle tree (`router.audit.merkle`), and checking either reads the bytes and never re-serialises.
``prev_hash`` is the predecessor's hash; the first event's is 64 zeros. The hash is not stored in
its own line: the next line (or, for the last one, a signed checkpoint's Merkle root) holds it.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from router.text import encodable

GENESIS_HASH = "0" * 64
_LEAF = hashlib.sha256(b"\x00")  # copied per line: the 0x00 prefix is hashed once


def canonical(value: Any) -> str:
    """The one serialisation of an event's fields."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def line_hash(line: bytes) -> bytes:
    """The event hash (and Merkle leaf hash) of one line's bytes, without its newline."""
    digest = _LEAF.copy()
    digest.update(line)
    return digest.digest()


_CHAIN_FIELDS = ("seq", "prev_hash", "hash")
_HEAD = re.compile(rb'\{"seq":([1-9][0-9]{0,18}),"prev_hash":"([0-9a-f]{64})"[,}]')


class Unsealed:
    """An event serialised but for its chain fields, which `seal` puts in front under the log's
    lock: there, only two strings are joined and one digest is taken."""

    __slots__ = ("_rest", "encodable")

    def __init__(self, document: dict[str, Any]) -> None:
        body = canonical({k: v for k, v in document.items() if k not in _CHAIN_FIELDS})
        self._rest = "}" if body == "{}" else "," + body[1:]
        # Whether UTF-8 can hold the text (a lone surrogate cannot): checked in C.
        self.encodable = body.isascii() or encodable(body)

    def seal(self, seq: int, prev_hash: str) -> tuple[str, bytes]:
        """The event's hash and its line (without newline), chained as ``seq`` after ``prev_hash``."""
        if not _HEX.fullmatch(prev_hash):
            raise ValueError(f"prev_hash must be 64 lowercase hex digits, not {prev_hash[:80]!r}")
        line = f'{{"seq":{int(seq)},"prev_hash":"{prev_hash}"{self._rest}'.encode()
        return line_hash(line).hex(), line


_HEX = re.compile(r"[0-9a-f]{64}")


def head_of(line: bytes) -> tuple[int, str] | None:
    """A line's seq and prev_hash, read from its fixed head without parsing the event (None: the
    line does not start as an event of this chain does)."""
    found = _HEAD.match(line)
    if found is None:
        return None
    return int(found.group(1)), found.group(2).decode()


def document_of(line: bytes) -> dict[str, Any] | None:
    """The event a line records, with its ``hash`` (None: not a JSON object)."""
    try:
        value = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):  # a line nested past the parser: unreadable
        return None
    if not isinstance(value, dict):
        return None
    value["hash"] = line_hash(line.rstrip(b"\n")).hex()
    return value


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_link(line: bytes, expected_seq: int, prev: str) -> tuple[str, int]:
    """What is wrong with ``line`` as the event at ``expected_seq`` after ``prev`` ("" if nothing),
    and the seq to blame. An event edited in place shows as its successor's broken link: the
    successor records the hash the event had when it was written."""
    head = head_of(line)
    if head is None:
        return "line is not a chained event (truncated, overwritten or not written by stockade)", expected_seq
    seq, prev_hash = head
    if seq != expected_seq:
        kind = "deleted or reordered" if seq > expected_seq else "inserted, duplicated or reordered"
        return f"expected seq {expected_seq}, found {seq}: events were {kind}", expected_seq
    if prev_hash != prev:
        return (
            f"event seq {seq - 1} was modified or replaced: seq {seq} records a different hash for it",
            max(seq - 1, 1),
        )
    return "", seq
