"""`RedisStore`: the shared store, so several routers on one Redis act as one router.

Keys are in `router.store.keys`. Every update touching more than one key, or reading before it
writes, is one Lua script (atomic in Redis); the scripts are below, with their KEYS and ARGV.
Every key has a TTL. Errors from redis-py become `StoreError` here and nowhere else.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Awaitable, Collection, Iterator, Mapping
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio
import redis.exceptions
import structlog
from redis.maint_notifications import MaintNotificationsConfig

from policy.base import RATE_SCOPES, RateCounts
from router.approvals import Approval, ApprovalStatus
from router.errors import StoreError
from router.provenance import MAX_SOURCES, USER
from router.rates import BUCKETS, PERIODS
from router.rates import scopes as rate_scopes
from router.store import keys
from router.store.base import CallContext, PendingExternal, SessionRecord, checked_session_id
from router.store.keys import is_session_id
from router.wire import canonical_tool_name

T = TypeVar("T")

# KEYS: session, provenance, pending. ARGV: ttl_ms.
# Renews the session; returns its hash as a flat list, or nil if it is not open.
# KEYS: session, provenance, pending. ARGV: ttl_ms, the caller's agent ("" for the router itself).
# Renewed only for its own agent: another's request must not keep a session alive.
_LOAD_SESSION = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
if ARGV[2] == '' or redis.call('HGET', KEYS[1], 'agent') == ARGV[2] then
  for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[1]) end
end
return redis.call('HGETALL', KEYS[1])
"""

# KEYS: session, provenance. ARGV: ttl_ms, source, max_sources, taint ("" for none), key...
# Adds source to each key's newline-separated list (once, at most max_sources), taints the
# session; a closed session is left alone. Returns 1 if the session was open.
_RECORD_OUTPUT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'taint:' .. ARGV[4], '1') end
local source, limit = ARGV[2], tonumber(ARGV[3])
-- Which source each call's output is ('o:' is no key's prefix), for endorsement.
redis.call('HSET', KEYS[2], 'o:' .. string.match(source, '[^:]*$'), source)
local needle = '\\n' .. source .. '\\n'
for i = 5, #ARGV do
  local current = redis.call('HGET', KEYS[2], ARGV[i])
  if not current then
    redis.call('HSET', KEYS[2], ARGV[i], source)
  elseif not string.find('\\n' .. current .. '\\n', needle, 1, true) then
    local _, newlines = string.gsub(current, '\\n', '')
    if newlines + 1 < limit then redis.call('HSET', KEYS[2], ARGV[i], current .. '\\n' .. source) end
  end
end
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 1
"""

# KEYS: session, provenance. ARGV: call_id. Marks the source of the call's output endorsed in the
# session; returns that source, or false if the session is closed or the call left no output.
_ENDORSE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local source = redis.call('HGET', KEYS[2], 'o:' .. ARGV[1])
if not source then return false end
redis.call('HSET', KEYS[1], 'endorsed:' .. source, '1')
return source
"""

# KEYS: session. ARGV: label... Adds each as 'label:<label>' to an open session (its TTL unchanged).
# Returns 1 if the session was open.
_ADD_LABELS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for i = 1, #ARGV do redis.call('HSET', KEYS[1], 'label:' .. ARGV[i], '1') end
return 1
"""

# KEYS: pending. ARGV: call_id. Removes and returns the pending call's JSON, or nil.
_TAKE_REPORT = """
local value = redis.call('HGET', KEYS[1], ARGV[1])
if value then redis.call('HDEL', KEYS[1], ARGV[1]) end
return value
"""

# KEYS: approval, approvals index, session. ARGV: id, created_at (score), JSON, keep_ms, binding,
# the approval keys' prefix. The index lives as long as the longest-kept approval in it, and each
# put drops up to 8 of its oldest ids whose approvals are gone (else, with approvals flowing and no
# one listing them, it would grow for ever); an open session remembers the approval as the latest
# for its binding ('approval:<binding>' in its hash). If it remembers one still pending and
# unexpired (by Redis's clock, TIME), nothing is stored and that one's id is returned (identical
# calls held at once share one approval); else the new id.
_PUT_APPROVAL = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
for _, old in ipairs(redis.call('ZRANGE', KEYS[2], 0, 7)) do
  if redis.call('EXISTS', ARGV[6] .. old) == 0 then redis.call('ZREM', KEYS[2], old) end
end
local earlier = redis.call('EXISTS', KEYS[3]) == 1 and redis.call('HGET', KEYS[3], 'approval:' .. ARGV[5])
if earlier then
  local stored = redis.call('GET', ARGV[6] .. earlier)
  if stored then
    local found = cjson.decode(stored)
    if found['status'] == 'pending' and tonumber(found['expires_at']) > now then return earlier end
  end
end
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[4]) then redis.call('PEXPIRE', KEYS[2], ARGV[4]) end
if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('HSET', KEYS[3], 'approval:' .. ARGV[5], ARGV[1]) end
return ARGV[1]
"""

