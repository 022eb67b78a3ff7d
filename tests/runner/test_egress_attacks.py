"""Attacks on the egress proxy's promises, each counting what got through: a secret reflected back
in an encoding, a method the grant leaves out sent inside HTTPS. On asyncio's loop and on uvloop,
and the method attacks from inside each sandbox tier."""

from __future__ import annotations

import base64
import gzip
import http.server
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

import pytest
import trustme

from runner import EgressRecord, EgressRule, RunnerSettings, Sandbox, SandboxSpec, make_sandbox
from runner.base import Injection, InputFile, ResourceLimits
from runner.egress import EgressProxy
from runner.egress.intercept import InterceptCA
from tests.conftest import https_and_http
from tests.runner.test_egress import HOST, _asyncio_loop_factory, _runs_on_the_loop_asked_for, https_via, parse, send  # noqa: F401  (run on both loops)

SECRET = "sk/echo+5f1d=8a3b?9c7e&4d2a~Zx"  # characters that percent- and base64url-encoding change
PLACEHOLDER = "stockade-placeholder-echo"


def _percent_keeping(value: str, kept: str) -> str:
    """``value`` URL-encoded but for letters, digits and ``kept`` (as Go's and JavaScript's do)."""
    return "".join(c if c.isascii() and (c.isalnum() or c in kept) else "".join(f"%{b:02X}" for b in c.encode())
                   for c in value)  # fmt: skip


# How a reflecting upstream (or a tool, from what it got back) may hand the secret on.
ENCODINGS: dict[str, Callable[[str], str]] = {
    "raw": lambda v: v,
    "hex": lambda v: v.encode().hex(),
    "HEX": lambda v: v.encode().hex().upper(),
    "reversed": lambda v: v[::-1],
    "upper": str.upper,
    "basic": lambda v: base64.b64encode(f"agent-1:{v}".encode()).decode(),  # base64(user:secret), unaligned
    "base64url": lambda v: base64.urlsafe_b64encode(v.encode()).decode().rstrip("="),
    "percent": lambda v: quote(v, safe=""),
    # PHP's urlencode and Java's URLEncoder escape "~"; Go's html/template writes "+" and "&" as entities.
    "percent-php": lambda v: "".join(
        c if c.isascii() and (c.isalnum() or c in "-._") else quote(c, safe="") if c != "~" else "%7E" for c in v
    ),
    "html-go": lambda v: v.replace("&", "&amp;").replace("+", "&#43;").replace("'", "&#39;"),
    # Encoders that escape only some punctuation, and base64 wrapped as MIME does (the value
    # crossing a line break): a review had each reach the client whole.
    "percent-go-path": lambda v: _percent_keeping(v, "-._~$&+,;=:@"),
    "percent-js-escape": lambda v: _percent_keeping(v, "@*_+-./"),
    "json-dotnet": lambda v: "".join(f"\\u{ord(c):04X}" if c in "\"&'+<>`\\" else c for c in v),
    "html-hex": lambda v: "".join(c if c.isalnum() else f"&#x{ord(c):X};" for c in v),
    "basic-mime": lambda v: base64.encodebytes(f"agent-1:{'x' * 32}{v}".encode()).decode(),
}
# The name the proxy's record gives each (case does not matter to it).
SCRUBBED_AS = {"raw": "raw", "hex": "hex", "HEX": "hex", "reversed": "reversed", "upper": "raw", "basic": "base64",
               "base64url": "base64url", "percent": "percent", "percent-php": "percent", "html-go": "html",
               "percent-go-path": "percent", "percent-js-escape": "percent", "json-dotnet": "json",
               "html-hex": "html", "basic-mime": "base64"}  # fmt: skip


def leaked(text: bytes | str) -> list[str]:
    """The encodings of SECRET found in ``text``."""
    data = text if isinstance(text, str) else text.decode("utf-8", "replace")
    return [name for name, encode in ENCODINGS.items() if encode(SECRET) in data]


@dataclass
class Reflector:
    """Loopback upstreams for HOST (HTTPS and plain HTTP) that reflect each request's headers:
    ``/<encoding>`` answers every header value in that encoding, in the body and in ``X-Reflected``;
    ``?framing=chunked`` sends the body in 5-byte chunks, ``?coding=gzip|br`` compresses it (or
    claims to) whatever the request asked for, ``?name=hex`` also names a header after the value.
    Remembers each request's method and X-Api-Key."""

    https_port: int = 0
    http_port: int = 0
    ca_file: Path = Path()
    seen: list[tuple[str, str]] = field(default_factory=list)


