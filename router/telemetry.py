"""Spans for tool calls, after the OpenTelemetry GenAI conventions for tool execution.

`ControlPlane.call` makes one ``execute_tool {tool}`` span (kind INTERNAL; ``gen_ai.operation.name``
``execute_tool``, ``gen_ai.tool.name``, ``gen_ai.tool.description``, ``gen_ai.tool.type`` ``function``,
``gen_ai.tool.call.id`` the call's ``call_id``), `ControlPlane.decide` one ``stockade.decide {tool}``
span. The steps of the call are their children: ``stockade.policy.decide``, ``stockade.approval``,
``stockade.credentials.mint``, ``stockade.sandbox.run``, ``stockade.audit.append``. The call's span
carries ``stockade.decision_id`` (the key of its audit trail; a rejected call's is its error event's,
`rejected`), ``stockade.session_id``, ``stockade.agent``, ``stockade.outcome`` (the result's status:
``completed``, ``denied``, ``pending_approval``, ``awaiting_report``, ``error``; ``rejected`` or
``cancelled`` when it raised; for `decide`, the decision), ``stockade.reasons``,
``stockade.policy_revision`` and ``stockade.tier``.
Arguments, output and credential values never go into a span (exception messages are redacted, and
a malformed call's error names only its fields, not the values refused).

A span's status is ERROR, with ``error.type``, when its work failed: a refusal caused by a failure
(`FAILURES`: the policy engine, the store, the audit log or the sandbox), a tool run that did not end
``ok`` (its verdict), a call rejected as malformed or unknown (the error's code), a cancellation
(``call.cancelled``). A deny by policy is an outcome, not an error.

Spans go to the provider `configure_tracing` set up from the settings (OTLP/HTTP), or to one given to
`use_tracer_provider`; else to the global provider, if the application embedding the router set an SDK
one. With none of these no span is made at all: the call path pays a check, not the API's no-op spans
(about 10 µs each here). An export gives up after `EXPORT_TIMEOUT_S`, and `shutdown_tracing` after
`SHUTDOWN_TIMEOUT_S`: a collector that does not answer must not hold a router's exit. Only the
OpenTelemetry API is imported here; the SDK and the exporter (the ``otel`` extra) are imported once
an endpoint is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import structlog
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from router.errors import InvalidCall, StockadeError
from router.redact import redact

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider

    from policy import CredentialGrant, Decision
    from router.credentials import Lease
    from router.settings import Settings
    from router.store import SessionRecord
    from router.tools import ToolSpec
    from runner import RunResult

log = structlog.get_logger(__name__)

NAME = "stockade"  # the instrumentation scope of every span
# Reason codes that mean something failed, not that policy said no (the router answers 503 for them).
FAILURES = frozenset({
    "policy.error", "policy.unavailable", "audit.unavailable", "store.unavailable", "sandbox.unavailable",
    "sandbox.error", "router.error",
})  # fmt: skip
_MAX_TEXT = 2000  # of an exception's message or stack in a span event
_MAX_FIELD = 200  # of a field's path named in a span
_LOOK_AGAIN_S = 1.0  # see tracer()
_NOT_SET = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)  # what the global provider is until an SDK's is set
EXPORT_TIMEOUT_S = 5.0
"""How long one export to the collector may take, retries included (the SDK's default is 10 s)."""
SHUTDOWN_TIMEOUT_S = 3.0
"""How long `shutdown_tracing` waits for the spans still held to be exported."""
_TIMEOUT_VARIABLES = frozenset({"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"})


@dataclass(frozen=True, slots=True)
class _Trace:
    """The call being traced in this context: where its step spans go, and its own span."""

    tracer: trace.Tracer
    span: Span
    operation: str  # the span's name, completed with the tool's once it is known


class _State:
    """Where this process's spans go (module state, changed under ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.provider: trace.TracerProvider | None = None  # given to use_tracer_provider
        self.tracer: trace.Tracer | None = None  # the provider's
        self.global_tracer: trace.Tracer | None = None  # the global provider's, once the application set one
        self.next_look = 0.0  # when to look for a global provider again (time.monotonic())
        self.configured: tuple[tuple[str | None, str, str], SdkTracerProvider] | None = None  # configure_tracing's


_state = _State()
_current: ContextVar[_Trace | None] = ContextVar("stockade_trace", default=None)
# What a span is when nothing is traced: a span that records nothing, entered at the cost of a no-op.
_OFF: AbstractContextManager[Span] = contextlib.nullcontext(trace.INVALID_SPAN)


# -- where spans go --------------------------------------------------------------------------


def use_tracer_provider(provider: trace.TracerProvider | None) -> None:
    """Send the router's spans to ``provider``; None: to the global provider again, if one is set.
    For an application that keeps its provider out of the global slot (which takes one provider
    per process), and for tests."""
    with _state.lock:
        _state.provider = provider
        _state.tracer = None if provider is None else provider.get_tracer(NAME)


def tracer() -> trace.Tracer | None:
    """The tracer the router's spans go to now; None: no provider records them, make none.

    While no global provider is set, one is looked for at most once a second: the API's lookup
    (about 1.5 µs here) would otherwise be most of what an untraced call pays. Once set, it stays
    (the API takes one per process).
    """
    if _state.tracer is not None:
        return _state.tracer
    if _state.global_tracer is not None:
        return _state.global_tracer
    now = time.monotonic()
    if now < _state.next_look:
        return None
    _state.next_look = now + _LOOK_AGAIN_S
    provider = trace.get_tracer_provider()
    if isinstance(provider, _NOT_SET):
        return None  # no SDK set up in this process: every span would be a no-op
    _state.global_tracer = provider.get_tracer(NAME)
    return _state.global_tracer


def configure_tracing(settings: Settings, *, version: str | None = None) -> SdkTracerProvider | None:
    """Export the router's spans over OTLP/HTTP, in batches, if ``settings.telemetry`` says where:
    ``otlp_endpoint``, or ``enabled`` (where the standard ``OTEL_EXPORTER_OTLP_*`` variables say).
    The provider is the router's own (`use_tracer_provider`), with the resource ``service.name``,
    ``service.instance.id`` (``settings.instance``) and ``service.version``. The SDK and the exporter
    are imported only here, only then.

    Returns the provider; None if tracing is not configured, or could not be set up (a malformed
    endpoint, the ``otel`` extra not installed): logged as a warning, never raised, since spans are
    no reason for a router not to start. Idempotent: the first provider set up in a process stays
    until `shutdown_tracing` (a later call with other settings says so in a warning).
    """
    config = settings.telemetry
    if config.otlp_endpoint is None and not config.enabled:
        return None
    wanted = (config.otlp_endpoint, config.service_name, settings.instance)
    with _state.lock:
        if _state.configured is not None:
            if _state.configured[0] != wanted:
                log.warning(
                    "tracing_already_configured", endpoint=_state.configured[0][0], ignored=config.otlp_endpoint
                )
            return _state.configured[1]
        try:
            provider = _otlp_provider(config.otlp_endpoint, config.service_name, settings.instance, version)
        except ImportError as exc:
            log.warning("tracing_not_configured", error=str(exc), fix="pip install 'stockade[otel]'")
            return None
        except Exception as exc:  # whatever the endpoint or the SDK make of it: no spans, the router still runs
            log.warning("tracing_not_configured", error=f"{type(exc).__name__}: {exc}", endpoint=config.otlp_endpoint)
            return None
        _state.configured = (wanted, provider)
        _state.provider, _state.tracer = provider, provider.get_tracer(NAME, version)
    log.info("tracing_configured", endpoint=config.otlp_endpoint or "OTEL_EXPORTER_OTLP_*")
    return provider


def shutdown_tracing(provider: SdkTracerProvider | None = None, *, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> bool:
    """Export what `configure_tracing`'s provider still holds and end it (``provider``: only if it
    is that one), waiting at most ``timeout_s``; the router's spans go to the global provider again,
    and a later `configure_tracing` sets up a new one. Returns whether it ended in time (True when
    there was nothing to end).

    The SDK's own shutdown waits up to 30 s for its exporting thread, which sends batch after batch
    to a collector that does not answer, each until the export times out: a router would take that
    long to stop. Past ``timeout_s`` the spans still held are given up (logged), and the shutdown
    goes on in a daemon thread, which no exit waits for."""
    with _state.lock:
        configured = _state.configured
        if configured is None or (provider is not None and configured[1] is not provider):
            return True
        _state.configured = None
        if _state.provider is configured[1]:
            _state.provider = _state.tracer = None
    ending = threading.Thread(target=configured[1].shutdown, name="stockade-tracing-shutdown", daemon=True)
    ending.start()
    ending.join(timeout_s)
    if ending.is_alive():
        log.warning("tracing_shutdown_timed_out", timeout_s=timeout_s, endpoint=configured[0][0])
        return False
    return True


def _otlp_provider(endpoint: str | None, service_name: str, instance: str, version: str | None) -> SdkTracerProvider:
    """An SDK provider exporting over OTLP/HTTP to ``endpoint`` (None: the OTEL_EXPORTER_OTLP_* variables)."""
    url = None if endpoint is None else traces_url(endpoint)
    # Imported here, once an endpoint is configured: the SDK is the optional ``otel`` extra.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: PLC0415
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415

    resource: dict[str, str] = {"service.name": service_name, "service.instance.id": instance}
    if version is not None:
        resource["service.version"] = version
    provider = TracerProvider(resource=Resource.create(resource))
    # The SDK's default (10 s an export, retries included) is kept only where the standard variables
    # set another: a collector that does not answer holds the exporting thread, and the shutdown, that long.
    timeout = None if _TIMEOUT_VARIABLES.intersection(os.environ) else EXPORT_TIMEOUT_S
    exporter = OTLPSpanExporter(endpoint=url, timeout=timeout)
    batches = None if "OTEL_BSP_EXPORT_TIMEOUT" in os.environ else EXPORT_TIMEOUT_S * 1000
    provider.add_span_processor(BatchSpanProcessor(exporter, export_timeout_millis=batches))
    return provider


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of ``endpoint``: a collector's base URL (``http://collector:4318``,
    as ``OTEL_EXPORTER_OTLP_ENDPOINT``) gets ``/v1/traces``; a URL ending in it is kept.

    Raises:
        ValueError: not an http(s) URL with a host (and a valid port, if any).
    """
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"the OTLP endpoint must be an http(s) URL with a host, not {endpoint!r}")
    _ = parts.port  # raises ValueError for a port out of range or not a number
    if parts.path.rstrip("/").endswith("/v1/traces"):
        return endpoint
    return endpoint.rstrip("/") + "/v1/traces"


