"""Redaction's matching: every form of every secret found in one pass (the cost does not grow
with the number of secrets), overlapping secrets replaced as one span, numbers holding a secret,
and the audit log's second look made cheap (what holds nothing, or was redacted already, passes)."""

from __future__ import annotations

import base64
import json
import os
import secrets
import time

import pytest

from router.redact import REMEMBERED_MIN, Redactor
from runner.egress.scrub import Matcher, StreamScrubber, compile_forms, scrub


def _token() -> str:
    """A minted-token-sized secret: what the redactor holds one of for each call in flight."""
    return "eyJhbGciOiJFZERTQSJ9." + secrets.token_urlsafe(300) + "." + secrets.token_urlsafe(64)


def _best_of_three(redactor: Redactor, text: str) -> float:
    timings = []
    for _ in range(3):
        started = time.perf_counter()
        redactor(text)
        timings.append(time.perf_counter() - started)
    return min(timings)


def test_redacting_costs_one_pass_whatever_the_number_of_secrets() -> None:
    """Two hundred secrets (thousands of forms) cost about what two do on a 2 MiB output; matching
    form after form cost a hundred times more."""
    text = os.urandom(1 << 20).hex()
    few, many = Redactor(), Redactor()
    for redactor, count in ((few, 2), (many, 200)):
        for i in range(count):
            redactor.add(_token(), f"tok{i}")
        redactor(text[:100])  # the matcher is built on first use: not what is timed
    assert _best_of_three(many, text) < 3 * _best_of_three(few, text) + 0.02


def test_overlapping_secrets_are_replaced_as_one_span() -> None:
    """Two secrets sharing characters, written overlapping, leave no piece of either behind."""
    redactor = Redactor()
    redactor.add("AAAA-1111-BBBB", "one")
    redactor.add("BBBB-2222-CCCC", "two")
    assert redactor("x AAAA-1111-BBBB-2222-CCCC y") == "x [REDACTED:one,two] y"
    assert redactor("x bbbb-2222-cccc AAAA-1111-BBBB y") == "x [REDACTED:two] [REDACTED:one] y"
    forms = compile_forms([("one", "AAAA-1111-BBBB"), ("two", "BBBB-2222-CCCC")])
    scrubbed, found = scrub(b"AAAA-1111-BBBB-2222-CCCC", forms)  # the egress proxy's path
    assert scrubbed == b"[REDACTED:one,two]"
    assert {form.label for form in found} == {"one", "two"}


def test_a_form_inside_a_longer_one_is_found_at_every_offset() -> None:
    """The matcher's candidates are found by prefix: a form starting inside another, or sharing
    its prefix with many (every token's header), is still found."""
    forms = compile_forms([(f"t{i}", _token()) for i in range(50)] + [("short", "abcdef")])
    matcher = Matcher(forms)
    needle = forms[7].needle
    data = b"xx" + needle.upper() + b"abcdefabcdef" + needle[:-1]
    scrubbed, found = matcher.scrub(data)
    assert scrubbed == b"xx" + forms[7].replacement + b"[REDACTED:short][REDACTED:short]" + needle[:-1]
    assert [form.needle for form in found] == [needle, b"abcdef"]


def test_a_secret_of_non_ascii_characters_is_found_in_text_as_short_as_itself() -> None:
    """Forms are matched as UTF-8 bytes: a text with fewer characters than the secret has bytes
    (the secret alone, echoed) must still be read, not passed as too short to hold it."""
    password = "\u043f\u0430\u0440\u043e\u043b\u044c12"  # Russian "password" and two digits
    redactor = Redactor()
    redactor.add(password, "db")
    redactor.add("€€€€€€€€", "eur")
    assert redactor(password) == "[REDACTED:db]"
    assert redactor(f"pw: {password}") == "pw: [REDACTED:db]"
    assert redactor.deep({"out": "key=€€€€€€€€"}) == {"out": "key=[REDACTED:eur]"}