@pytest.fixture(scope="module")
def reflector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reflector]:
    state = Reflector()
    ca = trustme.CA()
    state.ca_file = tmp_path_factory.mktemp("reflector") / "ca.pem"
    ca.cert_pem.write_to_path(str(state.ca_file))

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            state.seen.append((self.command, self.headers.get("X-Api-Key", "")))
            url = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            encode = ENCODINGS.get(url.path.strip("/"), ENCODINGS["raw"])
            body = "".join(f"{name}: {encode(value)}\n" for name, value in self.headers.items()).encode()
            self.send_response(200)
            # (a header holds no line break: a wrapped form is sent unwrapped there)
            self.send_header("X-Reflected", encode(self.headers.get("X-Api-Key", "")).replace("\n", ""))
            if query.get("name") == "hex":  # the secret as a header's name
                self.send_header("X-" + self.headers.get("X-Api-Key", "").encode().hex(), "reflected")
            coding = query.get("coding")
            if coding == "gzip":
                body = gzip.compress(body)
                self.send_header("Content-Encoding", "gzip")
            elif coding == "br":
                self.send_header("Content-Encoding", "br")  # not brotli at all: the proxy must not pass it
            elif coding == "reflect":  # the request's header as the coding, as a mirroring service does
                self.send_header("Content-Encoding", self.headers.get("X-Api-Key", ""))
            if query.get("framing") == "chunked":
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for start in range(0, len(body), 5):  # every form straddles chunks
                    piece = body[start : start + 5]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.write(b"0\r\n\r\n")
            else:
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            self.close_connection = True

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _answer

        def log_message(self, *args: object) -> None:
            pass

    with https_and_http(Handler, ca, HOST) as (state.https_port, state.http_port):
        yield state


@dataclass
class Proxied:
    proxy: EgressProxy
    ca: InterceptCA
    records: list[EgressRecord]


@pytest.fixture
async def proxied(tmp_path: Path, reflector: Reflector) -> AsyncIterator[Proxied]:
    """The proxy as a call with a credential for HOST gets it: both upstreams allowed, the
    credential for both (plain HTTP by the operator's leave)."""
    reflector.seen.clear()
    records: list[EgressRecord] = []

    async def keep(record: EgressRecord) -> None:
        records.append(record)

    ca = InterceptCA()
    server = EgressProxy(
        tmp_path / "egress.sock", [EgressRule(HOST, reflector.https_port), EgressRule(HOST, reflector.http_port)],
        keep, hosts={HOST: "127.0.0.1"}, injections=[Injection(
            "api-key", PLACEHOLDER, SECRET, (f"{HOST}:{reflector.https_port}", f"{HOST}:{reflector.http_port}"),
            allow_plaintext=True,  # the http upstream: scrubbed the same way
        )],
        intercept=ca, upstream_ca=reflector.ca_file,
    )  # fmt: skip
    await server.start()
    yield Proxied(server, ca, records)
    await server.aclose()


def test_the_listed_encodings_of_the_secret_differ() -> None:
    """Otherwise a test below could pass by catching one form where it claims several."""
    forms = [encode(SECRET) for encode in ENCODINGS.values()]
    assert len(set(forms)) == len(forms)
    assert all(PLACEHOLDER not in form for form in forms)


@pytest.mark.parametrize("scheme", ["https", "http"])
@pytest.mark.parametrize("query", ["", "?framing=chunked", "?coding=gzip", "?framing=chunked&coding=gzip"])
async def test_a_reflected_secret_reaches_the_client_in_no_encoding(
    proxied: Proxied, reflector: Reflector, scheme: str, query: str
) -> None:
    """The upstream gets the real secret and reflects it in every listed encoding, in its body
    (also chunked across pieces, also gzipped though the proxy asked for none) and a header:
    none of it reaches the client, and each request's record names what was scrubbed."""
    received = {}
    for name in ENCODINGS:
        request = f"GET /{name}{query} HTTP/1.1\r\nHost: {HOST}\r\nX-Api-Key: {PLACEHOLDER}\r\n\r\n".encode()
        if scheme == "https":
            _, reply = await https_via(proxied.proxy, reflector.https_port, proxied.ca.cert_pem, request)
        else:
            absolute = request.replace(b"GET /", f"GET http://{HOST}:{reflector.http_port}/".encode(), 1)
            reply = await send(proxied.proxy, absolute)
        status, body = parse(reply)
        assert status == 200, reply[:300]
        assert b"[REDACTED:api-key]" in body
        received[name] = reply + body  # headers as sent, and the body de-chunked
    assert [key for _, key in reflector.seen] == [SECRET] * len(ENCODINGS)  # the upstream had it each time
    leaks = {name: leaked(reply) for name, reply in received.items()}
    assert sum(len(found) for found in leaks.values()) == 0, leaks
    assert [r.scrubbed for r in proxied.records] == [(f"api-key:{SCRUBBED_AS[name]}",) for name in ENCODINGS]
    assert all(r.intercepted == (scheme == "https") for r in proxied.records)


