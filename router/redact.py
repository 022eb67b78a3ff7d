"""Redaction: the one function that scrubs secrets from tool output, errors, logs and audit events.

Every secret value and minted token is registered here with a label; `redact` replaces each
occurrence with ``[REDACTED:<label>]``, in every form the egress proxy scrubs from responses
(`runner.egress.scrub`, shared so the two never drift apart): raw and reversed, hex,
percent-encoded, JSON-escaped, base64 and base64url (padded or not, and inside a longer base64
text such as ``base64("user:" + secret)``), all regardless of ASCII case. A secret split into
pieces or otherwise transformed is not recognised (``docs/egress.md``). Upstream secrets stay
registered; a minted token is registered while its call runs (its output is scrubbed before the
lease is revoked). After that, and for tokens another router minted or this one minted before a
restart, a stockade token as written (a JWT whose payload says ``iss: stockade``; not its other
encodings, which are caught only while it is registered) is redacted by its shape,
``[REDACTED:stockade-token]``: an upstream can hand a revoked token back to any later
call, and a service that verifies with the JWKS alone takes it until it expires. One `Matcher`
finds every form of every secret in one pass, built once each time the set changes: a redaction
costs the length of the text, not that times the number of secrets.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import threading
import time
from collections.abc import Container, MutableMapping
from typing import Any, AnyStr

from runner.egress.scrub import Form, Matcher, secret_forms

TOKEN_ISSUER = "stockade"  # noqa: S105  (a claim value, not a secret)
"""The ``iss`` of the tokens stockade mints (`router.credentials.tokens`), which `Redactor`
recognises by their shape."""
TOKEN_LABEL = "stockade-token"  # noqa: S105  (a label, not a secret)
# A JWT as written is header.payload.signature in base64url, and a JSON object's base64 starts
# "eyJ". Found at each '.' that a payload and a signature follow (a lookahead, so a header read as
# a payload never hides the token after it; a literal start, which `re` seeks fast), with parts
# shorter than a stockade token's not read (its payload holds a call's binding, its signature is
# 64 bytes): a flood of short look-alikes costs a scan, not a decode each. Each run is read by at
# most the two dots around it: linear. The payload is read to tell a stockade token from another
# service's JWT a tool may rightly return. Payload and signature are redacted whether a header is
# there or not (it is public: the JWKS gives its key id), with whatever is glued before them.
_TAIL = re.compile(r"\.(?=(eyJ[A-Za-z0-9_-]{60,}+)\.([A-Za-z0-9_-]{80,}+))")
_TAIL_BYTES = re.compile(_TAIL.pattern.encode())
_B64URL = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
_B64URL_TEXT = frozenset(map(chr, _B64URL))

REMEMBERED_MIN = 64 << 10  # characters: a shorter text costs less to scan again than to remember
REMEMBERED_MAX = 32 << 20  # characters of redacted text held at most, so an output is not kept long


class Redactor:
    """The registered secrets, each in all its forms, and one `Matcher` for all of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[bytes, tuple[Form, float]] = {}  # needle -> (form, forget after)
        self._version = 0  # changes with the set of forms
        self._matcher: tuple[int, Matcher | None] = (0, None)  # built for that version
        self._next_expiry = float("inf")
        # Long texts this redactor returned, by id (the text held, so the id is not reused), with
        # the version they were redacted under: `deep` passes them as they are (the audit log gets
        # the output redacted for the agent, and need not scan it again).
        self._clean: dict[int, tuple[str, int]] = {}
        self._clean_size = 0
        self._tokens = False  # whether stockade tokens are redacted by their shape

    def redact_tokens(self) -> None:
        """Redact every stockade token by its shape from now on, registered or not (`_TAIL`): for a
        router that mints tokens (or shares a store with routers that do)."""
        with self._lock:
            self._tokens = True
            self._version += 1

    def add(self, secret: str, label: str, *, until: float = float("inf")) -> None:
        """Redact ``secret`` (and its encodings) as ``[REDACTED:label]`` until ``until`` (epoch), or
        longer if it is registered already for longer: a lease of an operator's secret (redacted for
        as long as the router runs) must not shorten that to the lease's expiry."""
        with self._lock:
            for needle, encoding in secret_forms(secret).items():
                kept = self._entries.get(needle)
                self._entries[needle] = (Form(needle, label, encoding), max(until, kept[1] if kept else until))
            self._next_expiry = min(self._next_expiry, until)
            self._version += 1

    def discard(self, secret: str) -> None:
        """Stop redacting ``secret`` before its time (tests that register their own secrets)."""
        with self._lock:
            for needle in secret_forms(secret):
                self._entries.pop(needle, None)
            self._version += 1

    def _expire(self, now: float) -> None:
        with self._lock:
            kept = {k: v for k, v in self._entries.items() if v[1] > now}
            if len(kept) != len(self._entries):
                self._entries = kept
                self._version += 1
            self._next_expiry = min((v[1] for v in kept.values()), default=float("inf"))

    def _current(self) -> tuple[int, Matcher | None]:
        """The matcher for the forms registered now, and its version. Built once per change of the
        set, when next needed: a burst of mints costs one build, not one each."""
        if self._next_expiry <= time.time():
            self._expire(time.time())
        built = self._matcher
        if built[0] == self._version:
            return built
        with self._lock:
            if self._matcher[0] != self._version:
                # Longest first: the order `Matcher.forms` documents (the egress proxy's order too).
                forms = sorted((form for form, _ in self._entries.values()), key=lambda f: len(f.needle), reverse=True)
                self._matcher = (self._version, Matcher(forms) if forms else None)
            return self._matcher

    def __call__(self, text: str) -> str:
        version, matcher = self._current()
        if matcher is None and not self._tokens:
            return text
        redacted = self._text(text, matcher)
        if len(redacted) >= REMEMBERED_MIN:
            self._remember(redacted, version)
        return redacted

    def scrub_bytes(self, data: bytes) -> bytes:
        """``data`` (any bytes, text in any ASCII-compatible encoding or not text at all) with every
        registered secret replaced: for files, which need not be UTF-8."""
        _, matcher = self._current()
        scrubbed = data if matcher is None else matcher.scrub(data)[0]
        if self._tokens and b".eyJ" in scrubbed:
            scrubbed = _without_tokens(scrubbed, _TAIL_BYTES, _B64URL, f"[REDACTED:{TOKEN_LABEL}]".encode())
        return scrubbed

    def _text(self, text: str, matcher: Matcher | None) -> str:
        # A character is up to 4 bytes of UTF-8: text shorter than every form even so holds none.
        # (Counting characters against bytes let a short text hold a non-ASCII secret unseen.)
        if matcher is not None and 4 * len(text) >= matcher.shortest:
            # Matched as UTF-8 bytes: folding ASCII case there keeps every offset, which str.lower()
            # does not for all of Unicode; surrogatepass keeps text that is not valid UTF-8 intact.
            scrubbed, found = matcher.scrub(text.encode("utf-8", "surrogatepass"))
            if found:
                text = scrubbed.decode("utf-8", "surrogatepass")
        if self._tokens and ".eyJ" in text:
            text = _without_tokens(text, _TAIL, _B64URL_TEXT, f"[REDACTED:{TOKEN_LABEL}]")
        return text

    def _remember(self, text: str, version: int) -> None:
        with self._lock:
            if self._clean.pop(id(text), None) is None:
                self._clean_size += len(text)
            self._clean[id(text)] = (text, version)
            while self._clean_size > REMEMBERED_MAX and len(self._clean) > 1:
                oldest = next(iter(self._clean))
                self._clean_size -= len(self._clean.pop(oldest)[0])

    @property
    def active(self) -> bool:
        """Whether anything is redacted at all (a secret registered, or tokens by their shape)."""
        return bool(self._entries) or self._tokens

    def deep(self, value: Any) -> Any:
        """``value`` with every string in it (keys and leaves of dicts and lists) redacted, and every
        number whose text holds a secret replaced by that text redacted (a card number returned as a
        JSON number). Whatever holds nothing to redact is returned as it is, not copied."""
        version, matcher = self._current()
        if matcher is None and not self._tokens:
            return value
        return self._deep(value, matcher, version)

    def _deep(self, value: Any, matcher: Matcher | None, version: int) -> Any:
        if isinstance(value, str):
            if len(value) >= REMEMBERED_MIN:
                clean = self._clean.get(id(value))
                if clean is not None and clean[0] is value and clean[1] == version:
                    return value  # redacted already, under the same secrets
            return self._text(value, matcher)
        if isinstance(value, bool):
            return value
        if isinstance(value, int | float):
            try:
                text = int.__repr__(value) if isinstance(value, int) else float.__repr__(value)  # as JSON writes it
            except ValueError:  # an int too long to print: no JSON parser here builds one
                return value
            redacted = self._text(text, matcher)
            return value if redacted is text else redacted
        if isinstance(value, dict):
            copy: dict[Any, Any] = {}
            changed = False
            for key, item in value.items():
                new_key = self._text(key, matcher) if isinstance(key, str) else key
                new_item = self._deep(item, matcher, version)
                changed = changed or new_key is not key or new_item is not item
                copy[new_key] = new_item
            return copy if changed else value
        if isinstance(value, list | tuple):
            items = [self._deep(item, matcher, version) for item in value]
            return value if all(a is b for a, b in zip(items, value, strict=True)) else items
        return value


