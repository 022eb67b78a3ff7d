"""Impact analysis of a policy change: decide the inputs recorded in the audit log on a baseline
and on a candidate policy, and say what the candidate would let through that the baseline does
not, and the reverse.

Both policies decide every recorded input on the production path (`policy.EmbeddedEngine`), so
a log that spans several revisions shows only the candidate's change, never the drift between
what was in force then and the baseline. ``against_recorded`` compares the candidate with the
decisions as recorded instead, and counts how many of them another revision made.

A decision changes when its outcome, its reason codes or, unless one side denies (a deny
enforces nothing), its obligations differ. Each `Difference` has a direction:

- ``widened``: the candidate lets more through (deny → require_approval → allow, a higher
  limit, another egress host, port or method, another credential or scope, a longer TTL, a
  weaker sandbox tier in the catalog's ``tiers`` order, a session's sandbox instead of a fresh one);
- ``narrowed``: the reverse;
- ``mixed``: both at once (an egress rule's methods GET → POST);
- ``changed``: neither (reason codes, session labels, a value set to or from "as the tool asks").

A `Change`'s direction sums its differences': widened, narrowed, mixed when it has both, changed
when it has neither. `AcceptRule`s (an accept file) let a team accept changes one by one
(``decision_id``) or as a class (``tool``, ``agent``, ``principal``, ``direction``, ``field``);
`gated` names the changes a CI gate (``--fail-on``) stops on; `gate_failures` says why a gate fails
whatever the changes: nothing replayed, events skipped, or decisions the baseline's own revision
no longer reproduces.

A replay is only as faithful as the inputs it decides. An event whose input the log masked
(``labels.masked`` names a path under ``/input``: the value was erased or hashed, so the policy
would compare ``"sha256:..."`` where it read a number) or escaped is skipped as ``masked_input``
or ``escaped_input``, never decided as if recorded. A decision recorded under the baseline's own
revision must come out the same when the baseline decides it again; one that does not is counted
``unfaithful`` (its input was altered on the way to the log, say by redaction). `chained_documents`
reads the log checking every line's link in the hash chain, so an edited log is refused, not
replayed.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from policy import Decision, EmbeddedEngine, Outcome, PolicyInput
from policy.base import POLICY_ERROR
from router.audit import AuditEvent, AuditFilter
from router.audit.base import matches
from router.audit.chain import GENESIS_HASH, check_link, document_of, line_hash
from router.audit.layout import LogLayout, lines
from router.errors import AuditError
from runner import TIERS

Direction = Literal["widened", "narrowed", "mixed", "changed"]
DIRECTIONS: tuple[Direction, ...] = ("widened", "narrowed", "mixed", "changed")
GATES = ("widened", "narrowed", "any")
"""What ``--fail-on`` takes: a gate on widened changes stops mixed ones too (they widen)."""

_OUTCOME_RANK = {Outcome.DENY: 0, Outcome.REQUIRE_APPROVAL: 1, Outcome.ALLOW: 2}
_SKIP_SAMPLES = 5  # skipped events kept with their details; the rest are only counted


@dataclass(frozen=True, slots=True)
class Difference:
    """One way two decisions differ: the ``field`` (``outcome``, ``reasons``,
    ``limits.timeout_s``, ``egress.<host>:<port>``, ``credentials.<name>.scopes``,
    ``sandbox.min_tier``, ...), its direction, and the values on each side as short text."""

    field: str
    direction: Direction
    was: str
    now: str

    @property
    def text(self) -> str:
        """What differs, for a human: ``limits.timeout_s 60→30``."""
        return f"{self.field} {self.was}→{self.now}"


@dataclass(frozen=True, slots=True)
class Change:
    """A recorded decision the candidate decides differently: who, what, both decisions and how
    they differ. ``revision``: the policy revision the decision was recorded under."""

    decision_id: str
    timestamp: str
    tool: str
    agent: str
    principal: str
    session_id: str
    revision: str
    was: Decision
    now: Decision
    differences: tuple[Difference, ...]

    @property
    def direction(self) -> Direction:
        """The differences' directions summed up (see the module docstring)."""
        return summed(d.direction for d in self.differences)

    def summary(self) -> dict[str, Any]:
        """The change as JSON, for samples and scripts."""
        return {
            "decision_id": self.decision_id, "timestamp": self.timestamp, "tool": self.tool,
            "agent": self.agent, "principal": self.principal, "session_id": self.session_id,
            "recorded_revision": self.revision, "direction": self.direction,
            "was": self.was.outcome.value, "now": self.now.outcome.value,
            "was_reasons": sorted(set(self.was.reason_codes)), "now_reasons": sorted(set(self.now.reason_codes)),
            "differs": [d.text for d in self.differences],
            "differences": [{"field": d.field, "direction": d.direction, "was": d.was, "now": d.now}
                            for d in self.differences],
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Skipped:
    """A recorded event that could not be replayed, and why: ``unreadable_line`` (not a JSON
    object), ``malformed_event`` (not an audit event, or a decision without its input or result),
    ``masked_input`` / ``escaped_input`` (the log masked or escaped values of the input, so a
    policy would decide on a hash or ``[masked]`` instead of what it saw), ``invalid_input`` (the
    input no longer validates as a `PolicyInput`), ``malformed_result`` (``against_recorded``: the
    recorded decision does not parse). An ``unfaithful`` decision is recorded alike, in
    ``ReplayReport.unfaithful_samples``."""

    why: str
    decision_id: str | None
    detail: str


@dataclass(slots=True)
class ReplayReport:
    """What a replay found. ``revisions``: how many replayed decisions each policy revision
    recorded; ``skipped_samples``: the first few skipped events, all counted in ``skipped``;
    ``unfaithful``: replayed decisions recorded under the baseline's revision that the baseline
    now decides otherwise (the first few in ``unfaithful_samples``)."""

    mode: Literal["baseline", "recorded"]
    baseline_revision: str
    candidate_revision: str
    replayed: int = 0
    changes: list[Change] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    skipped_samples: list[Skipped] = field(default_factory=list)
    revisions: Counter[str] = field(default_factory=Counter)
    unfaithful: int = 0
    unfaithful_samples: list[Skipped] = field(default_factory=list)

    @property
    def other_revisions(self) -> int:
        """Replayed decisions recorded under another revision than the baseline's."""
        return sum(n for revision, n in self.revisions.items() if revision != self.baseline_revision)

    def skip(self, why: str, decision_id: str | None, detail: str) -> None:
        self.skipped[why] += 1
        if len(self.skipped_samples) < _SKIP_SAMPLES:
            self.skipped_samples.append(Skipped(why, decision_id, detail[:300]))

    def distrust(self, decision_id: str, detail: str) -> None:
        self.unfaithful += 1
        if len(self.unfaithful_samples) < _SKIP_SAMPLES:
            self.unfaithful_samples.append(Skipped("unfaithful", decision_id, detail[:300]))

    def by_direction(self) -> dict[str, int]:
        """How many changes go each way (every direction present, 0 when none)."""
        counted = Counter(change.direction for change in self.changes)
        return {direction: counted[direction] for direction in DIRECTIONS}

    def by_reason(self) -> dict[str, int]:
        """How often each of the candidate's reason codes appears among the changes (``(none)``
        for a change the candidate decides without a reason), most frequent first."""
        counted = Counter(code for c in self.changes for code in (sorted(set(c.now.reason_codes)) or ["(none)"]))
        return dict(counted.most_common())

    def groups(self, samples: int) -> dict[str, dict[str, dict[str, Any]]]:
        """Changes grouped by direction, tool, agent, principal and the candidate's reason code:
        per key the count, the count in each direction, and up to ``samples`` changes."""
        keyed: dict[str, Callable[[Change], Iterable[str]]] = {
            "direction": lambda c: [c.direction],
            "tool": lambda c: [c.tool],
            "agent": lambda c: [c.agent],
            "principal": lambda c: [c.principal],
            "reason": lambda c: sorted(set(c.now.reason_codes)) or ["(none)"],
        }
        grouped: dict[str, dict[str, dict[str, Any]]] = {}
        for dimension, keys_of in keyed.items():
            table: dict[str, dict[str, Any]] = {}
            for change in self.changes:
                for key in keys_of(change):
                    group = table.setdefault(key, {"count": 0, **dict.fromkeys(DIRECTIONS, 0), "samples": []})
                    group["count"] += 1
                    group[change.direction] += 1
                    if len(group["samples"]) < samples:
                        group["samples"].append(change.summary())
            grouped[dimension] = dict(sorted(table.items(), key=lambda item: (-item[1]["count"], item[0])))
        return grouped


def summed(directions: Iterable[Direction]) -> Direction:
    """One direction for several: mixed if they widen and narrow, changed if neither."""
    seen = set(directions)
    widens = bool(seen & {"widened", "mixed"})
    narrows = bool(seen & {"narrowed", "mixed"})
    if widens and narrows:
        return "mixed"
    return "widened" if widens else "narrowed" if narrows else "changed"


def _set_direction(before: frozenset[str], after: frozenset[str]) -> Direction:
    """A grant set going from ``before`` to ``after``: what it gains widens, what it loses narrows."""
    gained: list[Direction] = ["widened"] if after - before else []
    lost: list[Direction] = ["narrowed"] if before - after else []
    return summed([*gained, *lost])


def tier_order(*engines: EmbeddedEngine) -> tuple[str, ...]:
    """The catalog's ``tiers`` (weakest first) of the first engine whose data has them; the
    runner's order otherwise."""
    for engine in engines:
        catalog = engine.bundle.data.get("stockade", {}).get("catalog", {})
        tiers = catalog.get("tiers") if isinstance(catalog, dict) else None
        if isinstance(tiers, list) and tiers and all(isinstance(t, str) for t in tiers):
            return tuple(tiers)
    return TIERS


# -- comparing two decisions -----------------------------------------------------------------


def compare(was: Decision, now: Decision, policy_input: PolicyInput, tiers: Sequence[str]) -> tuple[Difference, ...]:
    """Every way ``now`` differs from ``was`` for ``policy_input`` (empty: the same decision).
    Messages are not compared; obligations only when neither side denies."""
    differences: list[Difference] = []
    if was.outcome is not now.outcome:
        wider = _OUTCOME_RANK[now.outcome] > _OUTCOME_RANK[was.outcome]
        differences.append(
            Difference("outcome", "widened" if wider else "narrowed", was.outcome.value, now.outcome.value)
        )
    was_codes, now_codes = sorted(set(was.reason_codes)), sorted(set(now.reason_codes))
    if was_codes != now_codes:
        differences.append(Difference("reasons", "changed", _listed(was_codes), _listed(now_codes)))
    if Outcome.DENY not in (was.outcome, now.outcome) and was.obligations != now.obligations:
        differences += _limits(was, now, policy_input)
        differences += _egress(was, now)
        differences += _credentials(was, now)
        differences += _sandbox(was, now, policy_input, tiers)
        was_labels, now_labels = (
            sorted(set(was.obligations.session_labels)),
            sorted(set(now.obligations.session_labels)),
        )
        if was_labels != now_labels:
            differences.append(Difference("session_labels", "changed", _listed(was_labels), _listed(now_labels)))
    return tuple(differences)


def _listed(values: Iterable[str]) -> str:
    return ",".join(values) or "(none)"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _limits(was: Decision, now: Decision, policy_input: PolicyInput) -> list[Difference]:
    differences = []
    for name in type(was.obligations.limits).model_fields:
        before, after = getattr(was.obligations.limits, name), getattr(now.obligations.limits, name)
        if before == after:
            continue
        # An absent limit is the tool's own (what the router falls back to).
        tool_default = policy_input.tool.limits.get(name)
        effective_before = before if before is not None else tool_default
        effective_after = after if after is not None else tool_default
        direction: Direction = "changed"
        if effective_before is not None and effective_after is not None and effective_before != effective_after:
            direction = "widened" if effective_after > effective_before else "narrowed"
        differences.append(Difference(f"limits.{name}", direction, _limit_text(before, tool_default),
                                      _limit_text(after, tool_default)))  # fmt: skip
    return differences


def _limit_text(value: float | None, tool_default: float | None) -> str:
    if value is not None:
        return _number(value)
    return f"tool's ({_number(tool_default)})" if tool_default is not None else "unset"


_ANY_METHOD: frozenset[str] = frozenset({"*"})


def _egress_grants(decision: Decision) -> dict[str, frozenset[str]]:
    """``host:port`` → the methods granted (``{"*"}``: a rule listing none grants every method)."""
    grants: dict[str, frozenset[str]] = {}
    for rule in decision.obligations.egress:
        key = f"{rule.host.lower().rstrip('.')}:{rule.port}"
        methods = frozenset(m.upper() for m in rule.methods) if rule.methods else _ANY_METHOD
        known = grants.get(key)
        grants[key] = _ANY_METHOD if _ANY_METHOD in (known, methods) else methods | (known or frozenset())
    return grants


def _methods_text(methods: frozenset[str] | None) -> str:
    if methods is None:
        return "none"
    return "any method" if methods == _ANY_METHOD else ",".join(sorted(methods))


def _egress(was: Decision, now: Decision) -> list[Difference]:
    before, after = _egress_grants(was), _egress_grants(now)
    differences = []
    for key in sorted(before.keys() | after.keys()):
        old, new = before.get(key), after.get(key)
        if old == new:
            continue
        if old is None or new is None:
            direction: Direction = "widened" if old is None else "narrowed"
        elif _ANY_METHOD in (old, new):
            direction = "widened" if new == _ANY_METHOD else "narrowed"
        else:
            direction = _set_direction(old, new)
        differences.append(Difference(f"egress.{key}", direction, _methods_text(old), _methods_text(new)))
    return differences


def _credential_grants(decision: Decision) -> dict[str, tuple[frozenset[str], int]]:
    """Credential name → (scopes, longest TTL) granted."""
    grants: dict[str, tuple[frozenset[str], int]] = {}
    for grant in decision.obligations.credentials:
        scopes, ttl = grants.get(grant.name, (frozenset(), 0))
        grants[grant.name] = (scopes | frozenset(grant.scopes), max(ttl, grant.ttl_s))
    return grants


def _credentials(was: Decision, now: Decision) -> list[Difference]:
    before, after = _credential_grants(was), _credential_grants(now)
    differences = []
    for name in sorted(before.keys() | after.keys()):
        old, new = before.get(name), after.get(name)
        if old == new:
            continue
        if old is None or new is None:
            shown = [f"{_listed(sorted(g[0]))} for {g[1]}s" if g else "none" for g in (old, new)]
            differences.append(Difference(f"credentials.{name}", "widened" if old is None else "narrowed", *shown))
            continue
        if old[0] != new[0]:
            direction = _set_direction(old[0], new[0])
            differences.append(
                Difference(f"credentials.{name}.scopes", direction, _listed(sorted(old[0])), _listed(sorted(new[0])))
            )
        if old[1] != new[1]:
            differences.append(Difference(f"credentials.{name}.ttl_s", "widened" if new[1] > old[1] else "narrowed",
                                          str(old[1]), str(new[1])))  # fmt: skip
    return differences


def _sandbox(was: Decision, now: Decision, policy_input: PolicyInput, tiers: Sequence[str]) -> list[Difference]:
    differences = []
    before, after = was.obligations.sandbox, now.obligations.sandbox
    if before.min_tier != after.min_tier:
        # The tier a call runs on is the tool's, raised to policy's minimum: compare those.
        ranks = [_effective_rank(tier, policy_input.tool.tier, tiers) for tier in (before.min_tier, after.min_tier)]
        direction: Direction = "changed"
        if None not in ranks and ranks[0] != ranks[1]:
            direction = "narrowed" if (ranks[1] or 0) > (ranks[0] or 0) else "widened"
        differences.append(
            Difference("sandbox.min_tier", direction, before.min_tier or "none", after.min_tier or "none")
        )
    if before.mode != after.mode:
        mode_direction: Direction = "changed"
        if before.mode is not None and after.mode is not None:  # a session's sandbox keeps state between calls
            mode_direction = "widened" if after.mode == "session" else "narrowed"
        differences.append(Difference("sandbox.mode", mode_direction, before.mode or "tool's", after.mode or "tool's"))
    return differences


def _effective_rank(minimum: str | None, tool_tier: str, tiers: Sequence[str]) -> int | None:
    """Rank of the tier the call runs on; None when a tier is not in the catalog's order."""
    if tool_tier not in tiers or (minimum is not None and minimum not in tiers):
        return None
    rank = tiers.index(tool_tier)
    return max(rank, tiers.index(minimum)) if minimum is not None else rank


# -- replaying a log -------------------------------------------------------------------------


def recorded_decision(result: Mapping[str, Any], revision: str) -> Decision:
    """The decision an audit event's ``result`` records (the router's extra keys, such as
    ``mode``, dropped).

    Raises:
        ValidationError: it is not a decision.
    """
    fields = {key: value for key, value in result.items() if key in Decision.model_fields}
    return Decision.model_validate({**fields, "policy_revision": revision})


def replay(
    documents: Iterable[dict[str, Any] | None],
    candidate: EmbeddedEngine,
    baseline: EmbeddedEngine,
    *,
    against_recorded: bool = False,
    where: AuditFilter | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplayReport:
    """Decide every recorded decision's input in ``documents`` (the log's events, oldest first;
    None for a line that is not JSON) on ``baseline`` and ``candidate``, and report the changes.

    ``against_recorded``: compare the candidate with the recorded decision instead of deciding
    on the baseline (whose revision then only tells drift apart). ``where``: which events
    (``kind`` is always ``decision``). ``progress``: called with the count replayed so far,
    every 1,000 decisions. Nothing in an event makes this raise: what cannot be replayed is
    counted in ``skipped``, what the baseline's own revision does not reproduce in ``unfaithful``
    (`gate_failures` turns both into reasons a gate fails). What ``documents`` raises (a
    `BrokenChain` from `chained_documents`) passes through.
    """
    where = dataclasses.replace(where or AuditFilter(), kind="decision", limit=None)
    report = ReplayReport(
        mode="recorded" if against_recorded else "baseline",
        baseline_revision=baseline.revision,
        candidate_revision=candidate.revision,
    )
    tiers = tier_order(candidate, baseline)
    for document in documents:
        if document is None:
            report.skip("unreadable_line", None, "a line of the log is not a JSON object")
            continue
        if not matches(document, where):
            continue
        readable = _replayable(document, report)
        if readable is None:
            continue
        event, policy_input = readable
        revision = str(event.bundles.get("policies", {}).get("revision", ""))
        recorded: Decision | None = None
        try:
            recorded = recorded_decision(event.result or {}, revision)
        except ValidationError as exc:
            if against_recorded:
                report.skip("malformed_result", event.decision_id[:100], _first_error(exc))
                continue
        was = recorded if recorded is not None and against_recorded else baseline.evaluate(policy_input)
        if revision == baseline.revision:
            reproduced = baseline.evaluate(policy_input) if against_recorded else was
            drift = _unreproduced(recorded, reproduced, policy_input, tiers)
            if drift is not None:
                report.distrust(event.decision_id, drift)
        now = candidate.evaluate(policy_input)
        report.replayed += 1
        report.revisions[revision] += 1
        if progress is not None and report.replayed % 1000 == 0:
            progress(report.replayed)
        differences = compare(was, now, policy_input, tiers)
        if differences:
            report.changes.append(Change(
                decision_id=event.decision_id, timestamp=event.timestamp, tool=policy_input.tool.name,
                agent=policy_input.subject.agent, principal=policy_input.subject.principal,
                session_id=policy_input.session.id, revision=revision, was=was, now=now, differences=differences,
            ))  # fmt: skip
    return report


def _replayable(document: dict[str, Any], report: ReplayReport) -> tuple[AuditEvent, PolicyInput] | None:
    """A decision event and its input, as recorded and as the policy saw it; None (counted in
    ``report.skipped``) when it cannot be replayed faithfully."""
    decision_id = str(document.get("decision_id"))[:100]
    try:
        event = AuditEvent.model_validate(document)
    except ValidationError as exc:
        report.skip("malformed_event", decision_id, _first_error(exc))
        return None
    if event.input is None or event.result is None:
        report.skip("malformed_event", decision_id, "a decision event without its input or result")
        return None
    altered = _altered_input(event)
    if altered is not None:
        why, detail = altered
        report.skip(why, decision_id, detail)
        return None
    try:
        return event, PolicyInput.model_validate(event.input)
    except ValidationError as exc:
        report.skip("invalid_input", decision_id, _first_error(exc))
        return None


class BrokenChain(AuditError):
    """The log's hash chain does not hold at ``seq`` of the segment at ``path``: an event was
    edited, removed, inserted or reordered, or the file is not a stockade audit log. A replay of
    it would decide on whatever the lines now say, so it is refused."""

    def __init__(self, path: Path, seq: int, problem: str) -> None:
        super().__init__(f"{path}: the hash chain is broken at seq {seq}: {problem}")
        self.path, self.seq, self.problem = path, seq, problem


def chained_documents(layout: LogLayout) -> Iterator[dict[str, Any] | None]:
    """The events of the log at ``layout`` oldest first, as `JsonlAuditLog.documents` gives them
    (None for a line that is chained but not JSON), each line's link to the one before checked
    as it is read (`router.audit.chain.check_link`; across a retired segment, from its tombstone).

    The links prove every event but the last unaltered since it was written; the last, and the
    signatures, only `stockade audit verify` can check against the signed checkpoints.

    Raises:
        BrokenChain: a link does not hold (raised when the reader gets there).
        OSError: a segment cannot be read.
    """
    expected, prev = 1, GENESIS_HASH
    for part in layout.parts():
        if part.kind == "tombstone":
            try:
                tombstone = part.tombstone()
            except (OSError, ValueError) as exc:
                raise BrokenChain(part.path, part.first_seq, f"{part.path.name} is unreadable ({exc})") from exc
            if tombstone.first_seq != expected:
                raise BrokenChain(part.path, expected, f"events {expected}..{tombstone.first_seq - 1} are missing "
                                                       "before a retired segment")  # fmt: skip
            expected, prev = tombstone.last_seq + 1, tombstone.last_hash
            continue
        for _, line in lines(part.path):
            problem, seq = check_link(line, expected, prev)
            if problem:
                raise BrokenChain(part.path, seq, problem)
            document = document_of(line)
            prev = str(document["hash"]) if document is not None else line_hash(line).hex()
            expected += 1
            yield document


def gate_failures(report: ReplayReport, allow_skipped: int = 0) -> list[tuple[str, str]]:
    """Why a gate fails whatever the changes, as (code, message): ``nothing_replayed`` (a gate
    that checked nothing proves nothing), ``skipped`` (more events skipped than ``allow_skipped``:
    what they would do is unknown), ``unfaithful`` (the replay does not reproduce what the
    baseline's own revision recorded, so its inputs are not what the policy saw)."""
    failures: list[tuple[str, str]] = []
    if report.replayed == 0:
        failures.append(("nothing_replayed", "no decision was replayed (the log holds none in the window, or "
                                             "none could be): a gate that checked nothing cannot pass"))  # fmt: skip
    skipped = sum(report.skipped.values())
    if skipped > allow_skipped:
        reasons = ", ".join(f"{n} {why}" for why, n in report.skipped.most_common())
        failures.append(("skipped", f"{skipped} events could not be replayed ({reasons}), over the {allow_skipped} "
                                    "allowed: what the candidate would do with them is unknown"))  # fmt: skip
    if report.unfaithful:
        failures.append(
            (
                "unfaithful",
                f"{report.unfaithful} decisions recorded under the baseline's revision "
                "are decided otherwise by it now: their inputs differ from what it saw",
            )
        )
    return failures


def _altered_input(event: AuditEvent) -> tuple[str, str] | None:
    """Why ``event``'s input is not what the policy saw (its skip reason and detail), or None.

    The log records where it masked (``labels.masked``, ``/input/args/card,...``) and where it
    escaped text (``escaped``, ``input.args.name``); any such path under the input may be one the
    policy reads, and which ones it reads is not knowable from here."""
    masked = [
        path for path in event.labels.get("masked", "").split(",") if path == "/input" or path.startswith("/input/")
    ]
    if masked:
        return "masked_input", f"the log masked {', '.join(masked)}: replaying it would decide on the mask"
    escaped = [path for path in event.escaped or () if path == "input" or path.startswith(("input.", "input["))]
    if escaped:
        return "escaped_input", f"the log escaped text at {', '.join(escaped)}: replaying it would decide on the escape"
    return None


_ROUTER_CODES = frozenset({POLICY_ERROR, "sandbox.unavailable"})
"""Reason codes of a deny the router may record in place of the policy's decision (an engine
that raised, an obligation it cannot meet, a tier it lacks): replaying the policy need not give it."""


def _unreproduced(
    recorded: Decision | None, replayed: Decision, policy_input: PolicyInput, tiers: Sequence[str]
) -> str | None:
    """How the baseline's replay of a decision recorded under its own revision differs from the
    record (None: it reproduces it, or the record is the router's own deny)."""
    if recorded is None:
        return "the recorded decision does not parse, so the replay cannot be checked against it"
    if recorded.outcome is Outcome.DENY and recorded.reason_codes and set(recorded.reason_codes) <= _ROUTER_CODES:
        return None
    differences = compare(recorded, replayed, policy_input, tiers)
    if not differences:
        return None
    shown = "; ".join(d.text for d in differences)
    return f"recorded under the baseline's revision, decided otherwise by it now: {shown}"


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "(top)"
    return f"{where}: {first['msg']} ({exc.error_count()} error{'s' if exc.error_count() > 1 else ''})"


# -- accepting and gating changes ------------------------------------------------------------


class AcceptFileError(ValueError):
    """An accept file that cannot be read or holds something that is not an accept entry."""


ACCEPT_MAX_BYTES = 16 << 20
"""The largest accept file read (a file of accept entries, even one per decision, is far smaller)."""
_MATCH_KEYS = ("decision_id", "tool", "agent", "principal", "direction", "field")
_NOTE_KEYS = ("note", "seen", "example")  # written by `accept_entries` for the reviewer; not matched


@dataclass(frozen=True, slots=True)
class AcceptRule:
    """One accepted change or class of changes. Every key given must match (``*`` and ``?``
    glob); ``field`` also matches the fields under it (``limits`` covers ``limits.timeout_s``);
    ``direction`` matches a difference's direction or its change's."""

    decision_id: str | None = None
    tool: str | None = None
    agent: str | None = None
    principal: str | None = None
    direction: str | None = None
    field: str | None = None

    def covers(self, change: Change, difference: Difference) -> bool:
        """Whether this rule accepts ``difference`` of ``change``."""
        checks = (
            (self.decision_id, change.decision_id), (self.tool, change.tool), (self.agent, change.agent),
            (self.principal, change.principal),
        )  # fmt: skip
        if any(pattern is not None and not fnmatch.fnmatchcase(value, pattern) for pattern, value in checks):
            return False
        if self.direction is not None and self.direction not in (difference.direction, change.direction):
            return False
        if self.field is not None:
            name = difference.field
            return fnmatch.fnmatchcase(name, self.field) or name.startswith(self.field + ".")
        return True


def load_accept(path: Path) -> list[AcceptRule]:
    """The rules of an accept file: a JSON array of entries, an object ``{"accept": [...]}``, or
    JSON lines (one entry per line).

    Raises:
        AcceptFileError: unreadable, not JSON, or an entry that is not an accept entry.
    """
    try:
        with path.open("rb") as handle:
            raw = handle.read(ACCEPT_MAX_BYTES + 1)  # /dev/zero, or a log passed by mistake, is not read whole
        text = raw.decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise AcceptFileError(f"cannot be read ({getattr(exc, 'strerror', None) or exc})") from exc
    if len(raw) > ACCEPT_MAX_BYTES:
        raise AcceptFileError(f"is over {ACCEPT_MAX_BYTES >> 20} MiB, more than any accept file needs")
    entries: list[Any]
    try:
        whole = json.loads(text) if text.strip() else []
    except RecursionError as exc:
        raise AcceptFileError("nests JSON too deeply to read") from exc
    except ValueError:
        entries = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    entries.append(json.loads(line))
                except (ValueError, RecursionError) as exc:
                    raise AcceptFileError(f"line {number} is not JSON ({exc})") from exc
    else:
        if isinstance(whole, dict) and "accept" in whole:
            whole = whole["accept"]
        entries = whole if isinstance(whole, list) else [whole]
    return [_rule(entry, number) for number, entry in enumerate(entries, 1)]


def _rule(entry: Any, number: int) -> AcceptRule:
    if not isinstance(entry, dict):
        raise AcceptFileError(f"entry {number} is a {type(entry).__name__}, not an object")
    unknown = sorted(set(entry) - set(_MATCH_KEYS) - set(_NOTE_KEYS))
    if unknown:
        raise AcceptFileError(f"entry {number} has unknown key {unknown[0]!r} (known: {', '.join(_MATCH_KEYS)})")
    given = {key: entry[key] for key in _MATCH_KEYS if entry.get(key) is not None}
    if not given:
        raise AcceptFileError(f"entry {number} names nothing to match, so it would accept every change")
    bad = [key for key, value in given.items() if not isinstance(value, str)]
    if bad:
        raise AcceptFileError(f"entry {number}: {bad[0]!r} must be a string")
    if "direction" in given and given["direction"] not in DIRECTIONS:
        raise AcceptFileError(f"entry {number}: direction {given['direction']!r} is not one of {', '.join(DIRECTIONS)}")
    return AcceptRule(**given)


def _gated_by(difference: Difference, gates: set[str]) -> bool:
    if "any" in gates:
        return True
    return any(gate in gates for gate in ("widened", "narrowed") if difference.direction in (gate, "mixed"))


def unaccepted(change: Change, rules: Sequence[AcceptRule], gates: set[str] | None = None) -> list[Difference]:
    """``change``'s differences no rule accepts (of those ``gates`` stop on, if given)."""
    return [d for d in change.differences
            if (gates is None or _gated_by(d, gates)) and not any(r.covers(change, d) for r in rules)]  # fmt: skip


def gated(report: ReplayReport, gates: set[str], rules: Sequence[AcceptRule]) -> list[Change]:
    """The changes a ``--fail-on`` gate stops on: those with a difference in a gated direction
    that no rule accepts."""
    if not gates:
        return []
    return [change for change in report.changes if unaccepted(change, rules, gates)]


def accept_entries(report: ReplayReport) -> list[dict[str, Any]]:
    """The report's changes as accept-file entries to review and commit: one per tool, field
    and direction, with how many decisions it covers and an example."""
    classes: dict[tuple[str, str, str], dict[str, Any]] = {}
    for change in report.changes:
        for difference in change.differences:
            key = (change.tool, difference.field, difference.direction)
            entry = classes.setdefault(key, {"tool": key[0], "field": key[1], "direction": key[2], "seen": 0,
                                             "example": f"{change.decision_id}: {difference.text}"})  # fmt: skip
            entry["seen"] += 1
    return [classes[key] for key in sorted(classes)]
