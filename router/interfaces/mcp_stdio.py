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
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import sys
from collections.abc import AsyncIterator
from typing import Any

import structlog

log = structlog.get_logger(__name__)

_MAX_LINE = 64 << 20  # bytes: one JSON-RPC message per line, as large as a call's arguments may be


class _Lines:
    """``async for line in ...`` over the client's messages (text, one per line)."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader

    def __aiter__(self) -> _Lines:
        return self

    async def __anext__(self) -> str:
        try:
            line = await self._reader.readline()
        except ValueError:  # a line over the limit: no message can be read from this stream again
            log.error("mcp_message_too_large", max_bytes=_MAX_LINE)
            raise StopAsyncIteration from None
        if not line:
            raise StopAsyncIteration
        return line.decode("utf-8", errors="replace")


class _Out:
    """``write`` and ``flush`` of text to the client, as the SDK calls them."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    async def write(self, text: str) -> None:
        self._writer.write(text.encode("utf-8"))

    async def flush(self) -> None:
        await self._writer.drain()


def _servable(fd: int) -> bool:
    """Whether ``fd`` is a pipe or a socket, which asyncio's pipe transports serve. (Not a
    terminal: they make its file non-blocking, and a terminal's is the shell's too.)"""
    mode = os.fstat(fd).st_mode
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


@contextlib.asynccontextmanager
async def stdio_wire() -> AsyncIterator[tuple[Any, Any] | None]:
    """The client's stdin and stdout as objects for the SDK's ``stdio_server(stdin, stdout)``, or
    None where asyncio cannot serve them (then call ``stdio_server()`` as it is)."""
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
        yield _Lines(reader), _Out(writer)
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
