"""The local approval socket (router.interfaces.local) against hostile neighbours and hostile bytes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from router import ApprovalError, ApprovalStatus, ControlPlane, Settings, StockadeError
from router.audit import AuditFilter
from router.interfaces.local import LocalRouters, approval_socket, socket_dir, socket_dirs
from router.settings import AuditSettings
from tests.conftest import ECHO, python_tool

DROP = python_tool("drop_table", ECHO, risk="critical", capabilities=["mutates_state"])


async def held(plane: ControlPlane) -> str:
    await plane.register(DROP)
    session = await plane.open_session("db-agent", "alice@example.com")
    result = await plane.call(session, "drop_table", {"table": "users"})
    assert result.approval_id is not None
    return result.approval_id


async def ask(path: Path, line: bytes) -> dict[str, object]:
    reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 20)
    writer.write(line)
    await writer.drain()
    reply = json.loads(await asyncio.wait_for(reader.readline(), 10))
    writer.close()
    assert isinstance(reply, dict)
    return reply


async def test_approvals_are_decided_through_the_router_that_holds_them(tmp_path: Path) -> None:
    settings = Settings(audit=AuditSettings(path=tmp_path / "audit.jsonl"))
    async with ControlPlane.from_settings(settings) as plane, approval_socket(plane) as path:
        assert path is not None
        approval_id = await held(plane)
        routers = LocalRouters(socket_dir(settings))
        assert [a.id for a in await routers.list(ApprovalStatus.PENDING)] == [approval_id]
        with pytest.raises(ApprovalError, match="never approves its own"):
            await routers.decide(approval_id, approver="db-agent", approve=True)
        decided = await routers.decide(approval_id, approver="oncall", approve=True, note="OPS-9")
        assert (decided.status, decided.approver) == (ApprovalStatus.APPROVED, "oncall")
        with pytest.raises(ApprovalError, match="no approval"):
            await routers.get("a-unknown")
    assert not path.exists()  # removed with the router


async def test_hostile_requests_get_an_answer_and_the_router_keeps_serving(tmp_path: Path) -> None:
    settings = Settings(audit=AuditSettings(path=tmp_path / "audit.jsonl"))
    async with ControlPlane.from_settings(settings) as plane, approval_socket(plane) as path:
        assert path is not None
        approval_id = await held(plane)
        hostile = (b"x" * (70 << 10), b"[" * 60_000, b"not json", b'{"op": "drop"}', b'{"op": "approve", "id": 7}',
                   b'{"op": "list", "status": "weird"}', b"\xff\xfe")  # fmt: skip
        for line in (h + b"\n" for h in hostile):
            reply = await ask(path, line)
            assert "error" in reply, (line[:20], reply)
        listed = await ask(path, b'{"op": "list"}\n')  # still serving
        assert [a["id"] for a in listed["approvals"]] == [approval_id]  # type: ignore[index, union-attr]
        assert (await plane.get_approval(approval_id)).status is ApprovalStatus.PENDING


async def test_malformed_requests_are_refused_and_on_record_with_the_process_that_sent_them(tmp_path: Path) -> None:
    """A request the socket does not take is refused as ``request.invalid``, naming the field,
    and audited as any refused request is, with the peer as the kernel reports it; a value of
    the wrong type is never read as another (``[]`` as no status, ``{"x": 1}`` as a name)."""
    settings = Settings(audit=AuditSettings(path=tmp_path / "audit.jsonl"))
    async with ControlPlane.from_settings(settings) as plane, approval_socket(plane) as path:
        assert path is not None
        approval_id = await held(plane)
        bad = {
            b"x" * (70 << 10): "one JSON line", b"[" * 60_000: "one JSON object", b"not json": "one JSON object",
            b'"op"': "one JSON object", b"null": "one JSON object", b'{"op": []}': "one JSON object",
            b'{"op": "drop"}': "unknown op", b'{"op": "list", "status": []}': "status must be",
            b'{"op": "list", "status": {}}': "status must be", b'{"op": "list", "status": ""}': "status must be",
            b'{"op": "get", "id": {"a": [1]}}': "id must be a string",
            b'{"op": "approve", "id": "%s", "approver": {"x": 1}}' % approval_id.encode(): "approver must be a string",
            b'{"op": "deny", "id": "%s", "approver": "oncall", "note": 7}' % approval_id.encode(): "note must be",
        }  # fmt: skip
        for line, problem in bad.items():
            reply = await ask(path, line + b"\n")
            error = reply.get("error")
            assert isinstance(error, dict), (line[:40], reply)
            assert (error["code"], problem in error["message"]) == ("request.invalid", True), (line[:40], error)
        assert (await plane.get_approval(approval_id)).status is ApprovalStatus.PENDING
        refused = await plane.audit.query(AuditFilter(kind="error", outcome="refused"))
    assert [(e.result or {})["code"] for e in refused] == ["request.invalid"] * len(bad)
    me = {"uid": os.getuid(), "gid": os.getgid(), "pid": os.getpid(), "exe": os.path.realpath(sys.executable)}
    assert all((e.result or {})["peer"] == me for e in refused)


async def test_a_blank_approver_is_refused_as_naming_nobody(tmp_path: Path) -> None:
    """Not as the requesting agent approving itself: nobody is named at all."""
    settings = Settings(audit=AuditSettings(path=tmp_path / "audit.jsonl"))
    async with ControlPlane.from_settings(settings) as plane, approval_socket(plane) as path:
        assert path is not None
        approval_id = await held(plane)
        routers = LocalRouters(socket_dir(settings))
        for blank in ("", " ", "\u200b"):
            with pytest.raises(ApprovalError, match="needs the approver's name"):
                await routers.decide(approval_id, approver=blank, approve=True)
        assert (await plane.get_approval(approval_id)).status is ApprovalStatus.PENDING
        refused = await plane.audit.query(AuditFilter(kind="error", outcome="refused"))
    assert [(e.result or {})["code"] for e in refused] == ["approval.no_approver"] * 3


CAPS = "+dac_override,+dac_read_search"
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", f"--inh-caps={CAPS}", f"--ambient-caps={CAPS}"]
"""Run a command as the user nobody, still able to reach root's 0700 socket directory: a
neighbour of another uid that got as far as the socket."""
CONNECT = (
    "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
    "s.sendall(b'{\"op\": \"list\"}\\n'); print(s.makefile().readline(), end='')"
)


async def test_a_peer_of_another_uid_is_refused_and_on_record(tmp_path: Path) -> None:
    """The test command runs as root (CI does, scripts/test installs util-linux's setpriv with Debian):
    the peer is a real process of uid 65534, never a skipped case."""
    assert os.getuid() == 0, "run the suite as root (scripts/test)"
    assert shutil.which("setpriv") is not None, "setpriv (util-linux) is part of Debian's base system"
    settings = Settings(audit=AuditSettings(path=tmp_path / "audit.jsonl"))
    async with ControlPlane.from_settings(settings) as plane, approval_socket(plane) as path:
        assert path is not None
        await held(plane)
        argv = [*NOBODY, sys.executable, "-I", "-c", CONNECT, str(path)]
        neighbour = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=60)
        assert neighbour.returncode == 0, neighbour.stderr
        reply = json.loads(neighbour.stdout)
        assert (set(reply), reply["error"]["code"]) == ({"error"}, "auth.forbidden")  # the held call is not shown
        [refused] = await plane.audit.query(AuditFilter(kind="error", outcome="refused"))
    assert (refused.result or {})["code"] == "auth.forbidden"
    assert (refused.result or {})["peer"]["uid"] == 65534


async def test_a_socket_directory_others_could_write_to_is_never_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router listens in the next private directory instead (the user's state directory),
    and the CLI never talks to a socket in the open one."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    settings = Settings(audit=AuditSettings(path=tmp_path / "audit.jsonl"))
    directory = socket_dir(settings)
    directory.parent.mkdir(mode=0o700, exist_ok=True)
    directory.mkdir(mode=0o755)
    os.chmod(directory, 0o755)  # noqa: S103  (the hostile case under test)
    async with ControlPlane.from_settings(settings) as plane, approval_socket(plane) as path:
        assert path is not None
        assert path.parent == socket_dirs(settings)[-1] != directory
        assert LocalRouters(socket_dirs(settings)).sockets() == [path]
        assert list(directory.iterdir()) == []
    with pytest.raises(StockadeError, match="mode 0700"):
        LocalRouters(directory).sockets()


def squat_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary directory (for this test) where "nobody" made ``stockade-<uid>`` first."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    squatted = temp / f"stockade-{os.getuid()}"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, 65534, 65534)
    return squatted


async def test_a_directory_another_user_made_first_cannot_stop_a_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Root without XDG_RUNTIME_DIR (a service) once put its sockets under /tmp/stockade-0, which
    any local user can create first: the router then refused to start. Its sockets now go under
    /run, where only root creates anything; the squatted directory changes nothing."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    squat_tmp(tmp_path, monkeypatch)
    settings = Settings(audit=AuditSettings(path=tmp_path / "audit.jsonl"))
    assert socket_dir(settings).parent == Path("/run/stockade-approvals")
    async with ControlPlane.from_settings(settings) as plane, approval_socket(plane) as path:
        assert path is not None
        assert (await ask(path, b'{"op": "list"}\n')) == {"approvals": []}
        assert LocalRouters(socket_dir(settings)).sockets() == [path]


async def test_a_deep_audit_directory_still_gets_a_socket(tmp_path: Path) -> None:
    """A socket path must stay under ~100 bytes: one beside a deep audit log would not."""
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "audit.jsonl"
    async with (
        ControlPlane.from_settings(Settings(audit=AuditSettings(path=deep))) as plane,
        approval_socket(plane) as path,
    ):
        assert path is not None
        assert len(str(path)) < 100
        assert (await ask(path, b'{"op": "list"}\n')) == {"approvals": []}


async def test_a_symlinked_socket_directory_is_never_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    settings = Settings(audit=AuditSettings(path=tmp_path / "logs" / "audit.jsonl"))
    (tmp_path / "logs").mkdir()
    socket_dir(settings).parent.mkdir(mode=0o700, exist_ok=True)
    socket_dir(settings).symlink_to(elsewhere)
    async with ControlPlane.from_settings(settings) as plane, approval_socket(plane) as path:
        assert path is not None
        assert path.parent == socket_dirs(settings)[-1]
    assert list(elsewhere.iterdir()) == []
    with pytest.raises(StockadeError, match="not a plain directory"):
        LocalRouters(socket_dir(settings)).sockets()
