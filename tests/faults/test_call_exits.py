"""Every exit of an allowed call is on record: a call cancelled mid-run (a client gone, a request
timeout, a task cancelled) ends its trail with an execution event saying so; a router killed
mid-call leaves an intact chain and no sandbox behind, and a restarted router goes on."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from router import ControlPlane, Settings
from router.audit import AuditFilter, JsonlAuditLog
from router.settings import AuditSettings
from tests.conftest import REPO, free_port, python_tool

SLEEPER = "import time\ndef main(seconds=30):\n    time.sleep(seconds)\n    return 'woke'\n"
SLOW = python_tool("sleeper", SLEEPER, sandbox={"limits": {"timeout_s": 60}})


async def _until_running(plane: ControlPlane, decision_id: str | None = None) -> str:
    """The decision_id of the sleeper's allowed call, once its decision is on record (it is then in
    the sandbox a few milliseconds later)."""
    for _ in range(200):
        found = await plane.audit.query(AuditFilter(kind="decision", tool="sleeper", outcome="allow"))
        if found:
            await asyncio.sleep(0.5)
            return found[-1].decision_id
        await asyncio.sleep(0.02)
    raise AssertionError("the call was never allowed")


@pytest.mark.parametrize("how", ["task cancelled", "request timeout"])
async def test_a_call_cut_short_mid_run_ends_its_trail_as_cancelled(tmp_path: Path, how: str) -> None:
    async with ControlPlane.from_settings(Settings(audit=AuditSettings(path=tmp_path / "a.jsonl"))) as plane:
        await plane.register(SLOW)
        session = await plane.open_session("agent-1", "alice@example.com")
        started = time.monotonic()
        if how == "task cancelled":
            task = asyncio.create_task(plane.call(session, "sleeper", {}))
            decision_id = await _until_running(plane)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(plane.call(session, "sleeper", {}), timeout=1.5)
            [decision] = await plane.audit.query(AuditFilter(kind="decision", tool="sleeper"))
            decision_id = decision.decision_id
        assert time.monotonic() - started < 10  # the sandbox was stopped, not waited for
        trail = await plane.audit.query(AuditFilter(decision_id=decision_id))
        assert [(e.kind, e.outcome) for e in trail] == [("decision", "allow"), ("execution", "cancelled")]
        result = trail[-1].result or {}
        assert (result["code"], result["stage"], result["tier"]) == ("call.cancelled", "running", "bwrap")
        # The session is not wedged by it.
        assert (await plane.call(session, "sleeper", {"seconds": 0})).output == "woke"


async def test_a_call_cancelled_at_any_turn_never_leaves_an_allow_without_an_exit(tmp_path: Path) -> None:
    """Cancelled after 0, 1, 2 … turns of the loop until calls complete on their own: whatever
    turn a cancellation lands on, an allow on record is followed by the call's execution event.
    (One landed while the allow was being written, waiting for its fsync: the call was not yet
    marked as going ahead, so the decision stayed on record with nothing after it.)"""
    echo = python_tool("echo", "def main(**kw):\n    return kw\n")
    async with ControlPlane.from_settings(Settings(audit=AuditSettings(path=tmp_path / "a.jsonl"))) as plane:
        await plane.register(echo)
        session = await plane.open_session("agent-1", "alice@example.com")
        completed = 0
        turns = 0
        while completed < 3:  # a few calls that outran their cancellation: every turn before was tried
            task = asyncio.create_task(plane.call(session, "echo", {"turns": turns}))
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            try:
                await task
                completed += 1
            except asyncio.CancelledError:
                pass
            turns += 1
        await asyncio.sleep(0.2)  # shielded records of the last cancellations
        trails: dict[str, list[str]] = {}
        for event in await plane.audit.query(AuditFilter(tool="echo")):
            trails.setdefault(event.decision_id, []).append(f"{event.kind}:{event.outcome}")
    unclosed = [t for t in trails.values() if "decision:allow" in t and not any(k.startswith("execution:") for k in t)]
    assert turns > 10
    assert unclosed == []


def _server(tmp_path: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    token = "tok-agent"
    principals = [{"name": "agent-1", "role": "agent", "may_register": True,
                   "token_sha256": hashlib.sha256(token.encode()).hexdigest()}]  # fmt: skip
    env = {**os.environ, "STOCKADE_AUDIT__PATH": str(tmp_path / "audit.jsonl"), "STOCKADE_LOG_LEVEL": "error",
           "STOCKADE_API_PRINCIPALS": json.dumps(principals)}  # fmt: skip
    with log.open("ab") as stderr:
        process = subprocess.Popen([str(Path(sys.executable).parent / "stockade"), "serve", "--port", str(port)],
                                   env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr)  # fmt: skip
    for _ in range(200):
        try:
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
            return process
        except httpx.HTTPError:
            time.sleep(0.05)
    process.kill()
    raise AssertionError(log.read_text()[-2000:])


def _children(pid: int) -> list[str]:
    return subprocess.run(["pgrep", "-P", str(pid)], check=False, capture_output=True, text=True).stdout.split()


async def test_a_router_killed_mid_call_leaves_an_intact_chain_and_no_sandbox(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "router.log"
    headers: dict[str, Any] = {"Authorization": "Bearer tok-agent"}
    router = _server(tmp_path, port, log)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=30) as client:
            assert (await client.post("/v1/tools", json=SLOW)).status_code == 201
            session = (await client.post("/v1/sessions", json={"principal": "alice@example.com"})).json()
            call = asyncio.create_task(client.post(f"/v1/sessions/{session['session_id']}/calls",
                                                   json={"tool": "sleeper", "args": {}}))  # fmt: skip
            audit = JsonlAuditLog(tmp_path / "audit.jsonl")
            for _ in range(200):
                if await audit.query(AuditFilter(kind="decision", tool="sleeper")):
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.5)  # in the sandbox now
            children = await asyncio.to_thread(_children, router.pid)
            assert children, "no sandbox was running"
            router.send_signal(signal.SIGKILL)
            router.wait(10)
            with pytest.raises(httpx.HTTPError):
                await call
    finally:
        router.kill()
        router.wait(10)
    for _ in range(50):  # --die-with-parent: the sandbox goes with the router
        if not any(os.path.exists(f"/proc/{pid}") for pid in children):
            break
        await asyncio.sleep(0.1)
    assert [pid for pid in children if os.path.exists(f"/proc/{pid}")] == []
    report = await audit.verify()
    assert report.ok, report.problem
    trail = [e.outcome for e in await audit.query(AuditFilter(tool="sleeper")) if e.kind != "policy"]
    assert trail == ["allow"]  # (besides its registration)

    # A new router on the same log goes on with the same chain.
    router = _server(tmp_path, port, log)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=30) as client:
            assert (await client.post("/v1/tools", json=SLOW)).status_code == 201
            session = (await client.post("/v1/sessions", json={"principal": "alice@example.com"})).json()
            done = await client.post(f"/v1/sessions/{session['session_id']}/calls",
                                     json={"tool": "sleeper", "args": {"seconds": 0}})  # fmt: skip
            assert done.json()["output"] == "woke"
    finally:
        router.terminate()
        router.wait(10)
    report = await audit.verify()
    assert (report.ok, report.events > 2) == (True, True)
    await audit.aclose()
