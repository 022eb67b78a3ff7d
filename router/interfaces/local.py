"""The local approval socket: how ``stockade approvals`` reaches a router whose store is embedded.

With the embedded store (the single-process setup: ``stockade mcp`` for Claude Code or Cursor,
or ``stockade serve`` alone), approvals live in the router's memory, where no other process can
see them. Such a router listens on a Unix socket, ``<pid>.sock`` in a private directory named
after its audit log's (`socket_dirs`: ``$XDG_RUNTIME_DIR/stockade/<key>``; for root, a service,
``/run/stockade-approvals/<key>``; else, or when that one is not safe to use, under the user's
own state directory, ``<state>/approvals/<key>``, never a shared one such as /tmp, where another
user could make the directory first). Each directory is 0700, the socket 0600; a socket path
longer than a Unix socket address holds is reached through the directory's descriptor. A router
with no safe directory runs without a socket (logged). It answers one JSON request per
connection: list, show, approve or deny. Only its own OS user (or root) may connect (checked on
the peer's credentials). The decisions go through the router's own `ApprovalBook`, so they are
audited like any other, with the deciding process (uid, pid and executable) on record.

Anyone who can act as that OS user can approve here, the agent included if it has a shell as
that user: the requesting agent's own name (in any case or width) is refused as approver, and
the process that decided is on record, but a local setup trusts its user. Prefer MCP elicitation
(the client asks the human) where the client supports it.

The CLI asks every router at once: one that is suspended, or answers garbage, is reported as not
answering, and the others' approvals are still listed and decided.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import pwd
import socket
import stat
import struct
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from router.approvals import Approval, ApprovalError, ApprovalStatus
from router.errors import AuditError, StockadeError, StoreError
from router.settings import state_dir
from router.wire import show

if TYPE_CHECKING:
    from router.control import ControlPlane
    from router.settings import Settings

log = structlog.get_logger(__name__)

_MAX_REQUEST = 64 << 10
_TIMEOUT_S = 10.0
ASK_TIMEOUT_S = 5.0
"""How long the CLI waits for one router's answer before it counts it as not answering."""
_RUN = "/run"
_ADDRESS_MAX = 100  # bytes of a socket path that bind and connect take as is (sun_path holds 108 on Linux)


def socket_dirs(settings: Settings) -> list[Path]:
    """Where the routers sharing these settings (the same audit log directory) may put their
    sockets, in the order a router tries them: under ``$XDG_RUNTIME_DIR``; for root (a service),
    under ``/run``, where no other user can create the directory first; then under the user's own
    state directory. Never under the shared temporary directory: another local user could make
    ``/tmp/stockade-<uid>`` first, and the router would have nowhere to listen."""
    bases = []
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime):
        bases.append(Path(runtime) / "stockade")
    if os.getuid() == 0 and os.path.isdir(_RUN) and os.access(_RUN, os.W_OK):
        bases.append(Path(_RUN) / "stockade-approvals")  # not the runner's /run/stockade, which sandboxes traverse
    bases.append(state_dir() / "approvals")
    key = hashlib.sha256(str(settings.audit.path.parent.resolve()).encode()).hexdigest()[:16]
    return [base / key for base in bases]


def socket_dir(settings: Settings) -> Path:
    """The first of `socket_dirs`: where a router puts its socket when that directory is safe."""
    return socket_dirs(settings)[0]


@contextlib.contextmanager
def _address(path: Path) -> Iterator[str]:
    """An address that binds or connects to ``path``: the path itself, or, when it is longer than
    a socket address holds (a deep home directory), the same file through ``/proc/self/fd`` and a
    descriptor of its directory, held open while the block runs."""
    if len(os.fsencode(path)) < _ADDRESS_MAX:
        yield str(path)
        return
    descriptor = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{descriptor}/{path.name}"
    finally:
        os.close(descriptor)


def _make_private(directory: Path, *, parents: bool) -> None:
    """Make ``directory`` (and its parent) 0700 if missing; check both are private (`_check_private`).
    ``parents``: make the directories above too (the state directory, which need not exist yet;
    never ``$XDG_RUNTIME_DIR``, which is unusable if it does not exist).

    Raises:
        StockadeError: either is not a private directory of ours. OSError: it cannot be made.
    """
    directory.parent.mkdir(mode=0o700, parents=parents, exist_ok=True)
    _check_private(directory.parent)  # before anything is made inside it
    directory.mkdir(mode=0o700, exist_ok=True)
    _check_private(directory)


