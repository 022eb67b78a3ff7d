"""A per-call HTTP proxy on a Unix socket that allows only the call's ``obligations.egress``.

Sandboxes have no network interface. A bridge inside each one forwards ``127.0.0.1:3128`` to
this proxy's socket, and tools see it as ``HTTP_PROXY``/``HTTPS_PROXY``. For each request:

- ``CONNECT host:port`` (HTTPS): allowed when a rule names that host and port; then tunnelled,
  unless the proxy must see inside (below).
- an absolute-form ``http://`` request: allowed when a rule names the host and port and, if the
  rule lists methods, the method; forwarded with ``Connection: close``.
- anything else, or a destination no rule names: ``403`` with the reason; malformed: ``400``.

Interception: for HTTPS to a host whose rule lists methods, or that has a credential, the proxy
terminates the sandbox's TLS with a per-call CA (`runner.egress.intercept`), opens its own
verified TLS connection upstream, and treats the one request inside like a plain HTTP one: the
method is checked against the rule (``403`` inside the tunnel and a refused record if it is not
granted) and the request is recorded with its own method. Without a CA such a CONNECT is refused,
never tunnelled unchecked. Every other host is tunnelled untouched, end to end.

Credentials (``injections``): the sandbox holds a placeholder; the proxy replaces it with the
real value in the request headers, only for the credential's hosts (exact host, or host:port),
only inside an intercepted CONNECT (TLS the proxy verified; a host without a port means 443),
and only until the credential's lease ends. Plain ``http://`` gets a value only if its
credential allows plain text (a host without a port then means 80), and never to port 443. A
request carrying a placeholder the proxy may not replace there (another host or port, plain
HTTP, an ended lease) is refused, ``403``, and recorded as refused. Responses from those hosts
are scrubbed of each of their credentials' values in every form `runner.egress.scrub` knows
(headers and body, with its length rewritten or sent chunked; the upstream is asked for an
uncompressed body, and one gzip or deflate coding is decompressed; any other coding, or more
than one, is refused, ``502``), so a reflecting upstream does not hand the secret back to the tool.
Records name the credentials injected and scrubbed (with the encoding found), never their values.

Destinations are matched before any name is resolved, so a refused request causes no DNS
lookup. A name that resolves to a loopback, private or link-local address is refused unless the
operator pinned it (``hosts``) or the rule names an IP literal: an allowlisted name must not
become a way into the host's own network. Every request, allowed or not, is reported once to
``on_record`` with byte counts; the router audits it with the call's ``decision_id``.

Each proxy serves at most 32 connections at once, beyond its first few only while a budget
shared by every proxy in the process lasts; others are answered ``503`` at once. A request's
head must arrive within 10 s (``408``). The proxy runs in the router's process: one sandbox
must not take its descriptors.

HTTP parsing and framing is h11's (the state machine under httpx and uvicorn): it rejects
malformed and ambiguous messages (request smuggling) that a hand-written parser would pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import os
import socket
import ssl
import stat
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import cast
from urllib.parse import unquote_to_bytes, urlsplit

import h11
import structlog

from runner.base import EgressHook, EgressRecord, EgressRule, Injection
from runner.egress.intercept import InterceptCA, upstream_context
from runner.egress.scrub import StreamScrubber, compile_forms, scrub

log = structlog.get_logger(__name__)

_HOP_BY_HOP = {
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection",
    b"te", b"trailer", b"transfer-encoding", b"upgrade",
}  # fmt: skip
_MAX_HEAD = 64 * 1024
_CHUNK = 65536
_INFLATABLE = {b"gzip", b"x-gzip", b"deflate"}
# The IANA HTTP content codings: the only ones a refusal names.
_KNOWN_CODINGS = _INFLATABLE | {b"identity", b"br", b"compress", b"x-compress", b"zstd", b"dcb", b"dcz", b"exi",
                                b"pack200-gzip", b"aes128gcm"}  # fmt: skip
_METHOD_OVERRIDES = {b"x-http-method-override", b"x-http-method", b"x-method-override"}
_CLOSE_GRACE_S = 1.0
_BUFFERED_MAX = 1 << 20  # a scrubbed body up to this keeps a Content-Length (rewritten); longer ones go chunked
# Connections a sandbox may hold open to its call's proxy at once. The proxy runs in the router's
# process, and each connection is one of its descriptors (two, with the upstream's): more are
# refused at once, or one tool could take the descriptors every other call and the router need.
_MAX_CONNECTIONS = 32
# Each proxy's first few connections are its own; beyond them it borrows from one budget for the
# whole process, so many calls attacking at once cannot exhaust it either, while an innocent call
# still gets its reserve.
_RESERVED_CONNECTIONS = 4
_MAX_BORROWED_TOTAL = 256
_HEAD_TIMEOUT_S = 10.0  # to send a request's head, in all: an idle client must not hold a slot for long
_PORT_DIGITS = 5  # longer port text is refused before int(), which refuses (ValueError) past 4300 digits
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class _Refused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class _UpstreamStopped(_Refused):
    """The upstream stopped taking the request's body (it may have answered already)."""


