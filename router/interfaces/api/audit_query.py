"""The auditor's read routes: ``GET /v1/audit/events`` (filters, a seq cursor, JSON pages or a
stream of JSON lines) and ``GET /v1/audit/decisions/{decision_id}`` (one call's whole trail).

On the JSONL log the events come from the index (`router.audit.index.AuditQuery`, DuckDB), run in
worker threads, never on the event loop, at most `CONCURRENT_QUERIES` at a time; with the Redis
backend (``STOCKADE_AUDIT__BACKEND=redis``) from the stream, scanned in chunks and filtered with
the same rules (`router.audit.index.matches`). Events are sent as written, with their ``hash``:
the lines are not parsed to be answered.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations, which name
# types made inside `add_query_routes`.
import asyncio
import contextlib
import importlib.util
import json
import threading
from collections.abc import AsyncIterator, Generator, Iterator
from typing import TYPE_CHECKING, Annotated, Any

import anyio
import redis.asyncio
import redis.exceptions
import structlog
from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from router.audit import AuditEvent
from router.audit.index import AuditQuery, EventFilter, event_with_hash, matches, promote
from router.audit.redis import STREAM
from router.control import ControlPlane
from router.errors import AuditError
from router.interfaces.api.openapi import problems
from router.interfaces.api.problems import from_exception, problem
from router.settings import ApiPrincipal
from router.store.redis import connect

if TYPE_CHECKING:
    from router.interfaces.api.app import Gate

log = structlog.get_logger("stockade.api")

NDJSON = "application/x-ndjson"
CONCURRENT_QUERIES = 2  # DuckDB uses two threads each: more would crowd out the router on a small host
MAX_PAGE = 100_000
# A page also ends once it holds this much event text (at least one event): a page of events with
# 1 MiB arguments and outputs would otherwise take several times MAX_PAGE MiB to build.
MAX_PAGE_BYTES = 32 << 20
_REDIS_CHUNK = 1000  # stream entries per XRANGE
_CHUNK_LINES = 500  # events per chunk of a streamed answer
ENGINE_MISSING = (
    "this router cannot query its audit log: DuckDB, the `audit` extra, is not installed with it; reinstall "
    "stockade with the extra (in a checkout: uv tool install -c requirements.lock '.[audit,otel]')"
)


class AuditEventPage(BaseModel):
    """A page of events, lowest seq first. ``next_after_seq``: pass it as ``after_seq`` for the
    next page; null when this page holds the last matching event."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    events: list[AuditEvent]
    next_after_seq: int | None = Field(description="the cursor for the next page; null: no more events")


# One --arg of the CLI: the argument's name, "=", the value it must have.
_Arg = Annotated[str, Field(pattern=r"^[^=]+=[\s\S]*$", max_length=4096)]

# The 503 of the query routes: the log cannot be read, or this install has no query engine.
_UNAVAILABLE = (503, "the audit log cannot be read, or this router was installed without the `audit` extra "
                "(DuckDB; audit.query_unavailable): retry later, or reinstall with it")  # fmt: skip

_EVENTS_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {
        "description": f"a page of events as JSON, or, if the request accepts {NDJSON}, the same events as JSON "
        "lines (one event per line), streamed",
        "content": {NDJSON: {"schema": {"type": "string", "description": "one AuditEvent (JSON) per line"}}},
    }
}


