"""The egress proxy on its Unix socket, driven the way a sandbox's bridge drives it."""

from __future__ import annotations

import asyncio
import http.server
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from runner import EgressRecord, EgressRule
from runner.egress import EgressProxy


@pytest.fixture(scope="module")
def http_upstream() -> Iterator[int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = f"{self.command} {self.path} {self.rfile.read(length).decode()}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
async def proxy(tmp_path: Path, http_upstream: int) -> AsyncIterator[tuple[EgressProxy, list[EgressRecord]]]:
    records: list[EgressRecord] = []

    async def keep(record: EgressRecord) -> None:
        records.append(record)

    server = EgressProxy(
        tmp_path / "egress.sock",
        [EgressRule("files.internal.test", http_upstream, ("GET",)), EgressRule("localhost", http_upstream)],
        keep,
        hosts={"files.internal.test": "127.0.0.1"},
    )
    await server.start()
    yield server, records
    await server.aclose()


async def send(proxy: EgressProxy, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_unix_connection(str(proxy.path))
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    await writer.wait_closed()
    return data


async def test_allowed_plain_http_get_is_forwarded(
    proxy: tuple[EgressProxy, list[EgressRecord]], http_upstream: int
) -> None:
    server, records = proxy
    host = f"files.internal.test:{http_upstream}"
    reply = await send(server, f"GET http://{host}/report?id=7 HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    assert reply.startswith(b"HTTP/1.1 200")
    assert reply.endswith(b"GET /report?id=7 ")  # the upstream saw origin-form, not the proxy's absolute URL
    [record] = records
    assert (record.method, record.host, record.allowed, record.status) == ("GET", "files.internal.test", True, 200)
    assert record.bytes_up > 0
    assert record.bytes_down > 0


async def test_a_method_the_rule_does_not_list_is_refused(
    proxy: tuple[EgressProxy, list[EgressRecord]], http_upstream: int
) -> None:
    server, records = proxy
    host = f"files.internal.test:{http_upstream}"
    reply = await send(
        server, f"POST http://{host}/upload HTTP/1.1\r\nHost: {host}\r\nContent-Length: 4\r\n\r\ndata".encode()
    )
    assert reply.startswith(b"HTTP/1.1 403")
    assert b"method POST" in reply
    assert [(r.method, r.allowed) for r in records] == [("POST", False)]


async def test_unlisted_hosts_and_ports_are_refused(
    proxy: tuple[EgressProxy, list[EgressRecord]], http_upstream: int
) -> None:
    server, records = proxy
    for target in ("evil.test:443", f"files.internal.test:{http_upstream + 1}", "files.internal.test.evil.test:443"):
        reply = await send(server, f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        assert reply.startswith(b"HTTP/1.1 403")
    assert [r.allowed for r in records] == [False, False, False]


async def test_allowlisted_name_resolving_to_a_private_address_is_refused(
    proxy: tuple[EgressProxy, list[EgressRecord]], http_upstream: int
) -> None:
    """'localhost' is allowlisted but not pinned: it resolves to loopback, which is refused."""
    server, records = proxy
    host = f"localhost:{http_upstream}"
    reply = await send(server, f"GET http://{host}/ HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    assert reply.startswith(b"HTTP/1.1 403")
    assert b"non-public address" in reply
    assert records[0].allowed is False


@pytest.mark.parametrize(
    "raw",
    [
        b"NONSENSE\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # origin-form: not a proxy request
        b"GET https://files.internal.test/ HTTP/1.1\r\nHost: files.internal.test\r\n\r\n",
        b"CONNECT files.internal.test HTTP/1.1\r\nHost: files.internal.test\r\n\r\n",  # no port
        b"GET http://files.internal.test/ HTTP/1.1\r\nHost: a\r\n"
        b"Content-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",  # smuggling-shaped
    ],
)
async def test_malformed_or_ambiguous_requests_get_400(
    proxy: tuple[EgressProxy, list[EgressRecord]], raw: bytes
) -> None:
    server, records = proxy
    reply = await send(server, raw)
    assert reply.startswith(b"HTTP/1.1 400")
    assert records[0].allowed is False


async def test_a_client_that_hangs_up_is_not_a_request(proxy: tuple[EgressProxy, list[EgressRecord]]) -> None:
    server, records = proxy
    _, writer = await asyncio.open_unix_connection(str(server.path))
    writer.close()
    await writer.wait_closed()
    await asyncio.sleep(0.05)
    assert records == []
