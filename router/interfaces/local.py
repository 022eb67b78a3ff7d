"""The local approval socket: how ``stockade approvals`` reaches a router whose store is embedded.

With the embedded store (the single-process setup: ``stockade mcp`` for Claude Code or Cursor,
or ``stockade serve`` alone), approvals live in the router's memory, where no other process can
see them. Such a router listens on a Unix socket, ``<pid>.sock`` in a private runtime directory
named after its audit log's (`socket_dir`: ``$XDG_RUNTIME_DIR/stockade/<key>``, or
``<tmp>/stockade-<uid>/<key>``, each 0700: a socket path must stay under ~100 bytes, which a
directory beside a deep audit log need not), the socket 0600, and answers one JSON request per
connection: list, show, approve or deny. Only its own OS user (or root) may connect (checked on the peer's credentials).
The decisions go through the router's own `ApprovalBook`, so they are audited like any other.

Anyone who can act as that OS user can approve here, the agent included if it has a shell as
that user: the requesting agent's own name is refused as approver, but a local setup trusts its
user. Prefer MCP elicitation (the client asks the human) where the client supports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import stat
import struct
import tempfile
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
_RUN = "/run"


def socket_dir(settings: Settings) -> Path:
    """Where the routers sharing these settings (the same audit log directory) put their sockets:
    under ``$XDG_RUNTIME_DIR``; for root without one (a service), under ``/run``, where no other
    user can create the directory first; else under the temporary directory, per uid."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime):
        base = Path(runtime) / "stockade"
    elif os.getuid() == 0 and os.path.isdir(_RUN) and os.access(_RUN, os.W_OK):
        # Not /tmp/stockade-0: any local user could make that first, and the router would refuse to start.
        base = Path(_RUN) / "stockade-approvals"  # not the runner's /run/stockade, which sandboxes traverse
    else:
        base = Path(tempfile.gettempdir()) / f"stockade-{os.getuid()}"
    key = hashlib.sha256(str(settings.audit.path.parent.resolve()).encode()).hexdigest()[:16]
    return base / key


@contextlib.asynccontextmanager
async def approval_socket(plane: ControlPlane) -> AsyncIterator[Path | None]:
    """Serve ``plane``'s approvals on a local socket while the block runs (only with the embedded
    store: with Redis, ``stockade approvals`` reads the shared store itself). Yields its path."""
    if plane.settings.store.url is not None:
        yield None
        return
    directory = socket_dir(plane.settings)
    directory.parent.mkdir(mode=0o700, exist_ok=True)
    _check_private(directory.parent)  # before anything is made inside it
    directory.mkdir(mode=0o700, exist_ok=True)
    _check_private(directory)
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
    uid = _peer_uid(writer)
    if uid is not None and uid not in (os.getuid(), 0):
        return _error("auth.forbidden", f"uid {uid} may not decide this router's approvals")
    try:
        line = await asyncio.wait_for(reader.readline(), _TIMEOUT_S)
    except ValueError:  # over the line limit
        return _error("request.invalid", f"a request is one JSON line of at most {_MAX_REQUEST} bytes")
    try:
        request = json.loads(line)
        op = request["op"]
    except (ValueError, KeyError, TypeError, RecursionError):
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


def _check_private(directory: Path) -> None:
    """Refuse a socket directory another user could plant sockets in or redirect (a symlink, not
    ours, or open to group or others): the approver would talk to whoever listens there.

    Raises:
        StockadeError: naming the directory and what is wrong with it.
    """
    found = directory.lstat()
    if stat.S_ISLNK(found.st_mode) or not stat.S_ISDIR(found.st_mode):
        raise StockadeError(f"{directory} is not a plain directory: remove it (it holds approval sockets)")
    if found.st_uid != os.getuid() or found.st_mode & 0o077:
        raise StockadeError(
            f"{directory} must be owned by uid {os.getuid()} with mode 0700 (it is uid {found.st_uid}, mode "
            f"{stat.S_IMODE(found.st_mode):o}): remove it if it is not yours, or set XDG_RUNTIME_DIR to a "
            "private directory of yours (the approval sockets go there)"
        )


def _peer_uid(writer: asyncio.StreamWriter) -> int | None:
    peer = writer.get_extra_info("socket")
    if peer is None:
        return None
    _, uid, _ = struct.unpack("3i", peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(uid)


def _error(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


class LocalRouters:
    """The approvals of every running router with a socket in ``directory``, for the CLI: the
    same methods as `ApprovalBook` (list, get, decide)."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory

    def sockets(self) -> list[Path]:
        """The sockets in the directory (none if it is missing; refused if it is not private)."""
        try:
            _check_private(self._directory.parent)
            _check_private(self._directory)
            return sorted(p for p in self._directory.iterdir() if p.suffix == ".sock")
        except FileNotFoundError:
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
            uid = _peer_uid(writer)
            if uid is not None and uid not in (os.getuid(), 0):  # not a router of ours: never tell it anything
                return None
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

    async def _holder(self, approval_id: str) -> tuple[Path, Approval]:
        """The socket of the router that holds the approval, and the approval."""
        sockets = self.sockets()
        if not sockets:
            await self._all({"op": "get", "id": approval_id})  # raises, saying where it looked
        errors = []
        for path in sockets:
            reply = await self._ask(path, {"op": "get", "id": approval_id})
            if reply is not None and "approval" in reply:
                return path, Approval.model_validate(reply["approval"])
            errors.append((reply or {}).get("error", {}))
        known = [e for e in errors if not str(e.get("message", "")).startswith("no approval ")]
        raise ApprovalError(str((known or errors or [{}])[0].get("message", f"no approval {approval_id}")))

    async def get(self, approval_id: str) -> Approval:
        return (await self._holder(approval_id))[1]

    async def decide(self, approval_id: str, *, approver: str, approve: bool, note: str = "") -> Approval:
        """Decide through the one router that holds it (no other router hears the decision)."""
        path, _ = await self._holder(approval_id)
        request = {"op": "approve" if approve else "deny", "id": approval_id, "approver": approver, "note": note}
        reply = await self._ask(path, request)
        if reply is None:
            raise StockadeError(f"the router holding approval {approval_id} stopped answering ({path})")
        if "approval" not in reply:
            raise ApprovalError(str(reply.get("error", {}).get("message", "refused")))
        return Approval.model_validate(reply["approval"])
