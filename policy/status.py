"""What an engine has in force, and whether the policy on disk loaded at the last try.

A reload that fails keeps the old policy deciding, which is right, but silent: `LoadStatus` is
what the engines record on every load attempt so that ``GET /v1/policy`` and ``/readyz`` can say
"the files on disk failed to load, the previous revision stays in force" until a later load
succeeds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Protocol, runtime_checkable


def now() -> datetime:
    """The time a load attempt is stamped with (UTC)."""
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class LoadStatus:
    """One engine's policy: the revision in force and the outcome of the last load attempt."""

    source: str
    """The directory or bundle file the engine loads from."""
    revision: str
    """The revision in force (the last one that loaded)."""
    loaded_at: datetime
    """When the revision in force was loaded."""
    attempted_at: datetime
    """When the engine last tried to load the files (its first load, or a reload)."""
    error: str | None = None
    """Why the last attempt failed (``file:line: message``, no backtrace); None once one succeeds."""
    failed_revision: str | None = None
    """The revision (or, if they could not be read as a policy, the content digest) of the files
    that failed; None if not even that could be computed."""

    @classmethod
    def first(cls, source: str, revision: str) -> LoadStatus:
        """The status of an engine that just loaded ``revision`` from ``source``."""
        at = now()
        return cls(source=source, revision=revision, loaded_at=at, attempted_at=at)

    @property
    def on_disk_loaded(self) -> bool:
        """Whether the files on disk loaded at the last attempt (then they are what is in force)."""
        return self.error is None

    def loaded(self, revision: str) -> LoadStatus:
        """This status after a load of ``revision`` succeeded: any earlier failure is cleared."""
        return LoadStatus.first(self.source, revision)

    def failed(self, error: str, failed_revision: str | None) -> LoadStatus:
        """This status after a load attempt failed: the revision in force stays."""
        return replace(self, attempted_at=now(), error=summarize(error), failed_revision=failed_revision)


@runtime_checkable
class ReportsLoadStatus(Protocol):
    """**Protocol**: an engine that records its `LoadStatus` (both shipped engines do)."""

    @property
    def load_status(self) -> LoadStatus: ...


_LOCATION = re.compile(r"-->\s*(\S+:\d+:\d+)")
_MAX_ERROR = 1000


def summarize(error: str) -> str:
    """A load error in one line: ``<what> <file:line:col>: <message>`` for a regorus error (its
    source snippet and any Rust backtrace dropped), else the error's first line."""
    text = error.split("Stack backtrace:", 1)[0].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    found = _LOCATION.search(text)
    message = next((line.removeprefix("error:").strip() for line in lines if line.startswith("error:")), None)
    if found is None or message is None:
        return lines[0][:_MAX_ERROR]
    head = lines[0].split("-->", 1)[0].strip().rstrip(":")
    return f"{head + ': ' if head else ''}{found.group(1)}: {message}"[:_MAX_ERROR]
