"""Credential costs, measured side by side in one run:

  - mint + revoke of one lease (a signed JWT, and an upstream secret), on the embedded store and
    on Redis;
  - one HTTPS request through the egress proxy with a credential injected (TLS terminated with the
    per-call CA, a second TLS connection upstream) against the same request tunnelled untouched
    (the baseline: what a call without credentials pays), and a direct connection for scale;
  - redacting a tool's output with stockade tokens found by their shape (revoked tokens, other
    routers' tokens) against the same redaction without (the baseline), on output holding a
    token and on a MiB of look-alikes.

Usage: .venv/bin/python bench/credentials.py [--iterations N] [--redis-url URL] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import ssl
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import report, summarize

from router.credentials import Binding, CredentialBroker, CredentialConfig, Grant
from router.credentials.tokens import TokenIssuer
from router.logging import configure_logging
from router.redact import Redactor
from router.store import MemoryStore, RedisStore, Store
from runner import EgressRule, Injection
from runner.egress import EgressProxy
from runner.egress.intercept import InterceptCA

HOST = "api.bench.test"
PLACEHOLDER = "stockade-placeholder-bench"


async def mint_revoke(store: Store, kind: str, n: int) -> list[float]:
    os.environ["STOCKADE_BENCH_SECRET"] = "sk-bench-0123456789"  # noqa: S105  (a stand-in value)
    config = CredentialConfig(name="bench", kind=kind, hosts=[HOST], scopes=["read"],  # type: ignore[arg-type]
                              value_env="STOCKADE_BENCH_SECRET" if kind == "secret" else None)  # fmt: skip
    broker = CredentialBroker([config], store)
    grant, binding = Grant(config, ("read",), 60), Binding("d", "c", "s", "agent", "0" * 64)
    samples = []
    for i in range(n + 50):
        started = time.perf_counter()
        leases = await broker.mint([grant], binding)
        await broker.revoke(leases)
        if i >= 50:
            samples.append(time.perf_counter() - started)
    await broker.aclose()
    return samples


def redaction_rows(n: int) -> dict[str, list[float]]:
    """Redacting 64 KiB of output holding one token, and 1 MiB of token look-alikes (every part
    long enough to be read), with token shapes off (the baseline) and on."""
    config = CredentialConfig(name="bench", kind="token", hosts=[HOST], scopes=["read"])
    lease = asyncio.run(
        TokenIssuer(MemoryStore()).mint(Grant(config, ("read",), 60), Binding("d", "c", "s", "a", "0" * 64))
    )
    token = lease.value.get_secret_value()
    output = ("x" * 1000 + "\n") * 32 + f'{{"authorization": "Bearer {token}"}}' + ("y" * 1000 + "\n") * 32
    lookalikes = ("eyJhbGciOiJFZERTQSIs.eyJ" + "A" * 60 + "." + "B" * 86 + " ") * ((1 << 20) // 172)
    rows: dict[str, list[float]] = {}
    for shapes in (False, True):
        redactor = Redactor()
        redactor.add("sk-operator-secret-0123456789", "upstream")  # a router always has some secret
        if shapes:
            redactor.redact_tokens()
        assert ("[REDACTED:stockade-token]" in redactor(output)) is shapes
        label = "token shapes on" if shapes else "baseline: token shapes off"
        for what, text, runs in (("64 KiB output with a token", output, n), ("1 MiB of look-alikes", lookalikes, 20)):
            samples = []
            for _ in range(runs):
                started = time.perf_counter()
                redactor(text)
                samples.append(time.perf_counter() - started)
            rows[f"redact {what}, {label}"] = samples
    return rows


async def upstream(ca: InterceptCA) -> tuple[asyncio.Server, int]:
    """A loopback HTTPS server for HOST answering every request with a small body."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=ca.server_context(HOST))
    return server, server.sockets[0].getsockname()[1]


