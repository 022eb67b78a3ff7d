"""The redactor: every registered form of a secret (the forms the egress proxy scrubs), and nothing else."""

from __future__ import annotations

import base64
import json
import time
from urllib.parse import quote, quote_plus

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from router.redact import Redactor

SECRET = "s3cr3t/value+with=chars?&"


def test_a_secret_is_scrubbed_raw_base64_and_url_encoded() -> None:
    redactor = Redactor()
    redactor.add(SECRET, "api-key")
    raw = SECRET.encode()
    forms = [SECRET, quote(SECRET, safe=""), quote_plus(SECRET), base64.b64encode(raw).decode(),
             base64.urlsafe_b64encode(raw).decode().rstrip("=")]  # fmt: skip
    for form in forms:
        assert redactor(f"before {form} after") == "before [REDACTED:api-key] after", form
    assert redactor("nothing secret here") == "nothing secret here"
    assert redactor.deep({"k": [SECRET, 3, {SECRET: None}]}) == {
        "k": ["[REDACTED:api-key]", 3, {"[REDACTED:api-key]": None}]}  # fmt: skip


def test_forgotten_and_expired_secrets_are_no_longer_scrubbed() -> None:
    redactor = Redactor()
    redactor.add("token-one-abcdef", "t1")
    redactor.add("token-two-abcdef", "t2", until=time.time() + 0.05)
    redactor.discard("token-one-abcdef")
    time.sleep(0.1)
    assert redactor("token-one-abcdef token-two-abcdef") == "token-one-abcdef token-two-abcdef"
    assert not redactor.active


def test_a_lease_of_a_secret_never_shortens_how_long_it_is_redacted() -> None:
    """An operator's secret is redacted for as long as the router runs; each call that uses it
    registers it again with its lease's expiry. That once replaced the permanent entry, so a minute
    after the lease ended the secret passed into outputs, the audit log and logs unredacted."""
    redactor = Redactor()
    redactor.add("sk-live-operator-secret-9x", "api-key")  # at start, for good
    redactor.add("sk-live-operator-secret-9x", "api-key", until=time.time() + 0.05)  # a lease of it
    redactor.add("minted-token-abcdef", "tok", until=time.time() + 0.05)
    redactor.add("minted-token-abcdef", "tok", until=time.time() + 60)  # minted again, later expiry
    time.sleep(0.1)
    assert redactor("sk-live-operator-secret-9x minted-token-abcdef") == "[REDACTED:api-key] [REDACTED:tok]"


def test_every_form_the_egress_proxy_scrubs_is_redacted_too() -> None:
    """Hex, reversed, any ASCII case, base64 of ``user:secret`` for users of every length (each
    alignment of the secret in base64), base64url, percent-encoding with either case of escape,
    JSON escapes (Go's \\u0026 for & too), HTML entities: 0 of them survive."""
    redactor = Redactor()
    redactor.add(SECRET, "api-key")
    raw = SECRET.encode()
    forms = {
        "hex": raw.hex(), "HEX": raw.hex().upper(), "reversed": SECRET[::-1], "reversed upper": SECRET[::-1].upper(),
        "upper": SECRET.upper(), "lower": SECRET.lower(), "swapped": SECRET.swapcase(),
        "percent lower": quote(SECRET, safe="").lower(), "percent keeping /": quote(SECRET),
        "json": json.dumps(SECRET)[1:-1].replace("/", "\\/"),
        "json as Go writes it": json.dumps(SECRET)[1:-1].replace("&", "\\u0026"),
        "json as Go writes it, / escaped": json.dumps(SECRET)[1:-1].replace("&", "\\u0026").replace("/", "\\/"),
        "html": SECRET.replace("&", "&amp;"),
        **{f"basic {user!r}": base64.b64encode(f"{user}:{SECRET}".encode()).decode()
           for user in ("", "a", "ab", "abc")},
        **{f"base64url {user!r}": base64.urlsafe_b64encode(f"{user}:{SECRET}".encode()).decode().rstrip("=")
           for user in ("", "a", "ab")},
        "base64 with more after": base64.b64encode(raw + b"&more=1").decode(),
    }  # fmt: skip
    survived = {name: redactor(f"before {form} after") for name, form in forms.items()}
    assert [name for name, text in survived.items() if "[REDACTED:api-key]" not in text] == []
    secret_bits = [form for form in forms.values() if any(form in text for text in survived.values())]
    assert secret_bits == []


def test_ordinary_text_and_fragments_of_a_secret_are_left_alone() -> None:
    redactor = Redactor()
    redactor.add(SECRET, "api-key")
    text = "s3cr3t and value+with and chars?& and " + SECRET[:5] + " in prose, 73337233 as hex"
    assert redactor(text) == text