# -- spans --------------------------------------------------------------------------------


def tool_call_span() -> AbstractContextManager[Span]:
    """The span of one `ControlPlane.call`: ``execute_tool``, then ``execute_tool {tool}`` once
    `started`. Ends on every exit; an exception marks it failed (see the module's docstring)."""
    found = tracer()
    if found is None:
        return _OFF
    attributes = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.type": "function"}
    return _span(found, "execute_tool", attributes, call=True)


def decide_span() -> AbstractContextManager[Span]:
    """The span of one `ControlPlane.decide`: ``stockade.decide {tool}`` (as `tool_call_span`)."""
    found = tracer()
    if found is None:
        return _OFF
    return _span(found, "stockade.decide", {}, call=True)


def step(name: str, attributes: Mapping[str, AttributeValue] | None = None) -> AbstractContextManager[Span]:
    """A child span for one step of the call traced in this context (none outside a traced call:
    the audit appends of a registration are not a call's). Ends on every exit; an exception marks
    it failed."""
    current = _current.get()
    if current is None:
        return _OFF
    return _span(current.tracer, name, attributes or {}, call=False)


@contextlib.contextmanager
def _span(tracer_: trace.Tracer, name: str, attributes: Mapping[str, AttributeValue], *, call: bool) -> Iterator[Span]:
    with tracer_.start_as_current_span(
        name, kind=SpanKind.INTERNAL, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as span:
        token = _current.set(_Trace(tracer_, span, name)) if call else None
        try:
            yield span
        except BaseException as exc:
            _escaped(span, exc, call=call)
            raise
        finally:
            if token is not None:
                _current.reset(token)


def _escaped(span: Span, exc: BaseException, *, call: bool) -> None:
    """Mark ``span`` failed by the exception leaving it."""
    if isinstance(exc, asyncio.CancelledError):  # the client left, a timeout or a shutdown: no fault to record
        code, cause, outcome = "call.cancelled", None, "cancelled"
    elif isinstance(reasons := getattr(exc, "reasons", None), list) and reasons:
        # The pipeline's refusal (control._Refused), a signal: its reason, and the failure behind it if any.
        code, cause, outcome = str(reasons[0]), exc.__cause__, "denied"
    elif isinstance(exc, StockadeError):  # refused to the caller: malformed, unknown tool or session, ...
        code, cause, outcome = exc.code, exc, "rejected"
    else:
        code, cause, outcome = type(exc).__qualname__, exc, "error"
    if call:
        span.set_attribute("stockade.outcome", outcome)
    failed(span, code, cause)


def failed(span: Span, code: str, exc: BaseException | None = None) -> None:
    """Mark ``span`` failed: status ERROR, ``error.type`` ``code``; ``exc`` recorded (redacted)."""
    if not span.is_recording():
        return
    span.set_attribute("error.type", code)
    # The code, low in cardinality, as the description; the message is in the exception's event.
    span.set_status(Status(StatusCode.ERROR, code))
    if exc is not None:
        message, stack = _told(exc)
        span.record_exception(exc, {
            "exception.message": redact(message)[:_MAX_TEXT], "exception.stacktrace": redact(stack)[-_MAX_TEXT:],
        })  # fmt: skip


def _told(exc: BaseException) -> tuple[str, str]:
    """What a span may say of ``exc``: its message and stack, redacted by the caller.

    A malformed call's message quotes the arguments (jsonschema shows the value it refused), and
    so may the exceptions chained to it: a span says only which fields were wrong, and shows the
    frames of the refusal alone. Any other error is told whole."""
    if isinstance(exc, InvalidCall):
        fields = sorted({problem.field[:_MAX_FIELD] for problem in exc.problems})
        message = f"invalid arguments at {', '.join(fields)}" if fields else "invalid arguments"
        frames = "".join(traceback.TracebackException.from_exception(exc).stack.format())
        return message, f"Traceback (most recent call last):\n{frames}{type(exc).__qualname__}: {message}\n"
    return str(exc), "".join(traceback.format_exception(exc))


# -- what the pipeline records on them ---------------------------------------------------------


def started(spec: ToolSpec, session: SessionRecord, call_id: str) -> None:
    """The call traced in this context is valid: name its span after the tool, and say whose it is."""
    current = _current.get()
    if current is None:
        return
    current.span.update_name(f"{current.operation} {spec.name}")
    current.span.set_attributes({
        "gen_ai.tool.name": spec.name, "gen_ai.tool.description": spec.description, "gen_ai.tool.call.id": call_id,
        "stockade.session_id": session.id, "stockade.agent": session.agent,
    })  # fmt: skip


def decided(span: Span, decision: Decision, tier: str | None, decision_id: str) -> None:
    """Policy decided (``span``: its step); the call's span keeps the decision's id, revision and tier."""
    if not span.is_recording():
        return
    codes = decision.reason_codes
    span.set_attributes({
        "stockade.outcome": decision.outcome.value, "stockade.reasons": codes,
        "stockade.policy_revision": decision.policy_revision,
    })  # fmt: skip
    facts: dict[str, AttributeValue] = {
        "stockade.decision_id": decision_id, "stockade.policy_revision": decision.policy_revision,
    }  # fmt: skip
    if tier is not None:
        span.set_attribute("stockade.tier", tier)
        facts["stockade.tier"] = tier
    failure = next((code for code in codes if code in FAILURES), None)
    if failure is not None:
        failed(span, failure)
    current = _current.get()
    if current is not None:
        current.span.set_attributes(facts)


def rejected(decision_id: str) -> None:
    """The call traced in this context was rejected before policy decided it (malformed, an
    unusable approval): its span keeps the ``decision_id`` its audit record is under, as a decided
    call's does."""
    current = _current.get()
    if current is not None and current.span.is_recording():
        current.span.set_attribute("stockade.decision_id", decision_id)


def approval(span: Span, approval_id: str | None, status: str, action: str) -> None:
    """An approval step: which approval, its status after it, and what was done (``requested``,
    ``asked_again``, ``redeemed``)."""
    if not span.is_recording() or approval_id is None:
        return
    span.set_attributes({
        "stockade.approval.id": approval_id, "stockade.approval.status": status, "stockade.approval.action": action,
    })  # fmt: skip
    current = _current.get()
    if current is not None:
        current.span.set_attribute("stockade.approval_id", approval_id)


def minting(span: Span, grants: Sequence[CredentialGrant]) -> None:
    """The credentials the mint step issues, by name (never a value)."""
    if span.is_recording():
        span.set_attribute("stockade.credentials.names", [grant.name for grant in grants])


def minted(span: Span, leases: Sequence[Lease]) -> None:
    """The leases the mint step issued, by id (never a value)."""
    if span.is_recording():
        span.set_attribute("stockade.credentials.lease_ids", [lease.id for lease in leases])


def ran(span: Span, run: RunResult) -> None:
    """How the sandbox run ended; a verdict other than ``ok`` is the step's error."""
    if not span.is_recording():
        return
    span.set_attributes({
        "stockade.tier": run.tier, "stockade.sandbox.verdict": run.verdict.value,
        "stockade.sandbox.wall_ms": run.usage.wall_s * 1000, "stockade.sandbox.cpu_ms": run.usage.cpu_s * 1000,
        "stockade.sandbox.max_rss_kb": run.usage.max_rss_kb,
    })  # fmt: skip
    if run.exit_code is not None:
        span.set_attribute("stockade.sandbox.exit_code", run.exit_code)
    if run.verdict.value != "ok":
        failed(span, run.verdict.value)


def ended(span: Span, outcome: str, reasons: Sequence[str], verdict: str | None = None) -> None:
    """How the call (or decision) ``span`` traces ended: ``outcome`` (the result's status, or the
    decision), its reasons, the tool's verdict. Failed if a reason is a failure, the outcome is
    ``error``, or the tool's run did not end ok."""
    if not span.is_recording():
        return
    span.set_attribute("stockade.outcome", outcome)
    if reasons:
        span.set_attribute("stockade.reasons", list(reasons))
    if verdict is not None:
        span.set_attribute("stockade.verdict", verdict)
    failure = next((code for code in reasons if code in FAILURES), None)
    if failure is None and (outcome == "error" or verdict not in (None, "ok")):
        failure = reasons[0] if reasons else verdict or "router.error"
    if failure is not None:
        failed(span, failure)
