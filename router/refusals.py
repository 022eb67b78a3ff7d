"""How refusals reach the audit log under a flood: one by one up to a burst, then counted.

Every request refused at the door (a bad token, a body over the limit, an unknown session) is
audited, and an audit append is an fsynced write. Unchecked, one client sending bad requests as
fast as it can makes the router write an event for each (some 400 a second from one client,
measured here): the disk fills, and the appends of real calls queue behind them. So refusals of
one kind (the same caller, the same code) are written one by one only up to ``burst`` in each
``window_s``; past that they are counted, and the count goes into the log as one event when the
window closes. Nothing goes uncounted: the events of a kind plus the counts in its summaries are
every refusal of that kind.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from router.audit import AuditEvent, timestamp


class RecordRefusal(Protocol):
    """Audits one refused request (`ControlPlane.record_refusal` under a `RefusalBudget`)."""

    async def __call__(
        self, who: str | None, what: str, reason: str, *, code: str = "auth.refused", session_id: str | None = None,
        tool: str | None = None, detail: Mapping[str, Any] | None = None,
    ) -> None: ...  # fmt: skip


def refusal_event(
    who: str | None, what: str, reason: str, *, code: str, labels: Mapping[str, str], session_id: str | None = None,
    tool: str | None = None, detail: Mapping[str, Any] | None = None,
) -> AuditEvent:  # fmt: skip
    """The audit event of one refused request, whoever refused it: ``kind: error``, outcome
    ``refused``, ``result.code``, ``result.request`` (``what``), ``result.message`` (``reason``),
    and ``detail``'s fields beside them (an approval's id and approver, the peer that asked)."""
    result: dict[str, Any] = {**(detail or {}), "code": code, "request": what[:300], "message": reason[:2000]}
    return AuditEvent(
        kind="error", decision_id=str(uuid.uuid4()), timestamp=timestamp(), agent=who, outcome="refused",
        session_id=session_id, tool=tool, labels=dict(labels), result=result,
    )  # fmt: skip


@dataclass(slots=True)
class RefusalSummary:
    """Refusals of one kind counted, not written one by one, in one window."""

    who: str | None
    code: str
    count: int
    first_request: str
    last_request: str
    started: float  # wall-clock seconds (epoch) of the window's start
    ended: float


@dataclass(slots=True)
class _Window:
    started: float
    started_at: float  # epoch, for the summary
    written: int = 0
    counted: int = 0
    first: str = ""
    last: str = ""


class RefusalBudget:
    """Which refusals are written one by one, and the counts of those that were not."""

    def __init__(self, burst: int, window_s: float) -> None:
        self.burst = burst
        self.window_s = window_s
        self._windows: dict[tuple[str | None, str], _Window] = {}

    def admit(self, who: str | None, code: str, request: str, now: float, epoch: float) -> bool:
        """Whether this refusal is written one by one (else it is counted). ``now``: a monotonic
        clock; ``epoch``: the wall clock, for the summary. Call `due` first: a window that has
        closed must give its count before a new one opens."""
        key = (who, code)
        window = self._windows.get(key)
        if window is None or now - window.started >= self.window_s:
            window = self._windows[key] = _Window(now, epoch)
        if window.written < self.burst:
            window.written += 1
            return True
        if not window.counted:
            window.first = request
        window.counted += 1
        window.last = request
        return False

    def due(self, now: float, epoch: float, *, every: bool = False) -> list[RefusalSummary]:
        """The counts of the windows that have closed (``every``: of all windows, as at shutdown),
        each once; closed windows are forgotten."""
        found = []
        for key, window in list(self._windows.items()):
            if every or now - window.started >= self.window_s:
                del self._windows[key]
                if window.counted:
                    found.append(RefusalSummary(key[0], key[1], window.counted, window.first, window.last,
                                                window.started_at, epoch))  # fmt: skip
        return found

    def next_close(self) -> float | None:
        """When (monotonic) the first window with a count closes, if one has."""
        closing = [w.started + self.window_s for w in self._windows.values() if w.counted]
        return min(closing, default=None)