def _is_token(payload: bytes) -> bool:
    """Whether a JWT's base64url ``payload`` says it is a stockade token."""
    try:
        decoded = base64.urlsafe_b64decode(payload + b"=" * (-len(payload) % 4))
        claims = json.loads(decoded) if TOKEN_ISSUER.encode() in decoded else None
    except (binascii.Error, ValueError, RecursionError):  # not base64url, UTF-8 or JSON; nested past reading
        return False
    return isinstance(claims, dict) and claims.get("iss") == TOKEN_ISSUER


def _without_tokens(text: AnyStr, tail: re.Pattern[AnyStr], alphabet: Container[object], label: AnyStr) -> AnyStr:
    """``text`` with each stockade token in it, and whatever is glued to its ends, as ``label``."""
    pieces: list[AnyStr] = []
    done = 0
    for found in tail.finditer(text):
        dot, payload = found.start(), found[1]
        if dot < done or not _is_token(payload.encode() if isinstance(payload, str) else payload):
            continue
        start = _header_start(text, dot, done, alphabet)
        pieces += [text[done:start], label]
        done = found.end(2)
    if not pieces:
        return text
    pieces.append(text[done:])
    return text[:0].join(pieces)


def _header_start(text: AnyStr, dot: int, floor: int, alphabet: Container[object]) -> int:
    """Where the run of base64url characters ending at ``dot`` starts (not before ``floor``).
    Read back only for a token found, so at most once per character of the text."""
    start = dot
    while start > floor and text[start - 1] in alphabet:
        start -= 1
    return start


REDACTOR = Redactor()
"""The process's redactor: logs, audit events and tool output all go through it."""


def redact(text: str) -> str:
    """``text`` with every registered secret replaced by ``[REDACTED:<label>]``."""
    return REDACTOR(text)


def redact_log_event(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: the same redaction for every log line."""
    if not REDACTOR.active:
        return event_dict
    return {k: REDACTOR.deep(v) if isinstance(v, str | dict | list | tuple) else v for k, v in event_dict.items()}
