"""Credential costs, measured side by side in one run:

  - mint + revoke of one lease (a signed JWT, and an upstream secret), on the embedded store and
    on Redis;
  - one HTTPS request through the egress proxy with a credential injected (TLS terminated with the
    per-call CA, a second TLS connection upstream) against the same request tunnelled untouched
    (the baseline: what a call without credentials pays), and a direct connection for scale;
  - redacting a tool's output with stockade tokens found by their shape (revoked tokens, other
    routers' tokens) against the same redaction without (the baseline), on output holding a
    token and on a MiB of look-alikes;
  - scrubbing a response from a credential's host at the egress proxy for every form of the
    secret (raw, reversed, hex, percent, JSON, HTML, base64 at any alignment, also wrapped over
    lines; any ASCII case), whole and streamed in 16 KiB pieces, against a plain replace of the
    raw value (the baseline: what scrubbing only the value as sent would cost).

Usage: .venv/bin/python bench/credentials.py [--iterations N] [--redis-url URL] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import ssl
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

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
from runner.egress.scrub import Matcher, StreamScrubber, compile_forms

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


def encodings(value: str) -> list[bytes]:
    """The secret as an upstream would hand it back: as sent, and encoded as common encoders write
    it (their own letter case), `secret_forms`'s kinds in turn."""
    raw = value.encode()
    return [raw, raw[::-1], raw.hex().encode(), raw.hex().upper().encode(), quote(value, safe="").encode(),
            json.dumps(value)[1:-1].replace("/", "\\/").encode(),
            "".join(f"&#x{ord(c):X};" if c in "/+" else c for c in value).encode(),  # OWASP's HTML encoder
            base64.b64encode(raw), base64.urlsafe_b64encode(raw).rstrip(b"="), base64.b64encode(b"user:" + raw),
            value.upper().encode()]  # fmt: skip


def scrub_bodies(value: str) -> dict[str, bytes]:
    """Response bodies a reflecting upstream could send: 4 MiB of ordinary lines with 60 copies of
    the secret (`encodings` in turn); 4 MiB of base64 wrapped at 64 columns (PEM, OpenSSL) holding
    60 copies, at each of base64's three alignments, the hostile case for the search across line
    breaks; and 16 MiB of blank lines. Each with how many copies it holds."""
    forms, size = encodings(value), 4 << 20
    lines: list[bytes] = []
    written = 0
    while written < size:
        lines.append(f"line {len(lines)}: status ok, nothing to see here, {len(lines) * 7919 % 100000:05d}".encode())
        written += len(lines[-1]) + 1
    for i in range(60):  # spread through the text
        lines[i * (len(lines) // 61) + 17] += b" " + forms[i % len(forms)]
    mixed = b"\n".join(lines)[:size]
    wrapped_parts = []
    for i in range(60):  # a random prefix of 3n, 3n+1 or 3n+2 bytes: every alignment
        chunk = base64.b64encode(os.urandom((3 << 20) // 60 + i % 3) + b"user:" + value.encode())
        wrapped_parts.append(b"\n".join(chunk[k : k + 64] for k in range(0, len(chunk), 64)))
    return {
        "lines, 60 secrets in mixed forms (4 MiB)": mixed,
        "base64 at 64 columns, 60 secrets (4 MiB)": b"\n".join(wrapped_parts),
        "blank lines (16 MiB)": b"\n" * (16 << 20),
    }


def scrub_rows(runs: int) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Scrubbing each `scrub_bodies` body whole and streamed, against replacing the raw value. Each
    scrub must replace every copy the body holds, streamed as whole, and leave no raw value."""
    value = "sk-live-4f9c2a7e1b8d6035_Zq/Xw+Yv"
    raw = value.encode()
    forms = compile_forms([("bench", value)])
    matcher = forms.matcher
    rows: dict[str, list[float]] = {}
    notes: dict[str, str] = {"scrubbed forms of one secret": str(len(forms))}
    for name, body in scrub_bodies(value).items():
        held = 60 if "60 secrets" in name else 0
        scrubbed, _ = matcher.scrub(body)
        replaced = scrubbed.count(b"[REDACTED:bench]")
        if replaced != held or raw in scrubbed or streamed(matcher, body) != scrubbed:
            raise RuntimeError(f"{name}: {replaced} of {held} copies replaced (whole), or streamed differs")
        notes[f"scrub {name}: MiB, copies replaced"] = f"{len(body) / (1 << 20):.1f}, {replaced}"
        for label, work in (
            ("baseline: raw value replaced", lambda b=body: b.replace(raw, b"[REDACTED:bench]")),
            ("every form", lambda b=body: matcher.scrub(b)),
            ("every form, streamed", lambda b=body: streamed(matcher, b)),
        ):
            samples = []
            for _ in range(runs):
                started = time.perf_counter()
                work()
                samples.append(time.perf_counter() - started)
            rows[f"scrub {name}: {label}"] = samples
    return rows, notes


def streamed(matcher: Matcher, body: bytes) -> bytes:
    """``body`` through a `StreamScrubber`, 16 KiB at a time, as the proxy relays a response."""
    scrubber = StreamScrubber(matcher)
    out = [scrubber.feed(body[k : k + (16 << 10)]) for k in range(0, len(body), 16 << 10)]
    out.append(scrubber.finish())
    return b"".join(out)


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
    parser.add_argument("--scrub-runs", type=int, default=5, help="runs of each egress scrub row")
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
    scrubbed, scrub_notes = await asyncio.to_thread(scrub_rows, opts.scrub_runs)
    rows.update({name: summarize(samples) for name, samples in scrubbed.items()})
    tunnel = rows["baseline: proxy, tunnelled untouched"]["p50_ms"]
    injected = rows["proxy, credential injected (TLS intercepted)"]["p50_ms"]
    report("credentials: mint/revoke and injection at the egress proxy", rows, {
        "token": "EdDSA (Ed25519) JWT, lease recorded in the store, revoked by marking it",
        "injection cost over plain tunnelling (p50)": f"+{injected - tunnel:.3f} ms ({injected / tunnel:.2f}x); "
        "one new connection per request in every row (the proxy serves one request per connection)",
        "scrub": "every form of one secret; streamed: fed 16 KiB at a time, as the proxy relays a body",
        "token shapes": "a revoked or unregistered stockade token is redacted by its shape; a text without "
                        "'eyJ' is not read for it",
        **scrub_notes,
    }, opts.json)  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