@dataclasses.dataclass
class _Exchange:
    """What the proxy learned about one request as it went; reported once as an `EgressRecord`."""

    method: str = "?"
    host: str = "?"
    port: int = 0
    allowed: bool = False
    reason: str = ""
    status: int = 0
    up: int = 0
    down: int = 0
    injected: tuple[str, ...] = ()
    intercepted: bool = False
    scrubbed: tuple[str, ...] = ()
    started: float = dataclasses.field(default_factory=time.perf_counter)
    reported: bool = False

    def fail(self, refused: _Refused) -> None:
        """The request ended with ``refused``; whether the rules allowed it stays as it was."""
        self.status, self.reason = refused.status, refused.reason

    def record(self, *, cut_off: bool = False) -> EgressRecord:
        return EgressRecord(self.method, self.host, self.port, self.allowed, self.reason, self.status, self.up,
                            self.down, (time.perf_counter() - self.started) * 1000, self.injected, self.intercepted,
                            self.scrubbed, cut_off)  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class _Route:
    """Where an allowed request goes: its rule, its origin-form target (none for CONNECT), the
    credentials for its host, whether HTTPS to it is intercepted, and the upstream connection."""

    rule: EgressRule
    target: str
    injections: tuple[Injection, ...]
    intercept: bool
    up_reader: asyncio.StreamReader
    up_writer: asyncio.StreamWriter


