"""The control plane: every tool call goes through `ControlPlane`.

    call(session, tool, args)
      1. registry: find the tool, parse and validate args ......... InvalidCall (audited, nothing runs)
      2. store: load the session (taint, counters, trusted context) . store down → StoreError (audited)
      3. policy: decide ............................................ any engine error → deny (policy.error)
      4. audit: append the decision ................................ audit down → deny, nothing runs
      5. deny → Denied; require_approval → Pending; external → AwaitingReport
      6. runner: run in the sandbox with limits from tool ⊕ obligations
      7. store: index the output for provenance, taint the session . store down → output withheld
      8. audit: append the execution (verdict, usage, output and digests)
      9. return ToolResult

Every event of one call shares its ``decision_id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import json
import re
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

import structlog

import policy as policy_pkg
import runner as runner_pkg
import runner.base
import runner.files
from policy import Decision, Outcome, PolicyEngine, PolicyInput, SessionInfo, SubjectInfo, ValueSources
from policy.base import MAX_SESSION_LABELS, POLICY_ERROR, EnvironmentInfo, InputInfo, RateCounts
from policy.bundle import fingerprint
from router import metrics, telemetry
from router.approvals import (
    Approval,
    ApprovalBook,
    ApprovalError,
    ApprovalStatus,
    binding,
    identity,
    same_identity,
)
from router.audit import AuditEvent, AuditLog, sha256_hex, timestamp
from router.audit import factory as audit_factory
from router.credentials import REDACTOR, Binding, CredentialBroker, CredentialError, Lease, redact
from router.credentials.base import CredentialUnavailable
from router.errors import (
    AuditError,
    DuplicateTool,
    FieldProblem,
    InvalidCall,
    InvalidToolSpec,
    PolicyError,
    SandboxUnavailable,
    SessionNotFound,
    StockadeError,
    StoreError,
    ToolNotFound,
    ToolRefused,
)
from router.logging import configure_default_logging
from router.provenance import (
    call_keys_async,
    content_keys_async,
    has_trusted_source,
    is_untrusted_only,
    source_label,
    split_output,
    supplied_keys_async,
    trusted_context_keys_async,
)
from router.refusals import RefusalBudget, refusal_event
from router.results import Artifact, DecisionResult, RunUsage, ToolResult
from router.sessions import UNTRUSTED_CONTENT, new_session
from router.settings import Settings
from router.store import MemoryStore, PendingExternal, SessionRecord, Store, make_store
from router.text import check_text, escape_invalid_text
from router.tools import (
    CommandExecutor,
    ExternalExecutor,
    PythonExecutor,
    RegisteredTool,
    ToolRegistry,
    ToolSpec,
    check_nesting,
    command_argv,
    parse_args,
    show,
    validate_args,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider

log = structlog.get_logger(__name__)
configure_default_logging()  # in-process use: redacted, on stderr, unless the application configured structlog
_T = TypeVar("_T")
_TOOL_REASONS = ("capability.", "risk.", "egress.", "credential.")  # deny reasons about the tool, not the call
_ITEM = "\x00"  # prefixes the store lookup names of checked values (no argument name may start so)
_TRACED = ("e:", "u:", "h:", "i:", "a:", "n:")  # identifiers and numbers: each must trace (`_derived`)

VERSION = "0.1.0"


_now = timestamp


def _derived(
    args: Mapping[str, Any],
    keys: Mapping[str, Collection[str]],
    provenance: Mapping[str, Collection[str]],
    key_sources: Mapping[str, Collection[str]],
    endorsed: Collection[str],
) -> bool:
    """Whether a call made after untrusted content returns a value derived from what the agent
    typed in rather than from trusted sources (its output is then ``derived:``, see
    `router.provenance`): an identifier or number in an argument with no trusted source
    (``calculator("500+499")`` when the user gave 500 and the page 499), or an argument holding
    text none of whose keys has one (``"37*27"``, ``"eve at evil dot example"``). A flag or a
    small number says nothing either way; ``"Bob"``, a name the user wrote, traces to them."""
    if any(not has_trusted_source(sources, endorsed) for sources in key_sources.values()):
        return True
    for arg, value in args.items():
        arg_keys = keys.get(arg, ())
        if any(key.startswith(_TRACED) for key in arg_keys) or not _holds_text(value):
            continue  # its identifiers and numbers were each checked above
        if not arg_keys or not has_trusted_source(provenance.get(arg, ()), endorsed):
            return True
    return False


def _spec_text(spec: ToolSpec) -> str:
    """A tool spec as canonical JSON (keys sorted): two specs are the same tool only if these are equal."""
    return json.dumps(json.loads(spec.model_dump_json()), sort_keys=True, separators=(",", ":"))


def _holds_text(value: Any) -> bool:
    """Whether ``value`` (JSON) holds a string that is not blank."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if item.strip():
                return True
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _iso(epoch: float) -> str:
    """``epoch`` as audit events write times."""
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


# Set while an interface that records its own refusal of a session it keeps (MCP: session.lost,
# on that session's trail) calls the plane, or while it does its own housekeeping (renewing,
# closing its sessions): the plane then leaves ``session.not_found`` unrecorded, not twice.
_SESSION_REFUSAL_RECORDED = contextvars.ContextVar("stockade_session_refusal_recorded", default=False)


@contextlib.contextmanager
def session_refusals_recorded_by_caller() -> Iterator[None]:
    """Within: a session that is not open raises `SessionNotFound` unrecorded; the caller records
    the refusal (or, for its own housekeeping, there is none to record)."""
    token = _SESSION_REFUSAL_RECORDED.set(True)
    try:
        yield
    finally:
        _SESSION_REFUSAL_RECORDED.reset(token)


@dataclasses.dataclass(frozen=True, slots=True)
class _LeaseOwner:
    """The call a lease was minted for, as the events of its revocation name it: all the plane keeps
    of a call whose lease it could not revoke yet (not its arguments or inputs)."""

    decision_id: str
    session: SessionRecord
    tool: str
    call_id: str


class _Call:
    """One call in flight: the ids and facts every audit event of it shares."""

    __slots__ = (
        "approval",
        "arg_keys",
        "args",
        "argv",
        "asked",
        "call_id",
        "canonical_args",
        "closed",
        "decision_id",
        "derived",
        "egress_records",
        "going_ahead",
        "input_infos",
        "inputs",
        "leases",
        "provenance",
        "rates",
        "session",
        "stage",
        "steered",
        "tier",
        "tool",
        "unaudited_egress",
        "values",
    )

    def __init__(self, session: SessionRecord, tool: RegisteredTool, args: dict[str, Any], canonical_args: str) -> None:
        self.session = session
        self.tool = tool
        self.args = args
        self.canonical_args = canonical_args
        self.argv: tuple[str, ...] = ()
        self.inputs: tuple[runner_pkg.InputFile, ...] = ()
        self.input_infos: list[dict[str, Any]] = []  # each input's name, sha256 and size, by name: what is approved
        self.approval: Approval | None = None  # a granted approval this call redeems
        self.asked: Approval | None = None  # an approval asked for this exact call before, not granted
        self.provenance: dict[str, list[str]] = {}
        self.values: dict[str, list[ValueSources]] = {}
        self.arg_keys: set[str] = set()
        self.steered = False  # an argument came only from untrusted content (see PendingExternal.steered)
        self.derived = False  # after untrusted content, an argument has no trusted source (see PendingExternal.derived)
        self.rates = RateCounts()
        self.tier: str | None = None  # the sandbox tier, once the call runs
        self.unaudited_egress = 0  # egress requests the audit log could not take: the output is withheld
        self.egress_records: list[asyncio.Future[None]] = []  # each done once its egress event is appended (or not)
        self.leases: list[Lease] = []  # minted credentials: revoked on every exit
        self.stage = "prepared"  # how far the call got, for the record of an exit that cut it short
        self.going_ahead = False  # the decision to go ahead is (or may be) on record: its trail must be closed
        self.closed = False  # the event that ends the trail (execution, or awaiting a report) is written
        self.call_id = "c-" + secrets.token_hex(8)
        self.decision_id = str(uuid.uuid4())

    @property
    def owner(self) -> _LeaseOwner:
        """The call as its leases' revocation events name it (what shutdown keeps of it)."""
        return _LeaseOwner(self.decision_id, self.session, self.tool.spec.name, self.call_id)


