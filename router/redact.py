"""Redaction: the one function that scrubs secrets from tool output, errors, logs and audit events.

Every secret value and minted token is registered here with a label; `redact` replaces each
occurrence, also in its base64 (standard and URL-safe, padded or not) and URL-encoded forms, with
``[REDACTED:<label>]``. Values a secret is merely part of (``base64("user:" + secret)``) are not
recognised: only the forms listed. Upstream secrets stay registered; a minted token is
registered while its call runs (its output is scrubbed before the lease is revoked) and until
its expiry at most, so the pattern stays as small as the number of calls in flight.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import MutableMapping
from typing import Any
from urllib.parse import quote, quote_plus

_MIN_LENGTH = 6  # shorter values would redact ordinary text


def _forms(secret: str) -> set[str]:
    raw = secret.encode()
    forms = {secret, quote(secret, safe=""), quote_plus(secret)}
    for encoded in (base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()):
        forms |= {encoded, encoded.rstrip("=")}
    return {f for f in forms if len(f) >= _MIN_LENGTH}


class Redactor:
    """The registered secrets, each in all its forms."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[str, float]] = {}  # form -> (label, forget after)
        self._order: tuple[tuple[str, str], ...] = ()  # (form, replacement), longest form first
        self._next_expiry = float("inf")

    def add(self, secret: str, label: str, *, until: float = float("inf")) -> None:
        """Redact ``secret`` (and its encodings) as ``[REDACTED:label]`` until ``until`` (epoch)."""
        with self._lock:
            for form in _forms(secret):
                self._entries[form] = (label, until)
            self._next_expiry = min(self._next_expiry, until)
            self._compile()

    def discard(self, secret: str) -> None:
        """Stop redacting ``secret`` (a revoked token: only its own call's output could hold it)."""
        with self._lock:
            for form in _forms(secret):
                self._entries.pop(form, None)
            self._compile()

    def _compile(self) -> None:
        # Longest first, so a secret's base64 form is not cut by a shorter secret inside it.
        # Plain substring replacement: compiling a regex over long tokens costs milliseconds per mint.
        forms = sorted(self._entries, key=len, reverse=True)
        self._order = tuple((f, f"[REDACTED:{self._entries[f][0]}]") for f in forms)

    def _expire(self, now: float) -> None:
        with self._lock:
            self._entries = {k: v for k, v in self._entries.items() if v[1] > now}
            self._next_expiry = min((v[1] for v in self._entries.values()), default=float("inf"))
            self._compile()

    def __call__(self, text: str) -> str:
        if self._next_expiry <= time.time():
            self._expire(time.time())
        for form, replacement in self._order:
            if form in text:
                text = text.replace(form, replacement)
        return text

    @property
    def active(self) -> bool:
        return bool(self._order)

    def deep(self, value: Any) -> Any:
        """``value`` with every string in it (keys and leaves of dicts and lists) redacted."""
        if not self._order:
            return value
        if isinstance(value, str):
            return self(value)
        if isinstance(value, dict):
            return {self(k) if isinstance(k, str) else k: self.deep(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.deep(v) for v in value]
        return value


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