class _Reader:
    """Where the routes read events: one `AuditQuery` over the JSONL log and its index, made on
    first use, or the Redis stream; either way at most `CONCURRENT_QUERIES` reads at once."""

    def __init__(self, plane: ControlPlane) -> None:
        settings = plane.settings
        self._path = settings.audit.path
        self._redis_url = settings.store.url if settings.audit.backend == "redis" else None
        self._timeout_s = settings.store.timeout_s
        self._query: AuditQuery | None = None
        self._redis: redis.asyncio.Redis | None = None
        self._made = threading.Lock()
        self.slots = asyncio.Semaphore(CONCURRENT_QUERIES)

    @property
    def on_redis(self) -> bool:
        return self._redis_url is not None

    def query(self) -> AuditQuery:
        """The engine (in a worker thread: opening it loads DuckDB and reads the index)."""
        with self._made:
            if self._query is None:
                try:
                    self._query = AuditQuery(self._path)
                except OSError as exc:
                    raise AuditError(f"cannot read the audit log at {self._path}: {exc}") from exc
            return self._query

    def client(self) -> redis.asyncio.Redis:
        if self._redis is None:
            assert self._redis_url is not None  # noqa: S101  (only on the Redis backend)
            self._redis = connect(self._redis_url, self._timeout_s)
        return self._redis

    def lines(self, where: EventFilter, limit: int | None) -> Generator[tuple[int, str]]:
        """Seq and JSON text (with its hash) of each selected event, from the index (blocking)."""
        for seq, digest, line in self.query().events(where, limit=limit):
            yield seq, event_with_hash(line, digest)

    async def page(self, where: EventFilter, limit: int | None) -> tuple[list[tuple[int, str]], bool]:
        """Up to ``limit`` selected events (seq, JSON text), fewer once they hold `MAX_PAGE_BYTES`
        (never none), and whether more are selected after them; without ``limit``, every one."""
        kept: list[tuple[int, str]] = []
        size = 0

        def took(seq: int, text: str) -> bool:
            """Whether the event joined the page (False: the page is full, and more follow)."""
            nonlocal size
            if limit is not None and (len(kept) == limit or (kept and size + len(text) > MAX_PAGE_BYTES)):
                return False
            kept.append((seq, text))
            size += len(text) + 1
            return True

        wanted = None if limit is None else limit + 1  # one more: is there a next page?
        async with self.slots:
            if self.on_redis:
                async for seq, text in self.redis_lines(where, wanted):
                    if not took(seq, text):
                        return kept, True
                return kept, False

            def read() -> bool:
                with contextlib.closing(self.lines(where, wanted)) as lines:
                    return not all(took(seq, text) for seq, text in lines)

            more = await anyio.to_thread.run_sync(read)
            return kept, more

    async def redis_lines(self, where: EventFilter, limit: int | None) -> AsyncIterator[tuple[int, str]]:
        """The same from the Redis stream: every entry read in chunks, filtered in a worker thread."""
        start, found = "-", 0
        while limit is None or found < limit:
            try:
                entries = await self.client().xrange(STREAM, min=start, max="+", count=_REDIS_CHUNK)
            except (redis.exceptions.RedisError, OSError) as exc:
                raise AuditError(f"cannot read the audit stream: {exc}; check that Redis is up") from exc
            if not entries:
                return
            for seq, text in await anyio.to_thread.run_sync(_select, entries, where):
                yield seq, text
                found += 1
                if limit is not None and found >= limit:
                    return
            last = entries[-1][0]
            start = "(" + (last.decode() if isinstance(last, bytes) else str(last))


def _select(entries: list[Any], where: EventFilter) -> list[tuple[int, str]]:
    selected = []
    for _, fields in entries:
        line = fields.get(b"event", fields.get("event")) if isinstance(fields, dict) else None
        if isinstance(line, str):
            line = line.encode()
        row = promote(line) if isinstance(line, bytes) else None
        if row is not None and row["seq"] is not None and matches(row, where):
            selected.append((row["seq"], event_with_hash(row["event"], row["hash"])))
    return selected


def _filter(
    session_id: str | None, agent: str | None, tool: str | None, outcome: str | None, kind: str | None,
    decision_id: str | None, call_id: str | None, principal: str | None, approver: str | None,
    credential: str | None, lease: str | None, egress_host: str | None, reason: str | None, taint: str | None,
    since: Any, until: Any, after_seq: int | None, arg: list[str] | None,
) -> EventFilter:  # fmt: skip
    pairs = tuple((key, value) for key, _, value in (a.partition("=") for a in arg or ()))
    return EventFilter(
        since=since, until=until, after_seq=after_seq, session_id=session_id, agent=agent, tool=tool, outcome=outcome,
        kind=kind, decision_id=decision_id, call_id=call_id, principal=principal, approver=approver,
        credential=credential, lease=lease, egress_host=egress_host, reason=reason, taint=taint, args=pairs,
    )  # fmt: skip