# KEYS: tools hash, registry version. ARGV: name, spec JSON, canonical name (lower case, '-' as
# '_'). Adds the tool unless the name, or another of the same canonical form, is taken; returns
# {the stored entry (the name's, else the first registered look-alike's), 1 if added}. Entries are
# {"version": n, "spec": ...}. The look-alikes are found by reading every name: registrations are
# rare and the registry small, and no index can fall out of step with the hash.
_PUT_TOOL = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if current then return {current, 0} end
local first, first_version = nil, nil
for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
  if (string.gsub(string.lower(name), '%-', '_')) == ARGV[3] then
    local entry = redis.call('HGET', KEYS[1], name)
    local version = tonumber(cjson.decode(entry)['version'])
    if first_version == nil or version < first_version then first, first_version = entry, version end
  end
end
if first then return {first, 0} end
local entry = '{"version":' .. redis.call('INCR', KEYS[2]) .. ',"spec":' .. ARGV[2] .. '}'
redis.call('HSET', KEYS[1], ARGV[1], entry)
return {entry, 1}
"""

# KEYS: approval. ARGV: expected status, new JSON. Replaces the approval (keeping its TTL) only
# if its status is still the expected one and, if pending or approved, it has not expired by
# Redis's clock (TIME): a router whose clock is behind cannot decide or redeem an expired one.
# Returns 1 if replaced.
_SWAP_APPROVAL = """
local current = redis.call('GET', KEYS[1])
if not current then return 0 end
local found = cjson.decode(current)
if found['status'] ~= ARGV[1] then return 0 end
if found['status'] == 'pending' or found['status'] == 'approved' then
  local clock = redis.call('TIME')
  if tonumber(clock[1]) + tonumber(clock[2]) / 1000000 > tonumber(found['expires_at']) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
