"""The local approval socket: how ``stockade approvals`` reaches a router whose store is embedded.

With the embedded store (the single-process setup: ``stockade mcp`` for Claude Code or Cursor,
or ``stockade serve`` alone), approvals live in the router's memory, where no other process can
see them. Such a router listens on a Unix socket, ``routers/<pid>.sock`` beside its audit log
(the directory 0700, the socket 0600), and answers one JSON request per connection: list, show,
approve or deny. Only its own OS user (or root) may connect (checked on the peer's credentials).
The decisions go through the router's own `ApprovalBook`, so they are audited like any other.

Anyone who can act as that OS user can approve here, the agent included if it has a shell as
that user: the requesting agent's own name is refused as approver, but a local setup trusts its
user. Prefer MCP elicitation (the client asks the human) where the client supports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from router.approvals import Approval, ApprovalError, ApprovalStatus
from router.errors import StockadeError

if TYPE_CHECKING:
    from router.control import ControlPlane
    from router.settings import Settings

log = structlog.get_logger(__name__)

_MAX_REQUEST = 64 << 10
_TIMEOUT_S = 10.0


def socket_dir(settings: Settings) -> Path:
    """Where the routers sharing these settings (same audit log) put their sockets."""
    return settings.audit.path.parent / "routers"


@contextlib.asynccontextmanager
async def approval_socket(plane: ControlPlane) -> AsyncIterator[Path | None]:
    """Serve ``plane``'s approvals on a local socket while the block runs (only with the embedded
    store: with Redis, ``stockade approvals`` reads the shared store itself). Yields its path."""
    if plane.settings.store.url is not None:
        yield None
        return
    directory = socket_dir(plane.settings)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / f"{os.getpid()}.sock"
    path.unlink(missing_ok=True)  # a stale one of an earlier process with this pid

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            reply = await _answer(plane, reader, writer)
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            log.warning("approval_socket_request_failed", error=f"{type(exc).__name__}: {exc}")
        finally:
            writer.close()

    old_umask = os.umask(0o177)  # the socket is created 0600: no window where others may connect
    try:
        server = await asyncio.start_unix_server(serve, path=str(path), limit=_MAX_REQUEST)
    finally:
        os.umask(old_umask)
    log.info("approval_socket_listening", path=str(path))
    try:
        yield path
    finally:
        server.close()
        await server.wait_closed()
        path.unlink(missing_ok=True)


async def _answer(plane: ControlPlane, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> dict[str, Any]:
    peer = writer.get_extra_info("socket")
    if peer is not None:
        _, uid, _ = struct.unpack("3i", peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        if uid not in (os.getuid(), 0):
            return _error("auth.forbidden", f"uid {uid} may not decide this router's approvals")
    line = await asyncio.wait_for(reader.readline(), _TIMEOUT_S)
    try:
        request = json.loads(line)
        op = request["op"]
    except (ValueError, KeyError, TypeError):
        return _error("request.invalid", 'send one JSON object per line: {"op": "list" | "get" | "approve" | "deny"}')
    try:
        if op == "list":
            status = ApprovalStatus(request["status"]) if request.get("status") else None
            return {"approvals": [a.model_dump(mode="json") for a in await plane.list_approvals(status)]}
        approval_id = str(request.get("id", ""))
        if op == "get":
            return {"approval": (await plane.get_approval(approval_id)).model_dump(mode="json")}
        if op in ("approve", "deny"):
            decide = plane.approve if op == "approve" else plane.deny_approval
            decided = await decide(approval_id, str(request.get("approver", "")), str(request.get("note", "")))
            return {"approval": decided.model_dump(mode="json")}
    except (StockadeError, ValueError) as exc:
        return _error(getattr(exc, "code", "request.invalid"), str(exc))
    return _error("request.invalid", f"unknown op {op!r}: list, get, approve or deny")


def _error(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


class LocalRouters:
    """The approvals of every running router with a socket in ``directory``, for the CLI: the
    same methods as `ApprovalBook` (list, get, decide)."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory

    def sockets(self) -> list[Path]:
        try:
            return sorted(p for p in self._directory.iterdir() if p.suffix == ".sock")
        except OSError:
            return []

    async def _ask(self, path: Path, request: dict[str, Any]) -> dict[str, Any] | None:
        """One router's reply; None if it is gone (its stale socket is removed)."""
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path), limit=64 << 20), _TIMEOUT_S)
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # its router died without cleaning up
            return None
        try:
            writer.write(json.dumps(request).encode() + b"\n")
            await writer.drain()
            reply: dict[str, Any] = json.loads(await asyncio.wait_for(reader.readline(), _TIMEOUT_S))
            return reply
        finally:
            writer.close()

    async def _all(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        replies = [r for r in [await self._ask(p, request) for p in self.sockets()] if r is not None]
        if not replies:
            raise StockadeError(
                f"no running router keeps approvals here ({self._directory}): start `stockade mcp` or "
                "`stockade serve` with these settings (the same STOCKADE_AUDIT__PATH), or point "
                "STOCKADE_STORE__URL at the routers' Redis"
            )
        return replies

    async def list(self, status: ApprovalStatus | None = None) -> list[Approval]:
        found: list[Approval] = []
        for reply in await self._all({"op": "list", "status": status.value if status else None}):
            found.extend(Approval.model_validate(a) for a in reply.get("approvals", []))
        return sorted(found, key=lambda a: a.created_at)

    async def _one(self, request: dict[str, Any]) -> Approval:
        """The reply of the router that holds the approval (ids are unique across routers)."""
        errors = []
        for reply in await self._all(request):
            if "approval" in reply:
                return Approval.model_validate(reply["approval"])
            errors.append(reply.get("error", {}))
        known = [e for e in errors if not str(e.get("message", "")).startswith("no approval ")]
        raise ApprovalError(str((known or errors or [{}])[0].get("message", "no such approval")))

    async def get(self, approval_id: str) -> Approval:
        return await self._one({"op": "get", "id": approval_id})

    async def decide(self, approval_id: str, *, approver: str, approve: bool, note: str = "") -> Approval:
        op = "approve" if approve else "deny"
        return await self._one({"op": op, "id": approval_id, "approver": approver, "note": note})