class _Budget:
    """Connections that proxies in this process hold beyond their reserve; taken at accept, given
    back at close. Locked: proxies may run on event loops in several threads."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._taken = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self._taken >= self._limit:
                return False
            self._taken += 1
            return True

    def give(self) -> None:
        with self._lock:
            self._taken -= 1


_BORROWED = _Budget(_MAX_BORROWED_TOTAL)


class EgressProxy:
    """Serves one call's egress on a Unix socket until closed.

    At most ``max_connections`` connections at once (more are answered ``503`` and closed), beyond
    the first few only while the process-wide budget lasts; each must send its request's head
    within ``head_timeout_s``.
    """

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
        head_timeout_s: float = _HEAD_TIMEOUT_S,
        max_connections: int = _MAX_CONNECTIONS,
    ) -> None:
        self.path = path
        self._rules = [EgressRule(r.host.lower().rstrip("."), r.port, tuple(m.upper() for m in r.methods))
                       for r in rules]  # fmt: skip
        self._on_record = on_record
        self._hosts = {k.lower(): v for k, v in (hosts or {}).items()}
        self._connect_timeout = connect_timeout_s
        self._idle_timeout = idle_timeout_s
        self._head_timeout = head_timeout_s
        self._max_connections = max_connections
        self._injections = tuple(injections)
        self._intercept = intercept
        self._upstream_tls = upstream_context(upstream_ca) if intercept is not None else None
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._conns: set[socket.socket] = set()  # every connection accepted and not closed yet
        self._borrowed: set[socket.socket] = set()  # those of them counted in the process's budget
        self._refusing = False  # over a cap: said once in the log, not for every connection
        self.records: list[EgressRecord] = []

    async def start(self) -> None:
        # The socket is accepted from here, not through asyncio's Server: there, a connection
        # accepted in the loop turn before a close raised inside asyncio (Python 3.11 asserts the
        # server is open when the connection's transport is made) and its socket was left for the
        # garbage collector. Here each connection is ours from its accept, synchronously.
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(self.path.lstat().st_mode):  # a stale socket of an earlier run, as asyncio's Server does
                self.path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.path))
            # The sandbox runs as another uid; the socket's directory is what limits who sees it.
            os.chmod(self.path, 0o666)  # noqa: S103
            listener.listen(_BACKLOG)
            listener.setblocking(False)
            asyncio.get_running_loop().add_reader(listener, self._accept, listener)
        except BaseException:
            listener.close()
            raise
        self._listener = listener

    async def aclose(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            asyncio.get_running_loop().remove_reader(listener)
            listener.close()
        for task in list(self._tasks):
            task.cancel()
        try:
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:  # also when this close is cancelled in turn (the sandbox's call was, again)
            for conn in list(self._conns):  # a connection whose task never ran
                conn.close()
                self._forget(conn)
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def _accept(self, listener: socket.socket) -> None:
        """Take the connections waiting (the listener is readable), each known before its task runs."""
        loop = asyncio.get_running_loop()
        for _ in range(_BACKLOG):
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError:
                # Out of descriptors, say: the connections wait in the backlog. Stop watching for a
                # moment (as asyncio's Server does), or a listener still readable would spin the loop.
                loop.remove_reader(listener)
                loop.call_later(_ACCEPT_RETRY_S, self._resume, listener)
                return
            conn.setblocking(False)
            if not self._admit(conn):
                continue
            self._conns.add(conn)
            task = loop.create_task(self._connection(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _admit(self, conn: socket.socket) -> bool:
        """Whether ``conn`` may be served now; if not, it is answered ``503`` and closed at once
        (accepted first, so it does not wait in the backlog, holding the client up)."""
        over = None
        if len(self._conns) >= self._max_connections:
            over = "call"
        elif len(self._conns) >= _RESERVED_CONNECTIONS:
            if _BORROWED.take():
                self._borrowed.add(conn)
            else:
                over = "process"
        if over is None:
            self._refusing = False
            return True
        if not self._refusing:
            self._refusing = True
            log.warning("egress_connections_refused", cap=over, open=len(self._conns), path=str(self.path))
        with contextlib.suppress(OSError):  # a full buffer, a client gone: it is closed all the same
            conn.send(_BUSY)
        conn.close()
        return False

    def _forget(self, conn: socket.socket) -> None:
        """``conn`` is closed: its slot, and its share of the process's budget, are free."""
        self._conns.discard(conn)
        if conn in self._borrowed:
            self._borrowed.discard(conn)
            _BORROWED.give()

    def _resume(self, listener: socket.socket) -> None:
        if self._listener is listener:  # not closed meanwhile
            asyncio.get_running_loop().add_reader(listener, self._accept, listener)

    async def _connection(self, conn: socket.socket) -> None:
        """Serve one accepted connection as a server-side stream (so `StreamWriter.start_tls`
        answers as the server when the proxy intercepts)."""
        loop = asyncio.get_running_loop()
        streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        protocol = asyncio.StreamReaderProtocol(
            asyncio.StreamReader(loop=loop), lambda r, w: streams.append((r, w)), loop=loop
        )
        # The protocol is told of the connection (and makes its streams) before this completes.
        setup = asyncio.ensure_future(loop.connect_accepted_socket(lambda: protocol, sock=conn))
        try:
            try:
                await asyncio.shield(setup)
            except asyncio.CancelledError:
                # aclose() while the stream is being made: let that finish (a loop turn or two),
                # so what it made is closed as a stream (a transport cut short mid-setup is not
                # marked closing, and its writer would be left to the garbage collector).
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await setup
                for _, writer in streams:
                    writer.close()
                conn.close()
                return
            except OSError:
                conn.close()
                return
            await self._serve(*streams[0])
        except Exception as exc:  # a task's exception would reach asyncio's logger, unredacted
            log.error("egress_connection_failed", error=exc.__class__.__name__)
            conn.close()
        finally:
            self._forget(conn)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        exchange = _Exchange()
        try:
            await self._handle(conn, reader, writer, exchange)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        except asyncio.CancelledError:
            # aclose() cancels open tunnels: the connection ends here (the task is ours, and nothing
            # waits for its result).
            pass
        except Exception as exc:  # a bug, or a library's error no branch above expected
            # Its text may quote what it choked on (h11 quotes a header, credential and all): only
            # its class is told, to the client, the log and the record, and it never reaches
            # asyncio's logger, which writes the task's traceback to stderr unredacted.
            log.error("egress_proxy_error", error=exc.__class__.__name__, host=exchange.host, port=exchange.port)
            if not exchange.reported:
                refused = _Refused(500, f"the proxy failed on this request ({exc.__class__.__name__})")
                await _send_error(conn, writer, refused.status, refused.reason)
                exchange.fail(refused)
                with contextlib.suppress(Exception):  # the hook failing too: the router counts it unaudited
                    await self._report_exchange(exchange)
        finally:
            await _close(writer)

    async def _report(self, record: EgressRecord) -> None:
        """Record an exchange, and hand it to the hook (the router's audit append) to the end even
        when this task is cancelled (the run ended, the proxy closes): the append goes on, and the
        router waits for it before it releases the call's output."""
        await asyncio.shield(self._deliver(record))

    async def _report_exchange(self, exchange: _Exchange, *, cut_off: bool = False) -> None:
        """Record ``exchange``, once."""
        exchange.reported = True
        await self._report(exchange.record(cut_off=cut_off))

    async def _deliver(self, record: EgressRecord) -> None:
        self.records.append(record)
        log.info("egress", method=record.method, host=record.host, port=record.port, allowed=record.allowed,
                 reason=record.reason, status=record.status, intercepted=record.intercepted, cut_off=record.cut_off,
                 scrubbed=list(record.scrubbed))  # fmt: skip
        if self._on_record is not None:
            await self._on_record(record)

    async def _handle(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, exchange: _Exchange
    ) -> None:
        try:
            try:
                async with asyncio.timeout(self._head_timeout):
                    request = await _next_request(conn, reader, self._idle_timeout)
            except TimeoutError:
                # No request yet, so none is recorded: an idle connection is not one.
                await _send_error(conn, writer, 408, f"send the request within {self._head_timeout:g} s")
                return
            if request.method == b"CONNECT":
                # What the client sends after its CONNECT must reach whatever serves the tunnel:
                # TLS, if the proxy intercepts. Read on, and a TLS hello sent early (or between
                # the 200 and the switch to TLS, which uvloop's turn order makes likely) lands in
                # the plain-text buffer, lost to TLS: the handshake would time out. Reading resumes
                # once the tunnel or TLS takes over.
                _transport(writer).pause_reading()
            route = await self._route(request, exchange)
        except ConnectionError:
            return  # hung up before asking for anything (a readiness probe): no request, no record
        except _Refused as refused:
            await _send_error(conn, writer, refused.status, refused.reason)
            exchange.fail(refused)
            await self._report_exchange(exchange)
            return
        except asyncio.CancelledError:
            if exchange.host != "?":  # it asked for somewhere: recorded, though nothing went out yet
                await self._report_exchange(exchange, cut_off=True)
            raise
        cut_off = False
        try:
            if route.intercept:
                await self._intercept_tls(conn, reader, writer, route, exchange)
            elif exchange.method == "CONNECT":
                await self._tunnel(conn, reader, writer, route, exchange)
            else:
                await self._forward(conn, request, reader, writer, route, exchange)
        except _Refused as refused:  # before any answer went to the client
            await _send_error(conn, writer, refused.status, refused.reason)
            exchange.fail(refused)
        except ConnectionError:
            pass  # the client left; what happened until then is recorded
        except (ssl.SSLError, OSError, TimeoutError) as exc:
            exchange.fail(_Refused(502, f"exchange with {exchange.host}:{exchange.port} failed: "
                                        f"{exc.__class__.__name__}"))  # fmt: skip
        except asyncio.CancelledError:
            # The run ended mid-exchange (its proxy closes): the request may have gone out in full,
            # so it is recorded as any other, marked cut off, before the cancellation goes on.
            cut_off = True
        finally:
            await _close(route.up_writer)
        if cut_off:
            await self._report_exchange(exchange, cut_off=True)
            raise asyncio.CancelledError
        await self._report_exchange(exchange)

    async def _route(self, request: h11.Request, exchange: _Exchange) -> _Route:
        """Check ``request`` against the rules and open its upstream connection, or `_Refused`."""
        _check_framing(request)
        # Methods are case-sensitive (RFC 9110 §9.1): checked, recorded and forwarded as sent.
        exchange.method = method = request.method.decode("ascii", "replace")
        exchange.host, exchange.port, target = _destination(method, request.target.decode("ascii", "replace"))
        host, port = exchange.host, exchange.port
        rule = self._rule(method, host, port, request.headers)
        # A credential goes only into what the proxy sends over TLS it verified itself (inside an
        # intercepted CONNECT); into plain HTTP only if its operator allowed that, and never to 443:
        # plain text to a TLS port is a request the sandbox shaped to read on the wire.
        tls = method == "CONNECT"
        injections = tuple(i for i in self._injections if i.applies_to(host, port, tls=tls))
        intercept = tls and bool(injections or rule.methods)
        if not tls:  # its headers are known now: a placeholder it may not carry is refused before any connection
            self._credentials(request.headers, injections, exchange, tls=False, target=request.target)
        if intercept and self._intercept is None:
            raise _Refused(403, f"HTTPS to {host}:{port} must be intercepted (a credential or a method "
                                "restriction) and this proxy has no CA for it")  # fmt: skip
        exchange.reason = f"allowed by rule {rule.host}:{rule.port}"
        address = await self._resolve(host)
        exchange.allowed = True
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(address, port), self._connect_timeout)
        except (OSError, TimeoutError) as exc:
            raise _Refused(502, f"upstream {host}:{port} unreachable: {exc.__class__.__name__}") from exc
        return _Route(rule, target, injections, intercept, up_reader, up_writer)

    def _rule(self, method: str, host: str, port: int, headers: Sequence[tuple[bytes, bytes]]) -> EgressRule:
        """The rule allowing ``method`` to ``host:port`` (a CONNECT is checked inside, if at all), or `_Refused`."""
        for rule in self._rules:
            if rule.host == host and rule.port == port:
                if method != "CONNECT":
                    _check_method(rule, method, headers)
                return rule
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
        route: _Route,
        exchange: _Exchange,
    ) -> None:
        await _established(conn, writer)
        exchange.status = 200
        leftover, _ = conn.trailing_data
        route.up_writer.write(leftover)
        _transport(writer).resume_reading()
        counts = [len(leftover), 0]
        try:
            await asyncio.gather(
                _pump(reader, route.up_writer, counts, 0, self._idle_timeout),
                _pump(route.up_reader, writer, counts, 1, self._idle_timeout),
            )
        finally:
            exchange.up, exchange.down = counts

    async def _intercept_tls(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        route: _Route,
        exchange: _Exchange,
    ) -> None:
        """Terminate the sandbox's TLS for the rule's host, check the one request inside against
        the rule, then forward it (with its credentials) over the proxy's own verified TLS
        connection to the upstream."""
        if self._intercept is None or self._upstream_tls is None:
            raise _Refused(500, "interception is not set up for this call")
        leftover, _ = conn.trailing_data
        if leftover:
            raise _Refused(400, "send the TLS handshake after the CONNECT response, not with the request")
        host = exchange.host
        exchange.intercepted = True
        try:
            # Upstream first: if it cannot be verified, the CONNECT itself is answered 502.
            async with asyncio.timeout(self._connect_timeout):
                await route.up_writer.start_tls(self._upstream_tls, server_hostname=host)
        except (ssl.SSLError, OSError, TimeoutError) as exc:
            raise _Refused(502, f"TLS with {host}:{exchange.port} failed: {exc.__class__.__name__}") from exc
        context = self._intercept.server_context(host)
        await _established(conn, writer)
        exchange.status = 200
        try:
            async with asyncio.timeout(self._connect_timeout):
                await writer.start_tls(context)
        except (ssl.SSLError, OSError, TimeoutError) as exc:  # e.g. a client that does not trust the call's CA
            exchange.fail(_Refused(502, f"TLS with the client failed: {exc.__class__.__name__}"))
            return
        inner = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        try:
            try:
                async with asyncio.timeout(self._head_timeout):
                    request = await _next_request(inner, reader, self._idle_timeout)
            except TimeoutError as exc:  # a tunnel held open, idle, is a connection slot taken
                raise _Refused(408, f"send the request within {self._head_timeout:g} s") from exc
            _check_framing(request)
            exchange.method = request.method.decode("ascii", "replace")
            target = request.target.decode("ascii", "replace")
            if not target.startswith("/"):
                raise _Refused(400, "inside the tunnel, send origin-form targets (/path)")
            _check_method(route.rule, exchange.method, request.headers)
        except _Refused as refused:
            await _send_error(inner, writer, refused.status, refused.reason)
            exchange.allowed = False
            exchange.fail(refused)
            return
        try:
            await self._forward(inner, request, reader, writer, dataclasses.replace(route, target=target), exchange)
        except _Refused as refused:
            await _send_error(inner, writer, refused.status, refused.reason)
            exchange.fail(refused)

    async def _forward(
        self,
        conn: h11.Connection,
        request: h11.Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        route: _Route,
        exchange: _Exchange,
    ) -> None:
        """Send ``request`` upstream with its credentials, and its response back, scrubbed of
        them. Raises `_Refused` only before anything was sent back."""
        injections = self._credentials(request.headers, route.injections, exchange, tls=route.intercept,
                                       target=request.target)  # fmt: skip
        upstream = h11.Connection(h11.CLIENT)
        # Host names the rule's authority, whatever the client wrote (as a proxy must, RFC 9112
        # §3.2.2): a credential for a shared front (a CDN, an ingress) never reaches another tenant.
        default_port = 443 if route.intercept else 80
        host = f"[{exchange.host}]" if ":" in exchange.host else exchange.host
        authority = host if exchange.port == default_port else f"{host}:{exchange.port}"
        # Expect is answered here (below): the upstream gets the body without waiting to be asked.
        dropped = _HOP_BY_HOP | {b"content-length", b"host", b"expect"}
        kept = [(k, v) for k, v in request.headers if k.lower() not in dropped]
        headers, exchange.injected = _inject([(b"host", authority.encode()), *kept], injections)
        scrubber = _ResponseScrubber(route.injections, request.method) if route.injections else None
        if scrubber is not None:
            # Scrubbing needs the body as text: ask for it uncompressed.
            headers = [(k, v) for k, v in headers if k.lower() != b"accept-encoding"]
            headers.append((b"accept-encoding", b"identity"))
        headers.append((b"connection", b"close"))
        headers.extend(_framing(request))
        try:
            data = upstream.send(h11.Request(method=request.method, target=route.target.encode(), headers=headers))
        except h11.LocalProtocolError:
            # h11 quotes the header it refuses, with the credential put into it: nothing of its
            # text is kept (no chained exception either). Only an injected value can make the
            # request invalid here: the client's own head was parsed by h11 already.
            injected = ", ".join(exchange.injected) or "none"
            raise _Refused(502, "the request is invalid with its credentials put in (a header h11 refuses); "
                                f"nothing was sent (injected: {injected})") from None  # fmt: skip
        route.up_writer.write(data)
        exchange.up = len(data)
        if conn.they_are_waiting_for_100_continue:
            # The request is allowed and on its way: a client that asked (curl does, for a body
            # over 1 KiB) sends its body now, not after its own timeout (1 s for curl).
            writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        try:
            await self._both_ways(conn, reader, writer, upstream, route, scrubber, exchange)
        finally:
            if scrubber is not None:
                exchange.scrubbed = scrubber.found()

    async def _both_ways(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        upstream: h11.Connection,
        route: _Route,
        scrubber: _ResponseScrubber | None,
        exchange: _Exchange,
    ) -> None:
        """The request's body upstream and the response back, at once: an upstream may answer
        before it has the whole body (a 401, a 413) and close, and the client gets that answer,
        not a 502 of ours. Raises as `_relay`, and as `_stream_body` when the client's side
        breaks before the answer is complete."""
        body = asyncio.create_task(_stream_body(conn, reader, upstream, route.up_writer, exchange, self._idle_timeout))
        relay = asyncio.create_task(self._relay(upstream, conn, route.up_reader, writer, scrubber, exchange))
        try:
            await asyncio.wait({body, relay}, return_when=asyncio.FIRST_EXCEPTION)
            failed = body.exception() if body.done() else None
            if failed is not None and not isinstance(failed, _UpstreamStopped) and not relay.done():
                raise failed  # the client broke its framing, hung up or went idle: the exchange ends
            try:
                await relay
            except (_Refused, OSError):
                if isinstance(failed, _UpstreamStopped) and exchange.status == 502:  # and it sent no answer
                    raise failed from None
                raise
        finally:
            body.cancel()  # done, or the upstream answered before it had the whole body
            relay.cancel()
            await asyncio.gather(body, relay, return_exceptions=True)

    def _credentials(
        self,
        headers: Sequence[tuple[bytes, bytes]],
        applicable: Sequence[Injection],
        exchange: _Exchange,
        *,
        tls: bool,
        target: bytes,
    ) -> tuple[Injection, ...]:
        """The credentials to put into a request with ``headers`` sent now (over verified TLS, if
        ``tls``): those of ``applicable`` (the ones its destination may have) whose placeholder it
        carries in a header. `_Refused` (``403``, the request not allowed) if it carries the
        placeholder of one not applicable, or of one whose lease has ended, in a header or in its
        ``target`` (the URL, percent-decoded, in any case): replacing it is refused, and sending
        the placeholder on would hide the attempt. (A body is not read for it.)"""
        now = time.time()
        used = []
        url = unquote_to_bytes(target).lower()
        for injection in self._injections:
            placeholder = injection.placeholder.encode()
            in_headers = any(placeholder in value for _, value in headers)
            if not in_headers and placeholder.lower() not in url:
                continue
            if injection not in applicable:
                how = "over TLS" if tls else "over plain HTTP"
                hint = "" if tls or injection.allow_plaintext else "; use https://"
                reason = f"credential {injection.label} may not go to {exchange.host}:{exchange.port} {how}{hint}"
            elif injection.expired(now):
                reason = f"credential {injection.label} has expired (its lease ended); the call may not use it now"
            else:
                if in_headers:  # in the URL only, the value goes nowhere: the placeholder goes where it may
                    used.append(injection)
                continue
            exchange.allowed = False
            raise _Refused(403, reason)
        return tuple(used)

    async def _relay(
        self,
        upstream: h11.Connection,
        conn: h11.Connection,
        up_reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        scrubber: _ResponseScrubber | None,
        exchange: _Exchange,
    ) -> None:
        """The upstream's response, passed to the client as it arrives (scrubbed, if ``scrubber``).
        Raises `_Refused` when it cannot be: before the head was sent, the client gets the error."""
        exchange.status = 502
        while True:
            try:
                event = upstream.next_event()
            except h11.RemoteProtocolError as exc:
                # h11 quotes the offending line: from a credential's host, it may reflect the value
                # injected into the request. What is wrong is said; the upstream's bytes never are.
                raise _Refused(502, f"malformed response from upstream: {str(exc).split(':', 1)[0]}") from exc
            if event is h11.NEED_DATA:
                chunk = await asyncio.wait_for(up_reader.read(_CHUNK), self._idle_timeout)
                exchange.down += len(chunk)
                upstream.receive_data(chunk)
                continue
            if isinstance(event, h11.Response):
                exchange.status = event.status_code
                kept = [(k, v) for k, v in event.headers if k.lower() not in _HOP_BY_HOP]
                response = h11.Response(status_code=event.status_code, headers=[*kept, (b"connection", b"close")],
                                        reason=event.reason)  # fmt: skip
                await _send(conn, writer, [response] if scrubber is None else scrubber.head(response))
            elif isinstance(event, h11.Data):
                await _send(conn, writer, [event] if scrubber is None else scrubber.body(event.data))
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                await _send(conn, writer, () if scrubber is None else scrubber.finish())
                with contextlib.suppress(h11.LocalProtocolError):
                    writer.write(conn.send(h11.EndOfMessage()))
                break
        await writer.drain()


