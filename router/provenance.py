"""Argument provenance: where each value of a new call was seen before in its session.

Sources, as policy sees them in ``input.provenance[arg]``:

- ``user``: the trusted context the framework declared when it opened the session;
- ``tool:<name>:<call_id>``: output of a tool without ``reads_untrusted``;
- ``untrusted:<name>:<call_id>``: output of a tool with ``reads_untrusted`` (sandboxed, or
  reported by the framework for an ``external`` tool).

What is matched. Content is indexed once, when it enters the session; an argument is reduced to
the same keys and looked up, so a lookup costs a few dictionary probes whatever the session size.

====================  =================================================================
key                   taken from
====================  =================================================================
whole string          a string of at most 256 characters, whitespace collapsed (exact case)
email                 ``local@domain.tld``, lower-cased; in indexed content also its domain (as a
                      hostname), but an argument that is one address matches only as that
                      whole address (not by its domain or the digits in it)
URL                   ``http(s)://...``: the whole URL (scheme and host lower-cased, default
                      port and trailing slash dropped) and, separately, its host
hostname              ``name.tld`` tokens, lower-cased, trailing dot dropped
IBAN                  country, check digits, groups of four (spaced or not), spaces removed,
                      upper-cased; only if the ISO 13616 mod-97 check digits are right
account number        8 or more digits, spaces and dashes removed
number                at least 3 significant digits, in canonical form (``100``, ``100.0`` and
                      ``"100.00"`` match; ``000`` or ``0.005`` are too common to say where they
                      came from)
====================  =================================================================

Strings longer than 256 characters (free text) are matched only by the identifiers they contain.
Nested arguments are matched leaf by leaf; the provenance of an argument is every source of any
of its keys. A key remembers at most 16 sources.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any
from urllib.parse import urlsplit

USER = "user"
_MAX_WHOLE = 256
MAX_SOURCES = 16  # per key: enough to name the culprit, bounded whatever the session reads
_MAX_DEPTH = 32

_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,63}")
_URL = re.compile(r"https?://[^\s<>\"'`(){}\[\]]+", re.IGNORECASE)
_HOST = re.compile(r"(?<![\w@.-])(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,63}\.?(?![\w-])")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?\b")
_ACCOUNT = re.compile(r"(?<![\w.])\d(?:[ -]?\d){7,}(?![\w.])")
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])")
_SPACE = re.compile(r"\s+")


def _number_key(text: str) -> str | None:
    if sum(ch.isdigit() for ch in text) < 3:
        return None
    try:
        canonical = format(Decimal(text).normalize(), "f")
    except InvalidOperation:
        return None
    # Significant digits, not written ones: "000" is 0 and "0.005" is 5 thousandths, as common as 5.
    if sum(ch.isdigit() for ch in canonical.lstrip("-").lstrip("0.")) < 3:
        return None
    return "n:" + canonical


def _iban_checksum_ok(iban: str) -> bool:
    """ISO 13616: move the first four characters to the end, letters to numbers, mod 97 == 1."""
    if not 15 <= len(iban) <= 34:
        return False
    rearranged = iban[4:] + iban[:4]
    return int("".join(str(int(ch, 36)) for ch in rearranged)) % 97 == 1


def _url_keys(url: str) -> Iterator[str]:
    url = url.rstrip(".,;:!?")
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").rstrip(".")
        port = parts.port
    except ValueError:
        return
    if not host:
        return
    default = {"http": 80, "https": 443}.get(parts.scheme.lower())
    netloc = host if port in (None, default) else f"{host}:{port}"
    path = parts.path.rstrip("/")
    query = f"?{parts.query}" if parts.query else ""
    yield f"u:{parts.scheme.lower()}://{netloc}{path}{query}"
    yield f"h:{host}"


def string_keys(text: str, *, indexing: bool = True) -> Iterator[str]:
    """The keys a string contributes (see the module docstring). Indexed content also contributes
    each email's domain as a hostname, so host and URL arguments match it; an email argument
    matches only as a whole address (any address at a domain a page mentions is not suspect)."""
    if len(text) <= _MAX_WHOLE:
        collapsed = _SPACE.sub(" ", text).strip()
        if collapsed:
            yield "s:" + collapsed
    if not indexing and _EMAIL.fullmatch(text.strip()):
        # An argument that is one email address is matched as that address only: not by its
        # domain, nor by a number in it (``123@a.example`` is not ``123@b.example``).
        yield "e:" + text.strip().lower()
        return
    for match in _EMAIL.finditer(text):
        email = match.group(0).lower()
        yield "e:" + email
        if indexing:
            yield "h:" + email.rsplit("@", 1)[1]
    for match in _URL.finditer(text):
        yield from _url_keys(match.group(0))
    for match in _HOST.finditer(text):
        yield "h:" + match.group(0).lower().rstrip(".")
    for match in _IBAN.finditer(text.upper()):
        iban = match.group(0).replace(" ", "")
        if _iban_checksum_ok(iban):
            yield "i:" + iban
    for match in _ACCOUNT.finditer(text):
        yield "a:" + re.sub(r"[ -]", "", match.group(0))
    for match in _NUMBER.finditer(text):
        key = _number_key(match.group(0))
        if key:
            yield key


def value_keys(value: Any, depth: int = 0, *, indexing: bool = True) -> Iterator[str]:
    """The keys of any JSON value: strings as above, numbers canonically, containers leaf by leaf."""
    if depth > _MAX_DEPTH:
        return
    if isinstance(value, str):
        yield from string_keys(value, indexing=indexing)
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int | float):
        key = _number_key(repr(value) if isinstance(value, float) else str(value))
        if key:
            yield key
    elif isinstance(value, dict):
        for item in value.values():
            yield from value_keys(item, depth + 1, indexing=indexing)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from value_keys(item, depth + 1, indexing=indexing)


def source_label(tool: str, call_id: str, *, untrusted: bool) -> str:
    return f"{'untrusted' if untrusted else 'tool'}:{tool}:{call_id}"


def content_keys(items: Iterable[Any]) -> set[str]:
    """The keys content entering a session contributes."""
    return {key for item in items for key in value_keys(item)}


def argument_keys(args: dict[str, Any]) -> dict[str, set[str]]:
    """The keys each top-level argument of a call is looked up by."""
    return {name: set(value_keys(value, indexing=False)) for name, value in args.items()}


class ProvenanceIndex:
    """One session's index from value keys to the sources they were seen in, in this process
    (`MemoryStore` keeps one per session; `RedisStore` keeps the same map in a Redis hash)."""

    __slots__ = ("_keys",)

    def __init__(self) -> None:
        self._keys: dict[str, list[str]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def add_keys(self, source: str, keys: Iterable[str]) -> None:
        for key in keys:
            sources = self._keys.setdefault(key, [])
            if source not in sources and len(sources) < MAX_SOURCES:
                sources.append(source)

    def lookup_keys(self, keys_by_arg: Mapping[str, Iterable[str]]) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for name, keys in keys_by_arg.items():
            sources: set[str] = set()
            for key in keys:
                sources.update(self._keys.get(key, ()))
            if sources:
                found[name] = sorted(sources)
        return found

    def add(self, source: str, content: Any) -> None:
        """Index ``content`` (any JSON value, or text) as seen from ``source``."""
        self.add_keys(source, content_keys([content]))

    def lookup(self, args: dict[str, Any]) -> dict[str, list[str]]:
        """For each top-level argument, every source any of its keys was seen in (sorted)."""
        return self.lookup_keys(argument_keys(args))
