"""A per-call HTTP proxy on a Unix socket that allows only the call's ``obligations.egress``.

Sandboxes have no network interface. A bridge inside each one forwards ``127.0.0.1:3128`` to
this proxy's socket, and tools see it as ``HTTP_PROXY``/``HTTPS_PROXY``. For each request:

- ``CONNECT host:port`` (HTTPS): allowed when a rule names that host and port; then tunnelled.
- an absolute-form ``http://`` request: allowed when a rule names the host and port and, if the
  rule lists methods, the method; forwarded with ``Connection: close``.
- anything else, or a destination no rule names: ``403`` with the reason; malformed: ``400``.

Credentials (``injections``): the sandbox holds a placeholder; the proxy replaces it with the
real value in the request headers, only for the credential's hosts (exact host, or host:port).
For HTTPS to such a host the proxy terminates TLS with a per-call CA (`runner.egress.intercept`)
and opens its own verified TLS connection upstream; every other host is tunnelled untouched.
Records name the credentials injected, never their values.

Destinations are matched before any name is resolved, so a refused request causes no DNS
lookup. A name that resolves to a loopback, private or link-local address is refused unless the
operator pinned it (``hosts``) or the rule names an IP literal: an allowlisted name must not
become a way into the host's own network. Every request, allowed or not, is reported once to
``on_record`` with byte counts; the router audits it with the call's ``decision_id``.

HTTP parsing and framing is h11's (the state machine under httpx and uvicorn): it rejects
malformed and ambiguous messages (request smuggling) that a hand-written parser would pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import ssl
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import h11
import structlog

from runner.base import EgressHook, EgressRecord, EgressRule, Injection
from runner.egress.intercept import InterceptCA, upstream_context

log = structlog.get_logger(__name__)

_HOP_BY_HOP = {
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection",
    b"te", b"trailer", b"transfer-encoding", b"upgrade",
}  # fmt: skip
_MAX_HEAD = 64 * 1024
_MAX_BODY = 16 << 20
_CHUNK = 65536


class _Refused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class EgressProxy:
    """Serves one call's egress on a Unix socket until closed."""

    def __init__(
        self,
        path: Path,
        rules: Sequence[EgressRule],
        on_record: EgressHook | None = None,
        *,
        hosts: Mapping[str, str] | None = None,
        connect_timeout_s: float = 10.0,
        idle_timeout_s: float = 60.0,
        injections: Sequence[Injection] = (),
        intercept: InterceptCA | None = None,
        upstream_ca: Path | None = None,
    ) -> None:
        self.path = path
        self._rules = [EgressRule(r.host.lower().rstrip("."), r.port, tuple(m.upper() for m in r.methods))
                       for r in rules]  # fmt: skip
        self._on_record = on_record
        self._hosts = {k.lower(): v for k, v in (hosts or {}).items()}
        self._connect_timeout = connect_timeout_s
        self._idle_timeout = idle_timeout_s
        self._injections = tuple(injections)
        self._intercept = intercept
        self._upstream_tls = upstream_context(upstream_ca) if intercept is not None else None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.records: list[EgressRecord] = []

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        # The sandbox runs as another uid; the socket's directory is what limits who sees it.
        os.chmod(self.path, 0o666)  # noqa: S103

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await self._handle(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        except asyncio.CancelledError:
            # aclose() cancels open tunnels: the connection ends here, and asyncio's stream callback
            # would otherwise report the cancellation as an error.
            pass
        finally:
            if task is not None:
                self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _report(self, record: EgressRecord) -> None:
        self.records.append(record)
        log.info("egress", method=record.method, host=record.host, port=record.port, allowed=record.allowed,
                 reason=record.reason, status=record.status)  # fmt: skip
        if self._on_record is not None:
            await self._on_record(record)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        started = time.perf_counter()
        method, host, port = "?", "?", 0
        try:
            request = await _next_request(conn, reader, self._idle_timeout)
        except ConnectionError:
            return  # hung up before asking for anything (a readiness probe): no request, no record
        except _Refused as refused:
            await _send_error(conn, writer, refused.status, refused.reason)
            await self._report(EgressRecord(method, host, port, False, refused.reason, refused.status))
            return
        try:
            _check_framing(request)
            method = request.method.decode("ascii", "replace").upper()
            host, port, target = _destination(method, request.target.decode("ascii", "replace"))
            rule_reason = self._check(method, host, port)
            address = await self._resolve(host)
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(address, port), self._connect_timeout)
        except _Refused as refused:
            await _send_error(conn, writer, refused.status, refused.reason)
            await self._report(EgressRecord(method, host, port, False, refused.reason, refused.status,
                                            duration_ms=(time.perf_counter() - started) * 1000))  # fmt: skip
            return
        except (OSError, TimeoutError) as exc:
            reason = f"upstream {host}:{port} unreachable: {exc.__class__.__name__}"
            await _send_error(conn, writer, 502, reason)
            await self._report(EgressRecord(method, host, port, True, reason, 502,
                                            duration_ms=(time.perf_counter() - started) * 1000))  # fmt: skip
            return
        injections = [i for i in self._injections if i.applies_to(host, port)]
        intercepted, injected = False, tuple[str, ...]()
        try:
            if method == "CONNECT" and injections and self._intercept is not None:
                intercepted = True
                status, up, down, injected = await self._intercept_tls(
                    conn, reader, writer, up_reader, up_writer, host, injections
                )
            elif method == "CONNECT":
                up, down = await self._tunnel(conn, reader, writer, up_reader, up_writer)
                status = 200
            else:
                status, up, down, injected = await self._forward(
                    conn, request, target, reader, writer, up_reader, up_writer, injections
                )
        except _Refused as refused:
            with contextlib.suppress(Exception):
                await _send_error(conn, writer, refused.status, refused.reason)
            status, up, down, rule_reason = refused.status, 0, 0, refused.reason
        except (ssl.SSLError, OSError, TimeoutError) as exc:
            status, up, down, rule_reason = 502, 0, 0, f"TLS with {host}:{port} failed: {exc.__class__.__name__}"
        finally:
            up_writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await up_writer.wait_closed()
        await self._report(EgressRecord(method, host, port, True, rule_reason, status, up, down,
                                        (time.perf_counter() - started) * 1000, injected, intercepted))  # fmt: skip

    def _check(self, method: str, host: str, port: int) -> str:
        for rule in self._rules:
            if rule.host == host and rule.port == port:
                if method == "CONNECT" or not rule.methods or method in rule.methods:
                    return f"allowed by rule {rule.host}:{rule.port}"
                raise _Refused(403, f"method {method} to {host}:{port} is not allowed (allowed: "
                                    f"{', '.join(rule.methods)})")  # fmt: skip
        raise _Refused(403, f"egress to {host}:{port} is not in this call's allowlist")

    async def _resolve(self, host: str) -> str:
        if host in self._hosts:
            return self._hosts[host]
        with contextlib.suppress(ValueError):
            ipaddress.ip_address(host)
            return host  # an IP literal named by the rule itself
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise _Refused(502, f"cannot resolve {host}: {exc.strerror}") from exc
        for *_, sockaddr in infos:
            address = ipaddress.ip_address(sockaddr[0])
            if not address.is_global:
                raise _Refused(403, f"{host} resolves to non-public address {address}")
        return str(infos[0][4][0])

    async def _tunnel(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
    ) -> tuple[int, int]:
        await _established(conn, writer)
        leftover, _ = conn.trailing_data
        up_writer.write(leftover)
        counts = [len(leftover), 0]
        await asyncio.gather(
            _pump(reader, up_writer, counts, 0, self._idle_timeout),
            _pump(up_reader, writer, counts, 1, self._idle_timeout),
        )
        return counts[0], counts[1]

    async def _intercept_tls(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
        host: str,
        injections: Sequence[Injection],
    ) -> tuple[int, int, int, tuple[str, ...]]:
        """Terminate the sandbox's TLS for ``host``, then forward one request with its
        credentials over the proxy's own verified TLS connection to the upstream."""
        if self._intercept is None or self._upstream_tls is None:
            raise _Refused(500, "interception is not set up for this call")
        leftover, _ = conn.trailing_data
        if leftover:
            raise _Refused(400, "send the TLS handshake after the CONNECT response, not with the request")
        await _established(conn, writer)
        await asyncio.wait_for(writer.start_tls(self._intercept.server_context(host)), self._connect_timeout)
        await asyncio.wait_for(up_writer.start_tls(self._upstream_tls, server_hostname=host), self._connect_timeout)
        inner = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        try:
            request = await _next_request(inner, reader, self._idle_timeout)
        except _Refused as refused:
            await _send_error(inner, writer, refused.status, refused.reason)
            return refused.status, 0, 0, ()
        _check_framing(request)
        target = request.target.decode("ascii", "replace")
        if not target.startswith("/"):
            await _send_error(inner, writer, 400, "inside the tunnel, send origin-form targets (/path)")
            return 400, 0, 0, ()
        return await self._forward(inner, request, target, reader, writer, up_reader, up_writer, injections)

    async def _forward(
        self,
        conn: h11.Connection,
        request: h11.Request,
        target: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
        injections: Sequence[Injection] = (),
    ) -> tuple[int, int, int, tuple[str, ...]]:
        body = bytearray()
        while True:
            event = await _next_event(conn, reader, self._idle_timeout)
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > _MAX_BODY:
                    raise _Refused(413, "request body over the proxy's cap")
            elif isinstance(event, h11.EndOfMessage):
                break
        upstream = h11.Connection(h11.CLIENT)
        # The body is framed by what we send, never by the client's claims.
        headers, injected = _inject(
            [(k, v) for k, v in request.headers if k.lower() not in _HOP_BY_HOP | {b"content-length"}], injections
        )
        headers.append((b"connection", b"close"))
        if body or request.method.upper() in (b"POST", b"PUT", b"PATCH"):
            headers.append((b"content-length", str(len(body)).encode()))
        data = upstream.send(h11.Request(method=request.method, target=target.encode(), headers=headers))
        if body:
            data += upstream.send(h11.Data(data=bytes(body)))
        data += upstream.send(h11.EndOfMessage())
        up_writer.write(data)
        await up_writer.drain()
        sent, received, status = len(data), 0, 502
        while True:
            chunk_event = upstream.next_event()
            if chunk_event is h11.NEED_DATA:
                chunk = await asyncio.wait_for(up_reader.read(_CHUNK), self._idle_timeout)
                received += len(chunk)
                upstream.receive_data(chunk)
                continue
            if isinstance(chunk_event, h11.Response):
                status = chunk_event.status_code
                kept = [(k, v) for k, v in chunk_event.headers if k.lower() not in _HOP_BY_HOP]
                writer.write(conn.send(h11.Response(status_code=status, headers=[*kept, (b"connection", b"close")],
                                                    reason=chunk_event.reason)))  # fmt: skip
            elif isinstance(chunk_event, h11.Data):
                writer.write(conn.send(h11.Data(data=chunk_event.data)))
            elif isinstance(chunk_event, h11.EndOfMessage | h11.ConnectionClosed):
                with contextlib.suppress(h11.LocalProtocolError):
                    writer.write(conn.send(h11.EndOfMessage()))
                break
            await writer.drain()
        await writer.drain()
        return status, sent, received, injected