async def test_a_body_coding_the_proxy_cannot_read_is_refused(proxied: Proxied, reflector: Reflector) -> None:
    """A body the proxy cannot scrub (here claimed to be brotli) is not passed on: 502, nothing leaks."""
    request = f"GET /raw?coding=br HTTP/1.1\r\nHost: {HOST}\r\nX-Api-Key: {PLACEHOLDER}\r\n\r\n".encode()
    _, reply = await https_via(proxied.proxy, reflector.https_port, proxied.ca.cert_pem, request)
    assert reply.startswith(b"HTTP/1.1 502")
    assert b"cannot scrub" in reply
    assert leaked(reply) == []
    [record] = proxied.records
    assert (record.status, record.allowed, record.injected) == (502, True, ("api-key",))


@pytest.mark.parametrize("scheme", ["https", "http"])
async def test_a_secret_reflected_as_the_body_coding_is_not_named_in_the_refusal(
    proxied: Proxied, reflector: Reflector, scheme: str
) -> None:
    """The refusal of a coding the proxy cannot read once quoted the upstream's Content-Encoding:
    an upstream that mirrors request headers put the secret there, and the 502 handed it to the
    tool (lower-cased) unscrubbed. Only registered codings are named now."""
    request = f"GET /raw?coding=reflect HTTP/1.1\r\nHost: {HOST}\r\nX-Api-Key: {PLACEHOLDER}\r\n\r\n".encode()
    if scheme == "https":
        _, reply = await https_via(proxied.proxy, reflector.https_port, proxied.ca.cert_pem, request)
    else:
        reply = await send(
            proxied.proxy, request.replace(b"GET /", f"GET http://{HOST}:{reflector.http_port}/".encode(), 1)
        )
    assert [key for _, key in reflector.seen] == [SECRET]  # the upstream had it
    assert reply.startswith(b"HTTP/1.1 502"), reply[:200]
    assert b"a coding it does not know" in reply
    assert SECRET.lower().encode() not in reply.lower()
    assert leaked(reply) == []
    [record] = proxied.records
    assert SECRET.lower() not in repr(record).lower()


@pytest.mark.parametrize("written", [PLACEHOLDER, quote(PLACEHOLDER, safe="").replace("s", "%73"), PLACEHOLDER.upper()])
async def test_a_placeholder_in_the_url_to_a_host_its_credential_may_not_go_to_is_refused(
    tmp_path: Path, reflector: Reflector, written: str
) -> None:
    """The placeholder was looked for in headers only: in a URL to another allowed host it went
    out, recorded as an allowed request, hiding the attempt to use the credential elsewhere. It is
    refused there now (403, a deny record), however the URL writes it; to the credential's own
    host it still goes (the value goes nowhere: only headers get it)."""
    records: list[EgressRecord] = []

    async def keep(record: EgressRecord) -> None:
        records.append(record)

    other = "other.allowed.test"
    server = EgressProxy(
        tmp_path / "egress.sock", [EgressRule(HOST, reflector.http_port), EgressRule(other, reflector.http_port)],
        keep, hosts={HOST: "127.0.0.1", other: "127.0.0.1"},
        injections=[Injection("api-key", PLACEHOLDER, SECRET, (f"{HOST}:{reflector.http_port}",),
                              allow_plaintext=True)],
    )  # fmt: skip
    await server.start()
    reflector.seen.clear()
    try:
        reply = await send(server, f"GET http://{other}:{reflector.http_port}/raw?k={written} HTTP/1.1\r\n"
                                   f"Host: {other}\r\n\r\n".encode())  # fmt: skip
        assert reply.startswith(b"HTTP/1.1 403"), reply[:200]
        assert reflector.seen == []  # nothing reached the upstream
        assert (records[-1].allowed, records[-1].status) == (False, 403)
        assert "credential api-key may not go to" in records[-1].reason
        own = await send(server, f"GET http://{HOST}:{reflector.http_port}/raw?k={written} HTTP/1.1\r\n"
                                 f"Host: {HOST}\r\n\r\n".encode())  # fmt: skip
        assert own.startswith(b"HTTP/1.1 200"), own[:200]
        assert (records[-1].allowed, records[-1].injected) == (True, ())
    finally:
        await server.aclose()