return 1
"""

# KEYS: session, provenance, pending. Deletes the three only if the first is a session (a hash
# with its agent), so no id can delete keys that are not a session's. Returns 1 if it was open.
_DELETE_SESSION = """
if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash' or redis.call('HEXISTS', KEYS[1], 'agent') == 0 then return 0 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return 1
"""

# KEYS: session, provenance, pending, then one rate hash per scope (`router.rates.scopes` order).
# ARGV: ttl_ms, count ("1" or "0"), the agent and the principal the rate keys were built for,
#       the minute, hour and day in ms, buckets per period, then the provenance keys to look up.
# Returns {session hash (flat), sources per provenance key (nil: never seen), counts: per scope,
# its minute, hour and day windows}; nil if the session is not open; {session hash} alone,
# changing nothing, if the session's agent or principal is not ARGV[3] / ARGV[4] (the caller
# built the rate keys without knowing them, and must build them again).
# A rate hash (router.rates) holds, per period p in m, h, d: 'p:<bucket index>' -> calls,
# 'p:head' (the newest bucket) and 'p:n' (the calls in the window: the head and the `buckets`
# before it). Time is Redis's own (TIME), so routers with skewed clocks count in the same buckets.
# Without count nothing is written: the counts are worked out from what is read.
_CALL_CONTEXT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local who = redis.call('HMGET', KEYS[1], 'agent', 'principal')
if who[1] ~= ARGV[3] or who[2] ~= ARGV[4] then return {redis.call('HGETALL', KEYS[1])} end
local count = ARGV[2] == '1'
if count then redis.call('HINCRBY', KEYS[1], 'call_count', 1) end
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[1]) end
local sources = {}
for i = 9, #ARGV do sources[i - 8] = redis.call('HGET', KEYS[2], ARGV[i]) end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local buckets = tonumber(ARGV[8])
local periods = {{'m:', tonumber(ARGV[5])}, {'h:', tonumber(ARGV[6])}, {'d:', tonumber(ARGV[7])}}
local keep_ms = math.ceil(periods[3][2] * (buckets + 1) / buckets)

-- A field of a rate key: absent is 0; anything but a whole count is an error, never a 0 that
-- would start the window over (whoever can write Redis could otherwise lift any limit).
local function whole(key, value)
  if not value then return nil end
  local n = tonumber(value)
  if n == nil or n < 0 or n % 1 ~= 0 then
    error({err = 'ERR rate key ' .. key .. ' holds ' .. string.sub(tostring(value), 1, 40) .. ', not a count'})
  end
  return n
end

local function windows(key, counts)
  local wanted, current = {}, {}
  for p = 1, 3 do
    local tag, width = periods[p][1], periods[p][2] / buckets
    current[p] = math.floor(now / width)
    wanted[#wanted + 1] = tag .. 'head'
    wanted[#wanted + 1] = tag .. 'n'
    wanted[#wanted + 1] = tag .. current[p]
  end
  local state = redis.call('HMGET', key, unpack(wanted))
  local update = {}
  for p = 1, 3 do
    local tag, now_bucket = periods[p][1], current[p]
    local head = whole(key, state[3 * p - 2])
    local total, calls = whole(key, state[3 * p - 1]) or 0, whole(key, state[3 * p]) or 0
    local gone = {}
    if head == nil then
      head = now_bucket
    elseif now_bucket - head > buckets then  -- every bucket left the window
      for i = head - buckets, head do gone[#gone + 1] = tag .. i end
      head, total = now_bucket, 0
    elseif now_bucket > head then  -- the buckets before now_bucket - buckets left it
      for i = head - buckets, now_bucket - buckets - 1 do gone[#gone + 1] = tag .. i end
      local old = redis.call('HMGET', key, unpack(gone))
      for i = 1, #gone do total = total - (whole(key, old[i]) or 0) end
      head = now_bucket
    end
    if count then
      if head > now_bucket then  -- Redis's clock stepped back: count in the newest bucket
        redis.call('HINCRBY', key, tag .. head, 1)
      else
        update[#update + 1] = tag .. head
        update[#update + 1] = calls + 1
      end
      total = total + 1
      if #gone > 0 then redis.call('HDEL', key, unpack(gone)) end
      update[#update + 1] = tag .. 'head'
      update[#update + 1] = head
      update[#update + 1] = tag .. 'n'
      update[#update + 1] = total
    end
    counts[#counts + 1] = total
  end
  if count then
    redis.call('HSET', key, unpack(update))
    redis.call('PEXPIRE', key, keep_ms)
  end
end

local counts = {}
for i = 4, #KEYS do windows(KEYS[i], counts) end
return {redis.call('HGETALL', KEYS[1]), sources, counts}
"""

# KEYS: lease. ARGV: none. Marks an existing lease revoked (its TTL unchanged). Returns 1 if it existed.
_REVOKE_LEASE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'status', 'revoked')
return 1
"""

# KEYS: jwks. ARGV: kid, JSON {"jwk", "until"}, ttl_ms. The hash lives as long as its longest key.
_PUBLISH_KEY = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[3]) then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return 1
"""

log = structlog.get_logger(__name__)

_WINDOW_NAMES = {scope: [f"{scope}_per_{period}" for period in PERIODS] for scope in RATE_SCOPES}
_MAX_AGENTS = 100_000  # sessions whose agent and principal this router remembers; beyond, it starts over