def test_offsets_hold_in_text_that_is_not_ascii_or_not_valid_utf8() -> None:
    """Case folding must not shift what is cut: ``İ`` lowercases to two characters in Python."""
    redactor = Redactor()
    redactor.add(SECRET, "api-key")
    assert redactor(f"İstanbul {SECRET.upper()} ünïcode \udcff end") == "İstanbul [REDACTED:api-key] ünïcode \udcff end"


def _jwt(issuer: str) -> str:
    """A token shaped as stockade mints them (the claims `TokenIssuer.mint` writes), by ``issuer``."""
    claims = {"iss": issuer, "sub": "agent-1", "aud": "api.example.com", "scope": "read", "iat": 1, "nbf": 1,
              "exp": 2_000_000_000, "jti": "l-" + "ab" * 12,
              "stockade": {"decision_id": "d-1", "call_id": "c-1", "session_id": "s-1",
                           "args_sha256": "cd" * 32}}  # fmt: skip
    return jwt.encode(claims, Ed25519PrivateKey.generate(), algorithm="EdDSA", headers={"kid": "k-0123456789abcdef"})


def test_stockade_tokens_are_redacted_by_their_shape_registered_or_not() -> None:
    """A revoked token is no longer registered (the search stays as small as the calls in flight),
    and another router's token never was: an upstream handing one back to a later call passed it
    to the agent and the audit log as written. Tokens of other issuers are left alone."""
    redactor = Redactor()
    mine, theirs = _jwt("stockade"), _jwt("accounts.example.com")
    assert redactor(f"Bearer {mine}") == f"Bearer {mine}"  # off until a router mints tokens
    redactor.redact_tokens()
    assert redactor.active
    for text, expected in {
        f"Bearer {mine}": "Bearer [REDACTED:stockade-token]",
        f'{{"authorization":"Bearer {mine}"}}': '{"authorization":"Bearer [REDACTED:stockade-token]"}',
        f"x{mine}y and {theirs}": f"[REDACTED:stockade-token] and {theirs}",  # glued to its ends: taken whole
        theirs: theirs,
        # A '.' before it once made the header read as the payload, and the token after it was
        # never looked at; two tokens joined by '.' let the second through.
        f"sess.{mine}": "sess.[REDACTED:stockade-token]",
        f"expired...{mine}": "expired...[REDACTED:stockade-token]",
        f"{mine}.{mine}": "[REDACTED:stockade-token].[REDACTED:stockade-token]",
        # Without its header (public: the JWKS gives its key id), once let through whole.
        "Bearer x." + mine.split(".", 1)[1]: "Bearer [REDACTED:stockade-token]",
        "header\n." + mine.split(".", 1)[1]: "header\n[REDACTED:stockade-token]",
    }.items():  # fmt: skip
        assert redactor(text) == expected
    assert redactor.deep({mine: [mine, {"k": f"={mine}"}]}) == {
        "[REDACTED:stockade-token]": ["[REDACTED:stockade-token]", {"k": "=[REDACTED:stockade-token]"}]
    }
    assert redactor.scrub_bytes(f"<{mine}>".encode("latin-1")) == b"<[REDACTED:stockade-token]>"


def test_finding_tokens_by_shape_stays_linear_on_hostile_text() -> None:
    """Look-alikes of every part, a MiB of them: read once each (a pattern that retried each start
    inside a run of base64url characters cost minutes)."""
    redactor = Redactor()
    redactor.redact_tokens()
    parts = "eyJhbGciOiJFZERTQSIs." + "eyJ" + "A" * 60 + "." + "B" * 80
    for text in ("eyJ" * (1 << 18), "a.eyJ" * (1 << 18), (parts + " ") * 6000, "eyJ." * (1 << 18)):
        started = time.perf_counter()
        assert redactor(text) == text
        assert time.perf_counter() - started < 2.0
    # A payload that names the issuer and nests past what json reads once made every redaction
    # of that text raise (RecursionError): the output, its audit events, the log line.
    nested = base64.urlsafe_b64encode(b'{"iss":"stockade","x":' + b"[" * 200_000).rstrip(b"=").decode()
    hostile = f"eyJhbGciOiJFZERTQSIsImtpZCI6Ik.{nested}.{'B' * 86}"
    assert redactor(hostile) == hostile
    assert redactor.deep({"out": hostile}) == {"out": hostile}
    mine = _jwt("stockade")
    glued = ("A" * (1 << 16) + mine + ".") * 16  # a MiB of glue, each run read back once
    started = time.perf_counter()
    assert redactor(glued) == "[REDACTED:stockade-token]." * 16
    assert time.perf_counter() - started < 2.0