def _inject(
    headers: list[tuple[bytes, bytes]], injections: Sequence[Injection]
) -> tuple[list[tuple[bytes, bytes]], tuple[str, ...]]:
    """Headers with each applicable credential's placeholder replaced by its value; the labels used."""
    used: list[str] = []
    for injection in injections:
        placeholder, value = injection.placeholder.encode(), injection.value.encode()
        replaced = [(k, v.replace(placeholder, value)) for k, v in headers]
        if replaced != headers:
            used.append(injection.label)
            headers = replaced
    return headers, tuple(used)


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader, idle_s: float) -> object:
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            raise _Refused(400, f"malformed request: {exc}") from exc
        if event is h11.NEED_DATA:
            data = await asyncio.wait_for(reader.read(_CHUNK), idle_s)
            conn.receive_data(data)
            continue
        if isinstance(event, h11.ConnectionClosed):
            raise ConnectionError("client closed")
        return event


async def _next_request(conn: h11.Connection, reader: asyncio.StreamReader, idle_s: float) -> h11.Request:
    event = await _next_event(conn, reader, idle_s)
    if not isinstance(event, h11.Request):
        raise _Refused(400, "expected an HTTP request")
    return event


def _check_framing(request: h11.Request) -> None:
    """Refuse a request whose body length is ambiguous (request smuggling)."""
    names = [name.lower() for name, _ in request.headers]
    if b"content-length" in names and b"transfer-encoding" in names:
        raise _Refused(400, "request has both Content-Length and Transfer-Encoding")


