"""`stockade approvals` against routers with the embedded store, over their local sockets: who
decided is on record, one hung router stops no other, and no other user can keep a router from
listening (router.interfaces.local, through the real CLI)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from router import ControlPlane, Settings
from router.audit import AuditEvent, AuditFilter
from router.audit.layout import LogLayout
from router.errors import AuditError
from router.interfaces import local
from router.interfaces.local import approval_socket
from router.settings import AuditSettings
from tests.conftest import ECHO, REPO, free_port, python_tool
from tests.router.test_cli import STOCKADE, run
from tests.router.test_local import squat_tmp
from tests.router.test_mcp import write_tools

DROP = python_tool("drop_table", ECHO, risk="critical", capabilities=["mutates_state"])

# Another router process on the same audit log, holding one call: it prints its approval id and
# socket, then serves until it is killed.
ROUTER = """
import asyncio, sys
from router import ControlPlane, Settings
from router.interfaces.local import approval_socket
from router.settings import AuditSettings
from tests.conftest import ECHO, python_tool

async def main():
    settings = Settings(audit=AuditSettings(path=sys.argv[1]))
    async with ControlPlane.from_settings(settings) as plane, approval_socket(plane) as path:
        await plane.register(python_tool("drop_table", ECHO, risk="critical", capabilities=["mutates_state"]))
        session = await plane.open_session("db-agent", "bob@example.com")
        held = await plane.call(session, "drop_table", {"table": "orders"})
        print(held.approval_id, path, flush=True)
        await asyncio.sleep(600)

