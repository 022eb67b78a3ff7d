"""Redaction: the one function that scrubs secrets from tool output, errors, logs and audit events.

Every secret value and minted token is registered here with a label; `redact` replaces each
occurrence with ``[REDACTED:<label>]``, in every form the egress proxy scrubs from responses
(`runner.egress.scrub`, shared so the two never drift apart): raw and reversed, hex,
percent-encoded, JSON-escaped, base64 and base64url (padded or not, and inside a longer base64
text such as ``base64("user:" + secret)``), all regardless of ASCII case. A secret split into
pieces or otherwise transformed is not recognised (``docs/egress.md``). Upstream secrets stay
registered; a minted token is registered while its call runs (its output is scrubbed before the
lease is revoked) and until its expiry at most, so the search stays as small as the number of
calls in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import MutableMapping
from typing import Any

from runner.egress.scrub import Form, scrub, secret_forms


class Redactor:
    """The registered secrets, each in all its forms."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[bytes, tuple[Form, float]] = {}  # needle -> (form, forget after)
        self._order: tuple[Form, ...] = ()  # longest needle first
        self._next_expiry = float("inf")

    def add(self, secret: str, label: str, *, until: float = float("inf")) -> None:
        """Redact ``secret`` (and its encodings) as ``[REDACTED:label]`` until ``until`` (epoch), or
        longer if it is registered already for longer: a lease of an operator's secret (redacted for
        as long as the router runs) must not shorten that to the lease's expiry."""
        with self._lock:
            for needle, encoding in secret_forms(secret).items():
                kept = self._entries.get(needle)
                self._entries[needle] = (Form(needle, label, encoding), max(until, kept[1] if kept else until))
            self._next_expiry = min(self._next_expiry, until)
            self._compile()

    def discard(self, secret: str) -> None:
        """Stop redacting ``secret`` (a revoked token: only its own call's output could hold it)."""
        with self._lock:
            for needle in secret_forms(secret):
                self._entries.pop(needle, None)
            self._compile()

    def _compile(self) -> None:
        # Longest first, so a secret's base64 form is not cut by a shorter secret inside it.
        # Plain substring search: compiling a regex over long tokens costs milliseconds per mint.
        forms = (form for form, _ in self._entries.values())
        self._order = tuple(sorted(forms, key=lambda form: len(form.needle), reverse=True))

    def _expire(self, now: float) -> None:
        with self._lock:
            self._entries = {k: v for k, v in self._entries.items() if v[1] > now}
            self._next_expiry = min((v[1] for v in self._entries.values()), default=float("inf"))
            self._compile()

    def __call__(self, text: str) -> str:
        if self._next_expiry <= time.time():
            self._expire(time.time())
        order = self._order
        if not order:
            return text
        # Matched as UTF-8 bytes: folding ASCII case there keeps every offset, which str.lower()
        # does not for all of Unicode; surrogatepass keeps text that is not valid UTF-8 intact.
        scrubbed, found = scrub(text.encode("utf-8", "surrogatepass"), order)
        return scrubbed.decode("utf-8", "surrogatepass") if found else text

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
