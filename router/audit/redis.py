"""`RedisAuditLog`: one hash chain for routers on different hosts, in a Redis stream.

Each event is one stream entry (``stockade:audit``, field ``event``: the canonical JSON with its
chain fields); ``stockade:audit:head`` holds the last seq and hash. The router computes the next
event's hash from the head it knows, and one Lua script appends it only if that is still the
head (XADD and the head update together, atomically); if another router appended first, the
script answers with the current head and the router chains onto that instead. Neither key
expires: the audit log is the system of record (Redis should run with AOF, as compose.yaml does).

Two faults the stream cannot see by itself are handled here:

- **Redis down.** An event the stream cannot take is written to this router's local spool (an
  fsynced JSONL log with its own chain, `JsonlAuditLog`) before `append` raises `AuditError`, so
  the call is denied and its refusal is still on record. When Redis answers again, the spooled
  events are chained into the stream first, in spool order, each labelled ``spool`` with the spool
  file and its seq there (so an auditor sees they were written late, and where they were first),
  and only then the new event.
- **Redis lost data** (restarted without persistence, a failover to a lagging replica). The router
  remembers the last head it appended (in memory and in a file beside the spool, so a restart
  remembers too). A stream whose head is behind that is a chain that went backwards: the router
  refuses to extend it (every append spools and raises), says so in `check()` (/readyz), and an
  operator who has looked into it accepts the new head by deleting the file and restarting.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
from pathlib import Path
from typing import Any

import redis.asyncio
import redis.exceptions
import structlog

from router.audit.base import GENESIS_HASH, AuditEvent, AuditFilter, VerifyReport, as_written, matches
from router.audit.chain import Unsealed, check_link
from router.audit.jsonl import JsonlAuditLog
from router.errors import AuditError
from router.store import keys

log = structlog.get_logger(__name__)

STREAM = f"{keys.PREFIX}audit"
HEAD = f"{keys.PREFIX}audit:head"
_MAX_RETRIES = 64

# KEYS: stream, head. ARGV: expected seq, expected hash, the event's canonical JSON (chained to them),
# the genesis hash, then the last event this router appended: its seq, stream entry id and hash
# ("0", "", "" if none). Appends and moves the head if the head is still the expected one; returns
# {1, entry id}, or {0, seq, hash} if another router moved it, or {2, seq, hash} if the stream no
# longer holds what this router appended (its head is behind it, or that entry is gone or
# different: Redis lost data, even if other routers have since appended past it).
_APPEND = """
local head = redis.call('HMGET', KEYS[2], 'seq', 'hash')
local seq, hash = head[1] or '0', head[2] or ARGV[4]
if tonumber(seq) < tonumber(ARGV[5]) then return {2, seq, hash} end
if ARGV[6] ~= '' then
  local mine = redis.call('XRANGE', KEYS[1], ARGV[6], ARGV[6])
  if #mine == 0 or not string.find(mine[1][2][2], ARGV[7], 1, true) then return {2, seq, hash} end
