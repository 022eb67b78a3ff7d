"""Sessions: one per agent task, carrying what policy needs across calls (taint, call count, the
trusted context the framework declared). This module checks and builds them; the `Store` keeps
them."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime

from router.errors import FieldProblem, InvalidCall
from router.store.base import SessionRecord
from router.tools import show

UNTRUSTED_CONTENT = "untrusted_content"
_MAX_NAME = 256
_MAX_CONTEXT_ITEMS = 1000
# The user's own words and the values they named, not documents (those arrive as tool output): the
# context goes into every policy input of the session and into its decision events, so its size
# bounds what one call costs the policy engine and the audit log.
MAX_CONTEXT_BYTES = 256 << 10


def _check_name(field_name: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > _MAX_NAME or not value.isprintable():
        problem = f"must be a non-empty printable string of at most {_MAX_NAME} characters, got {show(value)}"
        raise InvalidCall(f"{field_name} {problem}", [FieldProblem(field_name, problem)])
    return value


def _context_problem(problem: str) -> InvalidCall:
    return InvalidCall(f"trusted_context {problem}", [FieldProblem("trusted_context", problem)])


def new_session(agent: object, principal: object, trusted_context: object) -> SessionRecord:
    """A new session for ``agent`` acting for ``principal``.

    Raises:
        InvalidCall: a name is empty, too long or unprintable, or trusted_context is not a list of
            at most 1000 strings of at most `MAX_CONTEXT_BYTES` in all (UTF-8).
    """
    if not isinstance(trusted_context, list) or not all(isinstance(i, str) for i in trusted_context):
        raise _context_problem("must be a list of strings")
    if len(trusted_context) > _MAX_CONTEXT_ITEMS:
        raise _context_problem(f"has {len(trusted_context)} items; at most {_MAX_CONTEXT_ITEMS}")
    size = sum(len(item.encode("utf-8", "surrogatepass")) for item in trusted_context)
    if size > MAX_CONTEXT_BYTES:
        raise _context_problem(
            f"holds {size} bytes of text; at most {MAX_CONTEXT_BYTES} (UTF-8) in all: give the "
            "user's request and the values they named, not whole documents (let a tool read those)"
        )
    return SessionRecord(
        id="s-" + secrets.token_hex(12),
        agent=_check_name("agent", agent),
        principal=_check_name("principal", principal),
        trusted_context=tuple(trusted_context),
        opened_at=datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
    )
