"""The audit seam: the event record (a superset of OPA's decision-log event, defined in
`router.wire` so the SDK reads it without the server) and the `AuditLog` Protocol."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol, runtime_checkable

from router.audit.chain import GENESIS_HASH as GENESIS_HASH  # noqa: PLC0414  (re-exported)
from router.audit.chain import Unsealed
from router.audit.checkpoint import Checkpoint
from router.audit.masking import Rule, mask
from router.errors import AuditError
from router.redact import REDACTOR
from router.text import escape_invalid_text
from router.wire import AuditEvent as AuditEvent  # noqa: PLC0414  (re-exported; defined in router.wire for the SDK)
from router.wire import EventKind as EventKind  # noqa: PLC0414  (re-exported, as AuditEvent)


def timestamp() -> str:
    """Now, as audit events record it: UTC, microseconds, ``Z``."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class AuditFilter:
    """What `AuditLog.query` selects; every set field must match."""

    since: datetime | None = None
    until: datetime | None = None
    session_id: str | None = None
    agent: str | None = None
    tool: str | None = None
    outcome: str | None = None
    decision_id: str | None = None
    kind: str | None = None
    limit: int | None = None


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """The result of checking the log. ``broken_seq`` is the first seq that does not check out;
    ``line`` its line in the segment the problem names. ``signed``: the largest size a signed
    checkpoint vouches for; ``retired``: events retention deleted (each range under a signed
    tombstone); ``notes``: what was not checked, or not yet signed."""

    ok: bool
    events: int
    head_seq: int
    head_hash: str
    broken_seq: int | None = None
    line: int | None = None
    problem: str = ""
    signed: int = 0
    checkpoints: int = 0
    retired: int = 0
    notes: tuple[str, ...] = ()


@runtime_checkable
class AuditLog(Protocol):
    """**Protocol**: an append-only, hash-chained log of audit events."""

    async def append(self, event: AuditEvent) -> AuditEvent:
        """Chain and persist ``event``; returns it with ``seq``, ``prev_hash`` and ``hash``.
        Durable before it returns. Raises `AuditError` if it cannot be written."""
        ...

    async def query(self, where: AuditFilter) -> list[AuditEvent]:
        """Events matching ``where``, oldest first."""
        ...

    async def verify(self) -> VerifyReport:
        """Check every event's hash, sequence and link to its predecessor."""
        ...

    async def checkpoints(self) -> list[Checkpoint]:
        """The signed checkpoints published so far, oldest first."""
        ...

    async def check(self) -> str | None:
        """Why an append could not be made now (None: it can); for readiness, without appending."""
        ...

    async def aclose(self) -> None:
        """Release the log."""
        ...


def _parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def matches(document: dict[str, Any], where: AuditFilter) -> bool:
    for field in ("session_id", "agent", "tool", "outcome", "decision_id", "kind"):
        wanted = getattr(where, field)
        if wanted is not None and document.get(field) != wanted:
            return False
    if where.since is not None or where.until is not None:
        try:
            at = _parse_time(str(document.get("timestamp")))
        except ValueError:
            return False
        if where.since is not None and at < where.since:
            return False
        if where.until is not None and at > where.until:
            return False
    return True


def as_written(
    event: AuditEvent, masks: Sequence[Rule] = (), mask_key: bytes | None = None
) -> tuple[AuditEvent, Unsealed]:
    """``event`` as an audit log writes it, serialised but for its chain fields: the operator's
    masking rules applied (recorded in ``labels.masked``), every secret the
    process has registered redacted, and every string that UTF-8 cannot hold escaped (all here,
    where each log serialises the event, so no path to the log skips them). Escaping costs a walk of
    the document, so it is done only when the serialised text shows it is needed.

    Raises:
        AuditError: the event cannot be serialised at all (never for any value the pipeline builds).
    """
    try:
        try:
            document = event.model_dump(mode="json")
        except UnicodeEncodeError:  # pydantic refuses a lone surrogate in a key: escape, then dump
            paths: list[str] = []
            event = AuditEvent.model_validate(escape_invalid_text(event.model_dump(), "", paths))
            document = event.model_dump(mode="json")
            document["escaped"] = sorted(set(paths))
        original = document
        if masks:
            document, masked = mask(document, masks, mask_key)
            if masked:
                document["labels"] = {**document.get("labels", {}), "masked": ",".join(masked)[:2000]}
        written = REDACTOR.deep(document)
        unsealed = Unsealed(written)
        if not unsealed.encodable:
            escaped_paths: list[str] = []
            written = escape_invalid_text(written, "", escaped_paths)
            written["escaped"] = sorted(set(escaped_paths) | set(written.get("escaped") or ()))
            unsealed = Unsealed(written)
        if written is not original:  # masked, redacted or escaped: the event says what was written
            event = AuditEvent.model_validate(written)
        return event, unsealed
    except AuditError:
        raise
    except Exception as exc:  # whatever broke, the caller must see an audit failure
        raise AuditError(f"audit event cannot be serialised: {type(exc).__name__}: {exc}"[:500]) from exc
