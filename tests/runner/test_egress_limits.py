"""The egress proxy runs in the router's process, and its socket is inside every sandbox: one
tool holding connections open must not take the descriptors another call, or the router itself,
needs. Each proxy serves a bounded number of connections at once, proxies together a bounded
number beyond their reserves, and a connection has a deadline for its request's head. Malformed
requests end in a refusal on record, never in an exception. On asyncio's loop and on uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvloop

from runner import EgressRecord, EgressRule
from runner.egress import EgressProxy
from runner.egress import proxy as proxy_module
from runner.egress.intercept import InterceptCA
from tests.runner.test_egress import (  # noqa: F401  (run on both loops)
    HOST,
    HttpsUpstream,
    _asyncio_loop_factory,
    _runs_on_the_loop_asked_for,
    https_upstream,
)

__all__ = ["https_upstream"]  # the fixture, shared with tests/runner/test_egress.py

CAP = proxy_module._MAX_CONNECTIONS
RESERVED = proxy_module._RESERVED_CONNECTIONS
BORROWED = proxy_module._MAX_BORROWED_TOTAL
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"


@pytest.fixture
async def upstream() -> AsyncIterator[int]:
    """A plain HTTP service on loopback answering ``ok``."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(OK)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def fetch(proxy: EgressProxy, port: int) -> bytes:
    """An innocent call's request: GET b.test through ``proxy``."""
    reader, writer = await asyncio.open_unix_connection(str(proxy.path))
    writer.write(f"GET http://b.test:{port}/ HTTP/1.1\r\nHost: b.test\r\n\r\n".encode())
    reply = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return reply


@dataclass
class Flood:
    """A hostile tool's connections: those the proxy holds open, and what each of the others got."""

    held: list[socket.socket]
    turned_away: list[bytes]

    def close(self) -> None:
        for sock in self.held:
            sock.close()


async def flood(proxy: EgressProxy, n: int) -> Flood:
    """``n`` connections to ``proxy``, each sending one byte of a head and then nothing."""
    socks = []
    for start in range(0, n, 32):
        for _ in range(min(32, n - start)):  # each batch fits the listener's backlog
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(proxy.path))
            sock.send(b"G")
            socks.append(sock)
        await asyncio.sleep(0.05)  # the proxy accepts them
    await asyncio.sleep(0.1)
    found = Flood([], [])
    for sock in socks:
        try:
            found.turned_away.append(sock.recv(100, socket.MSG_DONTWAIT))
            sock.close()
        except BlockingIOError:  # nothing to read yet: it is being served
            sock.setblocking(False)
            found.held.append(sock)
    return found


def descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_tool_holding_idle_connections_is_capped_and_another_call_still_completes(
    tmp_path: Path, upstream: int
) -> None:
    """One sandbox opens many connections to its proxy and sends nothing more: the proxy serves
    the first 32, turns the rest away at once with ``503``, and closes each held one with ``408``
    once the deadline for its head has passed; meanwhile another call's request completes, and
    afterwards the first proxy serves again."""
    hostile = EgressProxy(tmp_path / "a.sock", [EgressRule("a.test", 9)], None, head_timeout_s=1.0)
    innocent = EgressProxy(tmp_path / "b.sock", [EgressRule("b.test", upstream)], None, hosts={"b.test": "127.0.0.1"})
    await hostile.start()
    await innocent.start()
    before = descriptors()
    attack = await flood(hostile, 100)
    try:
        assert (len(attack.held), set(attack.turned_away)) == (CAP, {proxy_module._BUSY})
        assert descriptors() - before <= 2 * CAP + 8  # each held connection: the tool's end, and the proxy's
        assert (await fetch(innocent, upstream)).endswith(b"ok")
        loop = asyncio.get_running_loop()
        timed_out = await asyncio.wait_for(asyncio.gather(*(loop.sock_recv(s, 100) for s in attack.held)), 5)
        assert all(reply.startswith(b"HTTP/1.1 408") for reply in timed_out)
        attack.close()
        await asyncio.sleep(0.05)
        reader, writer = await asyncio.open_unix_connection(str(hostile.path))
        writer.write(b"CONNECT evil.test:443 HTTP/1.1\r\nHost: evil.test\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 403")  # served again
        writer.close()
    finally:
        attack.close()
        await hostile.aclose()
        await innocent.aclose()
    assert [(r.method, r.status) for r in hostile.records] == [("CONNECT", 403)]  # an idle connection is no request