@contextlib.asynccontextmanager
async def approval_socket(plane: ControlPlane) -> AsyncIterator[Path | None]:
    """Serve ``plane``'s approvals on a local socket while the block runs (only with the embedded
    store: with Redis, ``stockade approvals`` reads the shared store itself). Yields its path."""
    if plane.settings.store.url is not None:
        yield None
        return
    directory = None
    candidates = socket_dirs(plane.settings)
    for candidate in candidates:
        try:
            _make_private(candidate, parents=candidate == candidates[-1])
        except (StockadeError, OSError) as exc:
            log.warning("approval_socket_directory_unusable", directory=str(candidate), error=str(exc))
            continue
        directory = candidate
        break
    if directory is None:
        # The router still serves its agent; its approvals are then decided through MCP
        # elicitation, or not at all. Refusing to start would let any local user stop it.
        log.warning("approval_socket_disabled", reason="no private directory for the approval socket",
                    tried=[str(d) for d in candidates])  # fmt: skip
        yield None
        return
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
        with _address(path) as address:
            server = await asyncio.start_unix_server(serve, path=address, limit=_MAX_REQUEST)
    finally:
        os.umask(old_umask)
    log.info("approval_socket_listening", path=str(path))
    try:
        yield path
    finally:
        server.close()
        await server.wait_closed()
        path.unlink(missing_ok=True)


_USAGE = 'send one JSON object per line: {"op": "list" | "get" | "approve" | "deny"}'


class _BadRequest(ValueError):
    """A request the socket does not take (not JSON, a field of the wrong type, an unknown op):
    refused as ``request.invalid``, with the message naming what is wrong."""