class _ResponseScrubber:
    """A response from a credential's host, as h11 events to send on, with its credentials' values
    removed in every form `runner.egress.scrub` knows: from the header names and values, the reason,
    and the body. A body up to ``_BUFFERED_MAX`` with a Content-Length is held, scrubbed and sent
    with its new length; a longer, chunked or compressed one is scrubbed as it streams and sent
    chunked. A gzip or deflate body (sent although the request asked for none) is decompressed;
    any other coding cannot be read, and is refused."""

    def __init__(self, injections: Sequence[Injection], method: bytes) -> None:
        self._forms = compile_forms((i.label, i.value) for i in injections)
        self._stream = StreamScrubber(self._forms)
        self._head_found: set[tuple[str, str]] = set()
        self._method = method.upper()
        self._inflate: zlib._Decompress | None = None
        self._held: h11.Response | None = None  # a head waiting for its body's new length
        self._body = bytearray()

    def found(self) -> tuple[str, ...]:
        """``<credential>:<encoding>`` of each form removed so far."""
        seen = self._head_found | {(form.label, form.encoding) for form in self._stream.found}
        return tuple(sorted(f"{label}:{encoding}" for label, encoding in seen))

    def _scrub(self, value: bytes) -> bytes:
        scrubbed, found = scrub(value, self._forms)
        self._head_found.update((form.label, form.encoding) for form in found)
        return scrubbed

    def head(self, response: h11.Response) -> list[h11.Response]:
        """What to send of the status line and headers now; `_Refused` for a body coding it cannot read."""
        headers: list[tuple[bytes, bytes]] = []
        length: int | None = None
        # Codings apply in order, however many headers list them (RFC 9110 §8.4): taken one header
        # at a time, "gzip" twice was inflated once and the inner gzip passed on unread.
        codings = [c.strip().lower() for name, value in response.headers if name.lower() == b"content-encoding"
                   for c in value.split(b",") if c.strip()]  # fmt: skip
        if codings and (len(codings) > 1 or (codings[0] not in _INFLATABLE and codings[0] != b"identity")):
            # Named only if each is a registered coding: the header's bytes are the upstream's, and a
            # credential host that reflects a request may have put the secret there (the reason goes
            # back to the tool unscrubbed).
            known = all(coding in _KNOWN_CODINGS for coding in codings)
            listed = b", ".join(codings).decode("ascii") if known else "a coding it does not know"
            raise _Refused(502, f"upstream sent a body coded {listed}, which the proxy cannot scrub for credentials "
                                "(it reads one gzip or deflate coding)")  # fmt: skip
        if codings and codings[0] in _INFLATABLE:
            self._inflate = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib header
        for name, value in response.headers:
            lower = name.lower()
            if lower == b"content-encoding":
                continue
            if lower == b"content-length" and self._method != b"HEAD":
                length = int(value)  # h11 has checked it; the new one is known once the body is scrubbed
                continue
            if self._scrub(name) != name:
                continue  # reflected as a header's name: a marker is no valid name, so the header goes
            headers.append((name, self._scrub(value)))
        scrubbed = h11.Response(status_code=response.status_code, headers=headers,
                                reason=self._scrub(bytes(response.reason)))  # fmt: skip
        if length is not None and length <= _BUFFERED_MAX and self._inflate is None:
            self._held = scrubbed
            return []
        return [scrubbed]  # no length: h11 sends the body chunked (or until close, to HTTP/1.0)

    def body(self, data: bytes) -> Iterator[h11.Data]:
        """What to send of ``data`` now."""
        if self._held is not None:
            self._body += data
            return
        if self._inflate is None:
            yield h11.Data(data=self._stream.feed(data))
            return
        # Bounded steps: a small compressed body may inflate to a great deal.
        while data:
            try:
                piece = self._inflate.decompress(data, _CHUNK)
            except zlib.error as exc:
                raise _Refused(502, "upstream's compressed body is corrupt") from exc
            data = self._inflate.unconsumed_tail
            yield h11.Data(data=self._stream.feed(piece))

    def finish(self) -> list[h11.Response | h11.Data]:
        """What is left to send once the upstream's body has ended."""
        if self._held is not None:
            body = self._scrub(bytes(self._body))
            length = (b"content-length", str(len(body)).encode())
            return [h11.Response(status_code=self._held.status_code, headers=[*self._held.headers, length],
                                 reason=self._held.reason), h11.Data(data=body)]  # fmt: skip
        rest = self._stream.feed(self._inflate.flush()) if self._inflate is not None else b""
        return [h11.Data(data=rest + self._stream.finish())]


