"""The redactor: every registered form of a secret (the forms the egress proxy scrubs), and nothing else."""

from __future__ import annotations

import base64
import json
import time
from urllib.parse import quote, quote_plus

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