async def test_many_hostile_calls_together_cannot_exhaust_the_process_and_an_innocent_call_completes(
    tmp_path: Path, upstream: int
) -> None:
    """Many calls' tools each hold as many connections as their proxy serves: together they get
    no more than each proxy's reserve plus the budget shared by the process; a call arriving after
    them still has its reserve, and its request completes."""
    proxies = [EgressProxy(tmp_path / f"h{i}.sock", [EgressRule("a.test", 9)], None) for i in range(10)]
    innocent = EgressProxy(tmp_path / "b.sock", [EgressRule("b.test", upstream)], None, hosts={"b.test": "127.0.0.1"})
    for proxy in [*proxies, innocent]:
        await proxy.start()
    attacks: list[Flood] = []
    try:
        for proxy in proxies:
            attacks.append(await flood(proxy, CAP))
        assert sum(len(attack.held) for attack in attacks) == len(proxies) * RESERVED + BORROWED  # of 320
        assert (await fetch(innocent, upstream)).endswith(b"ok")
    finally:
        for attack in attacks:
            attack.close()
        for proxy in [*proxies, innocent]:
            await proxy.aclose()
    assert proxy_module._BORROWED._taken == 0  # all given back: the next calls have the whole budget


async def test_an_intercepted_tunnel_with_no_request_inside_is_closed_at_the_deadline(
    tmp_path: Path, https_upstream: HttpsUpstream
) -> None:
    """Inside TLS the proxy intercepts, the request's head has the same deadline: a tool cannot
    hold a slot with a tunnel it sends nothing through."""
    ca = InterceptCA()
    proxy = EgressProxy(tmp_path / "t.sock", [EgressRule(HOST, https_upstream.port, ("GET",))], None,
                        hosts={HOST: "127.0.0.1"}, intercept=ca, upstream_ca=https_upstream.ca_file,
                        head_timeout_s=0.5)  # fmt: skip
    await proxy.start()
    try:
        reader, writer = await asyncio.open_unix_connection(str(proxy.path))
        writer.write(f"CONNECT {HOST}:{https_upstream.port} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 200")
        await writer.start_tls(ssl.create_default_context(cadata=ca.cert_pem.decode()), server_hostname=HOST)
        reply = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    finally:
        await proxy.aclose()
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert [(r.method, r.status, r.intercepted) for r in proxy.records] == [("CONNECT", 408, True)]


_STARVED = """
import asyncio, json, os, resource, socket, subprocess, sys
from pathlib import Path
import uvloop
from runner import EgressRule
from runner.egress import EgressProxy

ATTACKER = '''
import resource, socket, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
socks = []
deadline = time.monotonic() + 10
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX)
    s.setblocking(False)
    while time.monotonic() < deadline:
        try:
            s.connect(sys.argv[1])
            break
        except BlockingIOError:  # the backlog is full: wait for the proxy to take some
            time.sleep(0.01)
    else:
        break  # the proxy no longer accepts
    try:
        s.send(b"G")
    except OSError:  # turned away already
        pass
    socks.append(s)
print(len(socks), flush=True)
sys.stdin.read()
'''

async def main(tmp: Path) -> dict[str, object]:
    async def answer(reader, writer):
        await reader.readuntil(b"\\r\\n\\r\\n")
        writer.write(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\nConnection: close\\r\\n\\r\\nok")
        await writer.drain()
        writer.close()
    upstream = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = upstream.sockets[0].getsockname()[1]
    hostile = EgressProxy(tmp / "a.sock", [EgressRule("a.test", 9)], None)
    innocent = EgressProxy(tmp / "b.sock", [EgressRule("b.test", port)], None, hosts={"b.test": "127.0.0.1"})
    await hostile.start()
    await innocent.start()
    # The router near its soft limit: 200 descriptors to spare.
    opened = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (opened + 200, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    attacker = await asyncio.create_subprocess_exec(sys.executable, "-c", ATTACKER, str(hostile.path), "400",
                                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    held = int(await asyncio.wait_for(attacker.stdout.readline(), 30))
    await asyncio.sleep(0.5)
    result = {"attacker_connected": held}
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(innocent.path)), 5)
        writer.write(f"GET http://b.test:{port}/ HTTP/1.1\\r\\nHost: b\\r\\n\\r\\n".encode())
        result["innocent"] = (await asyncio.wait_for(reader.read(), 5)).decode()[-2:]
        writer.close()
    except (OSError, TimeoutError) as exc:
        result["innocent"] = type(exc).__name__
    try:
        open(tmp / "audit.jsonl", "a").close()
        result["router_open"] = "ok"
    except OSError as exc:
        result["router_open"] = exc.strerror
    attacker.stdin.close()
    await attacker.wait()
    await hostile.aclose()
    await innocent.aclose()
    return result

runner = asyncio.Runner(loop_factory=uvloop.new_event_loop if sys.argv[2] == "uvloop" else None)
print(json.dumps(runner.run(main(Path(sys.argv[1])))))
"""


