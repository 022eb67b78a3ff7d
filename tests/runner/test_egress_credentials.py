"""Where and when the egress proxy puts a credential into a request: only into what it sends over
TLS it verified itself (plain HTTP only where the credential allows it, and never to port 443),
only while the credential's lease lasts, and only a value a header can carry; a placeholder it
may not replace is refused and recorded, never sent on. And a response coded twice from a
credential's host is refused, not half-read. On asyncio's loop and on uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from runner import EgressRecord, EgressRule
from runner.base import Injection
from runner.egress import EgressProxy
from runner.egress import proxy as proxy_module
from runner.egress.intercept import InterceptCA
from tests.runner.test_egress import (  # noqa: F401  (run on both loops)
    HOST,
    PLACEHOLDER,
    SECRET,
    HttpsUpstream,
    _asyncio_loop_factory,
    _runs_on_the_loop_asked_for,
    credential,
    https_upstream,
    https_via,
    inner_request,
    parse,
    send,
)

__all__ = ["https_upstream"]  # the fixture, shared with tests/runner/test_egress.py

CA = InterceptCA()  # the calls' CA in these tests: made once, it costs a key pair


@pytest.fixture
async def unhandled() -> AsyncIterator[list[str]]:
    """What reaches the loop's exception handler (asyncio's logger, by default: unredacted, to stderr)."""
    seen: list[str] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: seen.append(repr(context.get("exception", context["message"]))))
    yield seen
    loop.set_exception_handler(None)


@dataclass
class Listener:
    """Whoever answers at an address a request goes to over plain TCP: it records every byte it
    gets, and answers each request ``200 ok`` (or ``reply``, if set)."""

    port: int
    connections: int = 0
    received: list[bytes] = field(default_factory=list)
    reply: bytes = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"

    def got(self) -> bytes:
        return b"".join(self.received)


async def listen(address: str, port: int = 0) -> tuple[asyncio.Server, Listener]:
    state = Listener(0)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            state.received.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(state.reply)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, address, port)
    state.port = server.sockets[0].getsockname()[1]
    return server, state


@pytest.fixture
async def listener() -> AsyncIterator[Listener]:
    server, state = await listen("127.0.0.1")
    yield state
    server.close()
    await server.wait_closed()


@pytest.fixture
async def listener_on_443() -> AsyncIterator[tuple[str, Listener]]:
    """A plain-text listener on port 443 of a loopback address of its own (binding 443 needs root)."""
    address = "127." + ".".join(str(b) for b in secrets.token_bytes(3)[:2]) + f".{2 + secrets.randbelow(250)}"
    try:
        server, state = await listen(address, 443)
    except PermissionError:  # the test command runs as root (scripts/test); a run that cannot is broken
        pytest.fail("binding port 443 needs root or CAP_NET_BIND_SERVICE: run the tests as scripts/test does")
    yield address, state
    server.close()
    await server.wait_closed()


async def proxy_for(
    tmp_path: Path, port: int, injection: Injection, address: str = "127.0.0.1", upstream: HttpsUpstream | None = None
) -> EgressProxy:
    """A call's proxy granting HOST:``port`` (at ``address``), with ``injection`` its credential,
    intercepting HTTPS with ``CA`` and trusting ``upstream``'s CA."""

    async def keep(record: EgressRecord) -> None:
        pass

    server = EgressProxy(tmp_path / "egress.sock", [EgressRule(HOST, port)], keep, hosts={HOST: address},
                         injections=[injection], intercept=CA,
                         upstream_ca=upstream.ca_file if upstream is not None else None)  # fmt: skip
    await server.start()
    return server


def plain_get(port: int) -> bytes:
    return f"GET http://{HOST}:{port}/user HTTP/1.1\r\nHost: {HOST}\r\nX-Api-Key: {PLACEHOLDER}\r\n\r\n".encode()


@pytest.mark.parametrize("entry", ["host", "host:port"])
async def test_a_credential_never_goes_over_plain_http_unless_it_allows_it(
    tmp_path: Path, listener: Listener, entry: str
) -> None:
    """A plain ``http://`` request carrying the placeholder, to the credential's own host and port:
    the proxy would send it in clear text to whatever the name resolves to, unverified. It is
    refused, ``403``, recorded as refused, and nothing (not even the placeholder) goes out."""
    hosts = (HOST,) if entry == "host" else (f"{HOST}:{listener.port}",)
    proxy = await proxy_for(tmp_path, listener.port, Injection("api-key", PLACEHOLDER, SECRET, hosts))
    try:
        reply = await send(proxy, plain_get(listener.port))
    finally:
        await proxy.aclose()
    assert reply.startswith(b"HTTP/1.1 403"), reply
    assert b"over plain HTTP; use https://" in reply
    assert listener.got() == b""  # the secret was sent here in clear text before
    assert listener.connections == 0  # refused before any connection was made
    [record] = proxy.records
    assert (record.allowed, record.status, record.injected, record.intercepted) == (False, 403, (), False)
    assert "may not go to" in record.reason
    assert SECRET not in record.reason