end
if seq ~= ARGV[1] or hash ~= ARGV[2] then return {0, seq, hash} end
local document = cjson.decode(ARGV[3])
local id = redis.call('XADD', KEYS[1], '*', 'event', ARGV[3])
redis.call('HSET', KEYS[2], 'seq', tostring(document['seq']), 'hash', document['hash'])
return {1, id}
"""


class RedisAuditLog:
    """`AuditLog` on a Redis stream shared by every router pointed at the same server, with a local
    spool for what the stream cannot take (see the module docstring)."""

    def __init__(
        self, url: str, *, timeout_s: float = 2.0, spool_dir: Path | None = None, instance: str = "router"
    ) -> None:
        self._spool_lock: int | None = None
        spool: Path | None = None
        if spool_dir is not None:
            self._spool_lock, spool = _claim_spool(spool_dir, instance)
        self._redis = redis.asyncio.Redis.from_url(
            url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._append = self._redis.register_script(_APPEND)
        self._lock = asyncio.Lock()
        self._seq, self._head = 0, GENESIS_HASH
        self._spool = JsonlAuditLog(spool) if spool is not None else None
        self._pending = spool is not None and spool.exists() and spool.stat().st_size > 0
        self._memory = spool.with_name(spool.name + ".redis-head") if spool is not None else None
        # The last event this router (ever) appended: seq, stream entry id, hash.
        self._appended, self._appended_id, self._appended_hash = _read_memory(self._memory)
        self._memory_fd: int | None = None
        self.regressed: str | None = None  # why the stream is refused, once it went backwards

    async def append(self, event: AuditEvent) -> AuditEvent:
        event, unsealed = as_written(event)
        async with self._lock:
            try:
                if self.regressed is not None:
                    raise AuditError(self.regressed)
                await self._drain()
                return await self._put(event, unsealed)
            except AuditError as exc:
                await self._to_spool(event, exc)
                raise
            except Exception as exc:  # any fault here must deny the call (audited), never escape
                error = AuditError(f"cannot append to the audit stream: {type(exc).__name__}: {exc}")
                await self._to_spool(event, error)
                raise error from exc

    async def _put(self, event: AuditEvent, unsealed: Unsealed) -> AuditEvent:
        """Chain ``event`` onto the stream's head (retrying if another router moved it)."""
        try:
            for _ in range(_MAX_RETRIES):
                chain: dict[str, Any] = {"seq": self._seq + 1, "prev_hash": self._head}
                chain["hash"], text = unsealed.seal(self._seq + 1, self._head)
                answer = await self._append(
                    [STREAM, HEAD],
                    [str(self._seq), self._head, text, GENESIS_HASH, str(self._appended), self._appended_id,
                     self._appended_hash],
                )  # fmt: skip
                if int(answer[0]) == 1:
                    self._seq, self._head = chain["seq"], chain["hash"]
                    self._remember(self._seq, str(answer[1]), self._head)
                    return event.model_copy(update=chain)
                seq, head = int(answer[1]), str(answer[2])  # another router appended first
                if int(answer[0]) == 2:
                    self.regressed = (
                        f"the audit stream went backwards: its head is seq {seq}, and it no longer holds "
                        f"seq {self._appended} as this router appended it (Redis lost data?). Appends are refused and "
                        f"spooled; to accept the new head, delete {self._memory} and restart"
                    )
                    raise AuditError(self.regressed)
                self._seq, self._head = seq, head
        except (redis.exceptions.RedisError, OSError) as exc:
            raise AuditError(f"cannot append to the audit stream: {exc}; check that Redis is up") from exc
        raise AuditError(f"the audit stream's head moved {_MAX_RETRIES} times in a row; retry")

    async def _to_spool(self, event: AuditEvent, why: AuditError) -> None:
        """Keep ``event`` in the local spool; if that fails too, say so in ``why``'s message."""
        if self._spool is None:
            return
        try:
            await self._spool.append(event)
            self._pending = True
        except AuditError as exc:
            why.args = (f"{why}; the local spool failed too: {exc}",)

    async def _drain(self) -> None:
        """Chain every spooled event into the stream, oldest first; the spool is emptied once all
        are in. Raises `AuditError` (the spool is kept) if the stream refuses one."""
        if self._spool is None or not self._pending:
            return
        done = self._drained()
        # Read one event at a time: while Redis is down, the first put fails at once, so an
        # append costs the same whether the spool holds ten events or a day's outage.
        with self._spool.path.open("rb") as handle:
            for line in handle:
                if not line.strip():
                    continue
                document = json.loads(line)
                if document["seq"] <= done:
                    continue  # chained before a crash cut this drain short
                labels = {**document.get("labels", {}), "spool": f"{self._spool.path.name}#{document['seq']}"}
                body = {k: v for k, v in document.items() if k not in ("seq", "prev_hash", "hash")}
                spooled = AuditEvent.model_validate({**body, "labels": labels})
                await self._put(*as_written(spooled))
                self._progress(document["seq"])
        path = self._spool.path
        await self._spool.aclose()
        await asyncio.to_thread(self._clear_spool)
        # A fresh writer: the old one's notion of what is synced belongs to the truncated file.
        self._spool = JsonlAuditLog(path)
        self._pending = False

    def _progress_path(self) -> Path:
        assert self._spool is not None  # noqa: S101  (the caller checks)
        return self._spool.path.with_name(self._spool.path.name + ".drained")

    def _drained(self) -> int:
        try:
            return int(self._progress_path().read_text() or 0)
        except (OSError, ValueError):
            return 0

    def _progress(self, seq: int) -> None:
        self._progress_path().write_text(str(seq))

    def _clear_spool(self) -> None:
        assert self._spool is not None  # noqa: S101  (the caller checks)
        # The spool's events are in the stream now; a fresh spool starts a fresh chain. Progress
        # goes first: a crash between the two chains the old spool again (duplicates, labelled
        # with their spool seq) rather than skipping the new spool's first events.
        self._progress_path().unlink(missing_ok=True)
        os.truncate(self._spool.path, 0)

    def _remember(self, seq: int, entry_id: str, digest: str) -> None:
        self._appended, self._appended_id, self._appended_hash = seq, entry_id, digest
        if self._memory is None:
            return
        # One pwrite of a fixed-width record per append, no fsync: a crashed process's page cache
        # still reaches the file; a power loss may forget the last few, which only weakens the check.
        try:
            if self._memory_fd is None:
                self._memory.parent.mkdir(parents=True, exist_ok=True)
                self._memory_fd = os.open(self._memory, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o640)
            os.pwrite(self._memory_fd, f"{seq:020d} {entry_id:>41} {digest}\n".encode(), 0)
        except OSError as exc:  # memory in this process still holds; a restart may forget it
            log.warning("audit_head_memory_unwritable", path=str(self._memory), error=str(exc))

    async def check(self) -> str | None:
        if self.regressed is not None:
            return self.regressed
        try:
            await self._redis.ping()
        except (redis.exceptions.RedisError, OSError) as exc:
            return f"the audit stream is unreachable: {exc}"
        if self._pending:
            async with self._lock:
                try:
                    await self._drain()
                except AuditError as exc:
                    return f"spooled audit events cannot be chained into the stream: {exc}"
        return None

    async def _documents(self) -> list[dict[str, Any] | None]:
        try:
            entries = await self._redis.xrange(STREAM)
        except (redis.exceptions.RedisError, OSError) as exc:
            raise AuditError(f"cannot read the audit stream: {exc}") from exc
        documents: list[dict[str, Any] | None] = []
        for _, fields in entries or []:
            try:
                value = json.loads((fields or {})["event"])
            except (KeyError, ValueError, TypeError):
                value = None
            documents.append(value if isinstance(value, dict) else None)
        return documents

    async def query(self, where: AuditFilter) -> list[AuditEvent]:
        found = []
        for document in await self._documents():
            if document is not None and matches(document, where):
                found.append(AuditEvent.model_validate(document))
                if where.limit is not None and len(found) >= where.limit:
                    break
        return found

    async def verify(self) -> VerifyReport:
        expected_seq, prev = 1, GENESIS_HASH
        for index, document in enumerate(await self._documents(), start=1):
            problem, seq = check_link(document, expected_seq, prev)
            if problem or document is None:
                return VerifyReport(False, expected_seq - 1, expected_seq - 1, prev, seq, index, problem)
            prev, expected_seq = document["hash"], expected_seq + 1
        return VerifyReport(True, expected_seq - 1, expected_seq - 1, prev)

    async def aclose(self) -> None:
        await self._redis.aclose()
        if self._spool is not None:
            await self._spool.aclose()
        if self._memory_fd is not None:
            os.close(self._memory_fd)
            self._memory_fd = None
        if self._spool_lock is not None:
            os.close(self._spool_lock)  # releases the spool for the next router on this host
            self._spool_lock = None


def _claim_spool(directory: Path, instance: str) -> tuple[int, Path]:
    """A spool file in ``directory`` that no other live process on this host uses, and the locked
    descriptor that keeps it ours: ``<instance>.jsonl``, else ``<instance>.1.jsonl`` and so on. A
    router restarted on the same instance name takes its old spool back (and drains it); two
    routers running on one host never drain each other's."""
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in instance)[:100] or "router"
    directory.mkdir(parents=True, exist_ok=True)
    for n in range(1024):
        path = directory / (f"{name}.jsonl" if n == 0 else f"{name}.{n}.jsonl")
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return fd, path
    raise AuditError(f"no free audit spool in {directory}: 1,024 routers hold one")


def _read_memory(path: Path | None) -> tuple[int, str, str]:
    """The last event a router recorded in ``path``: seq, stream entry id, hash (0, "", "" if none)."""
    if path is None:
        return 0, "", ""
    try:
        seq, entry_id, digest = path.read_text().split()
        return int(seq), entry_id, digest
    except (OSError, ValueError):
        return 0, "", ""