asyncio.run(main())
"""


async def held(plane: ControlPlane, agent: str = "db-agent") -> str:
    await plane.register(DROP)
    session = await plane.open_session(agent, "alice@example.com")
    result = await plane.call(session, "drop_table", {"table": "users"})
    assert result.approval_id is not None
    return result.approval_id


@pytest.fixture
def suspended(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    """A second router on the audit log of ``tmp_path``, stopped (SIGSTOP, as Ctrl-Z stops it)
    once it holds a call: its socket is there and takes connections, and nothing answers."""
    env = {**os.environ, "STOCKADE_LOG_LEVEL": "error"}
    router = subprocess.Popen(
        [sys.executable, "-c", ROUTER, str(tmp_path / "audit.jsonl")], cwd=REPO, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert router.stdout is not None
        approval_id, socket = router.stdout.readline().split()
        os.kill(router.pid, signal.SIGSTOP)
        yield router, approval_id, Path(socket)
    finally:
        os.kill(router.pid, signal.SIGCONT)
        router.terminate()
        router.wait(30)
        if router.stdout is not None:
            router.stdout.close()


async def test_a_suspended_router_leaves_the_others_listed_and_decided(
    tmp_path: Path, suspended: tuple[subprocess.Popen[str], str, Path]
) -> None:
    router, its_approval, its_socket = suspended
    audit = tmp_path / "audit.jsonl"
    env = {"STOCKADE_AUDIT__PATH": str(audit)}
    settings = Settings(audit=AuditSettings(path=audit))
    async with ControlPlane.from_settings(settings) as plane, approval_socket(plane) as path:
        assert path is not None
        approval_id = await held(plane)

        listed = await asyncio.to_thread(run, "approvals", "list", "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        assert [a["id"] for a in json.loads(listed.stdout)] == [approval_id]
        report = json.loads(listed.stderr.strip().splitlines()[-1])
        assert report == {"not_answering": [{"socket": str(its_socket), "pid": router.pid,
                                             "error": "no answer in time"}]}  # fmt: skip

        table = await asyncio.to_thread(run, "approvals", "list", env=env)
        assert (table.returncode, approval_id[:12] in table.stdout) == (0, True)
        assert f"(pid {router.pid}) is not answering" in table.stderr

        granted = await asyncio.to_thread(run, "approvals", "approve", approval_id, "--approver", "oncall", env=env)
        assert granted.returncode == 0, granted.stderr
        unreachable = await asyncio.to_thread(run, "approvals", "show", its_approval, env=env)
        assert unreachable.returncode == 2
        assert f"no answering router holds approval {its_approval}" in unreachable.stderr

        routers = local.LocalRouters(local.socket_dirs(settings), timeout_s=0.5)
        assert [a.id for a in await routers.list()] == [approval_id]
        assert [(s.socket, s.pid) for s in routers.not_answering] == [(its_socket, router.pid)]


async def test_a_decision_over_the_socket_records_the_process_that_made_it(tmp_path: Path) -> None:
    """The approver's name is what the caller typed; the kernel's word on the caller (uid, pid,
    executable) is recorded beside it, and the agent's own name in another case is refused."""
    audit = tmp_path / "audit.jsonl"
    env = {**os.environ, "STOCKADE_AUDIT__PATH": str(audit)}
    async with (
        ControlPlane.from_settings(Settings(audit=AuditSettings(path=audit))) as plane,
        approval_socket(plane) as path,
    ):
        assert path is not None
        approval_id = await held(plane, agent="claude")
        own = await asyncio.to_thread(run, "approvals", "approve", approval_id, "--approver", "Claude", env=env)
        assert (own.returncode, "never approves its own" in own.stderr) == (1, True)

        def approve() -> tuple[int, int]:
            cli = subprocess.Popen(
                [STOCKADE, "approvals", "approve", approval_id, "--approver", "oncall"], env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            return cli.pid, cli.wait(120)

        pid, code = await asyncio.to_thread(approve)
        assert code == 0
        decision_id = (await plane.get_approval(approval_id)).decision_id
        [approved] = await plane.audit.query(AuditFilter(decision_id=decision_id, kind="approval", outcome="approved"))
    assert (approved.result or {})["approver"] == "oncall"
    assert (approved.result or {})["peer"] == {
        "uid": os.getuid(), "gid": os.getgid(), "pid": pid, "exe": os.path.realpath(sys.executable),
    }  # fmt: skip


async def test_a_directory_another_user_made_in_tmp_cannot_keep_a_router_from_listening(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user without XDG_RUNTIME_DIR (ssh, cron, a container) once put the sockets under
    ``/tmp/stockade-<uid>``, which any local user can make first: the router then refused to
    start. They now go under the user's own state directory (here so deep that the socket is
    bound through its directory's descriptor), where the CLI finds them."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(local, "_RUN", str(tmp_path / "no-run"))  # as for a user who is not root
    squatted = squat_tmp(tmp_path, monkeypatch)
    state = tmp_path / ("s" * 40) / "state"
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    audit = tmp_path / "audit.jsonl"
    settings = Settings(audit=AuditSettings(path=audit))
    async with ControlPlane.from_settings(settings) as plane, approval_socket(plane) as path:
        assert path is not None
        assert path.parent.parent == state / "stockade" / "approvals"
        assert len(os.fsencode(path)) > 108  # longer than a socket address holds
        approval_id = await held(plane)
        env = {"STOCKADE_AUDIT__PATH": str(audit), "XDG_STATE_HOME": str(state), "TMPDIR": str(squatted.parent)}
        listed = await asyncio.to_thread(run, "approvals", "list", "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        assert [a["id"] for a in json.loads(listed.stdout)] == [approval_id]
    assert list(squatted.iterdir()) == []


async def test_with_no_private_directory_a_router_runs_without_its_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refusing to start would let any user who can make a directory stop the router: it serves
    its agent, and its approvals are decided by elicitation (a warning says why there is no socket)."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(local, "_RUN", str(tmp_path / "no-run"))
    state = tmp_path / "state"
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    (state / "stockade" / "approvals").mkdir(parents=True, mode=0o700)
    os.chown(state / "stockade" / "approvals", 65534, 65534)
    settings = Settings(audit=AuditSettings(path=tmp_path / "audit.jsonl"))
    async with ControlPlane.from_settings(settings) as plane, approval_socket(plane) as path:
        assert path is None
        await plane.register(python_tool("echo", ECHO))
        session = await plane.open_session("claude", "alice@example.com")
        assert (await plane.call(session, "echo", {"x": 1})).ok


async def test_a_router_that_cannot_audit_the_decision_is_a_failure_not_a_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exit 1 says the approval was refused; a router whose audit log fails (a full disk) did not
    refuse anything, and the CLI exits 2 with its reason, as it does against the shared store."""
    audit = tmp_path / "audit.jsonl"
    env = {"STOCKADE_AUDIT__PATH": str(audit)}
    async with (
        ControlPlane.from_settings(Settings(audit=AuditSettings(path=audit))) as plane,
        approval_socket(plane) as path,
    ):
        assert path is not None
        approval_id = await held(plane)

        async def full_disk(event: AuditEvent) -> None:
            raise AuditError("audit log unwritable (no space left on device)")

        with monkeypatch.context() as patched:
            patched.setattr(plane.audit, "append", full_disk)
            for verb in ("approve", "deny"):
                failed = await asyncio.to_thread(run, "approvals", verb, approval_id, "--approver", "oncall", env=env)
                assert failed.returncode == 2, failed.stderr
                assert "could not be audited; it is still pending" in failed.stderr
        assert (await plane.get_approval(approval_id)).status.value == "pending"
        own = await asyncio.to_thread(run, "approvals", "approve", approval_id, "--approver", "db-agent", env=env)
        assert (own.returncode, "never approves its own" in own.stderr) == (1, True)  # a refusal is still 1


@pytest.mark.parametrize("command", ["serve", "mcp --http"])
def test_a_server_stopped_by_sigterm_removes_its_socket_and_closes_its_plane(tmp_path: Path, command: str) -> None:
    """uvicorn raises the signal that stopped it again once it has served, which ended the
    process before the approval socket was removed (1,600 stale ones were found on one machine)
    and, for `stockade mcp --http`, before the plane closed (no checkpoint over the log's tail)."""
    audit = tmp_path / "audit.jsonl"
    settings = Settings(audit=AuditSettings(path=audit))
    port = free_port()
    argv = [STOCKADE, *command.split(), "--port", str(port)]
    if command != "serve":
        argv += ["--agent", "claude", "--principal", "alice@example.com", "--tools", str(write_tools(tmp_path))]
    env = {**os.environ, "STOCKADE_AUDIT__PATH": str(audit), "STOCKADE_LOG_LEVEL": "error"}
    server = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        socket = local.socket_dir(settings) / f"{server.pid}.sock"
        for _ in range(600):
            if socket.exists() or server.poll() is not None:
                break
            time.sleep(0.05)
        assert socket.exists(), server.stderr.read().decode()[-2000:] if server.poll() is not None else "no socket"
        for _ in range(200):  # a refused request: an event on the log, for the shutdown checkpoint to cover
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"http://127.0.0.1:{port}{'/v1/sessions' if command == 'serve' else '/mcp'}", content=b"{")
                break
            time.sleep(0.05)
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
        if server.stderr is not None:
            server.stderr.close()
    assert not socket.exists(), "the stopped server left its approval socket behind"
    events = len(audit.read_text().splitlines())
    signed = LogLayout(audit).read_checkpoints()
    assert signed, "no checkpoint: the plane never closed"
    assert signed[-1].size == events  # the tail is signed at shutdown