async def test_a_tool_flooding_its_proxy_starves_neither_the_router_nor_another_call(tmp_path: Path) -> None:
    """A router with 200 descriptors to spare, and a tool (its own process, as in a sandbox)
    opening 400 connections to its call's proxy: the router can still open its audit file and
    another call's request completes. Uncapped, the proxy took every descriptor: the other call's
    connection waited in the backlog until it timed out. (In a process of its own, on the loop
    this test runs on: the limit is per process.)"""
    loop = "uvloop" if isinstance(asyncio.get_running_loop(), uvloop.Loop) else "asyncio"
    router = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _STARVED, str(tmp_path), loop, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    out, err = await asyncio.wait_for(router.communicate(), 120)
    assert router.returncode == 0, err.decode()[-2000:]
    result = json.loads(out.decode().splitlines()[-1])
    assert result == {"attacker_connected": 400, "innocent": "ok", "router_open": "ok"}, err.decode()[-2000:]


@pytest.mark.parametrize(
    "raw",
    [
        b"CONNECT a.test:" + b"9" * 5000 + b" HTTP/1.1\r\nHost: a.test\r\n\r\n",  # int() refuses past 4300 digits
        b"CONNECT a.test:\xd9\xa4\xd9\xa4\xd9\xa3 HTTP/1.1\r\nHost: a.test\r\n\r\n",  # digits, though not ASCII ones
        b"GET http://[::1/ HTTP/1.1\r\nHost: a.test\r\n\r\n",  # urlsplit raises on it
        b"GET http://[zz]:80/ HTTP/1.1\r\nHost: a.test\r\n\r\n",
    ],
)
async def test_a_malformed_request_is_refused_on_record_and_raises_nowhere(tmp_path: Path, raw: bytes) -> None:
    seen: list[str] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: seen.append(repr(context.get("exception"))))
    records: list[EgressRecord] = []

    async def keep(record: EgressRecord) -> None:
        records.append(record)

    proxy = EgressProxy(tmp_path / "m.sock", [EgressRule("a.test", 443)], keep)
    await proxy.start()
    try:
        reader, writer = await asyncio.open_unix_connection(str(proxy.path))
        writer.write(raw)
        reply = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    finally:
        await proxy.aclose()
        await asyncio.sleep(0.05)
        asyncio.get_running_loop().set_exception_handler(None)
    assert reply.startswith(b"HTTP/1.1 400"), reply
    assert [(r.allowed, r.status) for r in records] == [(False, 400)]
    assert seen == []


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def through_proxy(
    tmp_path: Path, upstream: Handler
) -> AsyncIterator[tuple[EgressProxy, int, list[EgressRecord]]]:
    """A loopback upstream served by ``upstream``, a proxy granting it as b.test, and the proxy's
    records: (proxy, upstream port, records)."""
    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    records: list[EgressRecord] = []

    async def keep(record: EgressRecord) -> None:
        records.append(record)

    proxy = EgressProxy(tmp_path / "p.sock", [EgressRule("b.test", port)], keep, hosts={"b.test": "127.0.0.1"})
    await proxy.start()
    try:
        yield proxy, port, records
    finally:
        await proxy.aclose()
        server.close()
        await server.wait_closed()