@pytest.mark.parametrize("entry", ["host", "host:443"])
async def test_plain_http_to_port_443_never_carries_a_credential_even_one_allowed_plain_text(
    tmp_path: Path, listener_on_443: tuple[str, Listener], entry: str
) -> None:
    """``http://host:443/``: a request shaped to put a TLS host's credential on the wire in clear
    text. Refused even for a credential that may go over plain HTTP elsewhere."""
    address, listener = listener_on_443
    hosts = (HOST,) if entry == "host" else (f"{HOST}:443",)
    injection = Injection("api-key", PLACEHOLDER, SECRET, hosts, allow_plaintext=True)
    proxy = await proxy_for(tmp_path, 443, injection, address)
    try:
        reply = await send(proxy, plain_get(443))
    finally:
        await proxy.aclose()
    assert reply.startswith(b"HTTP/1.1 403"), reply
    assert (listener.got(), listener.connections) == (b"", 0)
    assert [(r.allowed, r.status, r.injected) for r in proxy.records] == [(False, 403, ())]


async def test_a_credential_allowed_plain_text_goes_only_to_the_port_it_names_or_80(
    tmp_path: Path, listener: Listener
) -> None:
    """With the operator's leave, the value goes over plain HTTP: to the port its entry names, and
    for a host alone to port 80 only (it once matched every port)."""
    alone = Injection("api-key", PLACEHOLDER, SECRET, (HOST,), allow_plaintext=True)
    proxy = await proxy_for(tmp_path, listener.port, alone)
    try:
        refused = await send(proxy, plain_get(listener.port))
    finally:
        await proxy.aclose()
    assert refused.startswith(b"HTTP/1.1 403"), refused
    assert listener.got() == b""

    proxy = await proxy_for(tmp_path, listener.port, credential(listener.port, allow_plaintext=True))
    try:
        reply = await send(proxy, plain_get(listener.port))
    finally:
        await proxy.aclose()
    assert parse(reply) == (200, b"ok")
    assert f"x-api-key: {SECRET}".encode() in listener.got().lower()
    assert [(r.allowed, r.status, r.injected) for r in proxy.records] == [(True, 200, ("api-key",))]


@pytest.mark.parametrize(
    ("entry", "allow_plaintext", "host", "port", "tls", "applies"),
    [
        ("api.x", False, "api.x", 443, True, True),  # a host alone: HTTPS on 443
        ("api.x", False, "api.x", 8443, True, False),
        ("api.x", False, "api.x", 80, False, False),  # plain HTTP: not without the operator's leave
        ("api.x", True, "api.x", 80, False, True),  # with it, a host alone means 80
        ("api.x", True, "api.x", 443, False, False),  # and never 443
        ("api.x", True, "api.x", 443, True, True),
        ("api.x:8443", False, "api.x", 8443, True, True),
        ("api.x:8443", False, "api.x", 443, True, False),
        ("api.x:8443", False, "api.y", 8443, True, False),
        ("API.X.:8080", True, "api.x", 8080, False, True),  # case and a trailing dot do not matter
        ("api.x:443", True, "api.x", 443, False, False),
        ("api.x:http", True, "api.x", 80, False, False),  # a port that is no number names none
        ("api.x:http", False, "api.x", 443, True, False),
        ("[::1]:8443", False, "::1", 8443, True, True),
        ("[::1]", False, "::1", 443, True, True),
        ("::1", False, "::1", 443, True, True),
    ],
)
def test_which_destinations_a_credential_entry_names(
    entry: str, allow_plaintext: bool, host: str, port: int, tls: bool, applies: bool
) -> None:
    assert Injection("k", "p", "v", (entry,), allow_plaintext).applies_to(host, port, tls=tls) is applies


