"""The MCP stdio wire read and written on the event loop.

The ``mcp`` SDK's `stdio_server` wraps stdin and stdout in ``anyio.wrap_file``: every line read,
every write and every flush is a hop to a worker thread and back, several per tool call, which
cost more than the rest of the transport together (bench/transports.py). When both ends are pipes
or sockets, as when an MCP client starts ``stockade mcp``, `stdio_wire` serves them with asyncio's
own pipe transports instead and hands the SDK the same line interface; anything else (a regular
file, a terminal) gets the SDK's threads as before.

Like the SDK's, it keeps the wire to itself while serving: fd 0 reads the null device and fd 1
writes to stderr, so a child or a stray ``print`` can neither read the client's messages nor
corrupt the stream; both are restored on exit.

It also answers for the SDK what the SDK drops without a word: a line that is not UTF-8, not
JSON (or JSON no parser here takes: a lone surrogate, nesting past its limit) or not a JSON-RPC
message gets a JSON-RPC error (-32700, -32600) with the id it gave, if one can be read, else
null, instead of a request left unanswered forever; a response to no request the server sent is
dropped. Each, and every JSON-RPC error the server sends, is told to the ``refused`` hook first
(to put it on record).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import stat
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import mcp_types as types
import structlog
from pydantic import ValidationError

log = structlog.get_logger(__name__)

_MAX_LINE = 64 << 20  # bytes: one JSON-RPC message per line, as large as a call's arguments may be
_MAX_ASKED = 10_000  # requests to the client awaiting its response (elicitations): past it, the oldest are forgotten
PARSE_ERROR, INVALID_REQUEST = -32700, -32600

RequestId = int | str
Refused = Callable[[RequestId | None, int, str], Awaitable[None]]
"""Told of each JSON-RPC error before the client is sent it (and of a response to no request,
which gets none): the id it answers (None: null), the JSON-RPC code, the message."""

# The head of each line the SDK writes: one compact message (`model_dump_json`), its members in
# their declared order, so a request, a result and an error each show what they are up front.
_SENT = re.compile(
    r'\{"jsonrpc":"2\.0","id":(?P<id>-?\d+|"(?:[^"\\]|\\.)*"|null),"(?P<kind>method|result|error)":'
    r'(?:\{"code":(?P<code>-?\d+),"message":"(?P<message>(?:[^"\\]|\\.)*))?'
)


_CANCELS = '{"jsonrpc":"2.0","method":"notifications/cancelled",'  # the head of a cancellation the SDK writes


class _Out:
    """``write`` and ``flush`` of text to the client, as the SDK calls them; it keeps the ids of
    the requests the server sent (only a response to one is taken) and tells ``refused`` of each
    error before it goes out."""

    def __init__(self, writer: asyncio.StreamWriter, refused: Refused | None = None) -> None:
        self._writer = writer
        self._refused = refused
        self.asked: dict[RequestId, None] = {}  # insertion-ordered: the oldest is forgotten first

    async def write(self, text: str) -> None:
        sent = _SENT.match(text)  # anchored: reads the head only
        if sent is not None and sent["kind"] != "result":
            given = json.loads(sent["id"])
            if sent["kind"] == "method" and given is not None:
                self.asked[given] = None
                while len(self.asked) > _MAX_ASKED:
                    del self.asked[next(iter(self.asked))]
            elif sent["code"] is not None:
                await self.tell(given, int(sent["code"]), _unescaped(sent["message"] or ""))
        elif text.startswith(_CANCELS):
            # The server withdrew a request (the call that asked was cancelled): a response to it
            # now, a human's late yes, goes to no one, so it is refused on the record, not taken
            # for the SDK to drop unheard.
            with contextlib.suppress(ValueError, KeyError, TypeError):
                self.asked.pop(json.loads(text)["params"]["requestId"], None)
        self._writer.write(text.encode("utf-8"))

    async def flush(self) -> None:
        await self._writer.drain()

    async def tell(self, given: RequestId | None, code: int, message: str) -> None:
        """Tell the ``refused`` hook of an error (one sent, or a response dropped)."""
        if self._refused is not None:
            await self._refused(given, code, message)

    async def error(self, given: RequestId | None, code: int, message: str) -> None:
        """Answer a message the SDK will never see with a JSON-RPC error."""
        said = {"jsonrpc": "2.0", "id": given, "error": {"code": code, "message": message}}
        await self.write(json.dumps(said, separators=(",", ":")) + "\n")
        await self.flush()


class _Lines:
    """``async for line in ...`` over the client's messages (text, one per line), each a JSON-RPC
    message; any other line is answered on ``out`` (see the module docstring) and skipped."""

    def __init__(self, reader: asyncio.StreamReader, out: _Out | None = None) -> None:
        self._reader = reader
        self._out = out

    def __aiter__(self) -> _Lines:
        return self

    async def __anext__(self) -> str:
        while True:
            try:
                line = await self._reader.readline()
            except ValueError:  # a line over the limit: no message can be read from this stream again
                log.error("mcp_message_too_large", max_bytes=_MAX_LINE)
                raise StopAsyncIteration from None
            if not line:
                raise StopAsyncIteration
            if line.strip() and await self._taken(line):  # a blank line is no message: nothing to answer
                return line.decode("utf-8")

    async def _taken(self, line: bytes) -> bool:
        """Whether the SDK gets ``line``; if not, it is answered (or, a response, dropped), told."""
        # Strictly: a tool must never run on U+FFFD the client did not send.
        try:
            message = types.jsonrpc_message_adapter.validate_json(line.decode("utf-8"), by_name=False)
        except UnicodeDecodeError:
            return await self._refuse(line, PARSE_ERROR, "Parse error: the message is not UTF-8")
        except ValidationError as exc:
            found = exc.errors(include_url=False, include_input=False)
            if found and found[0]["type"] == "json_invalid":  # what no parser here reads (the SDK's either)
                return await self._refuse(line, PARSE_ERROR, f"Parse error: {found[0]['msg']}"[:300])
            return await self._refuse(line, INVALID_REQUEST, "Invalid Request: not a JSON-RPC 2.0 message "
                                      "(request, notification or response)")  # fmt: skip
        out = self._out
        if (
            isinstance(message, types.JSONRPCResponse | types.JSONRPCError)
            and out is not None
            and (
                message.id is None or out.asked.pop(message.id, False) is False  # (a kept id's value is None)
            )
        ):
            return await self._refuse(line, INVALID_REQUEST, "a response to no request this server sent: dropped",
                                      answer=False)  # fmt: skip
        return True

    async def _refuse(self, line: bytes, code: int, message: str, *, answer: bool = True) -> bool:
        log.warning("mcp_message_refused", code=code, reason=message)
        if self._out is None:
            return False
        given = _given_id(line.decode("utf-8", errors="replace"))
        if answer:
            await self._out.error(given, code, message)
        else:
            await self._out.tell(given, code, message)
        return False


def _given_id(text: str) -> RequestId | None:
    """The id a line that is no valid message gave, if it can be read before whatever is wrong
    with it: the top-level ``id`` member, read member by member (a truncated line's, too)."""
    decoder = json.JSONDecoder()
    try:
        at = _skip(text, 0)
        if text[at] != "{":
            return None
        while True:
            key, at = decoder.raw_decode(text, _skip(text, at + 1))
            at = _skip(text, at)
            if not isinstance(key, str) or text[at] != ":":
                return None
            value, at = decoder.raw_decode(text, _skip(text, at + 1))
            if key == "id":
                return value if isinstance(value, int | str) and not isinstance(value, bool) else None
            at = _skip(text, at)
            if text[at] != ",":
                return None
    except (ValueError, IndexError, RecursionError):  # cut off, or nested past what can be read
        return None


def _skip(text: str, at: int) -> int:
    """Where the JSON whitespace at ``at`` ends."""
    while at < len(text) and text[at] in " \t\n\r":
        at += 1
    return at


def _unescaped(text: str) -> str:
    """A JSON string's body as text (one cut off mid-escape: as it is)."""
    try:
        return str(json.loads(f'"{text}"'))
    except ValueError:
        return text


def _servable(fd: int) -> bool:
    """Whether ``fd`` is a pipe or a socket, which asyncio's pipe transports serve. (Not a
    terminal: they make its file non-blocking, and a terminal's is the shell's too.)"""
    mode = os.fstat(fd).st_mode
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


@contextlib.asynccontextmanager
async def stdio_wire(refused: Refused | None = None) -> AsyncIterator[tuple[Any, Any] | None]:
    """The client's stdin and stdout as objects for the SDK's ``stdio_server(stdin, stdout)``, or
    None where asyncio cannot serve them (then call ``stdio_server()`` as it is). ``refused``: told
    of each JSON-RPC error before the client gets it (see the module docstring)."""
    if not (_servable(0) and _servable(1)):
        yield None
        return
    loop = asyncio.get_running_loop()
    sys.stdout.flush()
    restore_in, restore_out = os.dup(0), os.dup(1)
    wire_in, wire_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    transports: list[asyncio.BaseTransport] = []
    try:
        reader = asyncio.StreamReader(limit=_MAX_LINE)
        read_transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(wire_in, "rb", buffering=0)
        )
        transports.append(read_transport)
        write_transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(wire_out, "wb", buffering=0)
        )
        transports.append(write_transport)
        writer = asyncio.StreamWriter(write_transport, protocol, None, loop)
        out = _Out(writer, refused)
        yield _Lines(reader, out), out
    finally:
        for transport in transports:
            transport.close()
        # The transports made the wire's files non-blocking: hand them back as they came.
        os.set_blocking(restore_in, True)
        os.set_blocking(restore_out, True)
        os.dup2(restore_in, 0)
        os.dup2(restore_out, 1)
        os.close(restore_in)
        os.close(restore_out)
