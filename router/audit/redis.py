"""`RedisAuditLog`: one hash chain for routers on different hosts, in a Redis stream.

Each event is one stream entry (``stockade:audit``, field ``event``: its line as the JSONL log
writes it, `router.audit.chain`; field ``hash``: its hash); ``stockade:audit:head`` holds the last
seq and hash and the Merkle tree state after it, and the latest signed checkpoint, which is also
added to ``stockade:audit:checkpoints`` (any router signs the head every ``checkpoint_interval_s``
if it moved, and on shutdown). The router computes the next
event's hash from the head it knows, and one Lua script appends it only if that is still the
head (XADD and the head update together, atomically); if another router appended first, the
script answers with the current head and the router chains onto that instead. Neither key
expires: the audit log is the system of record (Redis should run with AOF, as compose.yaml does).
A router with a spool also lists the entry ids it appended (``stockade:audit:writer:...``, the
last 256, expiring a month after its last append), for the drain below.

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
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import random
import socket
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Any

import redis.asyncio
import redis.exceptions
import structlog

from router.audit.base import GENESIS_HASH, AuditEvent, AuditFilter, VerifyReport, as_written, matches, timestamp
from router.audit.chain import Unsealed, canonical, document_of, line_hash
from router.audit.checkpoint import Checkpoint, VerifyKey, latest_signed, sign_checkpoint
from router.audit.jsonl import JsonlAuditLog, LogOptions, keep_anchor, publish_file, read_anchor
from router.audit.layout import read_checkpoint_source
from router.audit.merkle import CompactRange, MerkleTree
from router.audit.verify import Walk, gather_checkpoints
from router.errors import AuditError
from router.store import keys
from router.store.redis import connect

log = structlog.get_logger(__name__)

STREAM = f"{keys.PREFIX}audit"
HEAD = f"{keys.PREFIX}audit:head"
# When another router moved the head, the put is tried again on the head it answered, at once the
# first time (the usual case with several routers: one appended since this one's last append).
# After a second loss in a row, each try waits a random while up to a bound that doubles with each
# loss (full jitter, from `_BACKOFF_BASE_S` to `_BACKOFF_CAP_S`): routers that lost together do not
# all come back together. Only after `_CONTENTION_S` of losses is the call denied.
_BACKOFF_BASE_S = 0.001
_BACKOFF_CAP_S = 0.05
_CONTENTION_S = 10.0

# KEYS: stream, head, this writer's list of entry ids. ARGV: expected seq, expected hash, the
# event's line (chained to them), the genesis hash, then the last event this router appended: its
# seq, stream entry id and hash ("0", "", "" if none), then the new event's seq, hash and the
# Merkle tree state after it (JSON), then "1" to add the entry id to the writer's list ("" not to).
# Appends and moves the head if the head is still the expected one; returns {1, entry id}, or
# {0, seq, hash, tree} if another router moved it, or {2, seq, hash} if the stream no longer holds
# what this router appended (its head is behind it, or that entry is gone or different: Redis lost
# data, even if other routers have since appended past it).
_APPEND = """
local head = redis.call('HMGET', KEYS[2], 'seq', 'hash', 'tree')
local seq, hash = head[1] or '0', head[2] or ARGV[4]
if tonumber(seq) < tonumber(ARGV[5]) then return {2, seq, hash} end
if ARGV[6] ~= '' then
  local mine = redis.call('XRANGE', KEYS[1], ARGV[6], ARGV[6])
  if #mine == 0 or mine[1][2][4] ~= ARGV[7] then return {2, seq, hash} end
end
if seq ~= ARGV[1] or hash ~= ARGV[2] then return {0, seq, hash, head[3] or ''} end
local id = redis.call('XADD', KEYS[1], '*', 'event', ARGV[3], 'hash', ARGV[9])
redis.call('HSET', KEYS[2], 'seq', ARGV[8], 'hash', ARGV[9], 'tree', ARGV[10])
if ARGV[11] == '1' then
  redis.call('RPUSH', KEYS[3], id)
  redis.call('LTRIM', KEYS[3], -WRITER_IDS, -1)
  redis.call('PEXPIRE', KEYS[3], WRITER_TTL_MS)
