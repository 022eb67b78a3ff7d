"""Spans of rejected calls join their audit records, and a collector that never answers does not
hold a router's exit: through the real pipeline, into a real SDK provider, and over OTLP/HTTP to a
loopback socket that takes connections and never answers."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from router import ApprovalError, ControlPlane, InvalidCall, StockadeError
from router.settings import AuditSettings, Settings
from tests.conftest import REPO
from tests.router.test_telemetry import exporter

__all__ = ["exporter"]  # the fixture, shared


PAY = {"name": "pay", "description": "p", "risk": "high", "capabilities": ["sends_external"],
       "input_schema": {"type": "object", "properties": {"n": {"type": "integer"}}},
       "executor": {"kind": "external"}}  # fmt: skip


async def test_the_span_of_a_rejected_call_carries_the_decision_id_of_its_audit_record(
    tmp_path: Path, exporter: InMemorySpanExporter
) -> None:
    """A call refused before policy decided it (malformed arguments, an approval for another call,
    an unknown approval) is on record under a decision id: its span carries that id, and the record
    the call's id once the call had one, so a trace and the audit trail join."""
    settings = Settings(audit=AuditSettings(path=tmp_path / "audit.jsonl", signing_key=tmp_path / "k" / "audit.key"))
    seen: list[tuple[type[StockadeError], dict[str, Any], dict[str, Any]]] = []
    async with ControlPlane.from_settings(settings) as plane:
        await plane.register(PAY)
        session = await plane.open_session("bot", "alice@example.com", trusted_context=["pay 1"])
        held = await plane.call(session, "pay", {"n": 1})
        assert held.status == "pending_approval"
        tries: list[tuple[type[StockadeError], dict[str, Any], str | None]] = [
            (InvalidCall, {"n": "x"}, None),
            (ApprovalError, {"n": 2}, held.approval_id),  # granted for another call
            (ApprovalError, {"n": 1}, "a-00000000000000000000"),  # no such approval
        ]
        for error, args, approval_id in tries:
            exporter.clear()
            with pytest.raises(error):
                await plane.call(session, "pay", args, approval_id=approval_id)
            [span] = [s for s in exporter.get_finished_spans() if s.name.startswith("execute_tool")]
            record = json.loads((tmp_path / "audit.jsonl").read_text().splitlines()[-1])
            seen.append((error, dict(span.attributes or {}), record))

    for error, attributes, record in seen:
        assert (record["kind"], record["outcome"]) == ("error", "invalid")
        assert attributes["stockade.outcome"] == "rejected"
        assert attributes["stockade.decision_id"] == record["decision_id"], error
        # Malformed: refused before the call was made, so it has no id; else the call's own.
        assert record.get("call_id") == attributes.get("gen_ai.tool.call.id"), error
    assert [record.get("call_id") is None for _, _, record in seen] == [True, False, False]


BLACK_HOLE_ROUTER = """
import asyncio, sys
from router import ControlPlane, Settings
from router.settings import AuditSettings, TelemetrySettings

async def main(root, port):
    audit = AuditSettings(path=root + "/audit.jsonl", signing_key=root + "/k/audit.key")
    settings = Settings(audit=audit, telemetry=TelemetrySettings(otlp_endpoint=f"http://127.0.0.1:{port}"))
    async with ControlPlane.from_settings(settings) as plane:
        await plane.register({"name": "ext", "description": "e", "risk": "low", "capabilities": [],
                              "input_schema": {"type": "object"}, "executor": {"kind": "external"}})
        session = await plane.open_session("bot", "alice@example.com")
        for i in range(300):
            await plane.call(session, "ext", {"i": i})
    print("closed", flush=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def test_a_collector_that_never_answers_does_not_hold_the_router_s_exit(tmp_path: Path) -> None:
    """The SDK's defaults wait 10 s an export and 30 s for its exporting thread at exit: a router
    whose collector takes connections and never answers took 20 s or more to stop. It stops within
    the shutdown deadline (and each export's timeout), its spans given up."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(1000)  # connections are taken (by the kernel), never answered
    try:
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", BLACK_HOLE_ROUTER, str(tmp_path), str(hole.getsockname()[1])],
            cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        took = time.monotonic() - started
    finally:
        hole.close()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "closed"
    assert took < 12, took  # the shutdown's deadline (3 s), a start, 300 calls, and room for a slow host
    assert "tracing_shutdown_timed_out" in done.stderr