async def test_a_request_body_streams_upstream_and_is_never_held_whole(tmp_path: Path) -> None:
    """The proxy runs in the router's process: a body it held whole (16 MiB on each of 32
    connections, trickled forever) would let one tool make the router hold half a GiB. The body
    goes upstream as it arrives: the upstream has the first MiB while the client still holds the
    rest back, and a chunked body arrives chunked, whole; each record counts the bytes sent."""
    arrived = asyncio.Event()
    got: dict[str, bytes] = {}

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        name = head.split(b" ")[1].decode()
        body = b""
        while not body.endswith(b"0\r\n\r\n") and len(body) < 3 << 20:
            chunk = await reader.read(1 << 16)
            if not chunk:
                break
            body += chunk
            if len(body) >= 1 << 20:
                arrived.set()
        got[name] = head + body
        writer.write(OK)
        await writer.drain()
        writer.close()

    async with through_proxy(tmp_path, upstream) as (proxy, port, records):
        reader, writer = await asyncio.open_unix_connection(str(proxy.path))
        writer.write(f"POST http://b.test:{port}/sized HTTP/1.1\r\nHost: b.test\r\nContent-Length: {3 << 20}\r\n\r\n"
                     .encode() + b"x" * (1 << 20))  # fmt: skip
        await asyncio.wait_for(arrived.wait(), 10)  # the first MiB is upstream; two are still to come
        assert "/sized" not in got
        writer.write(b"x" * (2 << 20))
        assert (await asyncio.wait_for(reader.read(), 10)).endswith(b"ok")
        writer.close()

        reader, writer = await asyncio.open_unix_connection(str(proxy.path))
        writer.write(f"POST http://b.test:{port}/chunked HTTP/1.1\r\nHost: b.test\r\nTransfer-Encoding: chunked\r\n\r\n"
                     "5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n".encode())  # fmt: skip
        assert (await asyncio.wait_for(reader.read(), 10)).endswith(b"ok")
        writer.close()
    (sized_head, _, sized_body), (chunked_head, _, chunked_body) = (got[n].partition(b"\r\n\r\n") for n in got)
    assert f"content-length: {3 << 20}".encode() in sized_head.lower()
    assert sized_body == b"x" * (3 << 20)
    assert b"transfer-encoding: chunked" in chunked_head.lower()
    assert (b"hello" in chunked_body, chunked_body.endswith(b"0\r\n\r\n")) == (True, True)
    assert [(r.method, r.status) for r in records] == [("POST", 200), ("POST", 200)]
    assert records[0].bytes_up > 3 << 20


async def read_until_reset(reader: asyncio.StreamReader) -> bytes:
    """What ``reader`` gets until its end or a reset."""
    got = b""
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(1 << 16):
            got += chunk
    return got


async def test_an_upstream_answering_before_it_has_the_body_is_heard(tmp_path: Path) -> None:
    """An upstream may refuse a request from its head (a 401, a 413) and close without reading
    the body: the client gets that answer, not a 502 of the proxy's, while its body still goes."""
    refusal = b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 4\r\nConnection: close\r\n\r\nnope"

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(refusal)
        await writer.drain()
        writer.close()  # with the body unread: the kernel resets the connection

    async with through_proxy(tmp_path, upstream) as (proxy, port, records):
        reader, writer = await asyncio.open_unix_connection(str(proxy.path))
        answer = asyncio.create_task(read_until_reset(reader))  # as it comes: a reset may follow it
        writer.write(f"POST http://b.test:{port}/up HTTP/1.1\r\nHost: b.test\r\nContent-Length: {8 << 20}\r\n\r\n"
                     .encode())  # fmt: skip
        with contextlib.suppress(ConnectionError):
            for _ in range(128):  # the body, a piece at a time, until the proxy stops reading it
                writer.write(b"x" * (64 << 10))
                await asyncio.wait_for(writer.drain(), 5)
        reply = await asyncio.wait_for(answer, 10)
        writer.close()
    assert reply.startswith(b"HTTP/1.1 401")
    assert reply.endswith(b"nope")
    assert [(r.method, r.allowed, r.status) for r in records] == [("POST", True, 401)]


async def test_a_client_expecting_100_continue_is_told_to_go_on_at_once(tmp_path: Path) -> None:
    """curl asks before sending a body over 1 KiB and waits a second for an answer: the proxy
    answers ``100 Continue`` once the request is allowed, so the body goes without that wait,
    and the upstream gets it without being asked."""
    heads: list[bytes] = []

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        await reader.readexactly(4096)
        writer.write(OK)
        await writer.drain()
        writer.close()

    async with through_proxy(tmp_path, upstream) as (proxy, port, _):
        reader, writer = await asyncio.open_unix_connection(str(proxy.path))
        writer.write(f"POST http://b.test:{port}/up HTTP/1.1\r\nHost: b.test\r\nContent-Length: 4096\r\n"
                     "Expect: 100-continue\r\n\r\n".encode())  # fmt: skip
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.5)
        writer.write(b"x" * 4096)
        reply = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    assert interim.startswith(b"HTTP/1.1 100 ")
    assert reply.endswith(b"ok")
    assert b"expect" not in heads[0].lower()
