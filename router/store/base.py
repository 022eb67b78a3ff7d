"""The `Store` seam: the state a router keeps between calls, and shares with other routers.

It holds sessions (who, taint, call count, trusted context, policy's labels), each session's provenance index and
pending external reports, approvals, rate windows, credential leases and the public keys that
verify minted tokens. `MemoryStore` keeps them in this process
(the embedded default); `RedisStore` keeps them in Redis, so several routers act as one. Every
method raises `StoreError` when the backend fails; the control plane then denies and audits.

A session id not of `router.store.keys.is_session_id`'s shape names no session: reads and deletes
answer as for one not open, and writes under it raise `InvalidCall`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from policy.base import RateCounts
from router.errors import InvalidCall
from router.store.keys import is_session_id
from router.wire import show

if TYPE_CHECKING:
    from router.approvals import Approval, ApprovalStatus


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """One agent task's session, as loaded for one call (a snapshot, not a live object)."""

    id: str
    agent: str
    principal: str
    trusted_context: tuple[str, ...]
    opened_at: str
    taint: frozenset[str] = field(default_factory=frozenset)
    call_count: int = 0
    endorsed: frozenset[str] = field(default_factory=frozenset)  # source labels a human endorsed
    # What policy wrote about the session (``session_labels`` obligations of allowed calls).
    labels: frozenset[str] = field(default_factory=frozenset)
    # The latest approval asked for each exact call in the session (binding -> approval id): a
    # retry of a held call finds it, so a model need not carry approval ids (MCP, frameworks).
    approvals: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CallContext:
    """What the store knows for one call: its session, where its arguments were seen before, and
    the calls in its rate windows (all 0 for a call refused before counting)."""

    session: SessionRecord
    provenance: dict[str, list[str]]
    rates: RateCounts


@dataclass(frozen=True, slots=True)
class PendingExternal:
    """An allowed call to an ``external`` tool, waiting for the framework to report its output."""

    session_id: str
    call_id: str
    decision_id: str
    tool: str
    # The provenance keys of the call's arguments: a trusted tool's output that repeats them does
    # not make them trusted (they keep the sources they had).
    echoed: tuple[str, ...] = ()
    # An argument of the call came only from untrusted content: the call was steered by it, and
    # its whole output is untrusted content (a trusted tool's, and declared trusted parts, alike).
    steered: bool = False
    # After untrusted content, an argument had keys yet no trusted source: its output is derived
    # (indexed as ``derived:``), neither a trusted source nor untrusted content.
    derived: bool = False


def checked_session_id(session_id: str) -> str:
    """``session_id``, if it is shaped as a session id (`router.store.keys.is_session_id`).

    Raises:
        InvalidCall: it is not (nothing is stored under it).
    """
    if not is_session_id(session_id):
        raise InvalidCall(f"session id {show(session_id)} is not one the router makes (s- and 24 hex digits)")
    return session_id