def add_query_routes(app: FastAPI, plane: ControlPlane, gate: "Gate") -> None:
    """Add the audit read routes (role auditor or admin) to ``app``."""
    from router.interfaces.api.app import Instant  # noqa: PLC0415  (app.py calls this while it is loaded)

    Auditor = Annotated[ApiPrincipal, Depends(gate.require("auditor", "admin"))]
    reader = _Reader(plane)
    Text = Annotated[str | None, Query(max_length=4096)]

    async def engine_missing(request: Request) -> Response | None:
        """The (audited) 503 problem for a query the JSONL log cannot answer here: DuckDB is an
        optional dependency, and without it opening the index would fail as an internal error."""
        if reader.on_redis or importlib.util.find_spec("duckdb") is not None:
            return None
        answer = problem(503, "audit.query_unavailable", "Audit queries unavailable", ENGINE_MISSING)
        return await gate.turn_away(request, answer, f"audit.query_unavailable: {ENGINE_MISSING}")

    @app.get("/v1/audit/events", tags=["audit"], response_model=AuditEventPage,
             responses={**_EVENTS_ANSWER, **problems(_UNAVAILABLE)})  # fmt: skip
    async def list_audit_events(
        request: Request,
        _: Auditor,
        session_id: Text = None, agent: Text = None, tool: Text = None, outcome: Text = None, kind: Text = None,
        decision_id: Text = None, call_id: Text = None, principal: Text = None, approver: Text = None,
        credential: Text = None, lease: Text = None, egress_host: Text = None,
        reason: Annotated[str | None, Query(max_length=4096, description="a reason or error code")] = None,
        taint: Annotated[str | None, Query(max_length=4096, description="a session taint label")] = None,
        since: Instant | None = None, until: Instant | None = None,
        after_seq: Annotated[int | None, Query(ge=0, description="only events after this seq (the cursor)")] = None,
        arg: Annotated[list[_Arg] | None, Query(description="KEY=VALUE: the call's argument KEY is VALUE (a string "
                                                "by its text, a number by its value, other JSON as JSON)")] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 1000,
    ) -> Response:  # fmt: skip
        """Events matching every given filter, lowest seq first: a page with the cursor for the
        next one, or (``Accept: application/x-ndjson``) the page as a stream of JSON lines."""
        if (missing := await engine_missing(request)) is not None:
            return missing
        where = _filter(session_id, agent, tool, outcome, kind, decision_id, call_id, principal, approver, credential,
                        lease, egress_host, reason, taint, since, until, after_seq, arg)  # fmt: skip
        if NDJSON in request.headers.get("accept", ""):
            chunks = stream(where, limit)
            # The first chunk before the status: a query that cannot start is a 503 problem, as a page's is.
            first = await anext(chunks, b"")
            return StreamingResponse(_ended(first, chunks), media_type=NDJSON)
        found, more = await reader.page(where, limit)
        cursor = found[-1][0] if more else None
        body = '{"events":[' + ",".join(text for _, text in found) + '],"next_after_seq":' + json.dumps(cursor) + "}"
        return Response(body.encode(), media_type="application/json")

    async def stream(where: EventFilter, limit: int) -> AsyncIterator[bytes]:
        # A query slot is held while each chunk is read, not while it is sent: a client that
        # stops reading must not keep every other auditor's query waiting (it holds only its
        # own idle cursor).
        if reader.on_redis:
            lines = aiter(reader.redis_lines(where, limit))
            while True:
                async with reader.slots:
                    batch = [text async for _, text in _take(lines, _CHUNK_LINES)]
                if not batch:
                    return
                yield ("\n".join(batch) + "\n").encode()
        chunks = _chunks(reader.lines(where, limit))
        while True:
            async with reader.slots:
                chunk = await anyio.to_thread.run_sync(next, chunks, None)
            if chunk is None:
                return
            yield chunk

    @app.get("/v1/audit/decisions/{decision_id}", tags=["audit"], response_model=list[AuditEvent],
             responses=problems(_UNAVAILABLE))  # fmt: skip
    async def get_decision_trail(
        request: Request, decision_id: Annotated[str, PathParam(max_length=4096)], _: Auditor
    ) -> Response:
        """Everything joined to one decision: request, approval, credentials, egress, execution."""
        if (missing := await engine_missing(request)) is not None:
            return missing
        found = (await reader.page(EventFilter(decision_id=decision_id), None))[0]
        return Response(("[" + ",".join(text for _, text in found) + "]").encode(), media_type="application/json")


async def _ended(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A stream of JSON lines, ``first`` then ``rest``, that ends with a problem line when the query
    fails once the status is sent: one JSON object with no ``seq``, the problem document a page would
    have answered (``code`` ``audit.unavailable``), so a client sees the answer stopped short of the
    events asked for and, after fixing what it says, continues from the last seq it received."""
    if first:
        yield first
    try:
        async for chunk in rest:
            yield chunk
    except AuditError as exc:
        log.error("audit_stream_failed", error=str(exc))
        yield bytes(from_exception(exc).body) + b"\n"


async def _take(found: AsyncIterator[tuple[int, str]], count: int) -> AsyncIterator[tuple[int, str]]:
    """The next ``count`` (at most) of ``found``."""
    for _ in range(count):
        try:
            yield await anext(found)
        except StopAsyncIteration:
            return


def _chunks(found: Iterator[tuple[int, str]]) -> Iterator[bytes]:
    """JSON lines, `_CHUNK_LINES` per chunk (a worker thread per chunk, not per line)."""
    batch: list[str] = []
    for _, text in found:
        batch.append(text)
        if len(batch) >= _CHUNK_LINES:
            yield ("\n".join(batch) + "\n").encode()
            batch.clear()
    if batch:
        yield ("\n".join(batch) + "\n").encode()
