"""Spans of tool calls (router.telemetry): through the real pipeline (regorus, bubblewrap, the audit
log), into a real SDK provider with the SDK's in-memory exporter; and exported over OTLP/HTTP to a
collector stand-in on loopback."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import structlog
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from policy import PolicySettings
from router import VERSION, ControlPlane, InvalidCall, Settings, ToolNotFound, telemetry
from router.audit import AuditFilter
from router.credentials import CredentialConfig
from router.redact import REDACTOR
from router.settings import AuditSettings, TelemetrySettings
from tests.conftest import ECHO, REPO, copy_policies, edit_catalog, python_tool

CANARY = "sk-telemetry-canary-" + secrets.token_hex(8)  # a credential's value: never in a span


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """The router's spans as the SDK finished them, from a provider of the router's own (the global
    one can be set only once per process)."""
    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    telemetry.use_tracer_provider(provider)
    yield exported
    telemetry.use_tracer_provider(None)
    provider.shutdown()


def calls(exporter: InMemorySpanExporter, operation: str = "execute_tool") -> list[ReadableSpan]:
    """The spans of calls (``execute_tool``) or of decisions (``stockade.decide``)."""
    return [s for s in exporter.get_finished_spans() if s.name.split(" ")[0] == operation]


def children(exporter: InMemorySpanExporter, parent: ReadableSpan) -> list[ReadableSpan]:
    assert parent.context is not None
    parent_id = parent.context.span_id
    return [s for s in exporter.get_finished_spans() if s.parent is not None and s.parent.span_id == parent_id]


def names(spans: Sequence[ReadableSpan]) -> list[str]:
    return [s.name for s in spans]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in (span.attributes or {}).items()}


def failure(span: ReadableSpan) -> tuple[StatusCode, str | None]:
    return span.status.status_code, attrs(span).get("error.type")


def trace_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.trace_id


async def session_events(plane: ControlPlane, session: str) -> list[dict[str, Any]]:
    return [e.model_dump(mode="json") for e in await plane.audit.query(AuditFilter(session_id=session))]


async def test_an_allowed_call_is_one_execute_tool_span_with_the_audit_trails_decision_id(
    plane: ControlPlane, exporter: InMemorySpanExporter
) -> None:
    await plane.register(python_tool("echo", ECHO))
    session = await plane.open_session("agent-1", "alice@example.com")
    assert exporter.get_finished_spans() == ()  # registering and opening a session are not calls
    result = await plane.call(session, "echo", {"msg": "hi"})
    assert result.ok

    [call] = calls(exporter)
    assert (call.name, call.kind, call.parent) == ("execute_tool echo", SpanKind.INTERNAL, None)
    assert failure(call) == (StatusCode.UNSET, None)
    facts = attrs(call)
    assert {k: v for k, v in facts.items() if k.startswith("gen_ai.")} == {
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "echo", "gen_ai.tool.type": "function",
        "gen_ai.tool.description": "test tool echo", "gen_ai.tool.call.id": result.call_id,
    }  # fmt: skip
    assert facts["stockade.decision_id"] == result.decision_id
    assert (facts["stockade.session_id"], facts["stockade.agent"]) == (session, "agent-1")
    assert (facts["stockade.outcome"], facts["stockade.verdict"]) == ("completed", "ok")
    assert facts["stockade.tier"] == "bwrap"
    assert facts["stockade.policy_revision"] == plane.policy.revision

    trail = await session_events(plane, session)  # the log, read back: the span finds the call's trail
    assert [e["kind"] for e in trail] == ["decision", "execution"]
    assert {e["decision_id"] for e in trail} == {facts["stockade.decision_id"]}

    steps = children(exporter, call)
    assert names(steps) == [
        "stockade.policy.decide", "stockade.audit.append", "stockade.sandbox.run", "stockade.audit.append"]  # fmt: skip
    policy, _, run, _ = steps
    assert (attrs(policy)["stockade.outcome"], attrs(policy)["stockade.reasons"]) == ("allow", [])
    assert [attrs(s)["stockade.audit.kind"] for s in steps if s.name == "stockade.audit.append"] == [
        "decision", "execution"]  # fmt: skip
    ran = attrs(run)
    assert (ran["stockade.tier"], ran["stockade.sandbox.verdict"]) == ("bwrap", "ok")
    assert ran["stockade.sandbox.exit_code"] == 0
    assert ran["stockade.sandbox.wall_ms"] > 0
    assert {trace_id(s) for s in steps} == {trace_id(call)}


async def test_a_denied_call_has_its_decision_and_no_sandbox_run(
    plane: ControlPlane, exporter: InMemorySpanExporter
) -> None:
    await plane.register(python_tool("read_page", ECHO, capabilities=["reads_untrusted"]))
    await plane.register(python_tool(
        "send", ECHO, capabilities=["sends_external"], destination_args=["to"],
        input_schema={"type": "object", "properties": {"to": {"type": "string"}}},
    ))  # fmt: skip
    session = await plane.open_session("agent-1", "alice@example.com")
    assert (await plane.call(session, "read_page", {"mail": "evil@attacker.example"})).ok
    exporter.clear()
    result = await plane.call(session, "send", {"to": "evil@attacker.example"})
    assert (result.status, result.reasons) == ("denied", ["provenance.untrusted_destination"])

    [call] = calls(exporter)
    assert call.name == "execute_tool send"
    assert failure(call) == (StatusCode.UNSET, None)  # a deny by policy is an outcome, not an error
    facts = attrs(call)
    assert (facts["stockade.outcome"], facts["stockade.reasons"]) == ("denied", ["provenance.untrusted_destination"])
    assert facts["stockade.decision_id"] == result.decision_id
    assert "stockade.tier" not in facts
    steps = children(exporter, call)
    assert names(steps) == ["stockade.policy.decide", "stockade.audit.append"]
    decided = attrs(steps[0])
    assert (decided["stockade.outcome"], decided["stockade.reasons"]) == ("deny", ["provenance.untrusted_destination"])
    assert failure(steps[0]) == (StatusCode.UNSET, None)
    [decision] = [e for e in await session_events(plane, session) if e["decision_id"] == result.decision_id]
    assert decision["outcome"] == "deny"


async def test_a_held_call_then_approved_and_redeemed_shows_its_approval_steps(
    plane: ControlPlane, exporter: InMemorySpanExporter
) -> None:
    await plane.register(python_tool("drop_table", ECHO, risk="critical", capabilities=["mutates_state"]))
    session = await plane.open_session("db-agent", "alice@example.com")
    held = await plane.call(session, "drop_table", {"table": "users"})
    assert held.status == "pending_approval"
    assert held.approval_id is not None

    [first] = calls(exporter)
    assert failure(first) == (StatusCode.UNSET, None)
    assert (attrs(first)["stockade.outcome"], attrs(first)["stockade.approval_id"]) == (
        "pending_approval", held.approval_id)  # fmt: skip
    assert "stockade.sandbox.run" not in names(children(exporter, first))
    [asked] = [s for s in children(exporter, first) if s.name == "stockade.approval"]
    assert {k: v for k, v in attrs(asked).items() if k.startswith("stockade.approval.")} == {
        "stockade.approval.id": held.approval_id, "stockade.approval.status": "pending",
        "stockade.approval.action": "requested",
    }  # fmt: skip
    assert names(children(exporter, asked)) == ["stockade.audit.append"]  # the request, put on record

    await plane.approve(held.approval_id, "oncall@example.com")
    exporter.clear()
    result = await plane.call(session, "drop_table", {"table": "users"}, approval_id=held.approval_id)
    assert result.ok
    [second] = calls(exporter)
    assert attrs(second)["stockade.decision_id"] == held.decision_id == result.decision_id  # one trail
    assert attrs(second)["stockade.outcome"] == "completed"
    steps = [s for s in children(exporter, second) if s.name != "stockade.audit.append"]
    assert names(steps) == ["stockade.policy.decide", "stockade.approval", "stockade.sandbox.run"]
    redeemed = attrs(steps[1])
    assert (redeemed["stockade.approval.id"], redeemed["stockade.approval.status"]) == (held.approval_id, "used")
    assert redeemed["stockade.approval.action"] == "redeemed"


@pytest.fixture
async def credentialed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ControlPlane]:
    """A router that issues one secret credential, ``api-key`` (its value: CANARY)."""
    policies = copy_policies(tmp_path)
    edit_catalog(policies, egress_allowlist=["api.allowed.test"], credentials={"api-key": {"ttl_s": 60}})
    monkeypatch.setenv("TEST_TELEMETRY_KEY", CANARY)
    config = CredentialConfig(name="api-key", kind="secret", hosts=["api.allowed.test"], value_env="TEST_TELEMETRY_KEY")
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl"), policy=PolicySettings(dir=policies), credentials=[config]
    )
    async with ControlPlane.from_settings(settings) as control_plane:
        yield control_plane


async def test_a_credential_is_minted_in_its_own_step_and_its_value_is_in_no_span(
    credentialed: ControlPlane, exporter: InMemorySpanExporter
) -> None:
    plane = credentialed
    source = "import os\ndef main():\n    return os.environ['STOCKADE_CREDENTIAL_API_KEY']\n"
    await plane.register(python_tool("keyed", source, credentials=[{"name": "api-key"}]))
    session = await plane.open_session("agent-1", "alice@example.com")
    result = await plane.call(session, "keyed", {})
    assert result.ok, result.stderr
    assert str(result.output).startswith("stockade-placeholder-")  # the sandbox sees a placeholder

    [call] = calls(exporter)
    [mint] = [s for s in children(exporter, call) if s.name == "stockade.credentials.mint"]
    trail = await session_events(plane, session)
    minted = [e["result"]["lease_id"] for e in trail if (e["kind"], e["outcome"]) == ("credential", "minted")]
    assert len(minted) == 1
    assert (attrs(mint)["stockade.credentials.names"], attrs(mint)["stockade.credentials.lease_ids"]) == (
        ["api-key"], minted)  # fmt: skip
    assert names(children(exporter, mint)) == ["stockade.audit.append"]  # the lease, put on record

    values = [
        str(value)
        for span in exporter.get_finished_spans()
        for value in [
            span.name, span.status.description, *(span.attributes or {}).values(),
            *(v for event in span.events for v in (event.attributes or {}).values()),
            *span.resource.attributes.values(),
        ]
    ]  # fmt: skip
    assert len(values) > 50  # the scan saw the spans
    assert sum(CANARY in value for value in values) == 0


async def test_a_policy_engine_failure_marks_the_call_and_its_decision_failed(
    tmp_path: Path, settings: Settings, exporter: InMemorySpanExporter
) -> None:
    root = tmp_path / "policies" / "stockade"
    root.mkdir(parents=True)
    (root / "decision.rego").write_text(
        "package stockade\n"
        'decision := {"outcome": "allow", "obligations": {"limits": {"timeout_s": 10 / count(input.args)}}}\n'
    )
    broken = settings.model_copy(update={"policy": PolicySettings(dir=root.parent)})
    async with ControlPlane.from_settings(broken) as plane:
        await plane.register(python_tool("echo", ECHO))
        session = await plane.open_session("agent-1", "alice@example.com")
        result = await plane.call(session, "echo", {})  # evaluating it divides by zero
    assert (result.status, result.reasons) == ("denied", ["policy.error"])

    [call] = calls(exporter)
    assert failure(call) == (StatusCode.ERROR, "policy.error")
    assert call.status.description == "policy.error"
    assert attrs(call)["stockade.outcome"] == "denied"
    steps = children(exporter, call)
    assert "stockade.sandbox.run" not in names(steps)
    [policy] = [s for s in steps if s.name == "stockade.policy.decide"]
    assert failure(policy) == (StatusCode.ERROR, "policy.error")


async def test_a_sandbox_that_fails_to_start_is_an_error_with_its_cause_recorded(
    tmp_path: Path, settings: Settings, exporter: InMemorySpanExporter
) -> None:
    fake = tmp_path / "bwrap"
    fake.write_text("#!/nonexistent/interpreter\n")
    fake.chmod(0o755)
    broken = settings.model_copy(update={"runner": settings.runner.model_copy(update={"bwrap": str(fake)})})
    async with ControlPlane.from_settings(broken) as plane:
        await plane.register(python_tool("echo", ECHO))
        session = await plane.open_session("agent-1", "alice@example.com")
        result = await plane.call(session, "echo", {})
    assert (result.status, result.reasons) == ("error", ["sandbox.error"])

    [call] = calls(exporter)
    assert failure(call) == (StatusCode.ERROR, "sandbox.error")
    assert attrs(call)["stockade.outcome"] == "error"
    [run] = [s for s in children(exporter, call) if s.name == "stockade.sandbox.run"]
    assert failure(run) == (StatusCode.ERROR, "sandbox.error")
    [exception] = run.events
    assert exception.name == "exception"
    assert "could not start bwrap" in str((exception.attributes or {})["exception.message"])


async def test_a_cancelled_call_still_ends_its_spans(plane: ControlPlane, exporter: InMemorySpanExporter) -> None:
    await plane.register(python_tool("slow", "import time\ndef main():\n    time.sleep(20)\n"))
    session = await plane.open_session("agent-1", "alice@example.com")
    task = asyncio.create_task(plane.call(session, "slow", {}))
    for _ in range(250):  # until it is decided, and so on its way into the sandbox
        if any(e["kind"] == "decision" for e in await session_events(plane, session)):
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    [call] = calls(exporter)  # finished: ended
    assert failure(call) == (StatusCode.ERROR, "call.cancelled")
    assert attrs(call)["stockade.outcome"] == "cancelled"
    [run] = [s for s in children(exporter, call) if s.name == "stockade.sandbox.run"]
    assert failure(run) == (StatusCode.ERROR, "call.cancelled")
    assert run.events == ()  # a cancellation is no fault to record


async def test_decide_has_its_own_span(plane: ControlPlane, exporter: InMemorySpanExporter) -> None:
    await plane.register(python_tool("echo", ECHO))
    session = await plane.open_session("agent-1", "alice@example.com")
    decision = await plane.decide(session, "echo", {"a": 1})
    assert calls(exporter) == []
    [span] = calls(exporter, "stockade.decide")
    assert span.name == "stockade.decide echo"
    assert (attrs(span)["stockade.decision_id"], attrs(span)["stockade.outcome"]) == (decision.decision_id, "allow")
    assert names(children(exporter, span)) == ["stockade.policy.decide", "stockade.audit.append"]


async def test_a_rejected_call_fails_its_span_under_no_name_the_caller_made_up(
    plane: ControlPlane, exporter: InMemorySpanExporter
) -> None:
    session = await plane.open_session("agent-1", "alice@example.com")
    with pytest.raises(ToolNotFound):
        await plane.call(session, "no_such_tool", {})
    [call] = calls(exporter)
    assert call.name == "execute_tool"
    assert "gen_ai.tool.name" not in attrs(call)
    assert failure(call) == (StatusCode.ERROR, "tool.not_found")
    assert attrs(call)["stockade.outcome"] == "rejected"
    assert [event.name for event in call.events] == ["exception"]
    assert names(children(exporter, call)) == ["stockade.audit.append"]  # the rejection, put on record


async def test_a_malformed_calls_span_names_the_bad_fields_never_the_values(
    plane: ControlPlane, exporter: InMemorySpanExporter
) -> None:
    # jsonschema's message quotes the value it refused: a card number must not reach the collector.
    await plane.register({
        "name": "pay", "description": "Pay.", "risk": "low", "executor": {"kind": "external"},
        "input_schema": {"type": "object", "required": ["card"],
                         "properties": {"card": {"type": "string", "pattern": "^[0-9]{4}$"}}},
    })  # fmt: skip
    session = await plane.open_session("agent-1", "alice@example.com")
    card = "4111-1111-1111-1111 cvv 123"
    with pytest.raises(InvalidCall):
        await plane.call(session, "pay", {"card": card})
    [call] = calls(exporter)
    assert failure(call) == (StatusCode.ERROR, "call.invalid")
    [event] = call.events
    told = event.attributes or {}
    assert told["exception.message"] == "invalid arguments at args.card"
    assert str(told["exception.stacktrace"]).endswith("InvalidCall: invalid arguments at args.card\n")
    spans = exporter.get_finished_spans()
    everything = json.dumps([[dict(s.attributes or {}), [dict(e.attributes or {}) for e in s.events]] for s in spans])
    assert "4111" not in everything


def test_exception_messages_in_spans_are_redacted() -> None:
    secret = "sk-live-" + secrets.token_hex(12)
    REDACTOR.add(secret, "test-key", until=time.time() + 60)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("test").start_as_current_span("failing") as span:
        try:
            raise ValueError(f"upstream echoed {secret}")
        except ValueError as exc:
            telemetry.failed(span, "upstream.error", exc)
    [failing] = exporter.get_finished_spans()
    [event] = failing.events
    recorded = dict(event.attributes or {})
    assert secret not in json.dumps(recorded)
    assert "[REDACTED:test-key]" in str(recorded["exception.message"])
    assert "[REDACTED:test-key]" in str(recorded["exception.stacktrace"])
    assert (failing.status.status_code, failing.status.description) == (StatusCode.ERROR, "upstream.error")


# -- export ---------------------------------------------------------------------------------


@dataclass
class Collector:
    """An OTLP/HTTP collector stand-in on loopback: keeps each request it gets."""

    url: str = ""
    requests: list[tuple[str, str, bytes]] = field(default_factory=list)  # path, content type, body


@pytest.fixture
def collector() -> Iterator[Collector]:
    state = Collector()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            state.requests.append((self.path, self.headers.get("Content-Type", ""), body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")  # an empty ExportTraceServiceResponse: all accepted
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()
    server.server_close()


@pytest.fixture
def tracing_reset() -> Iterator[None]:
    """configure_tracing sets up one provider per process: ended around each test here."""
    telemetry.shutdown_tracing()
    yield
    telemetry.shutdown_tracing()


@pytest.mark.usefixtures("tracing_reset")
async def test_a_configured_endpoint_gets_the_spans_over_otlp_http(collector: Collector, settings: Settings) -> None:
    configured = settings.model_copy(update={
        "telemetry": TelemetrySettings(otlp_endpoint=collector.url), "instance": "router-7"})  # fmt: skip
    async with ControlPlane.from_settings(configured) as plane:  # sets the exporter up
        await plane.register(python_tool("echo", ECHO))
        session = await plane.open_session("agent-1", "alice@example.com")
        result = await plane.call(session, "echo", {})
    provider = telemetry.configure_tracing(configured)  # idempotent: the provider from_settings set up
    assert provider is not None
    assert provider.force_flush(10_000)

    assert {(path, kind) for path, kind, _ in collector.requests} == {("/v1/traces", "application/x-protobuf")}
    batches = []
    for _, _, body in collector.requests:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        batches += request.resource_spans
    spans = [span for batch in batches for scope in batch.scope_spans for span in scope.spans]
    [call] = [span for span in spans if span.name == "execute_tool echo"]
    assert {a.key: a.value.string_value for a in call.attributes}["stockade.decision_id"] == result.decision_id
    assert {span.name for span in spans} >= {"stockade.policy.decide", "stockade.sandbox.run", "stockade.audit.append"}
    resource = {a.key: a.value.string_value for a in batches[0].resource.attributes}
    assert (resource["service.name"], resource["service.instance.id"]) == ("stockade", "router-7")
    assert resource["service.version"] == VERSION


@pytest.mark.usefixtures("tracing_reset")
def test_configuring_is_idempotent_and_a_bad_endpoint_only_warns(collector: Collector, settings: Settings) -> None:
    def endpoint(url: str) -> Settings:
        return settings.model_copy(update={"telemetry": TelemetrySettings(otlp_endpoint=url)})

    assert telemetry.configure_tracing(settings) is None  # not asked to
    for bad in ("collector:4318", "ftp://127.0.0.1/v1/traces", "http://127.0.0.1:99999"):
        with structlog.testing.capture_logs() as logs:
            assert telemetry.configure_tracing(endpoint(bad)) is None
        assert [(e["event"], e["log_level"]) for e in logs] == [("tracing_not_configured", "warning")], bad
        assert telemetry.tracer() is None  # nothing set up: no span is made
    first = telemetry.configure_tracing(endpoint(collector.url + "/v1/traces"))
    assert first is not None
    assert telemetry.configure_tracing(endpoint(collector.url + "/v1/traces")) is first
    with structlog.testing.capture_logs() as logs:
        assert telemetry.configure_tracing(endpoint("http://127.0.0.1:9")) is first
    assert [e["event"] for e in logs] == ["tracing_already_configured"]
    assert telemetry.traces_url("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert telemetry.traces_url("http://127.0.0.1:4318/v1/traces") == "http://127.0.0.1:4318/v1/traces"


SDK_PROBE = """
import asyncio, sys
from router import ControlPlane, Settings, telemetry
from router.settings import AuditSettings

async def main():
    async with ControlPlane.from_settings(Settings(audit=AuditSettings(path=sys.argv[1]))) as plane:
        await plane.register({"name": "ext", "description": "e", "input_schema": {"type": "object"},
                              "risk": "low", "executor": {"kind": "external"}})
        session = await plane.open_session("agent-1", "alice@example.com")
        await plane.decide(session, "ext", {})
        await plane.call(session, "ext", {})
    assert telemetry.tracer() is None
    # The SDK's tracing and the exporter (redis-py loads the SDK's metrics itself, when installed).
    print(sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk.trace", "opentelemetry.exporter"))))

asyncio.run(main())
"""


def test_without_an_endpoint_the_sdk_is_never_imported(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STOCKADE_"))}
    done = subprocess.run([sys.executable, "-c", SDK_PROBE, str(tmp_path / "a.jsonl")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