async def _answer(plane: ControlPlane, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> dict[str, Any]:
    peer = _peer(writer)
    # Read now, while the peer is connected: later its pid may be gone, or another process's.
    on_record = peer.record() if peer is not None else None
    if peer is not None and peer.uid not in (os.getuid(), 0):
        message = f"uid {peer.uid} may not decide this router's approvals"
        return await _refuse(plane, on_record, "connect", "auth.forbidden", message)
    what = "request"
    try:
        try:
            line = await asyncio.wait_for(reader.readline(), _TIMEOUT_S)
        except ValueError as exc:  # over the line limit
            raise _BadRequest(f"a request is one JSON line of at most {_MAX_REQUEST} bytes") from exc
        try:
            request = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise _BadRequest(_USAGE) from exc
        if not isinstance(request, dict) or not isinstance(request.get("op"), str):
            raise _BadRequest(_USAGE)
        what = show(request["op"])
        return await _serve(plane, request, on_record)
    except ValueError as exc:  # a _BadRequest, or a value no check foresaw: refused all the same
        return await _refuse(plane, on_record, what, "request.invalid", str(exc))
    except StockadeError as exc:  # refused decisions are on record already (`ApprovalBook.decide`)
        return _error(exc.code, str(exc))


async def _serve(plane: ControlPlane, request: dict[str, Any], peer: dict[str, Any] | None) -> dict[str, Any]:
    """The reply to one well-formed request (``op`` is a string).

    Raises:
        _BadRequest: a field of the wrong type or value, or an unknown op. StockadeError: as the
            plane's approval methods.
    """
    op = request["op"]
    if op == "list":
        status = request.get("status")
        statuses = [s.value for s in ApprovalStatus]
        if status is not None and (not isinstance(status, str) or status not in statuses):
            raise _BadRequest(f"status must be one of {', '.join(statuses)}, or null for every approval")
        listed = await plane.list_approvals(ApprovalStatus(status) if status is not None else None)
        return {"approvals": [a.model_dump(mode="json") for a in listed]}
    approval_id = _text(request, "id")
    if op == "get":
        return {"approval": (await plane.get_approval(approval_id)).model_dump(mode="json")}
    if op in ("approve", "deny"):
        # The approver is the name the requester gives; who asked is recorded beside it,
        # from the kernel, so an agent with a shell of this user is on record as itself.
        decided = await plane.approvals.decide(
            approval_id, approver=_text(request, "approver"), approve=op == "approve", note=_text(request, "note"),
            peer=peer,
        )  # fmt: skip
        return {"approval": decided.model_dump(mode="json")}
    raise _BadRequest(f"unknown op {show(op)}: list, get, approve or deny")


def _text(request: dict[str, Any], field: str) -> str:
    """The string ``field`` of ``request`` ("" if absent). Never the text of another JSON value:
    ``{"x": 1}`` is no approver's name.

    Raises:
        _BadRequest: naming the field.
    """
    value = request.get(field, "")
    if not isinstance(value, str):
        raise _BadRequest(f"{field} must be a string, not JSON {type(value).__name__}")
    return value


async def _refuse(
    plane: ControlPlane, peer: dict[str, Any] | None, what: str, code: str, message: str
) -> dict[str, Any]:
    """Audit a request refused at the socket, with the process that sent it (under the router's
    refusal budget, as any refused request: a flood is counted, not written one by one), and
    the error reply to it."""
    await plane.record_refusal(None, f"approval socket {what}", message, code=code,
                               detail={"peer": peer} if peer is not None else None)  # fmt: skip
    return _error(code, message)


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


@dataclass(frozen=True, slots=True)
class Peer:
    """The process at the other end of a socket, as the kernel vouches for it (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int

    def record(self) -> dict[str, Any]:
        """What the audit log keeps of the peer: uid, gid, pid and its executable (None if it is
        gone or not ours to read: a pid alone may be reused)."""
        try:
            executable: str | None = os.readlink(f"/proc/{self.pid}/exe")
        except OSError:
            executable = None
        return {"uid": self.uid, "gid": self.gid, "pid": self.pid, "exe": executable}


def this_process() -> dict[str, Any]:
    """What the audit log keeps of this process as the peer of the decisions it makes at the
    shared store (the CLI with a store URL: no router checks who it is): its uid, gid, pid and
    executable as for a socket's peer, the login of its uid and its host. The approver's name is
    whatever was typed; these say who typed it."""
    try:
        login: str | None = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        login = None
    return {**Peer(os.getpid(), os.getuid(), os.getgid()).record(), "login": login, "host": socket.gethostname()}


def _peer(writer: asyncio.StreamWriter) -> Peer | None:
    connected = writer.get_extra_info("socket")
    if connected is None:
        return None
    pid, uid, gid = struct.unpack(
        "3i", connected.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    )
    return Peer(int(pid), int(uid), int(gid))


def _error(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


@dataclass(frozen=True, slots=True)
class NotAnswering:
    """A router whose socket is there but which gave no answer in time, or no readable one (a
    suspended or wedged process): its approvals are not listed, and it is reported."""

    socket: Path
    pid: int | None
    error: str

    def as_json(self) -> dict[str, Any]:
        return {"socket": str(self.socket), "pid": self.pid, "error": self.error}


class LocalRouters:
    """The approvals of every running router with a socket in ``directories`` (`socket_dirs`),
    for the CLI: the same methods as `ApprovalBook` (list, get, decide). Routers are asked at
    once; those that do not answer are kept in `not_answering`, and the others still count."""

    def __init__(self, directories: Path | list[Path], *, timeout_s: float = ASK_TIMEOUT_S) -> None:
        self._directories = [directories] if isinstance(directories, Path) else list(directories)
        self._timeout_s = timeout_s
        self.not_answering: list[NotAnswering] = []

    def sockets(self) -> list[Path]:
        """The sockets in the directories that are private (none if missing). A directory that is
        not private is skipped (never talked to); refused only if no directory has a socket."""
        found: list[Path] = []
        refused: StockadeError | None = None
        for directory in self._directories:
            try:
                _check_private(directory.parent)
                _check_private(directory)
                found.extend(sorted(p for p in directory.iterdir() if p.suffix == ".sock"))
            except FileNotFoundError:
                continue
            except StockadeError as exc:
                refused = refused or exc
        if not found and refused is not None:
            raise refused
        return found

    async def _ask(self, path: Path, request: dict[str, Any]) -> dict[str, Any] | None:
        """One router's reply; None if it is gone (its stale socket is removed) or does not answer
        (then it is added to `not_answering`)."""
        try:
            with _address(path) as address:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(address, limit=64 << 20), self._timeout_s
                )
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # its router died without cleaning up
            return None
        except (OSError, TimeoutError) as exc:
            self._silent(path, None, exc)
            return None
        peer = None
        try:
            peer = _peer(writer)
            if peer is not None and peer.uid not in (os.getuid(), 0):  # not a router of ours: never tell it anything
                return None
            writer.write(json.dumps(request).encode() + b"\n")
            await asyncio.wait_for(writer.drain(), self._timeout_s)
            reply = json.loads(await asyncio.wait_for(reader.readline(), self._timeout_s))
            if not isinstance(reply, dict):
                raise ValueError(f"the reply is JSON {type(reply).__name__}, not an object")
            return reply
        except (OSError, TimeoutError, ValueError) as exc:  # ValueError: no JSON line (cut, garbage, over the limit)
            self._silent(path, peer.pid if peer is not None else None, exc)
            return None
        finally:
            writer.close()

    def _silent(self, path: Path, pid: int | None, exc: BaseException) -> None:
        error = "no answer in time" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
        if all(s.socket != path for s in self.not_answering):
            self.not_answering.append(NotAnswering(path, pid, error))
        log.debug("approval_router_not_answering", socket=str(path), pid=pid, error=error)

    async def _ask_all(self, request: dict[str, Any]) -> list[tuple[Path, dict[str, Any]]]:
        """Every router's reply, asked at once (a hung router costs one timeout, not one each)."""
        sockets = self.sockets()
        replies = await asyncio.gather(*(self._ask(path, request) for path in sockets))
        return [(path, reply) for path, reply in zip(sockets, replies, strict=True) if reply is not None]

    def _nobody(self) -> StockadeError:
        """The error when no router answered: where the CLI looked, and which did not answer."""
        if self.not_answering:
            return StockadeError(f"no router answered: {self._silent_summary()}")
        where = ", ".join(str(d) for d in self._directories)
        return StockadeError(
            f"no running router keeps approvals here ({where}): start `stockade mcp` or "
            "`stockade serve` with these settings (the same STOCKADE_AUDIT__PATH), or point "
            "STOCKADE_STORE__URL at the routers' Redis"
        )

    def _silent_summary(self) -> str:
        return "; ".join(f"{s.socket} (pid {s.pid}) is not answering: {s.error}" for s in self.not_answering)

    async def list(self, status: ApprovalStatus | None = None) -> list[Approval]:
        replies = await self._ask_all({"op": "list", "status": status.value if status else None})
        if not replies:
            raise self._nobody()
        found: list[Approval] = []
        for _, reply in replies:
            found.extend(Approval.model_validate(a) for a in reply.get("approvals", []))
        return sorted(found, key=lambda a: a.created_at)

    async def _holder(self, approval_id: str) -> tuple[Path, Approval]:
        """The socket of the router that holds the approval, and the approval: the first to say
        so (all are asked at once; one that hangs delays only a search that finds nothing)."""
        request = {"op": "get", "id": approval_id}

        async def ask(path: Path) -> tuple[Path, dict[str, Any] | None]:
            return path, await self._ask(path, request)

        asks = [asyncio.ensure_future(ask(path)) for path in self.sockets()]
        errors: list[dict[str, Any]] = []
        try:
            for next_reply in asyncio.as_completed(asks):
                path, reply = await next_reply
                if reply is not None and "approval" in reply:
                    return path, Approval.model_validate(reply["approval"])
                if reply is not None:
                    error = reply.get("error")
                    errors.append(error if isinstance(error, dict) else {})
        finally:
            for task in asks:
                task.cancel()
            await asyncio.gather(*asks, return_exceptions=True)  # each closes its connection
        if not errors:
            raise self._nobody()
        if self.not_answering:  # it may be held by a router that did not answer
            raise StockadeError(f"no answering router holds approval {approval_id}; {self._silent_summary()}")
        known = [e for e in errors if not str(e.get("message", "")).startswith("no approval ")]
        raise _raised((known or errors)[0], f"no approval {approval_id}")

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
            error = reply.get("error")
            raise _raised(
                error if isinstance(error, dict) else {}, f"the router at {path} did not decide {approval_id}"
            )
        return Approval.model_validate(reply["approval"])


def _raised(error: dict[str, Any], fallback: str) -> StockadeError:
    """The exception a router's error reply stands for, so the CLI's exit code says what happened:
    `ApprovalError` for a decision refused (an ``approval.*`` code: not pending, the agent's own,
    unknown); the router's failure (``audit.unavailable``: `AuditError`, ``store.unavailable``:
    `StoreError`) or a request it would not take (``request.invalid``, ``auth.forbidden``) as such,
    never as a refusal. ``fallback``: the message when the reply has none."""
    code, message = str(error.get("code", "")), str(error.get("message", fallback))
    if code.startswith("approval."):
        return ApprovalError(message)
    for failure in (AuditError, StoreError):
        if code == failure.code:
            return failure(message)
    raised = StockadeError(message)
    if code:
        raised.code = code[:100]  # the router's code, for a caller that reads it
    return raised
