"""The redactor: every registered form of a secret, and nothing else."""

from __future__ import annotations

import base64
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
