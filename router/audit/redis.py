"""`RedisAuditLog`: one hash chain for routers on different hosts, in a Redis stream.

Each event is one stream entry (``stockade:audit``, field ``event``: the canonical JSON with its
chain fields); ``stockade:audit:head`` holds the last seq and hash. The router computes the next
event's hash from the head it knows, and one Lua script appends it only if that is still the
head (XADD and the head update together, atomically); if another router appended first, the
script answers with the current head and the router chains onto that instead. Neither key
expires: the audit log is the system of record (Redis should run with AOF, as compose.yaml does).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import redis.asyncio
import redis.exceptions

from router.audit.base import GENESIS_HASH, AuditEvent, AuditFilter, VerifyReport, as_written, matches
from router.audit.chain import Unsealed, check_link
from router.errors import AuditError
from router.store import keys

STREAM = f"{keys.PREFIX}audit"
HEAD = f"{keys.PREFIX}audit:head"
_MAX_RETRIES = 64

# KEYS: stream, head. ARGV: expected seq, expected hash, the event's canonical JSON (chained to them).
# Appends and moves the head if the head is still the expected one; returns {1} or {0, seq, hash}.
_APPEND = """
local head = redis.call('HMGET', KEYS[2], 'seq', 'hash')
local seq, hash = head[1] or '0', head[2] or ARGV[4]
if seq ~= ARGV[1] or hash ~= ARGV[2] then return {0, seq, hash} end
local document = cjson.decode(ARGV[3])
redis.call('XADD', KEYS[1], '*', 'event', ARGV[3])
redis.call('HSET', KEYS[2], 'seq', tostring(document['seq']), 'hash', document['hash'])
return {1}
"""


class RedisAuditLog:
    """`AuditLog` on a Redis stream shared by every router pointed at the same server."""

    def __init__(self, url: str, *, timeout_s: float = 2.0) -> None:
        self._redis = redis.asyncio.Redis.from_url(
            url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._append = self._redis.register_script(_APPEND)
        self._lock = asyncio.Lock()
        self._seq, self._head = 0, GENESIS_HASH

    async def append(self, event: AuditEvent) -> AuditEvent:
        event, document = as_written(event)
        unsealed = Unsealed(document)
        async with self._lock:
            try:
                for _ in range(_MAX_RETRIES):
                    chain: dict[str, Any] = {"seq": self._seq + 1, "prev_hash": self._head}
                    chain["hash"], text = unsealed.seal(self._seq + 1, self._head)
                    answer = await self._append([STREAM, HEAD], [str(self._seq), self._head, text, GENESIS_HASH])
                    if int(answer[0]) == 1:
                        self._seq, self._head = chain["seq"], chain["hash"]
                        return event.model_copy(update=chain)
                    self._seq, self._head = int(answer[1]), str(answer[2])  # another router appended first
            except (redis.exceptions.RedisError, OSError) as exc:
                raise AuditError(f"cannot append to the audit stream: {exc}; check that Redis is up") from exc
        raise AuditError(f"the audit stream's head moved {_MAX_RETRIES} times in a row; retry")

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