async def request(socket_path: Path | None, port: int, trust: ssl.SSLContext) -> None:
    """One GET with an Authorization header: through the proxy (CONNECT, then TLS), or direct."""
    if socket_path is None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=trust, server_hostname=HOST)
    else:
        reader, writer = await asyncio.open_unix_connection(str(socket_path))
        writer.write(f"CONNECT {HOST}:{port} HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode())
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")
        await writer.start_tls(trust, server_hostname=HOST)
    writer.write(f"GET / HTTP/1.1\r\nHost: {HOST}\r\nAuthorization: Bearer {PLACEHOLDER}\r\n\r\n".encode())
    await writer.drain()
    body = await reader.read()
    if not body.endswith(b"ok"):
        raise RuntimeError(f"unexpected answer {body[:200]!r}")
    writer.close()
    with contextlib.suppress(ConnectionError, ssl.SSLError):
        await writer.wait_closed()


async def proxy_rows(n: int) -> dict[str, list[float]]:
    upstream_ca = InterceptCA()  # stands in for a public CA: the upstream's certificate is signed by it
    server, port = await upstream(upstream_ca)
    trust_upstream = ssl.create_default_context()
    trust_upstream.load_verify_locations(cadata=upstream_ca.cert_pem.decode())
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ca_file = Path(tmp) / "upstream-ca.pem"
        ca_file.write_bytes(upstream_ca.cert_pem)
        call_ca = InterceptCA()
        trust_call = ssl.create_default_context()
        trust_call.load_verify_locations(cadata=call_ca.cert_pem.decode())
        injection = Injection("bench", PLACEHOLDER, "real-token-value", (f"{HOST}:{port}",))  # TLS on its own port
        setups = {
            "baseline: direct TLS, no proxy": (None, trust_upstream),
            "baseline: proxy, tunnelled untouched": (
                EgressProxy(Path(tmp) / "t.sock", [EgressRule(HOST, port)], hosts={HOST: "127.0.0.1"}), trust_upstream),
            "proxy, credential injected (TLS intercepted)": (
                EgressProxy(Path(tmp) / "i.sock", [EgressRule(HOST, port)], hosts={HOST: "127.0.0.1"},
                            injections=[injection], intercept=call_ca, upstream_ca=ca_file), trust_call),
        }  # fmt: skip
        for name, (proxy, trust) in setups.items():
            if proxy is not None:
                await proxy.start()
            path = proxy.path if proxy is not None else None
            samples = []
            for i in range(n + 20):
                started = time.perf_counter()
                await request(path, port, trust)
                if i >= 20:
                    samples.append(time.perf_counter() - started)
            rows[name] = samples
            if proxy is not None:
                await proxy.aclose()
    server.close()
    await server.wait_closed()
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="'' to skip the Redis rows")
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    configure_logging("console", "warning")
    rows = {}
    stores: list[tuple[str, Store]] = [("embedded", MemoryStore())]
    if opts.redis_url:
        stores.append(("redis", RedisStore(opts.redis_url)))
    for label, store in stores:
        for kind in ("token", "secret"):
            rows[f"mint + revoke, {kind}, {label} store"] = summarize(await mint_revoke(store, kind, opts.iterations))
        await store.aclose()
    proxied = await proxy_rows(max(50, opts.iterations // 5))
    rows.update({name: summarize(samples) for name, samples in proxied.items()})
    redacted = await asyncio.to_thread(redaction_rows, opts.iterations)
    rows.update({name: summarize(samples) for name, samples in redacted.items()})
    tunnel = rows["baseline: proxy, tunnelled untouched"]["p50_ms"]
    injected = rows["proxy, credential injected (TLS intercepted)"]["p50_ms"]
    report("credentials: mint/revoke and injection at the egress proxy", rows, {
        "token": "EdDSA (Ed25519) JWT, lease recorded in the store, revoked by marking it",
        "injection cost over plain tunnelling (p50)": f"+{injected - tunnel:.3f} ms ({injected / tunnel:.2f}x); "
        "one new connection per request in every row (the proxy serves one request per connection)",
        "token shapes": "a revoked or unregistered stockade token is redacted by its shape; a text without "
                        "'eyJ' is not read for it",
    }, opts.json)  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