def _destination(method: str, target: str) -> tuple[str, int, str]:
    """(host, port, origin-form target) of a proxy request, or `_Refused`."""
    if method == "CONNECT":
        host, sep, port_text = target.rpartition(":")
        if not sep or not port_text.isdigit():
            raise _Refused(400, f"CONNECT target {target[:100]!r} is not host:port")
        return _host(host.strip("[]")), _port(int(port_text)), ""
    parts = urlsplit(target)
    if parts.scheme != "http" or not parts.hostname:
        raise _Refused(400, "send http:// URLs in absolute form, and https through CONNECT")
    try:
        port = parts.port or 80
    except ValueError as exc:
        raise _Refused(400, f"bad port in {target[:100]!r}") from exc
    path = parts.path or "/"
    return _host(parts.hostname), _port(port), path + (f"?{parts.query}" if parts.query else "")


def _host(host: str) -> str:
    host = host.lower().rstrip(".")
    if not host or len(host) > 253:
        raise _Refused(400, "bad host")
    return host


def _port(port: int) -> int:
    if not 0 < port < 65536:
        raise _Refused(400, f"bad port {port}")
    return port


async def _established(conn: h11.Connection, writer: asyncio.StreamWriter) -> None:
    """Answer a CONNECT: from here on the connection carries the tunnelled (or intercepted) bytes."""
    writer.write(conn.send(h11.Response(status_code=200, headers=[], reason=b"Connection Established")))
    await writer.drain()


async def _send_error(conn: h11.Connection, writer: asyncio.StreamWriter, status: int, reason: str) -> None:
    body = f"stockade egress: {reason}\n".encode()
    with contextlib.suppress(h11.LocalProtocolError, ConnectionError):
        writer.write(conn.send(h11.Response(status_code=status, headers=[
            (b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode()), (b"connection", b"close"),
        ])))  # fmt: skip
        writer.write(conn.send(h11.Data(data=body)))
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()


async def _pump(
    source: asyncio.StreamReader, sink: asyncio.StreamWriter, counts: list[int], slot: int, idle_s: float
) -> None:
    try:
        while data := await asyncio.wait_for(source.read(_CHUNK), idle_s):
            counts[slot] += len(data)
            sink.write(data)
            await sink.drain()
    except (ConnectionError, TimeoutError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            if sink.can_write_eof():
                sink.write_eof()
