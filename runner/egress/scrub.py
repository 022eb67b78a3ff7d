"""The forms a credential's value takes on the way back, and the scrubbing that removes them.

An upstream that reflects a request (an echo service, an error page quoting a header) hands
an injected secret back to the sandbox, where the tool can re-encode it before the agent sees
it. So the egress proxy scrubs every response from a credential's hosts, and the router's
redactor (`router.redact`) scrubs outputs, logs and audit events, for the same forms of each
value, listed by `secret_forms`:

- ``raw`` and ``reversed``;
- ``hex``;
- ``percent``: URL encoding (``%2F``; a space as ``%20`` or ``+``; ``/`` escaped or kept);
- ``json``: the value inside a JSON string, with its escapes (``\\/`` for ``/`` too);
- ``base64`` and ``base64url``, padded or not, and the value inside a longer base64 text at
  any alignment: ``base64("user:" + value)`` (HTTP Basic) included, for any user;

each matched regardless of ASCII case (so upper-, lower- and mixed-case variants, and hex and
percent escapes in either case). A match is replaced by ``[REDACTED:<label>]``.

Not caught, and not catchable by matching: a value split into pieces (across responses, by
``Range`` requests, by separators between its characters), partly echoed, or put through any
other transformation (another encoding, compression, encryption). This is a limit on careless
and lazy reflection, not a boundary against an upstream that computes on the secret; see
``docs/egress.md``.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from urllib.parse import quote, quote_plus

MIN_LENGTH = 6  # shorter forms would match ordinary text


@dataclass(frozen=True, slots=True)
class Form:
    """One way a credential's value is written: ``needle`` (ASCII lower case) is found in text
    with ASCII case folded, and replaced by ``replacement``."""

    needle: bytes
    label: str
    encoding: str
    replacement: bytes = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "replacement", f"[REDACTED:{self.label}]".encode())


def secret_forms(value: str) -> dict[bytes, str]:
    """Each form of ``value`` that is scrubbed, as a needle (lower case), with its encoding's name."""
    raw = value.encode("utf-8", "surrogatepass")
    forms: dict[bytes, str] = {}

    def add(encoding: str, *texts: bytes) -> None:
        for text in texts:
            forms.setdefault(text.lower(), encoding)  # where forms coincide, the plainest name wins

    add("raw", raw)
    add("reversed", value[::-1].encode("utf-8", "surrogatepass"))
    add("hex", raw.hex().encode())
    add("percent", quote(raw, safe="").encode(), quote_plus(raw).encode(), quote(raw).encode())
    ascii_json = json.dumps(value)[1:-1]
    escaped = json.dumps(value, ensure_ascii=False)[1:-1].encode("utf-8", "surrogatepass")
    add("json", ascii_json.encode(), escaped, ascii_json.replace("/", "\\/").encode())  # some encoders escape "/"
    # Go's encoding/json (and others, to be safe in HTML) escape <, > and & as \u003c, \u003e, \u0026.
    html_safe = ascii_json.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    add("json", html_safe.encode(), html_safe.replace("/", "\\/").encode())
    # An HTML page (an error page quoting a header) escapes &, <, >, " and ' as entities.
    add(
        "html",
        html.escape(value, quote=True).encode("utf-8", "surrogatepass"),
        html.escape(value, quote=False).encode("utf-8", "surrogatepass"),
    )
    standard, urlsafe = base64.b64encode(raw), base64.urlsafe_b64encode(raw)
    add("base64", standard, standard.rstrip(b"="))
    add("base64url", urlsafe, urlsafe.rstrip(b"="))
    # Inside a longer base64 text the value starts 0, 1 or 2 bytes into a 3-byte group; at each
    # alignment, the characters carrying only the value's bits are the same whatever surrounds it.
    for offset in range(3):
        encoded = base64.b64encode(bytes(offset) + raw)
        core = encoded[-(-8 * offset // 6) : 8 * (offset + len(raw)) // 6]
        add("base64", core)
        add("base64url", core.translate(bytes.maketrans(b"+/", b"-_")))
    return {needle: encoding for needle, encoding in forms.items() if len(needle) >= MIN_LENGTH}


def compile_forms(secrets: Iterable[tuple[str, str]]) -> tuple[Form, ...]:
    """The forms of each ``(label, value)``, longest first, so a longer form is never cut by a
    shorter one inside it."""
    forms = {needle: Form(needle, label, encoding) for label, value in secrets
             for needle, encoding in secret_forms(value).items()}  # fmt: skip
    return tuple(sorted(forms.values(), key=lambda form: len(form.needle), reverse=True))


def scrub(data: bytes, forms: Sequence[Form]) -> tuple[bytes, list[Form]]:
    """``data`` with every occurrence of each of ``forms`` (longest first) replaced, ASCII case
    folded; and the forms that were found."""
    if not forms or len(data) < len(forms[-1].needle):
        return data, []  # shorter than every form: most log fields and audit values
    folded = data.lower()  # bytes.lower folds ASCII only: offsets in ``folded`` are offsets in ``data``
    found: list[Form] = []
    for form in forms:
        start = folded.find(form.needle)
        if start < 0:
            continue
        found.append(form)
        # The folded copy gets NULs where a replacement went: nothing later matches across one.
        blank = bytes(len(form.replacement))
        pieces: list[bytes] = []
        folded_pieces: list[bytes] = []
        end = 0
        while start >= 0:
            pieces += (data[end:start], form.replacement)
            folded_pieces += (folded[end:start], blank)
            end = start + len(form.needle)
            start = folded.find(form.needle, end)
        data = b"".join(pieces) + data[end:]
        folded = b"".join(folded_pieces) + folded[end:]
    return data, found


class StreamScrubber:
    """Scrubs a body that arrives in pieces: the tail of each piece that could begin a form the
    next piece completes is held back until that piece (or the end) arrives."""

    def __init__(self, forms: Sequence[Form]) -> None:
        self._forms = forms
        self._hold = max((len(form.needle) for form in forms), default=1) - 1
        self._pending = b""
        self.found: set[Form] = set()

    def feed(self, data: bytes) -> bytes:
        """What can be passed on of everything received so far, scrubbed."""
        out, found = scrub(self._pending + data, self._forms)
        self.found.update(found)
        cut = max(len(out) - self._hold, 0)
        self._pending = out[cut:]
        return out[:cut]

    def finish(self) -> bytes:
        """The held-back rest, scrubbed, once the body has ended."""
        out, found = scrub(self._pending, self._forms)
        self.found.update(found)
        self._pending = b""
        return out