def test_a_number_whose_digits_hold_a_secret_is_redacted() -> None:
    """A python tool returning a card number as a JSON number gets the redaction string back;
    other numbers and booleans stay as they are."""
    redactor = Redactor()
    redactor.add("4111111111111111", "card")
    value = {"card": 4111111111111111, "longer": 94111111111111111, "n": 7, "f": 1.5, "ok": True}
    assert redactor.deep(value) == {
        "card": "[REDACTED:card]", "longer": "9[REDACTED:card]", "n": 7, "f": 1.5, "ok": True,
    }  # fmt: skip


def test_what_holds_no_secret_is_passed_on_not_copied() -> None:
    """The audit log's redaction of an event with nothing to redact returns the event itself."""
    redactor = Redactor()
    redactor.add("sk-live-4f9a8b7c6d5e", "api")
    document = {"result": {"stdout": "hello", "list": ["a", 1, {"b": 2.5}]}, "seq": 3}
    assert redactor.deep(document) is document
    assert redactor.deep({"x": ["sk-live-4f9a8b7c6d5e"]}) == {"x": ["[REDACTED:api]"]}


def test_an_output_redacted_already_is_not_scanned_again_until_the_secrets_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The audit event carries the output the agent got, redacted once: its second look skips it,
    unless a secret was registered since (then it looks again, and finds it)."""
    redactor = Redactor()
    redactor.add("sk-live-4f9a8b7c6d5e", "api")
    output = redactor("x" * REMEMBERED_MIN + " sk-live-4f9a8b7c6d5e " + "later-secret-42")
    assert "[REDACTED:api]" in output
    scanned: list[int] = []
    matcher = redactor._current()[1]
    assert matcher is not None
    original = matcher.scrub
    monkeypatch.setattr(matcher, "scrub", lambda data: scanned.append(len(data)) or original(data))
    event = {"result": {"stdout": output, "stderr": "a line of stderr, long enough to scan"}}
    assert redactor.deep(event) is event
    assert len("a line of stderr, long enough to scan") in scanned
    assert len(output.encode()) not in scanned  # the long output was not scanned again
    redactor.add("later-secret-42", "later")
    assert redactor.deep(event)["result"]["stdout"].endswith("[REDACTED:later]")


KEY = "Xq7/Lm+Pz9=Rt4/Wv2-Kb8_Ns5sk"  # a key with base64 and base64url punctuation, as many secret keys have
# How ordinary escapers write it, each escaping only some of its punctuation (a review found each
# reflected whole, unscrubbed, by the proxy and the redactor alike).
PARTLY_ESCAPED = {
    "Go url.PathEscape": KEY.replace("/", "%2F"),
    "JavaScript escape()": KEY.replace("=", "%3D"),
    ".NET System.Text.Json": KEY.replace("+", "\\u002B"),
    "JSON, all punctuation as \\u": "".join(c if c.isalnum() else f"\\u{ord(c):04x}" for c in KEY),
    "HTML, hex entities (OWASP)": "".join(c if c.isalnum() else f"&#x{ord(c):X};" for c in KEY),
    "HTML, decimal entities": "".join(c if c.isalnum() else f"&#{ord(c)};" for c in KEY),
    # ESAPI's encodeForHTML keeps ",.-_ " (found by bench/credentials.py's scrub rows).
    "HTML, ESAPI hex entities": "".join(c if c.isalnum() or c in ",.-_ " else f"&#x{ord(c):x};" for c in KEY),
    "HTML, ESAPI decimal entities": "".join(c if c.isalnum() or c in ",.-_ " else f"&#{ord(c)};" for c in KEY),
}


# JavaScript's encodeURI keeps all of KEY's punctuation: it is shown on a key it changes.
URI_KEY = "Ab3;x/y?z#w Q%9&k=v"


@pytest.mark.parametrize(
    ("key", "written"),
    [pytest.param(KEY, written, id=how) for how, written in PARTLY_ESCAPED.items()]
    + [pytest.param(URI_KEY, "Ab3;x/y?z#w%20Q%259&k=v", id="JavaScript encodeURI()")],
)
def test_a_secret_partly_escaped_by_a_common_encoder_is_found(key: str, written: str) -> None:
    forms = compile_forms([("api-key", key)])
    text = f"reflected: {written} (end)".encode()
    out, found = scrub(text, forms)
    assert out == b"reflected: [REDACTED:api-key] (end)", out
    assert found


TOKEN = "eyJhbGciOiJFZERTQSJ9." + "Zm9vYmFy-_" * 40  # a minted token's length: its base64 always wraps
PEM = base64.b64encode(b"x" + TOKEN.encode())


@pytest.mark.parametrize(
    "wrapped",
    [
        pytest.param(base64.encodebytes(b"agent-1:" + TOKEN.encode()), id="MIME, 76 columns"),
        pytest.param(b"\r\n".join(PEM[i : i + 64] for i in range(0, len(PEM), 64)), id="PEM, 64 columns, CR LF"),
        pytest.param(json.dumps(base64.encodebytes(TOKEN.encode()).decode()).encode(), id="in a JSON string"),
    ],
)
def test_a_secret_in_line_wrapped_base64_is_found_whole_and_streamed(wrapped: bytes) -> None:
    """MIME, PEM and openssl base64 wrap lines: a value longer than a line always crossed a break,
    and was found by no form (nor was a short one that happened to)."""
    forms = compile_forms([("token", TOKEN)])
    text = b"before\n" + wrapped + b"\nafter"
    out, found = scrub(text, forms)
    assert b"[REDACTED:token]" in out, out
    assert found
    assert out.startswith(b"before\n")
    assert out.endswith(b"\nafter")
    stream = StreamScrubber(forms)
    pieces = b"".join(stream.feed(text[i : i + 5]) for i in range(0, len(text), 5)) + stream.finish()
    # (streamed, a form is replaced as soon as it is whole: a padding "=" after it may remain)
    assert pieces.startswith(out[: out.index(b"[REDACTED:token]") + 16])
    assert len(pieces) <= len(out) + 2


def test_overlapping_forms_across_line_breaks_are_replaced_as_one() -> None:
    """Two secrets sharing bytes in one wrapped base64 text: both found, as on one line (the
    first rewrite found only non-overlapping matches, and the second secret's tail leaked)."""
    one = "AAAA-secret-one-" + "x" * 40 + "shared-tail-0123456789"
    two = "shared-tail-0123456789" + "y" * 40 + "-secret-two-BBBB"
    blob = base64.b64encode((one + two[len("shared-tail-0123456789") :]).encode())
    forms = compile_forms([("a", one), ("b", two)])
    flat, _ = scrub(blob, forms)
    out, found = scrub(b"\n".join(blob[i : i + 64] for i in range(0, len(blob), 64)), forms)
    assert out == flat == b"[REDACTED:a,b]I="
    assert sorted({form.label for form in found}) == ["a", "b"]


@pytest.mark.parametrize(
    ("secret", "text"),
    [("123456", b"1\n2\n3\n4\n5\n6\n7\n8\n"), ("abcdef12", b"ABC\r\nDEF\r\n12\r\n"),
     ("hunter2x", b'{"log": "hunter\\n2x was the nick"}'), ("hunter2x", b"hunter\n2x")],
)  # fmt: skip
def test_only_base64_is_read_across_line_breaks(secret: str, text: bytes) -> None:
    """Ordinary lines joined could spell a short secret (a list of digits), and a value with a
    break inside is a value split (a documented limit): neither is redacted, the lines kept."""
    assert scrub(text, compile_forms([("pw", secret)])) == (text, [])


def test_a_flood_of_line_breaks_costs_a_pass_not_a_list_per_break() -> None:
    """Reading across breaks once mapped each break of the whole text in Python: 64 MiB of
    blank lines with one key took 44 s and 3 GB. Generous bound: it takes well under a second."""
    matcher = compile_forms([("token", TOKEN)]).matcher
    text = b"\n" * (16 << 20) + base64.encodebytes(TOKEN.encode()) + b"\\n" * (4 << 20)
    started = time.perf_counter()
    out, found = matcher.scrub(text)
    assert time.perf_counter() - started < 5
    assert out.count(b"[REDACTED:token]") == 1
    assert found