async def _send(conn: h11.Connection, writer: asyncio.StreamWriter, events: Iterable[h11.Response | h11.Data]) -> None:
    for event in events:
        if not isinstance(event, h11.Data) or event.data:  # an empty chunk would end a chunked body
            writer.write(conn.send(event))
            await writer.drain()


def _transport(writer: asyncio.StreamWriter) -> asyncio.ReadTransport:
    """The client connection's transport, which reads too (StreamWriter types it write-only)."""
    return cast("asyncio.ReadTransport", writer.transport)


def _check_method(rule: EgressRule, method: str, headers: Sequence[tuple[bytes, bytes]]) -> None:
    """`_Refused` unless ``rule`` grants ``method`` (a rule listing no methods grants any), exactly
    as written (``get`` is not ``GET``), and the request asks for no other method in a header."""
    if not rule.methods:
        return
    if method not in rule.methods:
        hint = " (methods are case-sensitive)" if method.upper() in rule.methods else ""
        raise _Refused(403, f"method {method} to {rule.host}:{rule.port} is not allowed (allowed: "
                            f"{', '.join(rule.methods)}){hint}")  # fmt: skip
    # Many frameworks serve the method one of these headers names instead of the request's own:
    # a grant of GET alone would otherwise let a DELETE through.
    for name, _ in headers:
        if name.lower() in _METHOD_OVERRIDES:
            raise _Refused(403, f"header {name.decode('ascii', 'replace')} asks for another method, and "
                                f"{rule.host}:{rule.port} allows only {', '.join(rule.methods)}")  # fmt: skip