class Store(Protocol):
    """Sessions, provenance, pending reports, approvals and rate windows.

    Sessions expire after the store's idle TTL; using one (`load_session`) renews it. Provenance
    keys are the strings `router.provenance` reduces values to; the store only keeps, per session,
    which sources each key was seen in (at most ``MAX_SOURCES``).
    """

    shared: bool
    """Whether other routers use this store too: credentials they mint can reach this router's
    tools (through a shared upstream, a reflecting page), so it redacts every stockade token."""

    async def create_session(self, session: SessionRecord, provenance_keys: Collection[str]) -> None:
        """Store a new session, its trusted context already indexed as ``user`` content."""
        ...

    async def load_session(self, session_id: str, *, agent: str | None = None) -> SessionRecord | None:
        """The open session, or None if unknown, closed or expired. Its idle TTL is renewed unless
        ``agent`` is given and is not its agent (another agent's request keeps no session alive)."""
        ...

    async def delete_session(self, session_id: str) -> bool:
        """Forget a session with its index and pending reports; False if it was not open."""
        ...

    async def live_sessions(self, session_ids: Collection[str]) -> set[str]:
        """Which of ``session_ids`` are still open (without renewing them)."""
        ...

    async def record_output(
        self, session_id: str, source: str, provenance_keys: Collection[str], *, taint: str | None
    ) -> None:
        """Index content the agent is about to see, and add ``taint`` to the session, atomically."""
        ...

    async def endorse(self, session_id: str, call_id: str) -> str | None:
        """Endorse for the session the output call ``call_id`` put into it: returns its source
        label, or None if the session is not open or no output of that call was recorded in it."""
        ...

    async def call_context(
        self, session_id: str, tool: str, keys_by_arg: Mapping[str, Collection[str]], *, count: bool,
        agent: str | None = None,
    ) -> CallContext | None:  # fmt: skip
        """Everything policy needs from the store for one call, in one step (one round trip in
        Redis: this is the hot path). The session is renewed; ``count`` adds the call to the
        session's call count and to its rate windows first. Provenance: for each argument, the
        sorted sources any of its keys was seen in (arguments with none left out). None if the
        session is not open. ``agent``: who the caller says it is; if the session is another
        agent's, nothing is renewed or counted and the context has no provenance or rates (the
        caller refuses the call)."""
        ...

    async def add_session_labels(self, session_id: str, labels: Collection[str]) -> bool:
        """Add policy's ``labels`` to the open session (later loads carry them); False if it is not
        open. Labels are never removed: they end with the session."""
        ...

    async def expect_report(self, pending: PendingExternal) -> None:
        """Remember an allowed external call until its output is reported."""
        ...

    async def take_report(self, session_id: str, call_id: str) -> PendingExternal | None:
        """Remove and return the pending external call, or None: each one is reported once."""
        ...

    async def put_approval(self, approval: Approval, keep_s: float) -> str:
        """Store a new approval, kept (whatever its status) for ``keep_s`` seconds, and remember it
        in its session (if open) as the latest for its binding (`SessionRecord.approvals`); unless
        the session already remembers a pending, unexpired approval for that binding (an identical
        call held a moment before, perhaps on another router): then nothing is stored, and that
        one stands for both. Returns the id of the approval in force for the call."""
        ...

    async def get_approval(self, approval_id: str) -> Approval | None: ...

    async def list_approvals(self) -> list[Approval]:
        """Every approval still kept, oldest first."""
        ...

    async def swap_approval(self, approval: Approval, expected: ApprovalStatus) -> bool:
        """Replace the stored approval with ``approval`` only if its status is still ``expected``:
        two routers deciding or redeeming the same approval cannot both succeed. A pending or
        approved one past its ``expires_at`` by the store's own clock (not the caller's: a router
        whose clock is behind must not redeem it) is never replaced."""
        ...

    async def put_lease(self, lease_id: str, record: str, ttl_s: float) -> None:
        """Record a minted credential (JSON, never its value), active, for ``ttl_s`` seconds."""
        ...

    async def get_lease(self, lease_id: str) -> tuple[str, dict[str, Any]] | None:
        """(``active`` or ``revoked``, the record), or None once unknown or past its TTL."""
        ...

    async def revoke_lease(self, lease_id: str) -> bool:
        """Mark the lease revoked (it stays recorded until its TTL); False if it is not recorded."""
        ...

    async def publish_key(self, kid: str, jwk: str, ttl_s: float) -> None:
        """Publish a public signing key (JWK JSON) for ``ttl_s`` seconds."""
        ...

    async def public_keys(self) -> dict[str, str]:
        """The published public keys still in their time, by kid."""
        ...

    async def put_tool(self, name: str, spec_json: str) -> tuple[str, int, bool]:
        """Add a tool to the shared registry unless one of that name, or of a name with the same
        canonical form (`router.wire.canonical_tool_name`: ``Send_Email`` for ``send_email``), is
        there. Returns the stored spec (JSON: that tool's, when one is there), its registry
        version and whether this call added it. Tools are never replaced: every router serving a
        name serves the same tool, and no router serves a look-alike of it."""
        ...

    async def get_tool(self, name: str) -> str | None:
        """The registered tool's spec (JSON), or None."""
        ...

    async def list_tools(self) -> dict[str, str]:
        """Every registered tool's spec (JSON), by name; of look-alike names (registered before
        `put_tool` refused them), only the first registered."""
        ...

    async def ping(self) -> None:
        """Raise `StoreError` unless the backend answers."""
        ...

    async def aclose(self) -> None: ...
