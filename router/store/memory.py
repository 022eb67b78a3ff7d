"""`MemoryStore`: the embedded default, everything in this process's memory.

Nothing is shared with other processes and nothing survives a restart. Sessions expire after the
idle TTL like in Redis; approvals are dropped when their keep time is over; rate windows of idle
scopes are forgotten first when there are very many.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from policy.base import RateCounts
from router.approvals import Approval, ApprovalStatus
from router.provenance import ProvenanceIndex
from router.rates import PERIODS, RateCounter
from router.rates import scopes as rate_scopes
from router.store.base import CallContext, PendingExternal, SessionRecord, checked_session_id
from router.store.keys import is_session_id
from router.wire import canonical_tool_name


@dataclass(slots=True)
class _Session:
    record: SessionRecord
    last_used: float
    index: ProvenanceIndex = field(default_factory=ProvenanceIndex)
    pending: dict[str, PendingExternal] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)  # call id -> source label of its output


class MemoryStore:
    """`Store` in this process."""

    shared = False

    def __init__(self, session_ttl_s: float = 3600.0, rate_periods: Mapping[str, float] = PERIODS) -> None:
        self._session_ttl_s = session_ttl_s
        self._sessions: dict[str, _Session] = {}
        self._approvals: dict[str, tuple[Approval, float]] = {}  # id -> (approval, drop at)
        self._rates = RateCounter(rate_periods)
        self._leases: dict[str, tuple[str, dict[str, Any], float]] = {}  # id -> (status, record, until)
        self._keys: dict[str, tuple[str, float]] = {}  # kid -> (jwk, until)
        self._tools: dict[str, tuple[str, int]] = {}  # name -> (spec JSON, registry version)
        self._tool_names: dict[str, str] = {}  # canonical name -> the name registered under it

    def _live(self, session_id: str, now: float) -> _Session | None:
        session = self._open(session_id)
        if session is not None and now - session.last_used > self._session_ttl_s:
            del self._sessions[session_id]
            return None
        return session

    def _open(self, session_id: str) -> _Session | None:
        """The session, idle or not; None for an id not shaped as one (as in Redis, it names none)."""
        return self._sessions.get(session_id) if is_session_id(session_id) else None

    async def create_session(self, session: SessionRecord, provenance_keys: Collection[str]) -> None:
        checked_session_id(session.id)
        entry = _Session(session, time.monotonic())
        entry.index.add_keys("user", provenance_keys)
        self._sessions[session.id] = entry

    async def load_session(self, session_id: str, *, agent: str | None = None) -> SessionRecord | None:
        now = time.monotonic()
        session = self._live(session_id, now)
        if session is None:
            return None
        if agent is None or session.record.agent == agent:
            session.last_used = now
        return session.record

    async def delete_session(self, session_id: str) -> bool:
        return is_session_id(session_id) and self._sessions.pop(session_id, None) is not None

    async def live_sessions(self, session_ids: Collection[str]) -> set[str]:
        now = time.monotonic()
        return {s for s in session_ids if self._live(s, now) is not None}

    async def record_output(
        self, session_id: str, source: str, provenance_keys: Collection[str], *, taint: str | None
    ) -> None:
        session = self._open(session_id)
        if session is None:  # closed meanwhile: nothing more can be called in it
            return
        session.index.add_keys(source, provenance_keys)
        session.outputs[source.rsplit(":", 1)[-1]] = source
        if taint is not None and taint not in session.record.taint:
            session.record = dataclasses.replace(session.record, taint=session.record.taint | {taint})

    async def endorse(self, session_id: str, call_id: str) -> str | None:
        session = self._live(session_id, time.monotonic())
        source = None if session is None else session.outputs.get(call_id)
        if session is not None and source is not None:
            session.record = dataclasses.replace(session.record, endorsed=session.record.endorsed | {source})
        return source

    async def call_context(
        self, session_id: str, tool: str, keys_by_arg: Mapping[str, Collection[str]], *, count: bool,
        agent: str | None = None,
    ) -> CallContext | None:  # fmt: skip
        now = time.monotonic()
        session = self._live(session_id, now)
        if session is None:
            return None
        if agent is not None and session.record.agent != agent:
            return CallContext(session=session.record, provenance={}, rates=RateCounts())
        session.last_used = now
        if count:
            session.record = dataclasses.replace(session.record, call_count=session.record.call_count + 1)
        record = session.record
        windows = rate_scopes(session_id, record.agent, record.principal, tool)
        return CallContext(
            session=record,
            provenance=session.index.lookup_keys(keys_by_arg),
            rates=self._rates.hit(windows) if count else self._rates.peek(windows),
        )

    async def add_session_labels(self, session_id: str, labels: Collection[str]) -> bool:
        session = self._live(session_id, time.monotonic())
        if session is None:
            return False
        session.record = dataclasses.replace(session.record, labels=session.record.labels | frozenset(labels))
        return True

    async def expect_report(self, pending: PendingExternal) -> None:
        session = self._sessions.get(checked_session_id(pending.session_id))
        if session is not None:
            session.pending[pending.call_id] = pending

    async def take_report(self, session_id: str, call_id: str) -> PendingExternal | None:
        session = self._open(session_id)
        return None if session is None else session.pending.pop(call_id, None)

    def _drop_old_approvals(self, now: float) -> None:
        for approval_id in [k for k, (_, drop_at) in self._approvals.items() if drop_at <= now]:
            del self._approvals[approval_id]

    async def put_approval(self, approval: Approval, keep_s: float) -> str:
        now = time.time()
        self._drop_old_approvals(now)
        session = self._sessions.get(checked_session_id(approval.session_id))
        if session is not None and (earlier := session.record.approvals.get(approval.binding)) is not None:
            entry = self._approvals.get(earlier)
            if entry is not None and entry[0].status is ApprovalStatus.PENDING and entry[0].expires_at > now:
                return earlier
        self._approvals[approval.id] = (approval, now + keep_s)
        if session is not None:
            remembered = {**session.record.approvals, approval.binding: approval.id}
            session.record = dataclasses.replace(session.record, approvals=remembered)
        return approval.id

    async def get_approval(self, approval_id: str) -> Approval | None:
        entry = self._approvals.get(approval_id)
        return None if entry is None or entry[1] <= time.time() else entry[0]

    async def list_approvals(self) -> list[Approval]:
        self._drop_old_approvals(time.time())
        return sorted((a for a, _ in self._approvals.values()), key=lambda a: a.created_at)

    async def swap_approval(self, approval: Approval, expected: ApprovalStatus) -> bool:
        entry = self._approvals.get(approval.id)
        if entry is None or entry[0].status is not expected:
            return False
        if entry[0].status in (ApprovalStatus.PENDING, ApprovalStatus.APPROVED) and time.time() > entry[0].expires_at:
            return False  # expired: no longer decided or redeemed (as in Redis)
        self._approvals[approval.id] = (approval, entry[1])
        return True

    async def put_lease(self, lease_id: str, record: str, ttl_s: float) -> None:
        now = time.time()
        self._leases = {k: v for k, v in self._leases.items() if v[2] > now}
        self._leases[lease_id] = ("active", json.loads(record), now + ttl_s)

    async def get_lease(self, lease_id: str) -> tuple[str, dict[str, Any]] | None:
        entry = self._leases.get(lease_id)
        return None if entry is None or entry[2] <= time.time() else (entry[0], entry[1])

    async def revoke_lease(self, lease_id: str) -> bool:
        entry = self._leases.get(lease_id)
        if entry is None or entry[2] <= time.time():
            return False
        self._leases[lease_id] = ("revoked", entry[1], entry[2])
        return True

    async def publish_key(self, kid: str, jwk: str, ttl_s: float) -> None:
        self._keys[kid] = (jwk, time.time() + ttl_s)

    async def public_keys(self) -> dict[str, str]:
        now = time.time()
        self._keys = {k: v for k, v in self._keys.items() if v[1] > now}
        return {k: v[0] for k, v in self._keys.items()}

    async def put_tool(self, name: str, spec_json: str) -> tuple[str, int, bool]:
        taken = self._tool_names.get(canonical_tool_name(name), name)
        if taken in self._tools:
            return (*self._tools[taken], False)
        self._tools[name] = (spec_json, len(self._tools) + 1)
        self._tool_names[canonical_tool_name(name)] = name
        return spec_json, len(self._tools), True

    async def get_tool(self, name: str) -> str | None:
        entry = self._tools.get(name)
        return None if entry is None else entry[0]

    async def list_tools(self) -> dict[str, str]:
        return {name: spec for name, (spec, _) in self._tools.items()}

    async def ping(self) -> None:
        return None

    async def aclose(self) -> None:
        return None