def _honour_cancellation() -> None:
    """Raise `asyncio.CancelledError` if this task was asked to stop and the request was lost on
    the way: Python 3.11's ``asyncio.wait_for``, which redis-py wraps each socket write in, returns
    the result of an operation that finished as the cancellation arrived and drops the
    cancellation (fixed in 3.12). The task still counts the request (`asyncio.Task.cancelling`);
    code that means to swallow one (a timeout scope) takes it back with ``uncancel``."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class ControlPlane:
    """Registers tools, opens sessions, and decides, runs and audits every tool call."""

    def __init__(
        self,
        settings: Settings,
        *,
        policy: PolicyEngine,
        sandboxes: Mapping[str, runner_pkg.Sandbox],
        audit: AuditLog,
        store: Store | None = None,
    ) -> None:
        self.settings = settings
        self.policy = policy
        self.sandboxes = dict(sandboxes)
        self.audit = audit
        self.store: Store = store if store is not None else MemoryStore(settings.session_idle_ttl_s)
        self.registry = ToolRegistry()
        self._labels = {"instance": settings.instance, "version": VERSION}
        self._environment = EnvironmentInfo(name=settings.environment, instance=settings.instance)
        # Refused decisions go under the router's refusal budget, as every refusal.
        self.approvals = ApprovalBook(
            self.store, audit, ttl_s=settings.approval_ttl_s, keep_s=settings.approval_keep_s, labels=self._labels,
            refusals=self.record_refusal,
        )  # fmt: skip
        self.credentials = CredentialBroker(
            settings.credentials, self.store, key_rotation_s=settings.credential_key_rotation_s
        )
        self._leases: dict[str, tuple[_LeaseOwner, Lease]] = {}  # minted, not revoked, not expired: for shutdown
        # Sessions this router opened or served: the ones whose sandboxes it may hold and must
        # destroy when the session closes or expires, wherever that happens.
        self._here: set[str] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._quarantine_sweeper: asyncio.Task[None] | None = None
        # Refusals written one by one up to a burst, then counted (`router.refusals`).
        self._refusals = RefusalBudget(settings.audit.refusal_burst, settings.audit.refusal_window_s)
        self._refusal_counter: asyncio.Task[None] | None = None
        # Taken now, next to the load: an edit made before the watcher starts must still count.
        self._policy_seen = fingerprint(settings.policy.dir)
        self.policy_problem: str | None = None  # why the files on disk did not load, at the last try
        # The span exporter this plane set up from its settings (from_settings), if any; an
        # application's own provider is the application's to end.
        self._tracing: SdkTracerProvider | None = None

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> ControlPlane:
        """The backends ``settings`` name; by default the embedded ones: in-process Rego and store,
        bubblewrap, JSONL audit log.

        Raises:
            PolicyError: the policy directory does not load.
            SandboxUnavailable: the configured tier is unknown.
            StoreError: the store URL is malformed.
            AuditError: the Redis audit stream is chosen without a store URL.
        """
        settings = settings or Settings()
        try:
            engine = policy_pkg.make_engine(settings.policy)
        except policy_pkg.PolicyBundleError as exc:
            raise PolicyError(str(exc)) from exc
        try:
            sandboxes = runner_pkg.make_sandboxes(settings.runner)
        except runner_pkg.SandboxUnavailable as exc:
            raise SandboxUnavailable(str(exc)) from exc
        try:
            tracing = telemetry.configure_tracing(settings, version=VERSION)
            plane = cls(
                settings, policy=engine, sandboxes=sandboxes, audit=make_audit_log(settings), store=make_store(settings)
            )
        except BaseException:
            # The traceback keeps the engine alive in a cycle, freed by the collector on whatever
            # thread runs it next, where an unsendable regorus object raises: drop it here.
            if isinstance(engine, policy_pkg.EmbeddedEngine):
                engine.close()
            raise
        plane._tracing = tracing  # ended with the plane, within a deadline (aclose)
        return plane

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Revoke live credentials; stop sandboxes; close the policy engine, the store and the audit log."""
        for task in (self._sweeper, self._watcher, self._quarantine_sweeper, self._refusal_counter):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._write_refusal_counts(every=True)  # the counts of windows still open
        by_call: dict[str, tuple[_LeaseOwner, list[Lease]]] = {}
        for owner, lease in list(self._leases.values()):
            by_call.setdefault(owner.call_id, (owner, []))[1].append(lease)
        for owner, leases in by_call.values():
            await self._revoke(owner, leases)
        await self.credentials.aclose()
        for sandbox in self.sandboxes.values():
            await sandbox.aclose()
        await self.policy.aclose()
        await self.store.aclose()
        await self.audit.aclose()
        if self._tracing is not None:
            # Within a deadline: a collector that does not answer would hold the exit for 30 s or more.
            # In a thread: the wait must not stop the event loop.
            await asyncio.to_thread(telemetry.shutdown_tracing, self._tracing)
            self._tracing = None

    # -- registration and sessions -------------------------------------------------------

    async def register(self, spec: ToolSpec | Mapping[str, Any]) -> ToolSpec:
        """Register a tool, unless policy would refuse every call to it.

        Policy decides a probe call first: a fresh, untainted session and no arguments, the most
        a tool is ever allowed. A deny there whose every reason is about the tool itself
        (``capability.*``, ``risk.*``, ``egress.*``, ``credential.*``: a dangerous capability set, an
        unknown risk, egress or credentials outside the catalog) holds for every call: the tool is
        refused with policy's reasons, and the refusal audited (``kind: policy``). Any other deny
        (an error, a rule about arguments the probe lacks) is left to each call.

        Raises:
            InvalidToolSpec: malformed. DuplicateTool: the name is taken. ToolRefused: see above. Each
                refusal is audited (``kind: policy``, outcome ``tool_invalid``, ``tool_duplicate`` or
                ``tool_refused``).
        """
        try:
            tool = self.registry.prepare(spec)
        except InvalidToolSpec as exc:  # a DuplicateTool too
            name = spec.name if isinstance(spec, ToolSpec) else spec.get("name") if isinstance(spec, Mapping) else None
            outcome = "tool_duplicate" if isinstance(exc, DuplicateTool) else "tool_invalid"
            await self._record(AuditEvent(
                kind="policy", decision_id=str(uuid.uuid4()), timestamp=_now(), outcome=outcome,
                tool=name[:256] if isinstance(name, str) else None, labels=self._labels,
                result={"code": exc.code, "message": str(exc)[:2000]},
            ))  # fmt: skip
            raise
        probe = PolicyInput(
            subject=SubjectInfo(agent="register-probe", principal="register-probe"),
            session=SessionInfo(id="register-probe"), tool=tool.policy_view, args={}, now=_now(),
            environment=self._environment,
        )  # fmt: skip
        decision = await self.policy.decide(probe)
        if decision.outcome is Outcome.DENY and all(r.code.startswith(_TOOL_REASONS) for r in decision.reasons):
            codes = [r.code for r in decision.reasons]
            await self._record(AuditEvent(
                kind="policy", decision_id=str(uuid.uuid4()), timestamp=_now(), tool=tool.spec.name,
                outcome="tool_refused", labels=self._labels,
                bundles={"policies": {"revision": decision.policy_revision}},
                result={"reasons": [r.model_dump() for r in decision.reasons]},
            ))  # fmt: skip
            raise ToolRefused(
                f"tool {tool.spec.name!r} is not registered: policy would refuse every call to it ("
                + "; ".join(f"{r.code}: {r.message}" for r in decision.reasons)
                + ")",
                codes,
            )
        await self._share(tool, decision.policy_revision)
        try:
            self.registry.add(tool)
        except DuplicateTool as exc:
            # Taken while the store was asked: a call to it adopted the store's spec, or the same
            # registration ran twice at once. `_share` found exactly this spec in the store, so
            # the same spec here is this registration done; anything else is refused on record.
            name = tool.spec.name
            if name not in self.registry.names() or _spec_text(self.registry.get(name).spec) != _spec_text(tool.spec):
                await self._record(AuditEvent(
                    kind="policy", decision_id=str(uuid.uuid4()), timestamp=_now(), outcome="tool_duplicate",
                    tool=name, labels=self._labels, result={"code": exc.code, "message": str(exc)[:2000]},
                ))  # fmt: skip
                raise
        self.start()
        log.info("tool_registered", tool=tool.spec.name, risk=tool.spec.risk, executor=tool.spec.executor.kind)
        return tool.spec

    async def _share(self, tool: RegisteredTool, revision: str) -> None:
        """Put a tool in the store's registry, which every router sharing the store serves from
        (audited when it is added). The same spec already there is fine (each router of a
        deployment registers its tools at start); another spec under that name is refused.

        Raises:
            DuplicateTool: the name is registered with another spec. StoreError, AuditError.
        """
        name, spec_json = tool.spec.name, tool.spec.model_dump_json()
        spec_sha256 = hashlib.sha256(spec_json.encode()).hexdigest()
        known = await self.store.get_tool(name)
        raced = False
        if known is None:  # audited before it is added: a registration never goes unrecorded
            event = AuditEvent(
                kind="policy", decision_id=str(uuid.uuid4()), timestamp=_now(), tool=name, outcome="tool_registered",
                labels=self._labels, bundles={"policies": {"revision": revision}},
                result={"spec_sha256": spec_sha256, "spec": json.loads(spec_json)},
            )  # fmt: skip
            if not await self._record(event):
                raise AuditError(f"the registration of tool {name!r} could not be audited; it is not registered")
            known, version, added = await self.store.put_tool(name, spec_json)
            log.info("tool_shared", tool=name, registry_version=version, added=added)
            raced = not added
        existing = ToolSpec.model_validate_json(known)
        # As canonical JSON, not as models: Python's == takes True for 1 (and 1.0 for 1), which a
        # schema does not (`{"const": true}` is not `{"const": 1}`), and a router serves its own spec.
        if _spec_text(existing) != _spec_text(tool.spec):
            if raced:  # another router's spec won: the registration audited above did not take effect
                await self._record(event.model_copy(update={
                    "timestamp": _now(), "outcome": "tool_registration_lost",
                    "result": {"spec_sha256": spec_sha256, "registry_version": version},
                }))  # fmt: skip
            if existing.name != name:  # the store answered with the look-alike it holds
                refusal = DuplicateTool(
                    f"tool {name!r} differs from the registered tool {existing.name!r} only in case or '-'/'_' "
                    "(an agent or a human could mistake one for the other): pick another name"
                )
            else:
                refusal = DuplicateTool(
                    f"tool {name!r} is already registered in the shared store with another spec (by another router "
                    "or an earlier run): pick another name, or register exactly the same spec"
                )
            if not raced:  # (a lost race is on record already, as tool_registration_lost)
                await self._record(AuditEvent(
                    kind="policy", decision_id=str(uuid.uuid4()), timestamp=_now(), tool=name,
                    outcome="tool_duplicate", labels=self._labels, bundles={"policies": {"revision": revision}},
                    result={"code": refusal.code, "message": str(refusal), "spec_sha256": spec_sha256,
                            "registered_sha256": hashlib.sha256(known.encode()).hexdigest()},
                ))  # fmt: skip
            raise refusal

    async def tool(self, name: object) -> RegisteredTool:
        """The tool called ``name``: this router's, or one another router added to the shared
        registry (loaded on first use).

        Raises:
            InvalidCall: not a valid tool name. ToolNotFound: no such tool. StoreError.
        """
        try:
            return self.registry.get(name)
        except ToolNotFound:
            stored = await self.store.get_tool(str(name))
            if stored is None:
                raise
        return self._adopt(stored)

    def _adopt(self, stored: str) -> RegisteredTool:
        """A tool from the shared registry, added to this router's."""
        spec = ToolSpec.model_validate_json(stored)
        try:
            return self.registry.get(spec.name)  # adopted meanwhile
        except ToolNotFound:
            tool = self.registry.prepare(spec)
            self.registry.add(tool)
            log.info("tool_loaded_from_store", tool=spec.name)
            return tool

    async def list_tools(self) -> list[ToolSpec]:
        """Every registered tool, this router's and those added through the shared store.

        Raises:
            StoreError: the store cannot be read.
        """
        mine = set(self.registry.names())
        for name, stored in (await self.store.list_tools()).items():
            if name not in mine:
                self._adopt(stored)
        return self.registry.list()

    async def open_session(self, agent: str, principal: str, trusted_context: list[str] | None = None) -> str:
        """Open a session for one agent task; returns its id. ``trusted_context``: what the user
        gave (their request, addresses, accounts); values from it have provenance ``user``.

        Raises:
            InvalidCall: a bad agent or principal name, or trusted_context not a list of strings
                (its problems name the field: ``principal``, ``trusted_context[3]``).
            StoreError: the store cannot be written.
        """
        check_text(trusted_context, "trusted_context")
        session = new_session(agent, principal, [] if trusted_context is None else trusted_context)
        await self.store.create_session(session, await trusted_context_keys_async(list(session.trusted_context)))
        self._here.add(session.id)
        log.info("session_opened", session_id=session.id, agent=agent)
        self.start()
        return session.id

    def start(self) -> None:
        """Start the background work on the running loop: the session sweeper, the quarantine
        sweeper (`STOCKADE_RUNNER__QUARANTINE_KEEP_S`) and the policy watcher
        (`STOCKADE_POLICY__WATCH_INTERVAL_S`). Entering the plane (``async with``) and the HTTP
        app's start-up call it, so a router that serves no session yet still picks up a new policy;
        calling it again does nothing."""
        loop = asyncio.get_running_loop()
        if self._sweeper is None:
            self._sweeper = loop.create_task(self._sweep_sessions())
        if self._quarantine_sweeper is None:
            self._quarantine_sweeper = loop.create_task(self._sweep_quarantine())
        if self._watcher is None and self.settings.policy.watch_interval_s > 0:
            self._watcher = loop.create_task(self._watch_policy())

    async def _watch_policy(self) -> None:
        """Reload the policy when its files change; a broken policy keeps the old one in force."""
        while True:
            await asyncio.sleep(self.settings.policy.watch_interval_s)
            try:
                now = await asyncio.to_thread(fingerprint, self.settings.policy.dir)
                if now == self._policy_seen:
                    continue
                self._policy_seen = now
                await self.reload_policy(source="watcher")
            except PolicyError:  # audited and logged by reload_policy; the old policy decides
                pass
            except AuditError as exc:  # not reloaded, the log could not take the record: next time again
                log.error("policy_reload_unaudited", error=str(exc))
                self._policy_seen = ()
            except Exception as exc:  # a file vanishing mid-read must not end the watcher for good
                log.exception("policy_watch_failed")
                self.policy_problem = f"the policy files could not be read: {type(exc).__name__}: {exc}"
                self._policy_seen = ()  # look again next time

    async def expire_sessions(self) -> list[str]:
        """Destroy the sandboxes of sessions that expired (idle for longer than the TTL) or were
        closed through another router; returns their ids."""
        live = await self.store.live_sessions(self._here)
        gone = sorted(self._here - live)
        for session_id in gone:
            self._here.discard(session_id)
            for sandbox in self.sandboxes.values():
                await sandbox.close_session(session_id)
            log.info("session_ended_elsewhere_or_expired", session_id=session_id)
        return gone

    async def _sweep_sessions(self) -> None:
        interval = min(max(self.settings.session_idle_ttl_s / 2, 0.05), 30.0)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.expire_sessions()
            except Exception as exc:  # the sweeper must outlive a failing sandbox cleanup
                log.error("session_sweep_failed", error=str(exc))

    async def _sweep_quarantine(self) -> None:
        """Remove quarantined outputs older than the runner's ``quarantine_keep_s``, now and then
        every quarter of it (at most hourly), off the event loop."""
        keep, root = self.settings.runner.quarantine_keep_s, self.settings.runner.quarantine_dir
        interval = min(max(keep / 4, 0.05), 3600.0)
        while True:
            try:
                removed = await asyncio.to_thread(runner.files.sweep_quarantine, root, keep)
                if removed:
                    log.info("quarantine_swept", removed=removed, keep_s=keep)
            except Exception:  # the sweeper must outlive one failing pass
                log.exception("quarantine_sweep_failed")
            await asyncio.sleep(interval)

    async def close_session(self, session_id: str, *, agent: str | None = None) -> None:
        """Close a session: its pending external calls can no longer be reported, and its own
        sandboxes, if any, are destroyed (on other routers, by their sweepers). ``agent``: as for
        `decide` (only the session's agent may close it).

        Raises:
            SessionNotFound: not open (unknown, closed, expired), or another agent's (audited).
        """
        if agent is not None:
            await self._load_session(session_id, agent)
        if not isinstance(session_id, str) or not await self.store.delete_session(session_id):
            raise await self._not_found(session_id, agent, "unknown, closed, or expired")
        self._here.discard(session_id)
        for sandbox in self.sandboxes.values():
            await sandbox.close_session(session_id)

    async def renew_session(self, session_id: str, *, agent: str | None = None) -> None:
        """Keep an open session from expiring, as a call in it would (a client that stays
        connected, like an MCP client, keeps its session). ``agent``: as for `decide`.

        Raises:
            SessionNotFound: the session is not open (expired, closed, or the store lost it).
        """
        await self._load_session(session_id, agent)

    async def permitted_tools(self, session_id: str) -> list[ToolSpec]:
        """The tools policy could allow in this session now (judged with empty arguments and no rate
        counts, without auditing: a listing, not a call). What an MCP client is shown.

        Raises:
            SessionNotFound, StoreError: as for a call.
        """
        session = await self._load_session(session_id)
        permitted = []
        for spec in await self.list_tools():
            call = _Call(session, self.registry.get(spec.name), {}, "{}")
            try:
                decision = await self.policy.decide(self._policy_input(call))
            except Exception as exc:  # a listing fails closed too: the tool is not shown
                log.error("policy_engine_raised", error=str(exc), tool=spec.name)
                continue
            if decision.outcome is Outcome.DENY:
                continue
            if isinstance(spec.executor, ExternalExecutor) or self._select_tier(spec, decision)[1] is None:
                permitted.append(spec)
        return permitted

    async def record_refusal(
        self, who: str | None, what: str, reason: str, *, code: str = "auth.refused", session_id: str | None = None,
        tool: str | None = None, detail: Mapping[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """Audit a request refused at the door (unauthenticated, wrong role, another's session; a
        body or route the API would not take; an approval decision refused: ``code`` says which).
        ``session_id``, ``tool``: what the request was about, when the caller knows it (the event
        then joins that session's trail); ``detail``: more fields for ``result``. Written one by
        one up to the budget's burst, then counted (`router.refusals`)."""
        log.info("request_refused", who=who, what=what[:300], reason=reason, code=code, session_id=session_id)
        await self._write_refusal_counts()
        if not self._refusals.admit(who, code, what[:300], time.monotonic(), time.time()):
            # Past the burst of its kind: counted, and the count written when its window closes.
            if self._refusal_counter is None or self._refusal_counter.done():
                self._refusal_counter = asyncio.get_running_loop().create_task(self._count_refusals())
            return
        await self._record(refusal_event(who, what, reason, code=code, labels=self._labels, session_id=session_id,
                                         tool=tool, detail=detail))  # fmt: skip

    async def _count_refusals(self) -> None:
        """Write each count of refusals as its window closes, while any is being counted."""
        while (closes := self._refusals.next_close()) is not None:
            await asyncio.sleep(max(0.0, closes - time.monotonic()))
            await self._write_refusal_counts()

    async def _write_refusal_counts(self, *, every: bool = False) -> None:
        """One event for each closed window's count of refusals not written one by one
        (``every``: each window's, as at shutdown)."""
        for counted in self._refusals.due(time.monotonic(), time.time(), every=every):
            window = self._refusals.window_s
            await self._record(AuditEvent(
                kind="error", decision_id=str(uuid.uuid4()), timestamp=_now(), agent=counted.who,
                outcome="refused", labels=self._labels,
                result={"code": counted.code, "request": counted.first_request, "count": counted.count,
                        "last_request": counted.last_request,
                        "window": [_iso(counted.started), _iso(counted.ended)],
                        "message": f"{counted.count} more refusals of this kind were counted, not written one "
                                   f"by one (over {self._refusals.burst} in {window:g} s)"},
            ))  # fmt: skip

    async def readiness(self) -> dict[str, bool]:
        """What /readyz decides on: a policy in force, the store answering, an audit append possible.
        (Policy files that fail to load are reported by `readiness_problems`, but do not make the
        router unready: the last good policy decides, and every router would go out at once.)"""
        problems = await self.readiness_problems()
        return {name: problems[name] is None for name in ("policy", "store", "audit")}

    async def readiness_problems(self) -> dict[str, str | None]:
        """Each readiness check with why it fails (None: it passes). The audit check asks the log
        whether an append could be made now (disk space, a chain that went backwards), not whether
        a path looks writable. A policy directory that no longer loads is reported, though the
        last good policy stays in force (and decides)."""
        checks: dict[str, str | None] = {"policy": None if self.policy.revision else "no policy in force"}
        if self.policy_problem is not None:
            checks["policy_files"] = f"the files on disk do not load (the last good policy decides): " \
                                     f"{self.policy_problem[:500]}"  # fmt: skip
        try:
            await self.store.ping()
            checks["store"] = None
        except StoreError as exc:
            checks["store"] = str(exc)
        try:
            checks["audit"] = await self.audit.check()
        except Exception as exc:  # a check that breaks is a failing check
            checks["audit"] = f"{type(exc).__name__}: {exc}"
        return checks

    # -- approvals --------------------------------------------------------------------------

    async def list_approvals(self, status: ApprovalStatus | None = None) -> list[Approval]:
        """Approvals, optionally only those in ``status`` (e.g. pending ones for an approver)."""
        return await self.approvals.list(status)

    async def get_approval(self, approval_id: str) -> Approval:
        """One approval. Raises `ApprovalError` if unknown."""
        return await self.approvals.get(approval_id)

    async def approve(self, approval_id: str, approver: str, note: str = "") -> Approval:
        """Grant a pending approval. Refused for the requesting agent itself, or if not pending."""
        return await self.approvals.decide(approval_id, approver=approver, approve=True, note=note)

    async def deny_approval(self, approval_id: str, approver: str, note: str = "") -> Approval:
        """Refuse a pending approval; the call it was for cannot run with it."""
        return await self.approvals.decide(approval_id, approver=approver, approve=False, note=note)

    async def endorse(self, session_id: str, call_id: str, *, by: str, note: str = "") -> str:
        """Endorse, for this session only, the output of its earlier call ``call_id``: its values
        then count as trusted where policy checks destinations, amounts and sensitive values (the
        user's "pay the bill in this file"). For a human (the user, an approver), never the agent:
        over HTTP it takes the approver role. Audited (``kind: endorsement``) before it takes
        effect; ends with the session. Returns the endorsed source label.

        Raises:
            SessionNotFound: the session is not open. InvalidCall: the call left no output in it.
            ApprovalError: ``by`` is blank or the session's agent (refused, and on record).
            AuditError: the request could not be recorded (then it does not take effect), or its
                confirmation could not (then it is in force, on record as ``requested``).
            StoreError: the store failed (recorded; whether it took effect is then unknown).
        """
        session = await self._load_session(session_id, who=by)
        check_text([call_id, by, note], "endorsement")

        def event(outcome: str, **result: Any) -> AuditEvent:
            return AuditEvent(
                kind="endorsement", decision_id=str(uuid.uuid4()), timestamp=_now(), session_id=session.id,
                agent=session.agent, call_id=call_id, outcome=outcome, labels=self._labels,
                result={"by": by, "note": note[:2000], **result},
            )  # fmt: skip

        if not identity(by) or same_identity(by, session.agent):
            # The agent is what an injection steers: its word cannot make untrusted values trusted
            # (an approver identity named as the agent is the agent, as for approvals).
            await self._record(event("refused", code="endorsement.by_agent"))
            raise ApprovalError(f"an endorsement in session {session.id} cannot be made by {show(by)}: the "
                                "session's own agent never endorses what it read; ask a human approver")  # fmt: skip
        if not await self._record(event("requested")):
            raise AuditError("the endorsement could not be recorded: it was not made")
        try:
            source = await self.store.endorse(session.id, call_id)
        except StoreError as exc:
            await self._record(event("failed", error=str(exc)[:500]))
            raise
        if source is None:
            await self._record(event("refused", code="endorsement.unknown_output"))
            raise InvalidCall(
                f"call {call_id!r} left no output in session {session.id}: endorse the call_id of a call whose "
                "output the agent received",
                [FieldProblem("call_id", "no output of this call in this session")],
            )
        if not await self._record(event("endorsed", source=source)):
            # In force already, and on record as requested (before it took effect); the caller
            # must not read success without its confirmation in the log.
            raise AuditError(
                f"the endorsement of {source} is in force (recorded as requested), but its confirmation "
                "could not be recorded: check the audit log"
            )
        log.info("source_endorsed", session_id=session.id, source=source, by=by)
        return source

    async def reload_policy(self, *, source: str = "api", by: str | None = None) -> str:
        """Reload the policy directory; the old policy stays on any error. Every attempt is audited
        (``kind: policy``) with the old and new revision or the error; ``source``: what asked
        (``api``, ``watcher``, ``cli``), ``by``: who. Returns the revision in force.

        The ``reloaded`` event is written once the new policy has loaded and before it takes
        effect: a reload the log cannot take is not made (no policy decides calls off the record).

        Raises:
            PolicyError: the files do not load (the old policy stays; `policy_problem` says why).
            AuditError: the reload could not be audited (the old policy stays).
        """
        old = self.policy.revision

        async def on_record(new: str) -> None:
            reloaded = AuditEvent(
                kind="policy", decision_id=str(uuid.uuid4()), timestamp=_now(), agent=by, outcome="reloaded",
                labels=self._labels, bundles={"policies": {"revision": new}},
                result={"source": source, "previous_revision": old, "revision": new, "changed": new != old},
            )  # fmt: skip
            if not await self._record(reloaded):
                raise AuditError(f"the policy reload to revision {new[:12]} could not be audited; "
                                 f"revision {old[:12]} stays in force")  # fmt: skip

        try:
            new = await self.policy.reload(approve=on_record)
        except policy_pkg.PolicyBundleError as exc:
            self.policy_problem = str(exc)
            log.error("policy_reload_refused", error=str(exc), revision=old, source=source)
            await self._record(AuditEvent(
                kind="policy", decision_id=str(uuid.uuid4()), timestamp=_now(), agent=by, outcome="reload_refused",
                labels=self._labels, bundles={"policies": {"revision": old}},
                result={"code": "policy.reload_failed", "message": str(exc)[:2000], "source": source,
                        "kept_revision": old},
            ))  # fmt: skip
            raise PolicyError(str(exc)) from exc
        self.policy_problem = None
        return new

    # -- the pipeline -------------------------------------------------------------------

    async def decide(
        self, session_id: str, tool: str, args: Mapping[str, Any] | str | bytes, *, agent: str | None = None
    ) -> DecisionResult:
        """Decide a call without running it. The decision is audited like any other. ``agent``: the
        caller's identity, when it is authenticated (HTTP): another agent's session is not found."""
        with telemetry.decide_span() as span:
            call = await self._prepare(session_id, tool, args, count_call=False, agent=agent)
            telemetry.started(call.tool.spec, call.session, call.call_id)
            try:
                decision, _ = await self._decide(call, mode="decide")
            except _Refused as refusal:
                telemetry.ended(span, "deny", refusal.reasons)
                return DecisionResult(decision_id=call.decision_id, outcome="deny", reasons=refusal.reasons)
            telemetry.ended(span, decision.outcome.value, decision.reason_codes)
            return DecisionResult(
                decision_id=call.decision_id, outcome=decision.outcome.value, reasons=decision.reason_codes
            )

    async def call(
        self,
        session_id: str,
        tool: str,
        args: Mapping[str, Any] | str | bytes,
        *,
        inputs: Mapping[str, bytes] | None = None,
        approval_id: str | None = None,
        agent: str | None = None,
    ) -> ToolResult:
        """Validate, decide, run and audit one tool call. ``inputs``: files the tool sees read-only
        at ``/in/<name>``, each recorded in the audit log by sha256 and size. ``approval_id``: the
        approval a human granted for exactly this call (after ``pending_approval``); the call is
        decided again with it, and it is used up if the call goes ahead. ``agent``: as for `decide`.

        Raises:
            SessionNotFound: no such session.
            InvalidCall, ToolNotFound: the call is malformed (audited; nothing ran).
            ApprovalError: ``approval_id`` is not a granted approval for exactly this call (audited).
        """
        with telemetry.tool_call_span() as span:
            try:
                result = await self._call(session_id, tool, args, inputs, approval_id, agent)
            except StockadeError as exc:
                name = tool if isinstance(tool, str) and tool in self.registry.names() else "unknown"  # bounded labels
                metrics.CALLS.labels(name, exc.code).inc()
                raise
            metrics.CALLS.labels(result.tool, result.status).inc()
            telemetry.ended(span, result.status, result.reasons, result.verdict)
            return result

    async def _call(
        self,
        session_id: str,
        tool: str,
        args: Mapping[str, Any] | str | bytes,
        inputs: Mapping[str, bytes] | None,
        approval_id: str | None,
        agent: str | None,
    ) -> ToolResult:
        """The pipeline, in DESIGN §2 order; every way out of it is audited here, in one place.

        A step that refuses the call raises `_Refused` (with the event that records why, unless the
        audit log itself is what failed); it becomes the denied result below. Once the decision to
        go ahead is on record, any other exit (a cancellation: client gone, request timeout,
        shutdown; or a fault in the router) still closes the trail with an execution event.
        """
        call = await self._prepare(session_id, tool, args, inputs, count_call=True, agent=agent)
        telemetry.started(call.tool.spec, call.session, call.call_id)
        with structlog.contextvars.bound_contextvars(session_id=call.session.id, tool=call.tool.spec.name):
            if approval_id is not None:
                await self._check_approval(call, approval_id)
            else:
                await self._recall_approval(call)
            structlog.contextvars.bind_contextvars(decision_id=call.decision_id)
            try:
                return await self._steps(call)
            except _Refused as refusal:
                # Shielded here and below: a cancellation must not cut the record of an exit short.
                if refusal.event is not None:
                    await asyncio.shield(self._record(refusal.event))
                if call.going_ahead and not call.closed:
                    await asyncio.shield(self._close_trail(call, "refused", {"code": refusal.reasons[0]}))
                log.info("tool_call_refused", reasons=refusal.reasons, stage=call.stage)
                return self._result(call, refusal.status, reasons=refusal.reasons)
            except asyncio.CancelledError:
                if call.going_ahead and not call.closed:
                    log.warning("tool_call_cancelled", stage=call.stage)
                    # Shielded: a second cancellation must not stop the record of the first.
                    await asyncio.shield(self._close_trail(call, "cancelled", {"code": "call.cancelled"}))
                raise
            except ApprovalError as exc:  # audited where it was raised; the caller learns why
                if call.going_ahead and not call.closed:  # lost the race to redeem it
                    await asyncio.shield(self._close_trail(call, "refused", {"code": exc.code}))
                raise
            except Exception as exc:
                log.exception("tool_call_failed", stage=call.stage)
                detail = {"code": "router.error", "message": f"{type(exc).__name__}: {exc}"[:500]}
                if call.going_ahead and not call.closed:
                    await asyncio.shield(self._close_trail(call, "error", detail))
                else:
                    await asyncio.shield(self._record(self._event(
                        "error", call.decision_id, call.session, call.tool.spec.name, call.call_id,
                        outcome="internal_error", result=detail,
                    )))  # fmt: skip
                return self._result(call, "error" if call.going_ahead else "denied", reasons=["router.error"])
            finally:
                if call.leases:  # every exit: success, refusal, error, timeout, cancellation
                    await asyncio.shield(self._revoke(call.owner, call.leases))

    async def _steps(self, call: _Call) -> ToolResult:
        """Steps 3-11 of DESIGN §2 for a prepared call. Raises `_Refused`."""
        decision, tier = await self._decide(call, mode="call")
        if decision.outcome is Outcome.DENY:
            raise _Refused(decision.reason_codes)
        if decision.outcome is Outcome.REQUIRE_APPROVAL:
            if call.asked is not None and call.asked.status is ApprovalStatus.DENIED:
                raise _Refused(["approval.denied"], self.approvals.event(call.asked, "retry_refused"))
            with telemetry.step("stockade.approval") as span:
                action = "requested" if call.asked is None else "asked_again"
                held = await self._hold(call, decision)
                telemetry.approval(span, held.approval_id, ApprovalStatus.PENDING.value, action)
            return held
        call.going_ahead = True
        if call.approval is not None:
            with telemetry.step("stockade.approval") as span:
                await self._redeem(call)
                telemetry.approval(span, call.approval.id, ApprovalStatus.USED.value, "redeemed")
        if decision.obligations.session_labels:
            # Before the call runs: a later decision must not miss what this one allowed (a store
            # that fails here refuses the call).
            call.stage = "labelling"
            new = sorted(set(decision.obligations.session_labels) - call.session.labels)
            if new:
                await self._store_step(call, self.store.add_session_labels(call.session.id, new))
                log.info("session_labelled", labels=new)
        if decision.obligations.credentials:
            call.stage = "credentials"
            with telemetry.step("stockade.credentials.mint") as span:
                telemetry.minting(span, decision.obligations.credentials)
                await self._mint(call, decision)
                telemetry.minted(span, call.leases)
        await self._read_supplied(call)
        if isinstance(call.tool.spec.executor, ExternalExecutor):
            call.stage = "awaiting_report"
            if "reads_untrusted" in call.tool.spec.capabilities:
                # The framework runs it and the agent may read its output before (or without) the
                # report: the session is tainted now, so no later call is decided as if it were
                # clean. (No keys, and a source no call_id names: nothing to endorse until reported.)
                await self._store_step(call, self.store.record_output(
                    call.session.id, f"{source_label(call.tool.spec.name, call.call_id, untrusted=True)}/allowed", (),
                    taint=UNTRUSTED_CONTENT,
                ))  # fmt: skip
            await self._store_step(call, self.store.expect_report(
                PendingExternal(call.session.id, call.call_id, call.decision_id, call.tool.spec.name,
                                tuple(sorted(call.arg_keys)), steered=call.steered, derived=call.derived)
            ))  # fmt: skip
            call.closed = True  # the trail goes on with report()
            return self._result(call, "awaiting_report")
        assert tier is not None  # noqa: S101  (_decide gives every sandboxed call a tier)
        # Nothing runs for a caller who is gone. Checked here, between steps, where what the steps
        # made is on the call (its leases, revoked on the way out), not inside one.
        _honour_cancellation()
        return await self._run(call, decision, tier)

    async def report(self, session_id: str, call_id: str, output: Any, *, agent: str | None = None) -> ToolResult:
        """Record the output of an allowed ``external`` call; each call_id is reported once.

        Raises:
            SessionNotFound, InvalidCall: unknown session or call, oversized or non-JSON output.
            AuditError: the output could not be recorded (the call stays reportable).
            StoreError: the store failed (if the output was taken, it is audited but not indexed,
                and the call cannot be reported again: the framework must not show the output).
        """
        session = await self._load_session(session_id, agent)
        check_nesting(output, "output")  # first: nothing recursive may see a value nested too deep
        try:  # then a cycle or a non-JSON value, before anything else walks it
            encoded = json.dumps(output, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidCall(
                f"reported output is not JSON-serialisable ({type(exc).__name__}: {str(exc)[:200]})",
                [FieldProblem("output", "not JSON")],
            ) from exc
        check_text(output, "output")
        if len(encoded.encode()) > self.settings.max_report_bytes:
            raise InvalidCall(
                f"reported output is {len(encoded.encode())} bytes, over the "
                f"{self.settings.max_report_bytes}-byte cap: report less or raise STOCKADE_MAX_REPORT_BYTES",
                [FieldProblem("output", "over the cap")],
            )
        try:
            pending = await self.store.take_report(session.id, call_id) if isinstance(call_id, str) else None
        except StoreError as exc:
            await self._audit_store_failure(exc, str(uuid.uuid4()), session)
            raise
        if pending is None:
            raise InvalidCall(
                f"no external call {show(call_id)} is awaiting a report in session {session.id}: "
                "report only the call_id returned by call() for an external tool, once"
            )
        tool = await self.tool(pending.tool)
        event = self._event(
            "execution",
            pending.decision_id,
            session,
            tool.spec.name,
            pending.call_id,
            outcome="reported",
            result={"output": output, "output_sha256": sha256_hex(encoded.encode())},
        )
        try:
            await self.audit.append(event)
        except AuditError:
            await self.store.expect_report(pending)
            raise
        try:
            await self._remember(
                session,
                tool.spec,
                pending.call_id,
                output,
                echoed=pending.echoed,
                steered=pending.steered,
                derived=pending.derived,
            )
        except StoreError as exc:
            await self._audit_store_failure(exc, pending.decision_id, session, tool.spec.name, pending.call_id)
            raise
        return ToolResult(
            status="completed", decision_id=pending.decision_id, call_id=pending.call_id, tool=tool.spec.name,
            verdict="reported", output=output,
        )  # fmt: skip

    # -- steps --------------------------------------------------------------------------

    async def _prepare(
        self,
        session_id: str,
        tool_name: str,
        raw_args: Mapping[str, Any] | str | bytes,
        inputs: Mapping[str, bytes] | None = None,
        *,
        count_call: bool,
        agent: str | None = None,
    ) -> _Call:
        """Validate the call, then load everything the store knows for it in one step (the session,
        renewed and counted if ``count_call``; its arguments' provenance; its rate windows)."""
        try:
            try:
                tool = await self.tool(tool_name)
                args, canonical_args = parse_args(tool.spec.name, raw_args, self.settings.max_args_bytes)
                validate_args(tool, args)
                checked_inputs = _check_inputs(inputs or {}, self.settings.max_input_bytes)
                argv = command_argv(tool.spec.executor, args) if isinstance(tool.spec.executor, CommandExecutor) else ()
                if any(name.startswith(_ITEM) for name in args):
                    raise InvalidCall(
                        "an argument name starts with a NUL character: rename it",
                        [FieldProblem("args", "no argument name may start with NUL")],
                    )
            except StockadeError:
                raise
            except Exception as exc:  # a validator that breaks on hostile input: still a refusal, audited
                log.exception("call_validation_raised")
                raise InvalidCall(
                    f"the call could not be validated ({type(exc).__name__}): check its arguments' shape and size"
                ) from exc
        except StockadeError as exc:
            session = await self._load_session(session_id, agent)  # an unknown session is reported as such
            await self._audit_rejection(session, tool_name, exc)
            raise
        spec = tool.spec
        keys, checked = await call_keys_async(
            args, [*spec.destination_args, *spec.amount_args, *spec.sensitive_args], spec.content_args, spec.amount_args
        )
        # Each checked value is looked up in the same store step, under a name no argument has; for
        # a tool whose output is a trusted source, so is each identifier or number an argument
        # carries (`_derived` asks of each whether it has a trusted source).
        lookup: dict[str, Collection[str]] = {**keys, **{f"{_ITEM}{i}": v.keys for i, v in enumerate(checked)}}
        traced = set() if "reads_untrusted" in spec.capabilities else {
            key for arg_keys in keys.values() for key in arg_keys if key.startswith(_TRACED)
        }  # fmt: skip
        lookup.update({f"{_ITEM}k:{key}": (key,) for key in traced})
        context = await self._from_store(
            session_id,
            lambda sid: self.store.call_context(sid, spec.name, lookup, count=count_call, agent=agent),
            who=agent,
        )
        await self._check_owner(context.session, agent)
        call = _Call(context.session, tool, args, canonical_args)
        call.inputs, call.argv = checked_inputs, argv
        call.input_infos = [
            {"name": f.name, "sha256": hashlib.sha256(f.data).hexdigest(), "size": len(f.data)}
            for f in sorted(checked_inputs, key=lambda f: f.name)
        ]
        provenance = dict(context.provenance)
        key_sources = {key: provenance.pop(f"{_ITEM}k:{key}", []) for key in traced}
        for arg in (*spec.destination_args, *spec.amount_args, *spec.sensitive_args, *spec.content_args):
            if arg in args:  # present, even with nothing in it to check (policy holds an arg it has no entry for)
                call.values.setdefault(arg, [])
        for i, value in enumerate(checked):
            sources = provenance.pop(f"{_ITEM}{i}", [])
            call.values.setdefault(value.arg, []).append(ValueSources(path=value.path, key=value.key, sources=sources))
        call.provenance, call.rates = provenance, context.rates
        # A call the agent was steered to by untrusted content (a search for the words an injected
        # text gave it) returns what that text chose: none of its output is a trusted source.
        call.steered = any(is_untrusted_only(sources, context.session.endorsed) for sources in provenance.values())
        call.derived = (
            not call.steered
            and UNTRUSTED_CONTENT in context.session.taint
            and _derived(args, keys, provenance, key_sources, context.session.endorsed)
        )
        # What the checked values are keyed by (an amount of any size): the call supplied them.
        # The rest of what it supplied is read once it goes ahead (`_read_supplied`).
        call.arg_keys = {key for value in checked for key in value.keys}
        return call

    @staticmethod
    async def _read_supplied(call: _Call) -> None:
        """Add to ``call.arg_keys`` every key its arguments give read as content would (names,
        quoted phrases, a map's keys, the digits in an address: `supplied_keys`), so a trusted
        tool's output that repeats one is no source for it. Only an output indexed as a trusted
        tool's needs them: not a steered call's, nor all of a ``reads_untrusted`` tool's."""
        spec = call.tool.spec
        if call.steered or ("reads_untrusted" in spec.capabilities and not spec.untrusted_output):
            return
        call.arg_keys.update(await supplied_keys_async(call.args))

    async def _load_session(
        self, session_id: object, agent: str | None = None, *, who: str | None = None
    ) -> SessionRecord:
        """The open session ``session_id`` (renewed), if ``agent`` (when given) is its agent.
        ``who``: the caller, for the record of a refusal, when it is not ``agent`` (an approver,
        an admin). Raises as `_from_store`."""
        session = await self._from_store(
            session_id, functools.partial(self.store.load_session, agent=agent), who=who or agent
        )
        await self._check_owner(session, agent)
        return session

    async def _check_owner(self, session: SessionRecord, agent: str | None) -> None:
        """A session is its agent's alone: to another (authenticated) caller it does not exist."""
        if agent is not None and session.agent != agent:
            raise await self._not_found(session.id, agent, "another agent's session")

    async def _not_found(self, session_id: object, who: str | None, why: str) -> SessionNotFound:
        """The one answer for a session that is not open, or not the caller's (its existence is
        not revealed), on record first (``session.not_found``, ``why`` in the record only): an
        unknown, a closed and another agent's session cost the same, and each leaves a trace
        (unless its caller records it: `session_refusals_recorded_by_caller`)."""
        if not _SESSION_REFUSAL_RECORDED.get():
            await self.record_refusal(who, f"session {show(session_id, 300)}", why, code=SessionNotFound.code)
        return SessionNotFound(
            f"no open session {show(session_id)} (unknown, closed, or idle for longer than "
            f"{self.settings.session_idle_ttl_s:g}s); open one with open_session()"
        )

    async def _from_store(
        self, session_id: object, load: Callable[[str], Awaitable[_T | None]], *, who: str | None = None
    ) -> _T:
        """``load(session_id)``, which is None if the session is not open. ``who``: the caller,
        for the record of a refusal.

        Raises:
            SessionNotFound: unknown, closed, or idle for longer than the session TTL (audited).
            StoreError: the store failed (audited: nothing can be decided without the session).
        """
        if not isinstance(session_id, str) or not 0 < len(session_id) <= 256:
            raise await self._not_found(session_id, who, "not a session id")
        try:
            loaded = await load(session_id)
        except StoreError as exc:
            log.error("store_failed", error=str(exc), session_id=session_id)
            await self._record(AuditEvent(
                kind="error", decision_id=str(uuid.uuid4()), timestamp=_now(), session_id=session_id,
                outcome="store_unavailable", labels=self._labels, result={"code": exc.code, "message": str(exc)},
            ))  # fmt: skip
            raise
        if loaded is None:
            self._here.discard(session_id)
            raise await self._not_found(session_id, who, "unknown, closed, or expired")
        self._here.add(session_id)
        return loaded

    async def _store_step(self, call: _Call, step: Awaitable[_T]) -> _T:
        """``await step``, a store operation the call cannot go on without.

        Raises:
            _Refused: the store failed (the refusal carries the event that records it).
        """
        try:
            return await step
        except StoreError as exc:
            log.error("store_failed", error=str(exc), session_id=call.session.id)
            raise _Refused([exc.code], self._event(
                "error", call.decision_id, call.session, call.tool.spec.name, call.call_id,
                outcome="store_unavailable", result={"code": exc.code, "message": str(exc)},
            )) from exc  # fmt: skip

    async def _audit_store_failure(
        self, exc: StoreError, decision_id: str, session: SessionRecord, tool: str | None = None,
        call_id: str | None = None,
    ) -> None:  # fmt: skip
        log.error("store_failed", error=str(exc), session_id=session.id)
        await self._record(AuditEvent(
            kind="error", decision_id=decision_id, timestamp=_now(), session_id=session.id, agent=session.agent,
            tool=tool, call_id=call_id, outcome="store_unavailable", labels=self._labels,
            result={"code": exc.code, "message": str(exc)},
        ))  # fmt: skip

    async def _audit_rejection(
        self, session: SessionRecord, tool_name: object, exc: StockadeError, call: _Call | None = None
    ) -> None:
        """Audit a call rejected before it was decided (malformed, an unusable approval, the store
        down). ``call``: the call, once it was made: the event carries its ``decision_id`` and
        ``call_id``, as its span does, so the two join."""
        name = tool_name if isinstance(tool_name, str) and len(tool_name) <= 256 else repr(tool_name)[:256]
        if isinstance(exc, StoreError):  # on record as every store failure is, not as a malformed call
            decision_id = str(uuid.uuid4()) if call is None else call.decision_id
            telemetry.rejected(decision_id)
            await self._audit_store_failure(exc, decision_id, session, name, None if call is None else call.call_id)
            return
        result: dict[str, Any] = {"code": exc.code, "message": str(exc)}
        fields: list[str] = []
        if isinstance(exc, InvalidCall) and exc.problems:
            # Each problem by its field, and by its path when it may quote a value: an audit mask on
            # an argument erases what is said of it (router.audit.masking).
            result["problems"] = [
                {"field": p.field, "problem": p.problem, **({} if p.path is None else {"path": list(p.path)})}
                for p in exc.problems
            ]
            fields = sorted({p.field[:200] for p in exc.problems})
        decision_id = str(uuid.uuid4()) if call is None else call.decision_id
        call_id = None if call is None else call.call_id
        telemetry.rejected(decision_id)
        event = self._event("error", decision_id, session, name, call_id, outcome="invalid", result=result)
        await self._record(event)
        # The code and the fields only: a malformed call's message quotes the values it refused,
        # which an audit mask keeps out of the log, and so must this.
        told = {"fields": fields} if isinstance(exc, InvalidCall) else {"error": str(exc)}
        log.info("tool_call_rejected", code=exc.code, session_id=session.id, **told)

    async def _check_approval(self, call: _Call, approval_id: str) -> None:
        """The approval ``approval_id`` a human granted for exactly this call; the call joins its trail.

        Raises:
            ApprovalError, StoreError: not granted, not for this call, or unreadable (audited).
        """
        try:
            call.approval = await self.approvals.check(
                approval_id, session_id=call.session.id, tool=call.tool.spec.name, canonical_args=call.canonical_args,
                inputs=call.input_infos,
            )  # fmt: skip
        except (ApprovalError, StoreError) as exc:
            await self._audit_rejection(call.session, call.tool.spec.name, exc, call)
            raise
        call.decision_id = call.approval.decision_id  # one trail: request, approval, decision, run

    async def _recall_approval(self, call: _Call) -> None:
        """A call sent again without an approval id: the approval last asked for exactly this call
        in this session, if any, decides how it goes on. Granted: the call redeems it (as if its id
        were given: models and MCP clients cannot carry ids). Pending: the call is held under the
        same approval, not a new one. Refused by a human: the call stays refused for the approval
        TTL from that refusal (a model cannot wear the approver down by retrying). Used or
        expired: nothing (a new request). The call joins the approval's trail.

        Raises:
            StoreError: the approval could not be read (audited).
        """
        bound = binding(call.tool.spec.name, call.canonical_args, call.session.id, call.input_infos)
        remembered = call.session.approvals.get(bound)
        if remembered is None:
            return
        try:
            approval = await self.approvals.get(remembered)
        except ApprovalError:  # no longer kept
            return
        except StoreError as exc:
            await self._audit_rejection(call.session, call.tool.spec.name, exc, call)
            raise
        if approval.binding != bound:
            # The session's pointer is the store's word, and anyone who can write the store can
            # point it anywhere: an approval is only ever released for the exact call it names.
            log.warning("approval_recall_mismatch", approval_id=approval.id, session_id=call.session.id,
                        tool=call.tool.spec.name)  # fmt: skip
            return
        if approval.status is ApprovalStatus.APPROVED:
            call.approval = approval
        elif approval.status is ApprovalStatus.PENDING or (
            approval.status is ApprovalStatus.DENIED
            and time.time() < (approval.decided_at or approval.created_at) + self.settings.approval_ttl_s
        ):
            call.asked = approval
        else:
            return
        call.decision_id = approval.decision_id

    async def _decide(self, call: _Call, *, mode: str) -> tuple[Decision, str | None]:
        """Steps 3-4: ask policy, pick the sandbox tier, audit the decision. Returns the decision and
        the tier the call runs on (None for a deny or an external tool).

        Raises:
            _Refused: the decision could not be audited (nothing may run).
        """
        call.stage = "deciding"
        spec = call.tool.spec
        policy_input = self._policy_input(call)
        with telemetry.step("stockade.policy.decide") as span:
            started = time.perf_counter_ns()
            try:
                decision = await self.policy.decide(policy_input)
            except Exception as exc:  # a backend that breaks its contract still fails closed
                log.exception("policy_engine_raised")
                telemetry.failed(span, "policy.error", exc)
                decision = policy_pkg.deny(
                    "policy.error", f"policy engine raised: {exc}", revision=self.policy.revision
                )
            elapsed = time.perf_counter_ns() - started
            tier = None
            labelled = call.session.labels.union(decision.obligations.session_labels)
            if decision.outcome is not Outcome.DENY and len(labelled) > MAX_SESSION_LABELS:
                decision = policy_pkg.deny(POLICY_ERROR, f"the session_labels obligation would give the session "
                                           f"{len(labelled)} labels, over {MAX_SESSION_LABELS}",
                                           revision=decision.policy_revision)  # fmt: skip
            if decision.outcome is not Outcome.DENY and not isinstance(spec.executor, ExternalExecutor):
                tier, problem = self._select_tier(spec, decision)
                if problem is not None:
                    decision = policy_pkg.deny("sandbox.unavailable", problem, revision=decision.policy_revision)
            telemetry.decided(span, decision, tier, call.decision_id)
        metrics.DECISIONS.labels(decision.outcome.value).observe(elapsed / 1e9)
        if mode == "call" and decision.outcome is Outcome.ALLOW:
            # Before the append, not after: a cancellation while the allow is being written (its
            # fsync, a Redis round trip) may leave it on record, and the trail must then be closed.
            call.going_ahead = True
        await self._audit(self._event(
            "decision", call.decision_id, call.session, spec.name, call.call_id,
            outcome=decision.outcome.value,
            input=policy_input.model_dump(mode="json"),
            result={**decision.model_dump(mode="json", exclude={"policy_revision"}), "mode": mode},
            bundles={"policies": {"revision": decision.policy_revision}},
            metrics={"timer_policy_eval_ns": float(elapsed)},
        ))  # fmt: skip
        return decision, tier

    def _select_tier(self, spec: ToolSpec, decision: Decision) -> tuple[str, str | None]:
        """The tier a sandboxed call runs on: the tool's, raised to policy's minimum; and why it
        cannot run there (None if it can). A tier is never lowered."""
        tier: str = spec.sandbox.tier
        minimum = decision.obligations.sandbox.min_tier
        if minimum is not None and runner_pkg.tier_rank(minimum) > runner_pkg.tier_rank(tier):
            tier = minimum
        sandbox = self.sandboxes.get(tier)
        problem = f"this router does not offer the {tier} tier" if sandbox is None else sandbox.check()
        return tier, None if problem is None else f"needs the {tier} tier: {problem}"

    async def _hold(self, call: _Call, decision: Decision) -> ToolResult:
        """Step 5: open an approval bound to this exact call, audited; the agent gets its id."""
        call.stage = "approval"
        if call.asked is not None:  # asked before and still pending: the same approval, asked again
            await self._audit(self.approvals.event(call.asked, "asked_again"))
            log.info("tool_call_held_for_approval", reasons=decision.reason_codes, approval_id=call.asked.id)
            return self._result(call, "pending_approval", reasons=decision.reason_codes).model_copy(
                update={"approval_id": call.asked.id}
            )
        approval = await self._store_step(call, self.approvals.open(
            decision_id=call.decision_id, session_id=call.session.id, agent=call.session.agent,
            principal=call.session.principal, tool=call.tool.spec.name,
            canonical_args=call.canonical_args, reasons=[r.model_dump() for r in decision.reasons],
            inputs=call.input_infos,
        ))  # fmt: skip
        # Another call, identical and held at the same moment, may have opened it: this one asks again.
        await self._audit(self.approvals.event(approval, "requested" if approval.decision_id == call.decision_id
                                               else "asked_again"))  # fmt: skip
        log.info("tool_call_held_for_approval", reasons=decision.reason_codes, approval_id=approval.id)
        return self._result(call, "pending_approval", reasons=decision.reason_codes).model_copy(
            update={"approval_id": approval.id}
        )

    async def _redeem(self, call: _Call) -> None:
        """Use up the call's approval (single use: a concurrent call with it loses), audited.

        Raises:
            ApprovalError: it was redeemed in the meantime (audited).
            _Refused: the store or the audit log failed.
        """
        assert call.approval is not None  # noqa: S101  (the caller checks)
        call.stage = "approval"
        try:
            used = await self._store_step(call, self.approvals.redeem(call.approval.id))
        except ApprovalError as exc:  # redeemed by a concurrent call in the meantime
            await self._audit_rejection(call.session, call.tool.spec.name, exc, call)
            raise
        await self._audit(self.approvals.event(used, "redeemed"))

    async def _mint(self, call: _Call, decision: Decision) -> None:
        """Step 6: the call's credentials, minted (into ``call.leases``) and each audited.

        Raises:
            _Refused: a credential cannot be granted or minted (audited), or the audit log failed
                (what was minted is revoked by the caller).
        """
        session, spec = call.session, call.tool.spec
        try:
            if isinstance(spec.executor, ExternalExecutor):
                raise CredentialUnavailable(f"tool {spec.name} runs outside the sandbox, where no proxy can inject "
                                            "a credential: it gets none")  # fmt: skip
            grants = self.credentials.grant(decision.obligations.credentials)
            binding = Binding(call.decision_id, call.call_id, session.id, session.agent,
                              sha256_hex(call.canonical_args.encode()))  # fmt: skip
            # One lease at a time, each in ``call.leases`` (revoked on every exit from here on,
            # whatever happens next) and audited as soon as it exists: a later grant's failure
            # leaves none unrecorded.
            for grant in grants:
                (lease,) = await self._store_step(call, self.credentials.mint([grant], binding))
                call.leases.append(lease)
                self._leases[lease.id] = (call.owner, lease)
                await self._audit(self._event(
                    "credential", call.decision_id, session, spec.name, call.call_id,
                    outcome="minted", result=lease.record(),
                ))  # fmt: skip
        except CredentialError as exc:
            log.info("credential_refused", code=exc.code, error=str(exc))
            raise _Refused([exc.code], self._event(
                "credential", call.decision_id, session, spec.name, call.call_id,
                outcome="refused", result={"code": exc.code, "message": str(exc)},
            )) from exc  # fmt: skip

    async def _revoke(self, owner: _LeaseOwner, leases: list[Lease]) -> None:
        """Revoke a call's leases and audit each revocation (or its failure: the TTL ends it then).
        One that failed is kept for shutdown to try again (`aclose`) until it expires."""
        for lease, problem in await self.credentials.revoke(leases):
            if problem is None:
                self._leases.pop(lease.id, None)
            await self._record(self._event(
                "credential", owner.decision_id, owner.session, owner.tool, owner.call_id,
                outcome="revoked" if problem is None else "revoke_failed",
                result={"lease_id": lease.id, "name": lease.grant.config.name, "expires_at": lease.expires_at,
                        **({"error": str(problem)} if problem else {})},
            ))  # fmt: skip
        now = time.time()  # what the store's TTL ended needs no revocation
        for lease_id in [lease_id for lease_id, (_, lease) in self._leases.items() if lease.expires_at <= now]:
            del self._leases[lease_id]

    def _job(self, call: _Call, decision: Decision) -> runner_pkg.SandboxSpec:
        """What the sandbox runs: the tool's executor with its limits, inputs, egress and credentials."""
        spec = call.tool.spec
        limits = _limits(spec, decision)
        if isinstance(spec.executor, PythonExecutor):
            base = runner_pkg.python_job(
                spec.executor.source, spec.executor.entrypoint, call.args,
                interpreter=self.settings.runner.python, limits=limits,
            )  # fmt: skip
        else:
            base = runner_pkg.SandboxSpec(argv=call.argv, limits=limits)
        mode = decision.obligations.sandbox.mode or spec.sandbox.mode
        outputs = spec.sandbox.outputs
        return dataclasses.replace(
            base,
            call_id=call.call_id,
            inputs=call.inputs,
            outputs=runner_pkg.OutputCaps(outputs.max_files, outputs.max_bytes) if outputs else None,
            egress=tuple(runner_pkg.EgressRule(e.host, e.port, tuple(e.methods)) for e in decision.obligations.egress),
            on_egress=self._egress_auditor(call),
            session=call.session.id if mode == "session" else None,
            env={**base.env, **{lease.grant.config.env_var: lease.placeholder for lease in call.leases}},
            injections=tuple(_injection(lease) for lease in call.leases),
        )

    async def _run(self, call: _Call, decision: Decision, tier: str) -> ToolResult:
        """Steps 7-11: run in the sandbox, redact, audit the execution, index what the agent will see.

        Raises:
            _Refused: the sandbox failed (audited as the execution), the execution could not be
                audited (the output is withheld), or the output could not be indexed.
        """
        spec = call.tool.spec
        job = self._job(call, decision)
        call.stage, call.tier = "running", tier
        with telemetry.step("stockade.sandbox.run", {"stockade.tier": tier}) as span:
            started = time.perf_counter_ns()
            try:
                run = await self.sandboxes[tier].run(job)
            except runner_pkg.SandboxError as exc:  # the refusal marks the step failed, with exc as its cause
                code = "sandbox.unavailable" if isinstance(exc, runner_pkg.SandboxUnavailable) else "sandbox.error"
                log.error("sandbox_failed", error=str(exc))
                call.closed = True
                raise _Refused([code], self._event(
                    "execution", call.decision_id, call.session, spec.name, call.call_id,
                    outcome="error", result={"code": code, "message": str(exc), "tier": tier},
                ), status="error") from exc  # fmt: skip
            elapsed = time.perf_counter_ns() - started
            telemetry.ran(span, run)
        metrics.RUNS.labels(run.tier).observe(elapsed / 1e9)
        if call.egress_records:
            # The proxy closed when the run ended; a record it reported then may still be being
            # appended (shielded there): its outcome decides whether the output may leave.
            await asyncio.gather(*call.egress_records)

        # A secret the tool got hold of (an upstream echoing it back) never reaches the agent.
        python = isinstance(spec.executor, PythonExecutor) and run.verdict is runner_pkg.Verdict.OK
        run, stdout, stderr, result = await _redacted(run, parse=python)
        verdict, output, reasons = run.verdict.value, None, []
        if python:
            if result is _MALFORMED:
                verdict, reasons = "error", ["output.malformed"]
            else:
                output = result
        elif run.verdict is runner_pkg.Verdict.OK:
            output = stdout
        if call.unaudited_egress:
            # A request the tool made is missing from the log: what it brought back stays here.
            verdict, output, reasons = "error", None, ["audit.unavailable"]
        usage = RunUsage(
            wall_ms=run.usage.wall_s * 1000, cpu_ms=run.usage.cpu_s * 1000, max_rss_kb=run.usage.max_rss_kb
        )
        call.stage = "recording"
        try:
            await self._audit(self._event(
                "execution", call.decision_id, call.session, spec.name, call.call_id,
                outcome=verdict,
                result={
                    "verdict": verdict, "exit_code": run.exit_code, "detail": run.detail, "tier": run.tier,
                    "usage": usage.model_dump(), "limits": dataclasses.asdict(job.limits),
                    "stdout": stdout, "stderr": stderr,
                    "stdout_sha256": sha256_hex(run.stdout), "stderr_sha256": sha256_hex(run.stderr),
                    "start": run.start, "inputs": [dataclasses.asdict(f) for f in run.inputs],
                    "artifacts": [{**dataclasses.asdict(f), "untrusted": True} for f in run.artifacts],
                    "refused_outputs": [{"path": p, "why": w} for p, w in run.refused],
                    "quarantine": run.quarantine, "unaudited_egress": call.unaudited_egress,
                },
                metrics={"timer_run_ns": float(elapsed)},
            ))  # fmt: skip
        except _Refused:
            call.closed = True  # the audit log is down: there is nowhere to write more
            raise
        # Only now: an append cut short by a cancellation must still leave the trail to be closed.
        call.closed = True
        if call.unaudited_egress:
            log.error("egress_unaudited", requests=call.unaudited_egress)
            raise _Refused(["audit.unavailable"], status="error")
        # What the agent gets back enters its context: index it for the provenance of later calls.
        # If that fails, the output is withheld: unindexed, it could later pass for the user's.
        call.stage = "indexing"
        await self._store_step(call, self._remember(
            call.session, spec, call.call_id, output if output is not None else stdout, stderr, echoed=call.arg_keys,
            steered=call.steered, derived=call.derived,
        ))  # fmt: skip
        log.info("tool_call_completed", verdict=verdict, wall_ms=round(usage.wall_ms, 2))
        return ToolResult(
            status="completed", decision_id=call.decision_id, call_id=call.call_id, tool=spec.name,
            reasons=reasons, verdict=verdict, exit_code=run.exit_code, output=output,
            stdout=stdout, stderr=stderr, usage=usage, tier=run.tier, start=run.start,
            artifacts=[Artifact(path=f.path, size=f.size, sha256=f.sha256) for f in run.artifacts],
            quarantine=run.quarantine,
        )  # fmt: skip

    async def _close_trail(self, call: _Call, outcome: str, detail: dict[str, Any]) -> None:
        """The execution event of an allowed call that ended without one: what is known of it."""
        call.closed = True
        await self._record(self._event(
            "execution", call.decision_id, call.session, call.tool.spec.name, call.call_id, outcome=outcome,
            result={**detail, "verdict": outcome, "stage": call.stage, "tier": call.tier,
                    "credentials": [lease.id for lease in call.leases]},
        ))  # fmt: skip

    # -- helpers ------------------------------------------------------------------------

    def _egress_auditor(self, call: _Call) -> runner.base.EgressHook:
        """A hook that audits each request the call's egress proxy saw, under its decision_id."""

        async def audit_egress(record: runner_pkg.EgressRecord) -> None:
            done = asyncio.get_running_loop().create_future()
            call.egress_records.append(done)  # waited for before the output is released
            try:
                if not await self._record(self._event(
                    "egress", call.decision_id, call.session, call.tool.spec.name, call.call_id,
                    outcome="allow" if record.allowed else "deny", result=dataclasses.asdict(record),
                )):  # fmt: skip
                    call.unaudited_egress += 1  # the run goes on (the request is made); its output will not
            except BaseException:  # cut short: not on record
                call.unaudited_egress += 1
                raise
            finally:
                done.set_result(None)

        return audit_egress

    async def _record(self, event: AuditEvent) -> bool:
        """Append ``event`` (the log redacts and escapes it); False (logged) if the log failed, so the
        caller fails closed. Never raises: whatever breaks inside an append is an audit failure."""
        started = time.perf_counter()
        with telemetry.step("stockade.audit.append", {"stockade.audit.kind": event.kind}) as span:
            try:
                await self.audit.append(event)
            except AuditError as exc:
                log.error("audit_append_failed", error=str(exc), kind=event.kind, decision_id=event.decision_id)
                telemetry.failed(span, "audit.unavailable", exc)
                return False
            except Exception as exc:  # a log that breaks its contract still fails the call closed
                log.exception("audit_append_raised", kind=event.kind, decision_id=event.decision_id)
                telemetry.failed(span, "audit.unavailable", exc)
                return False
        metrics.AUDIT_APPEND.observe(time.perf_counter() - started)
        return True

    async def _audit(self, event: AuditEvent) -> None:
        """Append ``event``, which the call cannot go on without. Raises `_Refused` (audit.unavailable)."""
        if not await self._record(event):
            raise _Refused(["audit.unavailable"])

    async def _remember(
        self, session: SessionRecord, spec: ToolSpec, call_id: str, *content: Any, echoed: Collection[str] = (),
        steered: bool = False, derived: bool = False,
    ) -> None:  # fmt: skip
        """Index output the agent is about to see, and taint the session if the tool reads
        untrusted content. Raises `StoreError`.

        ``echoed``: every key the call's own arguments supply (`supplied_keys`). A trusted tool's
        output is a trusted source, except for what it only repeats (an echo, a formatter, "sent to
        X"): those values keep the sources they had, so a tool cannot launder an untrusted value
        into a trusted one.
        ``steered``: an argument came only from untrusted content, so all of the output is
        untrusted content: a trusted tool's, and the parts a tool declares its own
        (``untrusted_output``) alike. (The session is tainted already: that content tainted it.)
        ``derived``: after untrusted content, an argument had no trusted source, so what a trusted
        tool returns is indexed as ``derived:`` (neither trusted nor untrusted), not ``tool:``."""
        untrusted = steered or "reads_untrusted" in spec.capabilities
        if spec.untrusted_output and not steered:  # (untrusted_output is only for reads_untrusted tools)
            # Its own data is a trusted tool's output (indexed first: the call's endorsable
            # source is its third-party part), the declared parts untrusted content.
            output, *rest = content  # the output, then what else the agent sees (stderr): third-party
            trusted_part, third_party = split_output(output, spec.untrusted_output)
            await self._index(
                session, source_label(spec.name, call_id, untrusted=False, derived=derived), trusted_part, echoed, None
            )
            content = (*third_party, *rest)
        await self._index(
            session, source_label(spec.name, call_id, untrusted=untrusted, derived=derived), list(content),
            () if untrusted else echoed, UNTRUSTED_CONTENT if untrusted else None,
        )  # fmt: skip

    async def _index(
        self, session: SessionRecord, source: str, content: list[Any], echoed: Collection[str], taint: str | None
    ) -> None:
        keys = await content_keys_async(content)
        keys.difference_update(echoed)  # read by the same function: whatever the output repeats is in it
        await self.store.record_output(session.id, source, keys, taint=taint)

    def _policy_input(self, call: _Call) -> PolicyInput:
        return _policy_input(call, self.settings, self._environment)

    @staticmethod
    def _result(call: _Call, status: Any, reasons: list[str] | None = None) -> ToolResult:
        return ToolResult(
            status=status, decision_id=call.decision_id, call_id=call.call_id, tool=call.tool.spec.name,
            reasons=reasons or [],
        )  # fmt: skip

    def _event(
        self, kind: Any, decision_id: str, session: SessionRecord, tool: str, call_id: str | None, **fields: Any
    ) -> AuditEvent:
        return AuditEvent(
            kind=kind, decision_id=decision_id, timestamp=_now(), session_id=session.id, agent=session.agent,
            tool=tool, call_id=call_id, labels=self._labels, **fields,
        )  # fmt: skip


def make_audit_log(settings: Settings) -> AuditLog:
    """The audit log ``settings`` name: the JSONL file, or the Redis stream of the store's server.

    Raises:
        AuditError: the Redis stream is chosen without a store URL.
    """
    return audit_factory.make_audit_log(settings)


def _policy_input(call: _Call, settings: Settings, environment: EnvironmentInfo) -> PolicyInput:
    """What policy sees of a call. The principal's groups and labels come from ``settings`` (the
    principal's configuration), never from the caller."""
    principal = settings.principal_config(call.session.principal)
    return PolicyInput(
        subject=SubjectInfo(
            agent=call.session.agent,
            principal=call.session.principal,
            groups=list(principal.groups),
            labels=dict(principal.labels),
        ),
        session=SessionInfo(
            id=call.session.id,
            taint=sorted(call.session.taint),
            call_count=call.session.call_count,
            trusted_context=list(call.session.trusted_context),
            endorsed=sorted(call.session.endorsed),
            labels=sorted(call.session.labels),
        ),
        tool=call.tool.policy_view,
        args=call.args,
        inputs=[InputInfo.model_validate(i) for i in call.input_infos],
        approval=None
        if call.approval is None
        else {
            "id": call.approval.id,
            "status": call.approval.status.value,
            "approver": call.approval.approver,
            "reasons": [r["code"] for r in call.approval.reasons],
        },
        provenance=call.provenance,
        values=call.values,
        rate=call.rates,
        now=_now(),
        environment=environment,
    )


def _check_inputs(inputs: Mapping[str, bytes], max_bytes: int) -> tuple[runner_pkg.InputFile, ...]:
    files = []
    total = 0
    check_text(list(inputs), "inputs")
    for name, data in inputs.items():
        try:
            runner.files.check_input_name(name)
        except ValueError as exc:
            raise InvalidCall(str(exc), [FieldProblem(f"inputs[{name[:60]!r}]", "not a plain file name")]) from exc
        if not isinstance(data, bytes):
            raise InvalidCall(f"input {name!r} must be bytes", [FieldProblem(f"inputs[{name!r}]", "not bytes")])
        total += len(data)
        files.append(runner_pkg.InputFile(name, data))
    if total > max_bytes:
        raise InvalidCall(
            f"inputs total {total} bytes, over the {max_bytes}-byte cap: raise STOCKADE_MAX_INPUT_BYTES",
            [FieldProblem("inputs", "over the cap")],
        )
    return tuple(files)


class _Refused(Exception):  # a control-flow signal inside the pipeline, never raised out of it
    """A pipeline step refused the call: the reason codes the agent gets, the event that records
    why (None when the audit log itself failed: there is nowhere to write it), and the status."""

    def __init__(self, reasons: list[str], event: AuditEvent | None = None, *, status: str = "denied") -> None:
        super().__init__(reasons)
        self.reasons, self.event, self.status = reasons, event, status


_REDACT_ON_LOOP_MAX = 64 << 10  # bytes of output redacted on the event loop (~0.2 ms); more, in a thread
_MALFORMED = object()  # a python tool's stdout that is not its harness's result document


async def _redacted(run: runner_pkg.RunResult, *, parse: bool) -> tuple[runner_pkg.RunResult, str, str, Any]:
    """``run`` with its quarantined files redacted (`_scrub_artifacts`), and `_redacted_outputs`.
    Redacted once, here (the audit log passes the texts on as they are); a long output off the
    event loop, which other calls go on using meanwhile."""
    redacting = functools.partial(_redacted_outputs, run, parse=parse)
    if len(run.stdout) + len(run.stderr) > _REDACT_ON_LOOP_MAX:
        stdout, stderr, result = await asyncio.to_thread(redacting)
    else:
        stdout, stderr, result = redacting()
    if REDACTOR.active and (run.artifacts or run.refused) and run.quarantine:
        artifacts, refused = await asyncio.to_thread(_scrub_artifacts, run)
        run = dataclasses.replace(run, artifacts=artifacts, refused=refused)
    return run, stdout, stderr, result


def _redacted_outputs(run: runner_pkg.RunResult, *, parse: bool) -> tuple[str, str, Any]:
    """A run's stdout and stderr as text, redacted; and with ``parse``, the python tool's result
    redacted (`_MALFORMED` if stdout does not hold one). Redacted from the parsed value, not from
    the redacted stdout: a JSON escape (``\\u0073k-...``) can spell a secret no form of it matches."""
    stdout, stderr = redact(_text(run.stdout)), redact(_text(run.stderr))
    if not parse:
        return stdout, stderr, None
    try:
        # A tool may return text no response or record can carry (a lone surrogate from a JSON
        # escape): escaped like the audit log escapes it, so what the agent gets is exactly what was
        # recorded.
        return stdout, stderr, escape_invalid_text(REDACTOR.deep(runner_pkg.parse_result(run.stdout)), "", [])
    except (ValueError, RecursionError):  # nested deeper than anything here can walk: malformed too
        return stdout, stderr, _MALFORMED


_REFUSED_NAME = "its name holds a secret, and the redacted name is taken or invalid"
_REDACTION_MARK = re.compile(r"\[REDACTED:([^\]]*)\]")


def _scrub_artifacts(
    run: runner_pkg.RunResult,
) -> tuple[tuple[runner_pkg.FileRecord, ...], tuple[tuple[str, str], ...]]:
    """Redact secrets in the files a run left in quarantine: in the bytes of each (in place,
    whatever its encoding) and in its path (the file moved to the redacted path, or removed and
    refused when that cannot be done). Returns the new records, and the refused outputs with
    their paths redacted."""
    assert run.quarantine is not None  # noqa: S101  (the caller checks)
    root = Path(run.quarantine)
    records = []
    refused = [(redact(path), why) for path, why in run.refused]
    for record in run.artifacts:
        path = root / record.path
        name = redact(record.path)
        if name != record.path:
            # Named as the runner names outputs (letters, digits, ._+@=- and spaces), as a later
            # call's input or the agent's own tools may need: ``[REDACTED:api]`` as ``REDACTED=api``.
            name = _REDACTION_MARK.sub(r"REDACTED=\1", name)
            moved = _move_named(root, record.path, name) if runner.files.safe_relative(name) else None
            if moved is None:
                refused.append((name, _REFUSED_NAME))
                continue
            path = moved
        try:
            data = path.read_bytes()
        except OSError:  # gone: recorded as it was
            records.append(dataclasses.replace(record, path=name))
            continue
        scrubbed = REDACTOR.scrub_bytes(data)  # bytes, not text: a Latin-1 page holds the secret as ASCII too
        if scrubbed is data:
            records.append(dataclasses.replace(record, path=name))
            continue
        path.write_bytes(scrubbed)
        records.append(runner_pkg.FileRecord(name, len(scrubbed), sha256_hex(scrubbed)))
    return tuple(records), tuple(refused)


def _move_named(root: Path, old: str, new: str) -> Path | None:
    """Move quarantined ``old`` to ``new`` (both relative to ``root``); None, and ``old`` removed,
    if ``new`` is taken or cannot be made."""
    source = root / old
    moved: Path | None = root / new
    try:
        if (root / new).exists():
            raise FileExistsError(new)
        (root / new).parent.mkdir(parents=True, exist_ok=True)
        source.rename(root / new)
    except OSError:
        source.unlink(missing_ok=True)
        moved = None
    # A directory named after the secret, emptied by the move, would show it still.
    parent = source.parent
    while parent != root and root in parent.parents:
        try:
            parent.rmdir()
        except OSError:  # not empty (or gone): it and those above it stay
            break
        parent = parent.parent
    return moved


def _injection(lease: Lease) -> runner_pkg.Injection:
    """What the egress proxy needs to put the lease's value into requests to its hosts."""
    config = lease.grant.config
    return runner_pkg.Injection(config.name, lease.placeholder, lease.value.get_secret_value(), tuple(config.hosts),
                                allow_plaintext=config.allow_plaintext, expires_at=lease.expires_at)  # fmt: skip


def _limits(spec: ToolSpec, decision: Decision) -> runner_pkg.ResourceLimits:
    """The limits the call runs with: each one policy's obligation grants.

    A limit the obligation leaves out is the tool's own only while that is within the router's
    default (`runner.ResourceLimits`); above it, the call is refused with ``policy.error``. The
    tool's value is what its registrant asked for, not what policy allowed: taken as it is, a
    policy that lost a limit (a catalog without its default, a rule that errs) would run the tool
    uncapped. A policy that manages no limits at all still runs tools that ask for no more than
    the default.

    Raises:
        _Refused: the obligation lacks a limit the tool needs above the default (``policy.error``).
    """
    tool = spec.sandbox.limits
    granted = decision.obligations.limits
    ceiling = runner_pkg.ResourceLimits()
    chosen: dict[str, float] = {}
    uncapped: list[str] = []
    for name in ("timeout_s", "memory_mb", "cpus", "pids", "output_bytes"):
        value = getattr(granted, name)
        if value is None:
            value = getattr(tool, name)
            if value > getattr(ceiling, name):
                uncapped.append(name)
        chosen[name] = value
    if uncapped:
        log.warning("limits_obligation_incomplete", missing=uncapped, policy_revision=decision.policy_revision)
        raise _Refused([POLICY_ERROR])
    return runner_pkg.ResourceLimits(
        timeout_s=chosen["timeout_s"],
        memory_mb=int(chosen["memory_mb"]),
        cpus=chosen["cpus"],
        pids=int(chosen["pids"]),
        output_bytes=int(chosen["output_bytes"]),
    )