async def test_a_secret_reflected_as_a_header_name_is_dropped_with_its_header(
    proxied: Proxied, reflector: Reflector
) -> None:
    request = f"GET /raw?name=hex HTTP/1.1\r\nHost: {HOST}\r\nX-Api-Key: {PLACEHOLDER}\r\n\r\n".encode()
    _, reply = await https_via(proxied.proxy, reflector.https_port, proxied.ca.cert_pem, request)
    assert parse(reply)[0] == 200
    assert leaked(reply) == []
    assert proxied.records[0].scrubbed == ("api-key:hex", "api-key:raw")


# -- methods inside HTTPS, from each sandbox tier -------------------------------------------

METHOD_ATTACK = """
import json, socket, ssl, urllib.error, urllib.request
url = "https://HOST:PORT/resource"
context = ssl.create_default_context()  # the call's CA, from SSL_CERT_FILE
context.load_verify_locations("/in/upstream-ca.pem")  # and the upstream's own: whichever answers
statuses = {}
for method in ("GET", "POST", "PUT", "DELETE", "PATCH"):
    data = b"exfiltrated" if method in ("POST", "PUT", "PATCH") else None
    try:
        request = urllib.request.Request(url, data=data, method=method)
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            statuses[method] = reply.status
    except urllib.error.HTTPError as e:
        statuses[method] = e.code
    except OSError as e:
        statuses[method] = repr(e)
# A DELETE pipelined behind an allowed GET, on one tunnel.
sock = socket.create_connection(("127.0.0.1", 3128), timeout=10)
sock.sendall(b"CONNECT HOST:PORT HTTP/1.1\\r\\nHost: HOST:PORT\\r\\n\\r\\n")
head = b""
while not head.endswith(b"\\r\\n\\r\\n"):
    head += sock.recv(1)
tls = context.wrap_socket(sock, server_hostname="HOST")
tls.sendall(b"GET /resource HTTP/1.1\\r\\nHost: HOST\\r\\n\\r\\nDELETE /resource HTTP/1.1\\r\\nHost: HOST\\r\\n\\r\\n")
replies = b""
try:
    while chunk := tls.recv(65536):
        replies += chunk
except OSError:
    pass
statuses["pipelined"] = replies.count(b"HTTP/1.1 ")
print(json.dumps(statuses))
"""


@pytest.fixture(params=["bwrap", "docker", "gvisor"])
async def sandbox(request: pytest.FixtureRequest, runner_state: Path, reflector: Reflector) -> AsyncIterator[Sandbox]:
    settings = RunnerSettings(state_dir=runner_state, pool_size=0, egress_hosts={HOST: "127.0.0.1"},
                              egress_ca_file=reflector.ca_file)  # fmt: skip
    box = make_sandbox(settings, request.param)
    assert box.check() is None, f"{request.param} must work in the test environment"
    yield box
    await box.aclose()


async def test_methods_outside_an_https_grant_never_reach_the_upstream_from_any_tier(
    sandbox: Sandbox, reflector: Reflector
) -> None:
    """A GET-only grant to an HTTPS host, attacked from inside the sandbox with the other methods
    and with a DELETE pipelined behind a GET, by a tool that trusts the upstream's own CA as well
    as the call's (so a tunnel would have carried them): only the GETs get through."""
    reflector.seen.clear()
    records: list[EgressRecord] = []

    async def keep(record: EgressRecord) -> None:
        records.append(record)

    code = METHOD_ATTACK.replace("HOST", HOST).replace("PORT", str(reflector.https_port))
    result = await sandbox.run(SandboxSpec(
        argv=("python3", "-I", "-c", code), limits=ResourceLimits(timeout_s=30),
        inputs=(InputFile("upstream-ca.pem", reflector.ca_file.read_bytes()),),
        egress=(EgressRule(HOST, reflector.https_port, ("GET",)),), on_egress=keep,
    ))  # fmt: skip
    assert result.verdict == "ok", result.stderr[-800:]
    statuses = json.loads(result.stdout.decode().splitlines()[-1])
    assert statuses == {"GET": 200, "POST": 403, "PUT": 403, "DELETE": 403, "PATCH": 403, "pipelined": 1}
    assert [method for method, _ in reflector.seen if method != "GET"] == []  # nothing else got through
    assert [method for method, _ in reflector.seen] == ["GET", "GET"]
    assert [(r.method, r.allowed, r.status, r.intercepted) for r in records] == [
        ("GET", True, 200, True), ("POST", False, 403, True), ("PUT", False, 403, True),
        ("DELETE", False, 403, True), ("PATCH", False, 403, True), ("GET", True, 200, True),
    ]  # fmt: skip