end
return {1, id}
"""

# KEYS: head, checkpoints stream. ARGV: the checkpoint (JSON), its size, the digest of the
# checkpoint it follows ("" for the first). Publishes it if the head's checkpoint is still that one
# and it is not smaller; returns 1 if published, 0 if another router published first.
_CHECKPOINT = """
local current = redis.call('HGET', KEYS[1], 'checkpoint_digest') or ''
if current ~= ARGV[3] then return 0 end
redis.call('XADD', KEYS[2], '*', 'checkpoint', ARGV[1])
redis.call('HSET', KEYS[1], 'checkpoint', ARGV[1], 'checkpoint_digest', ARGV[4])
return 1
"""
CHECKPOINTS = f"{keys.PREFIX}audit:checkpoints"
_READ_CHUNK = 2000
# Entries after this router's last known append that a drain looks through for spooled events
# already in the stream (an append whose answer was lost to a timeout, though Redis ran it), when
# the writer's own list of entries (below) cannot say which are its own.
_LOST_ANSWERS_WINDOW = 10_000
# Each writer (a router's spool) keeps the ids of its last `_WRITER_IDS` entries in
# ``stockade:audit:writer:<host>:<spool>``, added by the append script itself: a drain finds the
# entries a lost answer left in the stream however many other routers appended since. The list
# expires `_WRITER_TTL_MS` after the writer's last append (a router gone for good leaves no key).
_WRITER_IDS = 256
_WRITER_TTL_MS = 30 * 24 * 3600 * 1000


class RedisAuditLog:
    """`AuditLog` on a Redis stream shared by every router pointed at the same server, with a local
    spool for what the stream cannot take (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 2.0,
        spool_dir: Path | None = None,
        instance: str = "router",
        options: LogOptions | None = None,
    ) -> None:
        self._options = options or LogOptions()
        self._signer = self._options.signer
        self._timer: asyncio.TimerHandle | None = None
        self._checkpoint_task: asyncio.Task[None] | None = None
        self._tree = CompactRange()
        self._spool_lock: int | None = None
        spool: Path | None = None
        if spool_dir is not None:
            self._spool_lock, spool = _claim_spool(spool_dir, instance)
        # Anyone with access to Redis can add an entry that is not UTF-8: decoded strictly, one such
        # reply would raise wherever it is read. Surrogate escapes keep its bytes (`_raw`) instead.
        self._redis = connect(url, timeout_s, decode_responses=True, encoding_errors="surrogateescape")
        script = _APPEND.replace("WRITER_IDS", str(_WRITER_IDS)).replace("WRITER_TTL_MS", str(_WRITER_TTL_MS))
        self._append = self._redis.register_script(script)
        self._publish = self._redis.register_script(_CHECKPOINT)
        self._lock = asyncio.Lock()
        self._seq, self._head = 0, GENESIS_HASH
        self._spool = JsonlAuditLog(spool) if spool is not None else None
        self._pending = spool is not None and spool.exists() and spool.stat().st_size > 0
        self._memory = spool.with_name(spool.name + ".redis-head") if spool is not None else None
        # Only a router with a spool drains one, so only it needs its entries listed (`_landed`).
        self._writer = _writer_key(spool) if spool is not None else f"{STREAM}:writer:-"
        # The last event this router (ever) appended: seq, stream entry id, hash.
        self._appended, self._appended_id, self._appended_hash = _read_memory(self._memory)
        self._memory_fd: int | None = None
        self.regressed: str | None = None  # why the stream is refused, once it went backwards
        # The largest head this router saw the stream reach (its own appends, others' it chained
        # onto, checkpoints signed), kept across restarts at `LogOptions.anchor` as the last
        # checkpoint signed or seen: a stream behind it lost events, whoever appended them.
        anchored = read_anchor(self._options.anchor, self._options.log_name) if self._options.anchor else None
        self._anchored = anchored.size if anchored is not None else 0  # the size kept at the anchor
        self._seen = self._anchored

    async def append(self, event: AuditEvent) -> AuditEvent:
        event, unsealed = as_written(event, self._options.masks, self._options.mask_key)
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
        loop = asyncio.get_running_loop()
        deadline, losses = loop.time() + _CONTENTION_S, 0
        try:
            while True:
                chain: dict[str, Any] = {"seq": self._seq + 1, "prev_hash": self._head}
                chain["hash"], line = unsealed.seal(self._seq + 1, self._head)
                tree = self._tree.copy()
                tree.append(bytes.fromhex(chain["hash"]))
                answer = await self._append(
                    [STREAM, HEAD, self._writer],
                    [str(self._seq), self._head, line.decode(), GENESIS_HASH, str(max(self._appended, self._seen)),
                     self._appended_id, self._appended_hash, str(chain["seq"]), chain["hash"],
                     json.dumps(tree.to_json()), "1" if self._spool is not None else ""],
                )  # fmt: skip
                if int(answer[0]) == 1:
                    self._seq, self._head, self._tree = chain["seq"], chain["hash"], tree
                    self._seen = max(self._seen, self._seq)
                    self._remember(self._seq, str(answer[1]), self._head)
                    self._schedule_checkpoint()
                    return event.model_copy(update=chain)
                seq, head = int(answer[1]), str(answer[2])  # another router appended first
                if int(answer[0]) == 2:
                    raise self._regressed(seq)
                self._seq, self._head = seq, head
                self._seen = max(self._seen, seq)
                self._tree = CompactRange.from_json(json.loads(answer[3])) if answer[3] else CompactRange()
                if self._tree.size != seq:
                    raise AuditError(f"the audit stream's head (seq {seq}) holds no matching Merkle tree state")
                losses += 1
                if loop.time() >= deadline:
                    break
                if losses > 1:  # the first loss only says another router appended since: its answer is the head now
                    bound = min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2 ** min(losses - 1, 16))
                    await asyncio.sleep(random.uniform(0, bound))  # noqa: S311  (jitter, not a secret)
        except (redis.exceptions.RedisError, OSError) as exc:
            raise AuditError(f"cannot append to the audit stream: {exc}; check that Redis is up") from exc
        raise AuditError(f"the audit stream's head moved {losses} times in {_CONTENTION_S:g}s (other routers "
                         "appending); retry")  # fmt: skip

    def _regressed(self, seq: int) -> AuditError:
        """Refuse the stream from now on: its head (seq ``seq``) is behind what this router appended
        or saw it reach."""
        reached = max(self._appended, self._seen)
        kept = " and ".join(str(path) for path in (self._memory, self._options.anchor) if path is not None)
        self.regressed = (
            f"the audit stream went backwards: its head is seq {seq}, but this router saw it reach seq {reached}, "
            f"or it no longer holds seq {self._appended} as this router appended it (Redis lost data, or was "
            f"restored from an older copy?). Appends are refused and spooled; `stockade audit verify` checks the "
            f"stream against the published checkpoints; to accept the new head, delete {kept or 'nothing'} and restart"
        )
        log.error("audit_stream_regressed", head=seq, reached=reached)
        return AuditError(self.regressed)

    # -- checkpoints ------------------------------------------------------------------------

    def _schedule_checkpoint(self) -> None:
        if self._signer is None or self._timer is not None:
            return
        self._timer = asyncio.get_running_loop().call_later(self._options.checkpoint_interval_s, self._timed)

    def _timed(self) -> None:
        self._timer = None
        self._checkpoint_task = asyncio.get_running_loop().create_task(self._checkpoint_quietly())

    async def _checkpoint_quietly(self) -> None:
        try:
            await self.checkpoint()
        except (AuditError, redis.exceptions.RedisError, OSError) as exc:  # the next timer tries again
            log.error("audit_checkpoint_failed", error=str(exc))

    async def checkpoint(self) -> Checkpoint | None:
        """Sign the stream's head as it stands now, unless it is signed already, and publish the
        checkpoint on the head, in the checkpoints stream and in the publish directory. Any
        router may sign; the first to publish for a given predecessor wins."""
        if self._signer is None:
            return None
        if self.regressed is not None:
            raise AuditError(self.regressed)
        # Held to what was seen before the head is read: an append of this router that ends while
        # the read is on its way goes past that read (it was taken for a regression mid-load).
        seen = self._seen
        seq, tree_json, current = await self._redis.hmget(HEAD, ["seq", "tree", "checkpoint"])
        if int(seq or 0) < seen:  # never sign a head behind one already seen: that history lost events
            raise self._regressed(int(seq or 0))
        previous = Checkpoint.model_validate_json(current) if current else None
        if previous is not None and previous.verify(self._signer.verify_key):
            self._seen = max(self._seen, previous.size)
        if seq is None or tree_json is None or (previous is not None and previous.size >= int(seq)):
            return previous
        tree = CompactRange.from_json(json.loads(tree_json))
        name = self._options.log_name
        prev = previous if previous is not None and previous.log == name else None
        checkpoint = sign_checkpoint(self._signer, log=name, size=tree.size, root=tree.root(), prev=prev)
        published = await self._publish(
            [HEAD, CHECKPOINTS],
            [checkpoint.signed_text().decode(), str(checkpoint.size), previous.digest() if previous else "",
             checkpoint.digest()],
        )  # fmt: skip
        if int(published):
            self._seen = max(self._seen, checkpoint.size)
            if self._options.anchor is not None and checkpoint.size > self._anchored:
                # Off Redis, beside the signing key: what this router's next start holds the stream to.
                self._anchored = checkpoint.size
                await asyncio.to_thread(keep_anchor, self._options.anchor, checkpoint)
            if self._options.publish_dir is not None:
                await asyncio.to_thread(publish_file, self._options.publish_dir, checkpoint)
        return checkpoint

    async def checkpoints(self) -> list[Checkpoint]:
        """Every checkpoint published on the stream, oldest first."""
        return [c for c in await self._read_checkpoints() if c is not None]

    async def head_checkpoint(self) -> Checkpoint | None:
        """The checkpoint the stream's head records (the latest published), if any readable."""
        try:
            return _checkpoint_or_none(await self._redis.hget(HEAD, "checkpoint"))
        except (redis.exceptions.RedisError, OSError) as exc:
            raise AuditError(f"cannot read the audit stream's head: {exc}") from exc

    async def _read_checkpoints(self) -> list[Checkpoint | None]:
        found: list[Checkpoint | None] = []
        try:
            entries = await self._redis.xrange(CHECKPOINTS)
        except (redis.exceptions.RedisError, OSError) as exc:
            raise AuditError(f"cannot read the audit checkpoints: {exc}") from exc
        for _, fields in entries or []:
            try:
                found.append(Checkpoint.model_validate_json((fields or {})["checkpoint"]))
            except (KeyError, ValueError):
                found.append(None)
        return found

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
        torn = await self._repair_spool()
        done = self._drained()
        landed: set[str] | None = None
        # The spool's own chain, followed as it is read: a line deleted, moved or edited while it
        # waited breaks it, and the break is on record in the stream before the rest goes in.
        seq, prev, broken = 1, GENESIS_HASH, False
        # Read one event at a time: while Redis is down, the first put fails at once, so an
        # append costs the same whether the spool holds ten events or a day's outage.
        with self._spool.path.open("rb") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                document = _spooled_document(line, self._spool.path, number)
                # (a break before what an earlier drain chained in is on record from that drain)
                if (
                    not broken
                    and document["seq"] > done
                    and (document["seq"] != seq or document.get("prev_hash") != prev)
                ):
                    broken = True
                    await self._put(*as_written(_spool_broken(self._spool.path, seq, document)))
                seq, prev = document["seq"] + 1, line_hash(line.rstrip(b"\n")).hex()
                if document["seq"] <= done:
                    continue  # chained before a crash cut this drain short
                labels = {**document.get("labels", {}), "spool": f"{self._spool.path.name}#{document['seq']}"}
                body = {k: v for k, v in document.items() if k not in ("seq", "prev_hash", "hash")}
                spooled, unsealed = as_written(AuditEvent.model_validate({**body, "labels": labels}))
                if landed is None:
                    landed = await self._landed()
                # Its put timed out, but Redis ran it: in the stream already, never twice. Either put:
                # the append that spooled it (as it is in the spool) or an earlier drain's (labelled).
                if _body(document) in landed or _sealed_body(unsealed) in landed:
                    log.warning("audit_spooled_event_in_stream", spool_seq=document["seq"], kind=document.get("kind"))
                    self._progress(document["seq"])
                    continue
                await self._put(spooled, unsealed)
                self._progress(document["seq"])
        if torn is not None:
            await self._put(*as_written(torn))
        path = self._spool.path
        await self._spool.aclose()
        await asyncio.to_thread(self._clear_spool)
        # A fresh writer: the old one's notion of what is synced belongs to the truncated file.
        self._spool = JsonlAuditLog(path)
        self._pending = False

    async def _repair_spool(self) -> AuditEvent | None:
        """Have the spool's own log set aside a last line a crash cut short (it does when it
        loads, `JsonlAuditLog`): that line was never acknowledged, so it is not an event to chain.
        Returns the event recording it, for the stream (the spool's own record of it goes with the
        spool when the drain empties it).

        Raises:
            AuditError: the torn line is still there (the spool's log was loaded before the crash
                tore it, or could not set it aside); the append that spools next sets it aside.
        """
        assert self._spool is not None  # noqa: S101  (the caller checks)
        path = self._spool.path
        before = _size(path)
        if before == 0 or _last_byte(path) == b"\n":
            return None
        problem = await self._spool.check()
        after = _size(path)
        if after >= before:
            raise AuditError(f"the audit spool {path} ends in a torn line that is not set aside yet ({problem})")
        aside = path.with_name(f"{path.name}.torn-{after}")
        try:
            digest = hashlib.sha256(aside.read_bytes()).hexdigest()
        except OSError as exc:
            digest = f"unreadable: {exc.strerror}"
        return AuditEvent(
            kind="error", decision_id=str(uuid.uuid4()), timestamp=timestamp(), outcome="audit_torn_tail",
            labels={"spool": f"{path.name}#torn-{after}"},
            result={"code": "audit.torn_tail", "offset": after, "length": before - after, "sha256": digest,
                    "set_aside": aside.name,
                    "message": "the spool's last line, cut short by a crash (never acknowledged), was moved aside"},
        )  # fmt: skip

    async def _landed(self) -> set[str]:
        """The events (chain fields aside, `_body`) this router appended after its last known
        append: a put whose answer was lost to a timeout may have landed. Read from the writer's
        list of entry ids when that covers the time since; else from the `_LOST_ANSWERS_WINDOW`
        entries after the last known append (whoever wrote them)."""
        try:
            entries = await self._own_entries()
            if entries is None:
                start = f"({self._appended_id}" if self._appended_id else "-"
                entries = await self._redis.xrange(STREAM, min=start, count=_LOST_ANSWERS_WINDOW)
        except (redis.exceptions.RedisError, OSError) as exc:
            raise AuditError(f"cannot append to the audit stream: {exc}; check that Redis is up") from exc
        found = set()
        for _, fields in entries or []:
            # Parsed from its bytes: an entry that is not UTF-8 (UnicodeDecodeError is a ValueError)
            # or not an event is no event of ours.
            with contextlib.suppress(ValueError, TypeError, AttributeError, RecursionError):
                found.add(_body(json.loads(_raw((fields or {}).get("event", "")))))
        return found

    async def _own_entries(self) -> list[Any] | None:
        """The entries this writer appended after its last known append, by its list of entry ids;
        None if the list cannot say (gone, or trimmed past that append)."""
        ids = [str(i) for i in await self._redis.lrange(self._writer, 0, -1)]
        known = _entry_id(self._appended_id) if self._appended_id else None
        newer = [i for i in ids if known is None or _entry_id(i) > known]
        complete = len(newer) < len(ids) if known is not None else 0 < len(ids) < _WRITER_IDS
        if not complete:
            return None
        async with self._redis.pipeline(transaction=False) as pipe:
            for entry in newer:
                pipe.xrange(STREAM, min=entry, max=entry)
            found: list[list[Any]] = await pipe.execute() if newer else []
        return [entry for entries in found for entry in entries]

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
        seen = self._seen  # before the read, as in `checkpoint`
        try:
            head = await self._redis.hget(HEAD, "seq")
        except (redis.exceptions.RedisError, OSError) as exc:
            return f"the audit stream is unreachable: {exc}"
        if not str(head or 0).isdigit():
            return f"the audit stream's head ({HEAD}) holds no seq: {str(head)[:64]!r}"
        if int(head or 0) < seen:
            return str(self._regressed(int(head or 0)))
        self._seen = max(self._seen, int(head or 0))  # each probe (/readyz) notes how far the stream has come
        if self._pending:
            async with self._lock:
                try:
                    await self._drain()
                except AuditError as exc:
                    return f"spooled audit events cannot be chained into the stream: {exc}"
                except Exception as exc:  # a probe reports, never raises (as `append` denies)
                    return f"spooled audit events cannot be chained into the stream: {type(exc).__name__}: {exc}"
        return None

    async def _chunks(self) -> AsyncIterator[tuple[list[str], list[bytes]]]:
        """The stream's entry ids and lines (as the bytes Redis holds), oldest first, a chunk at a
        time (never the whole stream in memory)."""
        after = "-"
        while True:
            try:
                entries = await self._redis.xrange(STREAM, min=after, count=_READ_CHUNK)
            except (redis.exceptions.RedisError, OSError) as exc:
                raise AuditError(f"cannot read the audit stream: {exc}") from exc
            if not entries:
                return
            yield (
                [str(entry_id) for entry_id, _ in entries],
                [_raw((fields or {}).get("event", "")) for _, fields in entries],
            )
            if len(entries) < _READ_CHUNK:
                return
            after = "(" + str(entries[-1][0])

    async def query(self, where: AuditFilter) -> list[AuditEvent]:
        found = []
        async for ids, chunk in self._chunks():
            for entry_id, line in zip(ids, chunk, strict=True):
                document = document_of(line)
                if document is None or not matches(document, where):
                    continue
                try:
                    found.append(AuditEvent.model_validate(document))
                except ValueError:  # an entry not written by stockade (`verify` reports where the chain breaks)
                    log.warning("audit_stream_entry_unreadable", entry=entry_id)
                    continue
                if where.limit is not None and len(found) >= where.limit:
                    return found
        return found

    async def inclusion_proofs(
        self, seqs: Sequence[int], *, keys: Sequence[VerifyKey] | None = None
    ) -> tuple[Checkpoint, dict[int, tuple[bytes, list[str]]]]:
        """An RFC 9162 inclusion proof of each of ``seqs`` against the stream's latest checkpoint,
        with each event's line: as `router.audit.verify.inclusion_proofs` for the JSONL log. With
        ``keys``, the latest one of them signed: anyone who can write to the Redis can add a
        checkpoint, and a proof against one unsigned proves nothing.

        Raises:
            AuditError: no checkpoint (signed by ``keys``) yet, a seq it does not cover, or a stream
                that does not match it.
        """
        checkpoints = await self.checkpoints()
        if not checkpoints:
            raise AuditError("the audit stream has no checkpoint yet: nothing to prove against")
        checkpoint = latest_signed(checkpoints, keys)
        if checkpoint is None:
            raise AuditError("no checkpoint of the audit stream is signed by the log's public key: nothing to "
                             "prove against; run `stockade audit verify`")  # fmt: skip
        wanted = set(seqs)
        for seq in wanted:
            if not 1 <= seq <= checkpoint.size:
                raise AuditError(f"seq {seq} is not covered by the latest checkpoint (size {checkpoint.size})")
        leaves: list[bytes] = []
        found: dict[int, bytes] = {}
        async for _, chunk in self._chunks():
            for line in chunk:
                if len(leaves) >= checkpoint.size:
                    break
                leaves.append(line_hash(line))
                if len(leaves) in wanted:
                    found[len(leaves)] = line
        if len(leaves) < checkpoint.size:
            raise AuditError("the audit stream does not match its latest checkpoint; run `stockade audit verify`")
        # The tree once, in a worker thread (a hash per event: the event loop keeps serving); each
        # proof is then a few lookups.
        tree = await asyncio.to_thread(MerkleTree, leaves)
        if tree.root().hex() != checkpoint.root:
            raise AuditError("the audit stream does not match its latest checkpoint; run `stockade audit verify`")
        return checkpoint, {seq: (found[seq], [node.hex() for node in tree.inclusion_proof(seq - 1)]) for seq in seqs}

    async def verify(
        self, *, keys: Sequence[VerifyKey] = (), trusted: Sequence[Checkpoint] = (), publish_dir: Path | None = None
    ) -> VerifyReport:
        """Check the stream against every checkpoint known: ``trusted`` (the auditor's), those in
        ``publish_dir`` (where the routers publish, out of Redis's reach), the head's and the
        checkpoints stream's; a chunk at a time, hashing in a worker thread so the event loop keeps
        serving. A stream rolled back (a restored copy, a lagging replica) or cut, with its
        checkpoints, shows against a checkpoint kept outside Redis."""
        if not keys and self._signer is not None:
            keys = [VerifyKey.from_pem(self._signer.public_pem())]
        # The head first: the checkpoint it records is in the checkpoints stream by then (one script
        # publishes both), and every event it records is in the stream.
        try:
            head_seq, head_hash, head_checkpoint = await self._redis.hmget(HEAD, ["seq", "hash", "checkpoint"])
        except (redis.exceptions.RedisError, OSError) as exc:
            raise AuditError(f"cannot read the audit stream's head: {exc}") from exc
        checkpoints = await self._read_checkpoints()
        at_head = _checkpoint_or_none(head_checkpoint)
        # Those Redis cannot rewrite first: where two disagree at one size, theirs is the root held to.
        sources: list[tuple[str, Iterable[Checkpoint | None]]] = [("the auditor's checkpoint", trusted)]
        if publish_dir is not None:
            sources.append((str(publish_dir), list(read_checkpoint_source(publish_dir))))
        if head_checkpoint:
            sources.append((f"the head's checkpoint ({HEAD})", [at_head]))
        sources.append(("stream checkpoints", checkpoints))
        found = gather_checkpoints(sources, keys, chained="stream checkpoints")
        if at_head is not None and at_head not in checkpoints:
            found.problems.append(f"the checkpoints stream ({CHECKPOINTS}) does not hold the head's checkpoint (size "
                                  f"{at_head.size}): checkpoints were removed or replaced")  # fmt: skip
        recorded = int(head_seq) if head_seq is not None and str(head_seq).isdigit() else 0
        walk = Walk(found)
        number = 0
        line_at_head: str | None = None  # the hash of the line at the head's seq (lines are seqs while the walk holds)
        async for ids, chunk in self._chunks():
            await asyncio.to_thread(walk.feed, chunk, STREAM, number + 1)
            if number < recorded <= number + len(chunk):
                line_at_head = line_hash(chunk[recorded - number - 1]).hex()
            if walk.report is not None:
                if walk.report.line is not None and number < walk.report.line <= number + len(chunk):
                    entry = ids[walk.report.line - number - 1]
                    walk.report = dataclasses.replace(
                        walk.report, problem=f"{walk.report.problem}; stream entry {entry}"
                    )
                break
            number += len(chunk)
        report = walk.finish(found)
        if not report.ok or not recorded:
            return report
        # A cut tail leaves a chain that holds by itself; the head still records where it ended.
        if report.events < recorded:
            problem = (f"the stream ends at seq {report.events}, but its head ({HEAD}) records seq {recorded}: "
                       f"events {report.events + 1}..{recorded} were cut off")  # fmt: skip
            return dataclasses.replace(report, ok=False, broken_seq=report.events + 1, problem=problem, notes=())
        if line_at_head != head_hash:
            problem = (f"event seq {recorded} is not the one the stream's head ({HEAD}) records: events up to it "
                       "were replaced or rewritten")  # fmt: skip
            return dataclasses.replace(report, ok=False, broken_seq=recorded, problem=problem, notes=())
        return report

    async def aclose(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._checkpoint_task is not None:
            await asyncio.gather(self._checkpoint_task, return_exceptions=True)
        if self._signer is not None and not self.regressed:
            with contextlib.suppress(AuditError, redis.exceptions.RedisError, OSError):
                await self.checkpoint()  # the tail is signed at shutdown
        await self._redis.aclose()
        if self._spool is not None:
            await self._spool.aclose()
        if self._memory_fd is not None:
            os.close(self._memory_fd)
            self._memory_fd = None
        if self._spool_lock is not None:
            os.close(self._spool_lock)  # releases the spool for the next router on this host
            self._spool_lock = None


def _checkpoint_or_none(text: str | bytes | None) -> Checkpoint | None:
    """The checkpoint in ``text`` (a Redis field), None if there is none or it is unreadable."""
    if not text:
        return None
    try:
        return Checkpoint.model_validate_json(text)
    except ValueError:
        return None


def _raw(value: object) -> bytes:
    """A field's bytes as Redis holds them (the client decodes with surrogate escapes: lossless)."""
    return str(value).encode(errors="surrogateescape")


def _sealed_body(unsealed: Unsealed) -> str:
    """`_body` of the line a put of ``unsealed`` writes, wherever it is chained."""
    return _body(json.loads(unsealed.seal(1, GENESIS_HASH)[1]))


def _spool_broken(spool: Path, expected: int, found: dict[str, Any]) -> AuditEvent:
    """The record that the spool's chain breaks where seq ``expected`` should be (``found`` is
    there): it was changed while it waited (the spool has no signature: a rewrite of its whole
    chain is not seen)."""
    message = (f"the audit spool {spool} does not chain at seq {expected} (it holds seq {found.get('seq')} there): "
               "an event deleted, moved or changed while it waited; what it holds is chained in as it is")  # fmt: skip
    log.error("audit_spool_broken", path=str(spool), seq=expected)
    return AuditEvent(
        kind="error", decision_id=str(uuid.uuid4()), timestamp=timestamp(), outcome="audit_spool_broken",
        result={"code": "audit.spool_broken", "seq": expected, "path": str(spool), "message": message},
    )  # fmt: skip


def _spooled_document(line: bytes, spool: Path, number: int) -> dict[str, Any]:
    """An event as the spool holds it (a whole line: the drain repairs a torn one first).

    Raises:
        AuditError: the line is no event (kept: the spool is not emptied, the operator looks).
    """
    try:
        document = json.loads(line) if line.endswith(b"\n") else None
    except (ValueError, RecursionError):
        document = None
    if not isinstance(document, dict) or not isinstance(document.get("seq"), int):
        raise AuditError(f"the audit spool {spool} line {number} is not an event; move the spool aside to look into it")
    return document


def _size(path: Path) -> int:
    """A spool's size in bytes (0: none)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _last_byte(path: Path) -> bytes:
    """A non-empty file's last byte: a newline unless a crash cut its last line short."""
    with path.open("rb") as handle:
        handle.seek(-1, os.SEEK_END)
        return handle.read(1)


def _body(document: dict[str, Any]) -> str:
    """An event as written, but for where it was chained (seq, prev_hash, hash): the same for its
    copy in the spool and in the stream."""
    return canonical({k: v for k, v in document.items() if k not in ("seq", "prev_hash", "hash")})


def _claim_spool(directory: Path, instance: str) -> tuple[int, Path]:
    """A spool file in ``directory`` that no other live process on this host uses, and the locked
    descriptor that keeps it ours: ``<instance>.jsonl``, else ``<instance>.1.jsonl`` and so on. A
    router restarted on the same instance name takes its old spool back (and drains it); two
    routers running on one host never drain each other's."""
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in instance)[:100] or "router"
    directory.mkdir(parents=True, exist_ok=True)
    for n in range(1024):
        path = directory / (f"{name}.jsonl" if n == 0 else f"{name}.{n}.jsonl")
        # ``.claim``, not ``.lock``: the spool's own log takes ``<spool>.lock`` for its appends.
        fd = os.open(path.with_name(path.name + ".claim"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return fd, path
    raise AuditError(f"no free audit spool in {directory}: 1,024 routers hold one")


def _writer_key(spool: Path) -> str:
    """The key of the list of entry ids the router writing to ``spool`` appended: named after the
    host and the spool's path, which no other live router on the host holds (`_claim_spool`)."""
    where = hashlib.sha256(str(spool.resolve()).encode()).hexdigest()[:16]
    return f"{STREAM}:writer:{socket.gethostname()}:{where}"


def _entry_id(entry: str) -> tuple[int, int]:
    """A stream entry id (``<ms>-<n>``) as numbers, which order as Redis orders the entries."""
    ms, _, n = entry.partition("-")
    return int(ms), int(n or 0)


def _read_memory(path: Path | None) -> tuple[int, str, str]:
    """The last event a router recorded in ``path``: seq, stream entry id, hash (0, "", "" if none)."""
    if path is None:
        return 0, "", ""
    try:
        seq, entry_id, digest = path.read_text().split()
        return int(seq), entry_id, digest
    except (OSError, ValueError):
        return 0, "", ""
