"""Sessions: one per agent task, carrying what policy needs across calls (taint, counters,
the trusted context the framework declared). In-process store; issue #4 adds Redis."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from router.errors import InvalidCall, SessionNotFound
from router.provenance import USER, ProvenanceIndex
from router.tools import show

UNTRUSTED_CONTENT = "untrusted_content"
_MAX_NAME = 256
_MAX_CONTEXT_ITEMS = 1000


@dataclass(slots=True)
class Session:
    """The router's state for one agent task."""

    id: str
    agent: str
    principal: str
    trusted_context: list[str]
    opened_at: datetime
    taint: set[str] = field(default_factory=set)
    call_count: int = 0
    last_used: float = field(default_factory=time.monotonic)
    provenance: ProvenanceIndex = field(default_factory=ProvenanceIndex)


@dataclass(frozen=True, slots=True)
class PendingExternal:
    """An allowed call to an ``external`` tool, waiting for the framework to report its output."""

    session_id: str
    call_id: str
    decision_id: str
    tool: str


def _check_name(field_name: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > _MAX_NAME or not value.isprintable():
        raise InvalidCall(
            f"{field_name} must be a non-empty printable string of at most {_MAX_NAME} characters, got {show(value)}"
        )
    return value


class SessionStore:
    """Open sessions and pending external calls, in this process."""

    def __init__(self, idle_ttl_s: float = 3600.0) -> None:
        self._sessions: dict[str, Session] = {}
        self._pending: dict[str, PendingExternal] = {}
        self._idle_ttl_s = idle_ttl_s

    def open(self, agent: str, principal: str, trusted_context: list[str]) -> Session:
        _check_name("agent", agent)
        _check_name("principal", principal)
        if not isinstance(trusted_context, list) or not all(isinstance(i, str) for i in trusted_context):
            raise InvalidCall("trusted_context must be a list of strings")
        if len(trusted_context) > _MAX_CONTEXT_ITEMS:
            raise InvalidCall(f"trusted_context has {len(trusted_context)} items; at most {_MAX_CONTEXT_ITEMS}")
        session = Session(
            id="s-" + secrets.token_hex(12),
            agent=agent,
            principal=principal,
            trusted_context=list(trusted_context),
            opened_at=datetime.now(UTC),
        )
        session.provenance.add_all(USER, session.trusted_context)
        self._sessions[session.id] = session
        return session

    def get(self, session_id: object) -> Session:
        """The open session ``session_id``; using it keeps it from expiring.

        Raises:
            SessionNotFound: unknown, closed, or idle for longer than the session TTL.
        """
        session = self._sessions.get(session_id) if isinstance(session_id, str) else None
        now = time.monotonic()
        if session is not None and now - session.last_used > self._idle_ttl_s:
            raise SessionNotFound(f"session {session.id} expired after {self._idle_ttl_s:g}s idle; open a new one")
        if session is None:
            raise SessionNotFound(f"no open session {show(session_id)}; open one with open_session()")
        session.last_used = now
        return session

    def expired(self) -> list[str]:
        """Ids of sessions idle for longer than the TTL (still to be closed)."""
        cutoff = time.monotonic() - self._idle_ttl_s
        return [s.id for s in self._sessions.values() if s.last_used < cutoff]

    def close(self, session_id: str) -> None:
        if session_id not in self._sessions:
            raise SessionNotFound(f"no open session {show(session_id)}")
        del self._sessions[session_id]
        self._pending = {k: p for k, p in self._pending.items() if p.session_id != session_id}

    def expect_report(self, pending: PendingExternal) -> None:
        self._pending[pending.call_id] = pending

    def take_report(self, session_id: str, call_id: object) -> PendingExternal:
        """The pending external call ``call_id`` of this session; it can be reported once."""
        pending = self._pending.get(call_id) if isinstance(call_id, str) else None
        if pending is None or pending.session_id != session_id:
            raise InvalidCall(
                f"no external call {show(call_id)} is awaiting a report in session {session_id}: "
                "report only the call_id returned by call() for an external tool, once"
            )
        del self._pending[pending.call_id]
        return pending
