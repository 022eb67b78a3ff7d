"""Approvals: a human's yes or no for one exact action.

An approval is bound to sha256 of (tool, canonical arguments, session, input files): the same
call, with the same arguments and files, in the same session, once. It carries the policy's
reasons, the requesting agent and an expiry. The call that redeems it is decided again with
``input.approval`` set, so an approval never overrides a deny, and covers only the reasons it was
asked for.

The approvals themselves live in the `Store`: status changes are compare-and-set there, so two
routers can never both approve, or both redeem, one approval.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
import unicodedata
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from router.audit import AuditEvent, AuditLog, timestamp
from router.errors import ApprovalError as ApprovalError  # noqa: PLC0414  (re-exported; defined with the others)
from router.errors import AuditError
from router.refusals import RecordRefusal, refusal_event
from router.text import encodable
from router.tools import show
from router.wire import Approval as Approval  # noqa: PLC0414  (re-exported; defined in router.wire for the SDK)
from router.wire import ApprovalStatus as ApprovalStatus  # noqa: PLC0414  (re-exported, as Approval)

if TYPE_CHECKING:
    from router.store.base import Store

log = structlog.get_logger(__name__)


def binding(tool: str, canonical_args: str, session_id: str, inputs: Sequence[Mapping[str, Any]] = ()) -> str:
    """What an approval is for: the tool, its canonical arguments, the session, and the files
    passed in (by name and sha256: the approver sees them, and other files make another call)."""
    parts = [tool, canonical_args, session_id]
    if inputs:  # none: the binding as it was before files were part of it (approvals kept across upgrades)
        parts.append(json.dumps([[i["name"], i["sha256"]] for i in inputs], separators=(",", ":")))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def identity(name: str) -> str:
    """The identity a name stands for, to compare an approver (or endorser) with the agent: NFKC
    then case folded (``Claude``, fullwidth ``CLAUDE`` and ``claude`` are one), without format
    characters (a zero-width space or joiner in ``cl\u200baude``) and surrounding whitespace.
    Compare identities, never names as typed: the agent picks how it spells the approver."""
    folded = unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", name).casefold())
    return "".join(c for c in folded if not invisible(c)).strip()


# Characters Unicode says to show as nothing (Default_Ignorable_Code_Point, DerivedCoreProperties)
# beyond the format ones (Cf), which `invisible` finds by category: the combining grapheme joiner,
# variation selectors, Hangul and Mongolian fillers. (U+2800, the blank Braille pattern, is not
# ignorable but shows as blank.)
SELECTORS = frozenset((0x180B, 0x180C, 0x180D, 0x180F)).union(range(0xFE00, 0xFE10), range(0xE0100, 0xE01F0))
"""Variation selectors: they choose how the character before them looks (an emoji's colour form,
a CJK or Mongolian glyph)."""
_IGNORABLE = SELECTORS.union(
    (0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x180E, 0x2800, 0x3164, 0xFFA0), range(0xFFF0, 0xFFF9)
)


def invisible(char: str) -> bool:
    """Whether ``char`` shows as nothing: a format character (Cf: zero-width spaces and joiners,
    bidi controls) or another default-ignorable one (`_IGNORABLE`)."""
    return unicodedata.category(char) == "Cf" or ord(char) in _IGNORABLE


def same_identity(one: str, other: str) -> bool:
    """Whether two names stand for one identity (see `identity`)."""
    return identity(one) == identity(other)


# Characters of an approver's name: a session's principal (256) and the MCP client's label that
# elicitation adds to it ("<principal> (via <client> <version>)").
MAX_APPROVER = 512
MAX_NOTE = 2000  # characters of a decision's note (the HTTP API's bound too)


# What no name holds: control characters (NUL, ESC, line breaks), lone surrogates, line and
# paragraph separators. (A no-break space, or the joiners some scripts are written with, may.)
_NOT_IN_A_NAME = frozenset({"Cc", "Cs", "Zl", "Zp"})


def _decision_problem(approver: str, note: str) -> str | None:
    """Why a decision's approver or note cannot be taken (None: they can): each goes into the
    audit log and the approver into every policy input of the call it releases, where a lone
    surrogate made the policy fail on every retry, and a name of 60,000 characters rode along."""
    if len(approver) > MAX_APPROVER or any(unicodedata.category(c) in _NOT_IN_A_NAME for c in approver):
        return (f"approver must be a name of at most {MAX_APPROVER} characters without control characters, "
                f"line breaks or lone surrogates, got {show(approver)}")  # fmt: skip
    if len(note) > MAX_NOTE or not encodable(note) or "\x00" in note:
        return (f"note must be text of at most {MAX_NOTE} characters (valid Unicode, no NUL), got {show(note)}: "
                "shorten it, or link to where the reasons are written")  # fmt: skip
    return None


class ApprovalBook:
    """The approval rules, over a `Store` (so an approval granted through one router, or the CLI,
    releases the call on another) and an audit log (every status change is recorded)."""

    def __init__(
        self, store: Store, audit: AuditLog, *, ttl_s: float = 900.0, keep_s: float = 86400.0,
        labels: Mapping[str, str] | None = None, refusals: RecordRefusal | None = None,
        peer: Mapping[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """``refusals``: how refused decisions are audited (a router passes its `record_refusal`,
        so a flood of them is counted under its budget); by default each is written to ``audit``.
        ``peer``: the process every decision made through this book comes from, recorded with each
        that names no other (the CLI deciding at the shared store: its own uid, login, host)."""
        self._peer = dict(peer) if peer is not None else None
        self._store = store
        self._audit = audit
        self._ttl_s = ttl_s
        self._keep_s = keep_s
        self._labels = dict(labels or {})
        self._refusals: RecordRefusal = refusals if refusals is not None else self._write_refusal

    def event(self, approval: Approval, outcome: str, peer: Mapping[str, Any] | None = None) -> AuditEvent:
        """The audit event of a change of ``approval``, under its decision_id; ``peer``: the local
        process that asked for it (uid, pid, executable), recorded as ``result.peer``."""
        result = approval.model_dump(mode="json", exclude={"args"})
        if peer is not None:
            result["peer"] = dict(peer)
        return AuditEvent(
            kind="approval", decision_id=approval.decision_id, timestamp=timestamp(),
            session_id=approval.session_id, agent=approval.agent, tool=approval.tool, outcome=outcome,
            labels=self._labels, result=result,
        )  # fmt: skip

    async def record(self, approval: Approval, outcome: str, peer: Mapping[str, Any] | None = None) -> bool:
        """Audit a change of ``approval`` under its decision_id; False (logged) if the log failed."""
        try:
            await self._audit.append(self.event(approval, outcome, peer))
        except AuditError as exc:
            log.error("audit_append_failed", error=str(exc), kind="approval", decision_id=approval.decision_id)
            return False
        return True

    async def refuse(
        self, approver: str, verb: str, approval: Approval | object, code: str, message: str,
        peer: Mapping[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """Audit a decision refused before it was made, as any refused request is
        (`router.refusals.refusal_event`), with the approver as the caller, the approval's id (and
        for a known ``approval``, its session and tool) and the ``peer``. Never raises: the refusal
        stands whether or not the log took it (a failure is logged)."""
        known = approval if isinstance(approval, Approval) else None
        approval_id = known.id if known is not None else approval[:128] if isinstance(approval, str) else show(approval)
        detail: dict[str, Any] = {"approver": approver[:300], "approval_id": approval_id}
        if peer is not None:
            detail["peer"] = dict(peer)
        await self._refusals(
            approver[:300], f"{verb} approval {approval_id}", message, code=code,
            session_id=known.session_id if known is not None else None, tool=known.tool if known is not None else None,
            detail=detail,
        )  # fmt: skip

    async def _write_refusal(
        self, who: str | None, what: str, reason: str, *, code: str = "auth.refused", session_id: str | None = None,
        tool: str | None = None, detail: Mapping[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """Write one refusal straight to the log: for a book without a router's refusal budget
        (the CLI's, deciding one approval for a human at the shared store)."""
        log.info("request_refused", who=who, what=what[:300], reason=reason, code=code, session_id=session_id)
        try:
            await self._audit.append(refusal_event(who, what, reason, code=code, labels=self._labels,
                                                   session_id=session_id, tool=tool, detail=detail))  # fmt: skip
        except AuditError as exc:
            log.error("audit_append_failed", error=str(exc), kind="error", code=code)

    async def open(
        self, *, decision_id: str, session_id: str, agent: str, principal: str, tool: str, canonical_args: str,
        reasons: list[dict[str, str]], inputs: Sequence[Mapping[str, Any]] = (),
    ) -> Approval:  # fmt: skip
        now = time.time()
        approval = Approval(
            id="a-" + secrets.token_hex(10), decision_id=decision_id, session_id=session_id, agent=agent,
            principal=principal, tool=tool, args=canonical_args, inputs=[dict(i) for i in inputs],
            binding=binding(tool, canonical_args, session_id, inputs), reasons=reasons, created_at=now,
            expires_at=now + self._ttl_s,
        )  # fmt: skip
        in_force = await self._store.put_approval(approval, self._ttl_s + self._keep_s)
        # An identical call held a moment before (on any router) opened one already: it stands for both.
        return approval if in_force == approval.id else await self.get(in_force)

    async def get(self, approval_id: object) -> Approval:
        """The approval, shown as expired once its time is up (if it was not decided or used)."""
        approval = await self._store.get_approval(approval_id) if isinstance(approval_id, str) else None
        if approval is None:
            raise ApprovalError(f"no approval {show(approval_id)} (unknown, or no longer kept)")
        return _as_of_now(approval)

    async def list(self, status: ApprovalStatus | None = None) -> list[Approval]:
        found = [_as_of_now(a) for a in await self._store.list_approvals()]
        return [a for a in found if status is None or a.status is status]

    async def decide(
        self, approval_id: str, *, approver: str, approve: bool, note: str = "", peer: Mapping[str, Any] | None = None
    ) -> Approval:
        """Record a human's decision. ``peer``: the local process the decision came from (the
        approval socket's peer: uid, pid, executable), recorded with it.

        The decision is on record before it takes effect: a grant the log does not hold never
        releases a call, whatever fails after (a lost reply from Redis, another approver first).

        Raises:
            ApprovalError: unknown, not pending (decided, used, expired), or the approver is the
                agent that asked (compared as `identity`: ``Claude`` is ``claude``): each refused
                on record first (`refuse`: ``approval.not_found``, ``approval.not_pending``,
                ``approval.self_decision``), or no approver named (blank, or only invisible
                characters: ``approval.no_approver``), or a name or note the log and the policy cannot
                take (``approval.invalid``: see `_decision_problem`); or another decision came first (this one is
                then on record as ``not_applied`` too).
            AuditError: the decision could not be audited; it was not made (still pending).
            StoreError: the store failed while the decision was being made: it is on record, and
                may or may not be in force (`get` says).
        """
        verb = "approve" if approve else "deny"
        peer = peer if peer is not None else self._peer
        try:
            approval = await self.get(approval_id)
        except ApprovalError as exc:
            await self.refuse(approver, verb, approval_id, "approval.not_found", str(exc), peer=peer)
            raise
        if approval.status is not ApprovalStatus.PENDING:
            message = f"approval {approval.id} is {approval.status.value}, not pending"
            await self.refuse(approver, verb, approval, "approval.not_pending", message, peer=peer)
            raise ApprovalError(message)
        if not identity(approver):
            message = (f"approval {approval.id} needs the approver's name ({show(approver)} names nobody): "
                       "give the name of the human who decides, e.g. --approver oncall@example.com")  # fmt: skip
            await self.refuse(approver, verb, approval, "approval.no_approver", message, peer=peer)
            raise ApprovalError(message)
        if same_identity(approver, approval.agent):
            message = (f"approval {approval.id} cannot be decided by {show(approver)}: "
                       "the requesting agent never approves its own calls")  # fmt: skip
            await self.refuse(approver, verb, approval, "approval.self_decision", message, peer=peer)
            raise ApprovalError(message)
        problem = _decision_problem(approver, note)
        if problem is not None:
            await self.refuse(show(approver), verb, approval, "approval.invalid", problem, peer=peer)
            raise ApprovalError(problem)
        decided = approval.model_copy(update={
            "status": ApprovalStatus.APPROVED if approve else ApprovalStatus.DENIED,
            "approver": approver, "note": note, "decided_at": time.time(),
        })  # fmt: skip
        if not await self.record(decided, decided.status.value, peer):
            raise AuditError(f"the decision on approval {approval.id} could not be audited; it is still pending")
        if not await self._store.swap_approval(decided, ApprovalStatus.PENDING):
            # On record, but another decision (itself on record) came first, or it expired by the
            # store's clock (this router's may be behind): say this one is not in force.
            await self.record(decided, "not_applied", peer)
            raise ApprovalError(f"approval {approval.id} was decided by someone else, or expired, meanwhile")
        log.info("approval_decided", approval_id=approval.id, status=decided.status.value, approver=approver)
        return decided

    async def check(
        self, approval_id: str, *, session_id: str, tool: str, canonical_args: str,
        inputs: Sequence[Mapping[str, Any]] = (),
    ) -> Approval:  # fmt: skip
        """The approval for exactly this call, approved and unused.

        Raises:
            ApprovalError: unknown, not approved, used, expired, or for another call.
        """
        approval = await self.get(approval_id)
        if approval.binding != binding(tool, canonical_args, session_id, inputs):
            raise ApprovalError(f"approval {approval.id} is for another call: tool, arguments, input files and "
                                "session must be exactly those approved")  # fmt: skip
        if approval.status is not ApprovalStatus.APPROVED:
            raise ApprovalError(f"approval {approval.id} is {approval.status.value}, not approved")
        return approval

    async def redeem(self, approval_id: str) -> Approval:
        """Mark an approved approval used: it cannot release another call, on any router."""
        approval = await self.get(approval_id)
        if approval.status is not ApprovalStatus.APPROVED:
            raise ApprovalError(f"approval {approval.id} is {approval.status.value}, not approved")
        used = approval.model_copy(update={"status": ApprovalStatus.USED})
        if not await self._store.swap_approval(used, ApprovalStatus.APPROVED):  # the store's clock decides expiry
            raise ApprovalError(f"approval {approval.id} was used by another call, or expired, meanwhile")
        return used


def _as_of_now(approval: Approval) -> Approval:
    """``approval`` as this router's clock sees it: for display and early refusal only. Whether it
    may still be decided or redeemed is the store's word (`Store.swap_approval`), by its clock."""
    if approval.status in (ApprovalStatus.PENDING, ApprovalStatus.APPROVED) and time.time() > approval.expires_at:
        return approval.model_copy(update={"status": ApprovalStatus.EXPIRED})
    return approval