async def test_a_credential_past_its_lease_is_refused_and_recorded(
    tmp_path: Path, https_upstream: HttpsUpstream
) -> None:
    """The lease ends while the call still runs: the request that carries the placeholder after
    that gets ``403`` from the proxy inside TLS and a refused record, and never reaches the
    upstream; before it, the same request got the value."""
    https_upstream.seen.clear()
    ends = time.time() + 2.0
    injection = credential(https_upstream.port, expires_at=ends)
    proxy = await proxy_for(tmp_path, https_upstream.port, injection, upstream=https_upstream)
    try:
        _, before = await https_via(proxy, https_upstream.port, CA.cert_pem, inner_request("GET"))
        assert time.time() < ends, "the first request took the whole lease: a slow machine"
        await asyncio.sleep(ends - time.time() + 0.05)
        _, after = await https_via(proxy, https_upstream.port, CA.cert_pem, inner_request("GET"))
    finally:
        await proxy.aclose()
    assert parse(before) == (200, b"authorized")
    status, body = parse(after)
    assert status == 403
    assert b"has expired" in body
    assert https_upstream.seen == [("GET", SECRET)]  # the second request never went out
    assert [(r.allowed, r.status, r.injected, r.intercepted) for r in proxy.records] == [
        (True, 200, ("api-key",), True), (False, 403, (), True)]  # fmt: skip
    assert "expired" in proxy.records[1].reason


async def test_a_value_no_header_may_carry_is_refused_without_being_quoted(
    tmp_path: Path, listener: Listener, unhandled: list[str], capfd: pytest.CaptureFixture[str]
) -> None:
    """A credential's value with a line break in it (a key read with its trailing newline) makes
    the request invalid once put in. h11 refuses it, quoting the header, value and all: that text
    must reach no one. The client gets ``502`` saying what went wrong, the request is recorded, and
    no exception is left for asyncio's logger (which would print it, unredacted, to stderr)."""
    broken = Injection("api-key", PLACEHOLDER, SECRET + "\n", (f"{HOST}:{listener.port}",), allow_plaintext=True)
    proxy = await proxy_for(tmp_path, listener.port, broken)
    try:
        reply = await send(proxy, plain_get(listener.port))
    finally:
        await proxy.aclose()
    await asyncio.sleep(0.05)  # a task's exception is reported as the task is collected
    assert reply.startswith(b"HTTP/1.1 502"), reply
    assert SECRET.encode() not in reply
    assert listener.got() == b""
    [record] = proxy.records
    assert (record.allowed, record.status) == (True, 502)
    assert SECRET not in repr(record)
    assert unhandled == []
    out, err = capfd.readouterr()
    assert SECRET not in out + err


async def test_a_failure_nothing_expected_is_recorded_and_never_reaches_asyncios_logger(
    tmp_path: Path, listener: Listener, unhandled: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug inside the proxy (here, one planted in its framing check) while it handles a request:
    the client gets ``500`` naming only the error's class, the request is recorded as refused, and
    the proxy goes on serving."""

    def planted(request: object) -> None:
        monkeypatch.undo()  # only the first request meets it
        raise KeyError(f"{SECRET} in an error's text")

    monkeypatch.setattr(proxy_module, "_check_framing", planted)
    proxy = await proxy_for(tmp_path, listener.port, credential(listener.port, allow_plaintext=True))
    try:
        failed = await send(proxy, plain_get(listener.port))
        served = await send(proxy, plain_get(listener.port))
    finally:
        await proxy.aclose()
    await asyncio.sleep(0.05)
    assert failed.startswith(b"HTTP/1.1 500"), failed
    assert b"KeyError" in failed
    assert SECRET.encode() not in failed
    assert parse(served) == (200, b"ok")
    assert [(r.allowed, r.status) for r in proxy.records] == [(False, 500), (True, 200)]
    assert SECRET not in proxy.records[0].reason
    assert unhandled == []


@pytest.mark.parametrize("codings", [[b"gzip", b"gzip"], [b"gzip, gzip"], [b"identity", b"gzip"], [b"gzip, br"]])
async def test_a_response_coded_more_than_once_is_refused(
    tmp_path: Path, listener: Listener, codings: list[bytes]
) -> None:
    """The upstream echoes the request (credential and all) gzipped twice, saying so in two
    ``Content-Encoding`` headers: inflated once and passed on, the inner gzip carried the value
    past the scrubber to the tool. Codings are read as one list; more than one is refused."""
    proxy = await proxy_for(tmp_path, listener.port, credential(listener.port, allow_plaintext=True))
    body = gzip.compress(gzip.compress(f"X-Api-Key: {SECRET}\n".encode()))
    headers = b"".join(b"Content-Encoding: %s\r\n" % coding for coding in codings)
    listener.reply = b"HTTP/1.1 200 OK\r\n%sContent-Length: %d\r\n\r\n%s" % (headers, len(body), body)
    try:
        reply = await send(proxy, plain_get(listener.port))
    finally:
        await proxy.aclose()
    assert reply.startswith(b"HTTP/1.1 502"), reply[:200]
    assert b"cannot scrub" in reply
    assert b"\x1f\x8b" not in reply  # not even the inner gzip
    [record] = proxy.records
    assert (record.status, record.injected) == (502, ("api-key",))