def _framing(request: h11.Request) -> list[tuple[bytes, bytes]]:
    """The header that frames ``request``'s body upstream: the length the client declared (h11
    holds both sides to it), chunked if the client chunked (the only coding h11 accepts), and an
    explicit zero for a POST, PUT or PATCH without one (some servers wait for a body otherwise)."""
    for name, value in request.headers:
        if name.lower() == b"content-length":
            return [(b"content-length", str(int(value)).encode())]
        if name.lower() == b"transfer-encoding":
            return [(b"transfer-encoding", b"chunked")]
    return [(b"content-length", b"0")] if request.method in (b"POST", b"PUT", b"PATCH") else []


async def _stream_body(
    conn: h11.Connection,
    reader: asyncio.StreamReader,
    upstream: h11.Connection,
    up_writer: asyncio.StreamWriter,
    exchange: _Exchange,
    idle_s: float,
) -> None:
    """Send the request's body upstream as it arrives, a read at a time with backpressure: the
    proxy runs in the router's process, and a body held whole (connections x body size) would let
    a tool make the router hold what it likes. Trailers are dropped. `_Refused` if the client's
    framing breaks; `_UpstreamStopped` if the upstream stops taking it."""
    while True:
        event = await _next_event(conn, reader, idle_s)
        if isinstance(event, h11.Data):
            data = upstream.send(h11.Data(data=event.data))
        elif isinstance(event, h11.EndOfMessage):
            data = upstream.send(h11.EndOfMessage())
        else:  # nothing else comes between a request's head and its end
            raise _Refused(400, f"unexpected {type(event).__name__} in the request body")
        try:
            up_writer.write(data)
            await up_writer.drain()
        except OSError as exc:
            raise _UpstreamStopped(502, f"upstream {exchange.host}:{exchange.port} stopped taking the request body: "
                                        f"{exc.__class__.__name__}") from None  # fmt: skip
        exchange.up += len(data)
        if isinstance(event, h11.EndOfMessage):
            return


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
        if not sep or not (port_text.isascii() and port_text.isdigit()) or len(port_text) > _PORT_DIGITS:
            raise _Refused(400, f"CONNECT target {target[:100]!r} is not host:port")
        return _host(host.strip("[]")), _port(int(port_text)), ""
    try:
        parts = urlsplit(target)
    except ValueError as exc:  # an unclosed "[" of an IPv6 literal, say
        raise _Refused(400, f"URL {target[:100]!r} is malformed") from exc
    if parts.scheme != "http" or not parts.hostname:
        raise _Refused(400, "send http:// URLs in absolute form, and https through CONNECT")
    try:
        port = parts.port or 80
    except ValueError as exc:
        raise _Refused(400, f"bad port in {target[:100]!r}") from exc
    path = parts.path or "/"
    return _host(parts.hostname), _port(port), path + (f"?{parts.query}" if parts.query else "")


def _host(host: str) -> str:
    """The host as rules name it: lower case, no trailing dot, an IPv6 address compressed (the
    policy writes ``2001:db8::1`` for ``2001:DB8:0::1`` too)."""
    host = host.lower().rstrip(".")
    if not host or len(host) > 253:
        raise _Refused(400, "bad host")
    if ":" in host:
        with contextlib.suppress(ValueError):
            return ipaddress.IPv6Address(host).compressed
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


_BACKLOG = 128  # connections waiting to be accepted, and taken per wakeup
_ACCEPT_RETRY_S = 1.0  # after an accept failed for want of resources (asyncio's Server waits as long)


async def _close(writer: asyncio.StreamWriter) -> None:
    """Close a connection: gracefully (TLS's close_notify) for a moment, then abruptly."""
    writer.close()
    try:
        async with asyncio.timeout(_CLOSE_GRACE_S):
            await writer.wait_closed()
    except (ConnectionError, OSError, TimeoutError, asyncio.CancelledError):
        # A peer that never answers close_notify, or a stream whose TLS handshake was cut short
        # (its close is never reported to the stream), would hold this forever; so would
        # aclose(), which waits for every connection. A cancellation (aclose()) ends it here too.
        writer.transport.abort()


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