def _string(value: object) -> str:
    """``value`` if it is a string (decoding a stored document); TypeError otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"a string was expected, not {type(value).__name__}")
    return value


def _strings(value: object) -> tuple[str, ...]:
    """``value`` if it is a list of strings, as a tuple (a string would pass as its characters)."""
    if not isinstance(value, list):
        raise TypeError(f"a list of strings was expected, not {type(value).__name__}")
    return tuple(_string(item) for item in value)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def connect(url: str, timeout_s: float, **options: Any) -> redis.asyncio.Redis:
    """A client of the Redis at ``url`` whose commands time out after ``timeout_s`` (also the
    connect timeout), ``options`` passed on to redis-py. Raises ValueError for a URL that is not
    Redis's.

    A pooled connection Redis dropped (a restart, a failover) is replaced before it is used, as
    redis-py does when it checks a connection it hands out. Its maintenance notifications
    (``"auto"`` by default on RESP3) turn that check off, and each router's first command after a
    restart then failed on the dead socket: a call denied, a refusal spooled. stockade needs no
    notices of a managed service's maintenance, so they are off. Commands are never retried blindly:
    a script whose reply was lost may have run (an approval redeemed, an event appended)."""
    return redis.asyncio.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        maint_notifications_config=MaintNotificationsConfig(enabled=False),
        **options,
    )


def redacted(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class RedisStore:
    """`Store` in Redis (``redis.asyncio``), shared by every router pointed at the same server."""

    shared = True

    def __init__(
        self, url: str, *, session_ttl_s: float = 3600.0, rate_periods: Mapping[str, float] = PERIODS,
        timeout_s: float = 2.0,
    ) -> None:  # fmt: skip
        self._where = redacted(url)
        try:
            self._redis = connect(url, timeout_s, decode_responses=True)
        except ValueError as exc:
            raise StoreError(f"store URL {self._where} is not a redis:// URL: {exc}") from exc
        self._session_ttl_ms = max(1, int(session_ttl_s * 1000))
        self._periods_ms = [max(1, int(rate_periods[name] * 1000)) for name in PERIODS]
        self._load = self._redis.register_script(_LOAD_SESSION)
        self._record = self._redis.register_script(_RECORD_OUTPUT)
        self._take = self._redis.register_script(_TAKE_REPORT)
        self._put = self._redis.register_script(_PUT_APPROVAL)
        self._swap = self._redis.register_script(_SWAP_APPROVAL)
        self._context = self._redis.register_script(_CALL_CONTEXT)
        self._revoke = self._redis.register_script(_REVOKE_LEASE)
        self._publish = self._redis.register_script(_PUBLISH_KEY)
        self._endorse = self._redis.register_script(_ENDORSE)
        self._put_tool = self._redis.register_script(_PUT_TOOL)
        self._label = self._redis.register_script(_ADD_LABELS)
        self._delete = self._redis.register_script(_DELETE_SESSION)
        self._subjects: dict[str, tuple[str, str]] = {}  # session id -> (agent, principal)

    async def _do(self, what: str, operation: Awaitable[T]) -> T:
        try:
            return await operation
        except redis.exceptions.ResponseError as exc:  # Redis answered: a script refused what it found
            raise StoreError(f"store {self._where} refused to {what}: {exc}") from exc
        except (redis.exceptions.RedisError, OSError) as exc:
            raise StoreError(f"store {self._where} failed to {what}: {exc}; check that Redis is up") from exc

    @contextlib.contextmanager
    def _reading(self, what: str) -> Iterator[None]:
        """Decoding ``what`` (a key's value). Whoever can write Redis can leave a value of any
        shape there: that is the store failing (the call denied and audited), never an exception
        of another kind escaping the pipeline unaudited."""
        try:
            yield
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # pydantic's and json's are ValueErrors
            raise StoreError(f"{what} in {self._where} is malformed ({_first_line(exc)}); delete or fix it") from exc

    async def create_session(self, session: SessionRecord, provenance_keys: Collection[str]) -> None:
        checked_session_id(session.id)

        async def run() -> None:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(keys.session(session.id), mapping={
                    "agent": session.agent, "principal": session.principal, "opened_at": session.opened_at,
                    "trusted_context": json.dumps(list(session.trusted_context)), "call_count": session.call_count,
                    **{f"taint:{label}": "1" for label in session.taint},
                    **{f"label:{label}": "1" for label in session.labels},
                })  # fmt: skip
                pipe.pexpire(keys.session(session.id), self._session_ttl_ms)
                if provenance_keys:
                    pipe.hset(keys.provenance(session.id), mapping=dict.fromkeys(provenance_keys, USER))
                    pipe.pexpire(keys.provenance(session.id), self._session_ttl_ms)
                await pipe.execute()

        await self._do("open a session", run())

    async def load_session(self, session_id: str, *, agent: str | None = None) -> SessionRecord | None:
        if not is_session_id(session_id):
            return None
        session_keys = [keys.session(session_id), keys.provenance(session_id), keys.pending(session_id)]
        flat = await self._do("load a session", self._load(session_keys, [self._session_ttl_ms, agent or ""]))
        return None if flat is None else self._session(session_id, flat)

    def _session(self, session_id: str, flat: list[str]) -> SessionRecord:
        fields = dict(zip(flat[::2], flat[1::2], strict=True))
        try:
            return SessionRecord(
                id=session_id, agent=fields["agent"], principal=fields["principal"], opened_at=fields["opened_at"],
                trusted_context=_strings(json.loads(fields["trusted_context"])), call_count=int(fields["call_count"]),
                taint=frozenset(k.removeprefix("taint:") for k in fields if k.startswith("taint:")),
                endorsed=frozenset(k.removeprefix("endorsed:") for k in fields if k.startswith("endorsed:")),
                labels=frozenset(k.removeprefix("label:") for k in fields if k.startswith("label:")),
                approvals={k.removeprefix("approval:"): v for k, v in fields.items() if k.startswith("approval:")},
            )  # fmt: skip
        except (KeyError, ValueError, TypeError) as exc:
            raise StoreError(f"session {session_id} in {self._where} is malformed ({exc}); close it") from exc

    async def call_context(
        self, session_id: str, tool: str, keys_by_arg: Mapping[str, Collection[str]], *, count: bool,
        agent: str | None = None,
    ) -> CallContext | None:  # fmt: skip
        if not is_session_id(session_id):
            return None
        wanted = sorted({k for arg_keys in keys_by_arg.values() for k in arg_keys})
        for _ in range(2):
            # A session's agent and principal never change: claimed by the caller or remembered,
            # they let the rate keys go in the same script as everything else. Unknown (first
            # call here), the script says them first.
            remembered = self._subjects.get(session_id, ("", ""))
            claimed = (agent, remembered[1] if remembered[0] == agent else "") if agent is not None else remembered
            scopes = rate_scopes(session_id, claimed[0], claimed[1], tool).values()
            script_keys = [keys.session(session_id), keys.provenance(session_id), keys.pending(session_id),
                           *(keys.rate(scope) for scope in scopes)]  # fmt: skip
            args: list[str | int] = [self._session_ttl_ms, int(count), *claimed, *self._periods_ms, BUCKETS, *wanted]
            reply = await self._do("load a call's context", self._context(script_keys, args))
            if reply is None:
                self._subjects.pop(session_id, None)
                return None
            session = self._session(session_id, reply[0])
            if len(self._subjects) >= _MAX_AGENTS:
                self._subjects.clear()
            self._subjects[session_id] = (session.agent, session.principal)
            if len(reply) == 3:
                break
            if agent is not None and session.agent != agent:  # another agent's session: nothing changed
                return CallContext(session=session, provenance={}, rates=RateCounts())
        else:
            raise StoreError(f"session {session_id} in {self._where} changed agent or principal; close it")
        seen = {key: str(value).split("\n") for key, value in zip(wanted, reply[1], strict=True) if value}
        provenance: dict[str, list[str]] = {}
        for name, arg_keys in keys_by_arg.items():
            sources = {source for key in arg_keys for source in seen.get(key, ())}
            if sources:
                provenance[name] = sorted(sources)
        found = iter(reply[2])
        with self._reading(f"the rate counts of session {session_id}"):
            rates = RateCounts.model_validate({name: int(next(found)) for scope in RATE_SCOPES
                                               for name in _WINDOW_NAMES[scope]})  # fmt: skip
        return CallContext(session=session, provenance=provenance, rates=rates)

    async def delete_session(self, session_id: str) -> bool:
        if not is_session_id(session_id):
            return False
        self._subjects.pop(session_id, None)
        session_keys = [keys.session(session_id), keys.provenance(session_id), keys.pending(session_id)]
        return bool(await self._do("close a session", self._delete(session_keys, [])))

    async def live_sessions(self, session_ids: Collection[str]) -> set[str]:
        ordered = [s for s in session_ids if is_session_id(s)]
        if not ordered:
            return set()

        async def run() -> list[Any]:
            async with self._redis.pipeline(transaction=False) as pipe:
                for session_id in ordered:
                    pipe.exists(keys.session(session_id))
                return await pipe.execute()

        found = await self._do("list sessions", run())
        return {s for s, exists in zip(ordered, found, strict=True) if exists}

    async def record_output(
        self, session_id: str, source: str, provenance_keys: Collection[str], *, taint: str | None
    ) -> None:
        if not is_session_id(session_id):  # names no session: as for a closed one, nothing is kept
            return
        args: list[Any] = [self._session_ttl_ms, source, MAX_SOURCES, taint or "", *provenance_keys]
        await self._do("index an output", self._record([keys.session(session_id), keys.provenance(session_id)], args))

    async def add_session_labels(self, session_id: str, labels: Collection[str]) -> bool:
        if not is_session_id(session_id):
            return False
        added = await self._do("label a session", self._label([keys.session(session_id)], sorted(labels)))
        return bool(added)

    async def endorse(self, session_id: str, call_id: str) -> str | None:
        if not is_session_id(session_id):
            return None
        found = await self._do(
            "endorse a source", self._endorse([keys.session(session_id), keys.provenance(session_id)], [call_id])
        )
        return found if isinstance(found, str) else None

    async def expect_report(self, pending: PendingExternal) -> None:
        checked_session_id(pending.session_id)

        async def run() -> None:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(keys.pending(pending.session_id), pending.call_id, json.dumps({
                    "decision_id": pending.decision_id, "tool": pending.tool, "echoed": list(pending.echoed),
                    "steered": pending.steered, "derived": pending.derived,
                }))  # fmt: skip
                pipe.pexpire(keys.pending(pending.session_id), self._session_ttl_ms)
                await pipe.execute()

        await self._do("remember an external call", run())

    async def take_report(self, session_id: str, call_id: str) -> PendingExternal | None:
        if not is_session_id(session_id):
            return None
        value = await self._do("take an external call", self._take([keys.pending(session_id)], [call_id]))
        if value is None:
            return None
        with self._reading(f"external call {call_id} of session {session_id}"):
            document = json.loads(value)
            return PendingExternal(
                session_id,
                call_id,
                _string(document["decision_id"]),
                _string(document["tool"]),
                _strings(document.get("echoed", [])),
                steered=bool(document.get("steered", False)),
                derived=bool(document.get("derived", False)),
            )

    async def put_approval(self, approval: Approval, keep_s: float) -> str:
        checked_session_id(approval.session_id)
        keep_ms = max(1, int(keep_s * 1000))
        args: list[str | float] = [approval.id, approval.created_at, _approval_json(approval), keep_ms,
                                   approval.binding, keys.approval("")]  # fmt: skip
        script_keys = [keys.approval(approval.id), keys.APPROVALS, keys.session(approval.session_id)]
        return str(await self._do("store an approval", self._put(script_keys, args)))

    async def get_approval(self, approval_id: str) -> Approval | None:
        value = await self._do("read an approval", self._redis.get(keys.approval(approval_id)))
        if value is None:
            return None
        with self._reading(f"approval {approval_id}"):
            return Approval.model_validate_json(value)

    async def list_approvals(self) -> list[Approval]:
        ids = [str(i) for i in await self._do("list approvals", self._redis.zrange(keys.APPROVALS, 0, -1))]
        if not ids:
            return []
        values = await self._do("list approvals", self._redis.mget([keys.approval(i) for i in ids]))
        gone = [i for i, v in zip(ids, values, strict=True) if v is None]
        if gone:  # their keys expired: drop them from the index too
            await self._do("list approvals", self._redis.zrem(keys.APPROVALS, *gone))
        listed = []
        for approval_id, value in zip(ids, values, strict=True):
            if value is not None:
                try:
                    with self._reading(f"approval {approval_id}"):
                        listed.append(Approval.model_validate_json(value))
                except StoreError as exc:  # one bad entry hides itself, not every approval from the approvers
                    log.error("store_entry_malformed", error=str(exc))
        return listed

    async def swap_approval(self, approval: Approval, expected: ApprovalStatus) -> bool:
        swapped = await self._do(
            "update an approval",
            self._swap([keys.approval(approval.id)], [expected.value, _approval_json(approval)]),
        )
        return bool(swapped)

    async def put_lease(self, lease_id: str, record: str, ttl_s: float) -> None:
        async def run() -> None:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(keys.lease(lease_id), mapping={"status": "active", "record": record})
                pipe.pexpire(keys.lease(lease_id), max(1, int(ttl_s * 1000)))
                await pipe.execute()

        await self._do("record a lease", run())

    async def get_lease(self, lease_id: str) -> tuple[str, dict[str, Any]] | None:
        found = await self._do("read a lease", self._redis.hgetall(keys.lease(lease_id)))
        if not found:
            return None
        with self._reading(f"lease {lease_id}"):
            record = json.loads(found["record"])
            if not isinstance(record, dict):
                raise TypeError("its record is not an object")
            return str(found["status"]), record

    async def revoke_lease(self, lease_id: str) -> bool:
        return bool(await self._do("revoke a lease", self._revoke([keys.lease(lease_id)], [])))

    async def publish_key(self, kid: str, jwk: str, ttl_s: float) -> None:
        entry = json.dumps({"jwk": jwk, "until": time.time() + ttl_s})
        await self._do("publish a key", self._publish([keys.JWKS], [kid, entry, max(1, int(ttl_s * 1000))]))

    async def put_tool(self, name: str, spec_json: str) -> tuple[str, int, bool]:
        entry, added = await self._do(
            "register a tool",
            self._put_tool([keys.TOOLS, keys.TOOLS_VERSION], [name, spec_json, canonical_tool_name(name)]),
        )
        with self._reading(f"the registry entry of tool {name!r}"):
            document = json.loads(entry)
            return json.dumps(document["spec"]), int(document["version"]), bool(int(added))

    async def get_tool(self, name: str) -> str | None:
        entry = await self._do("read a tool", self._redis.hget(keys.TOOLS, name))
        if entry is None:
            return None
        with self._reading(f"the registry entry of tool {name!r}"):
            return json.dumps(json.loads(entry)["spec"])

    async def list_tools(self) -> dict[str, str]:
        found = await self._do("list tools", self._redis.hgetall(keys.TOOLS))
        readable = []
        for name, entry in found.items():
            try:
                with self._reading(f"the registry entry of tool {name!r}"):
                    document = json.loads(entry)
                    readable.append((str(name), document, int(document["version"])))
            except StoreError as exc:  # one bad entry hides that tool (calls to it are refused), not all
                log.error("store_entry_malformed", error=str(exc))
        entries = [(name, document) for name, document, _ in sorted(readable, key=lambda item: item[2])]
        listed: dict[str, str] = {}
        seen: set[str] = set()
        for name, entry in entries:
            # Look-alikes stored before put_tool refused them: the first registered stands (a
            # router adopting both would refuse the second anyway).
            if canonical_tool_name(name) not in seen:
                seen.add(canonical_tool_name(name))
                listed[name] = json.dumps(entry["spec"])
        return listed

    async def public_keys(self) -> dict[str, str]:
        found = await self._do("read the keys", self._redis.hgetall(keys.JWKS))
        now, live, stale = time.time(), {}, []
        for kid, value in found.items():
            try:
                with self._reading(f"public key {kid!r}"):
                    entry = json.loads(value)
                    fresh, jwk = float(entry["until"]) > now, str(entry["jwk"])
            except StoreError as exc:  # tokens signed with that key fail to verify; the others do not
                log.error("store_entry_malformed", error=str(exc))
                continue
            if fresh:
                live[str(kid)] = jwk
            else:
                stale.append(kid)
        if stale:
            await self._do("drop old keys", self._redis.hdel(keys.JWKS, *stale))
        return live

    async def ping(self) -> None:
        await self._do("answer a ping", self._redis.ping())

    async def aclose(self) -> None:
        await self._redis.aclose()


def _approval_json(approval: Approval) -> str:
    """An approval as stored: without ``inputs`` when it has none, so a router of the version
    before input files were bound (whose model forbids the field) still reads it in a rolling upgrade."""
    return approval.model_dump_json(exclude={"inputs"} if not approval.inputs else None)
