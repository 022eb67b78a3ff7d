"""The forms a credential's value takes on the way back, and the scrubbing that removes them.

An upstream that reflects a request (an echo service, an error page quoting a header) hands
an injected secret back to the sandbox, where the tool can re-encode it before the agent sees
it. So the egress proxy scrubs every response from a credential's hosts, and the router's
redactor (`router.redact`) scrubs outputs, logs and audit events, for the same forms of each
value, listed by `secret_forms`:

- ``raw`` and ``reversed``;
- ``hex``;
- ``percent``: URL encoding (``%2F``; a space as ``%20`` or ``+``; ``/`` escaped or kept; the
  punctuation each common encoder keeps, ``~`` escaped as PHP and Java do, or kept; Go's
  ``url.PathEscape`` and JavaScript's ``escape`` and ``encodeURI`` too);
- ``json``: the value inside a JSON string, with its escapes (``\\/`` for ``/`` too; ``+`` and
  the HTML-sensitive characters as ``\\u00XX``, as .NET writes them; every punctuation character so);
- ``html``: the value in an HTML page, as the common escapers write it (``&#39;``, ``&#x27;``,
  ``&apos;``, ``&#34;``, ``&quot;``, ``&#43;``; every punctuation character as a hexadecimal or
  decimal entity, or all but ``,.-_`` and space as OWASP's ESAPI writes them);
- ``base64`` and ``base64url``, padded or not, and the value inside a longer base64 text at
  any alignment: ``base64("user:" + value)`` (HTTP Basic) included, for any user;

the base64 forms also across line breaks (and ``\\n`` escapes), since base64 is wrapped (MIME,
PEM, ``openssl base64``; `Matcher.spans`);

and each matched regardless of ASCII case (so upper-, lower- and mixed-case variants, and hex and
percent escapes in either case). A match is replaced by ``[REDACTED:<label>]``.

Not caught, and not catchable by matching: a value split into pieces (across responses, by
``Range`` requests, by separators between its characters), partly echoed, or put through any
other transformation (another encoding, compression, encryption). This is a limit on careless
and lazy reflection, not a boundary against an upstream that computes on the secret; see
``docs/egress.md``.
"""

from __future__ import annotations

import base64
import functools
import html
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, quote_plus

import re2

MIN_LENGTH = 6  # shorter forms would match ordinary text
# The narrowest line-wrapped base64 a streamed body is certain to be read whole across (MIME's is
# 76 columns, PEM's and OpenSSL's 64); a whole text is read across line breaks of any width.
WRAP_MIN = 60


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
    # Other stacks keep other punctuation: PHP's urlencode and Java's URLEncoder escape "~"
    # (Java and HTML forms keep "*"), JavaScript's encodeURIComponent keeps "!'()*~", and some
    # escape all but letters and digits; each with a space as %20 or "+".
    for kept in _PERCENT_KEPT:
        add("percent", _percent(raw, kept, b"%20"), _percent(raw, kept, b"+"))
    ascii_json = json.dumps(value)[1:-1]
    escaped = json.dumps(value, ensure_ascii=False)[1:-1].encode("utf-8", "surrogatepass")
    add("json", ascii_json.encode(), escaped, ascii_json.replace("/", "\\/").encode())  # some encoders escape "/"
    # Go's encoding/json (and others, to be safe in HTML) escape <, > and & as \u003c, \u003e, \u0026.
    html_safe = ascii_json.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    add("json", html_safe.encode(), html_safe.replace("/", "\\/").encode())
    # .NET's System.Text.Json escapes ", &, ', +, <, >, ` and \ as \u00XX by default; some
    # encoders escape every character but letters and digits so.
    add("json", _each_escaped(value, "\"&'+<>`\\", "\\u%04x"), _each_escaped(value, _PUNCTUATION, "\\u%04x"))
    # An HTML page (an error page quoting a header) escapes &, <, >, " and ' as entities, each
    # templating stack in its own way (Python's html.escape, MarkupSafe and Jinja, Go's
    # html/template, which also escapes "+", XML's &apos;).
    add(
        "html",
        html.escape(value, quote=True).encode("utf-8", "surrogatepass"),
        html.escape(value, quote=False).encode("utf-8", "surrogatepass"),
        *(html.escape(value, quote=False).translate(table).encode("utf-8", "surrogatepass") for table in _ENTITIES),
        # Encoders that write every character but letters and digits as a numeric entity,
        # hexadecimal or decimal; and OWASP's ESAPI (encodeForHTML), which keeps ",.-_ " too.
        _each_escaped(value, _PUNCTUATION, "&#x%x;"),
        _each_escaped(value, _PUNCTUATION, "&#%d;"),
        _each_escaped(value, _ESAPI_ESCAPED, "&#x%x;"),
        _each_escaped(value, _ESAPI_ESCAPED, "&#%d;"),
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


_PERCENT_KEPT = (b"", b"-._", b"-._*", b"-._~!'()*", b"-._~$&+,;=:@", b"@*_+-./", b"-._~!*'();/?:@&=+$,#")
"""Besides letters and digits, what each URL encoder in use leaves as it is (Python's ``quote``,
keeping ``-._~``, is listed apart): none; HTML forms; Java's ``URLEncoder``; JavaScript's
``encodeURIComponent``; Go's ``url.PathEscape``; JavaScript's ``escape``; its ``encodeURI``."""
_ENTITIES = tuple(
    str.maketrans(table)
    for table in (
        {'"': "&#34;", "'": "&#39;"},  # MarkupSafe (Jinja, Flask), ERB
        {'"': "&#34;", "'": "&#39;", "+": "&#43;"},  # Go's html/template
        {'"': "&quot;", "'": "&#39;"},
        {'"': "&quot;", "'": "&apos;"},  # XML, PHP's htmlspecialchars with ENT_QUOTES | ENT_HTML5
        {'"': "&#x22;", "'": "&#x27;"},
    )
)
"""How HTML escapers besides ``html.escape`` write the characters only some of them escape."""


_PUNCTUATION = "".join(chr(c) for c in range(0x20, 0x7F) if not chr(c).isalnum())
_ESAPI_ESCAPED = "".join(c for c in _PUNCTUATION if c not in ",.-_ ")  # what ESAPI's encodeForHTML escapes


def _each_escaped(value: str, escaped: str, template: str) -> bytes:
    """``value`` with each character of ``escaped``, and each control or non-ASCII one, written as
    ``template % code point`` (as JSON or HTML writes it); others as they are. In JSON (a
    ``\\u`` template) a character beyond the BMP is its UTF-16 pair, as `json.dumps` writes it."""
    json_ = template.startswith("\\u")
    return "".join(
        c if " " <= c <= "~" and c not in escaped
        else json.dumps(c)[1:-1] if json_ and ord(c) > 0xFFFF
        else template % ord(c)
        for c in value
    ).encode("utf-8", "surrogatepass")  # fmt: skip


def _percent(raw: bytes, kept: bytes, space: bytes) -> bytes:
    """``raw`` URL-encoded (upper-case escapes) leaving letters, digits and ``kept`` as they are."""
    return b"".join(
        bytes([byte]) if (chr(byte).isascii() and chr(byte).isalnum()) or byte in kept
        else space if byte == 0x20 else b"%%%02X" % byte
        for byte in raw
    )  # fmt: skip


def compile_forms(secrets: Iterable[tuple[str, str]]) -> Forms:
    """The forms of each ``(label, value)``, longest first, so a longer form is never cut by a
    shorter one inside it."""
    forms = {needle: Form(needle, label, encoding) for label, value in secrets
             for needle, encoding in secret_forms(value).items()}  # fmt: skip
    return Forms(sorted(forms.values(), key=lambda form: len(form.needle), reverse=True))


KEY_LENGTH = 8  # the prefix a candidate is found by: long enough that ordinary text rarely has one
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.encoding = re2.Options.Encoding.LATIN1  # one byte, one character: offsets are byte offsets
_RE2_OPTIONS.case_sensitive = True  # the text is folded first, ASCII only (RE2 would fold Latin-1 letters too)
_RE2_OPTIONS.never_capture = True


class Matcher:
    """Finds every form of a set in one pass, whatever the number of forms.

    RE2 (a DFA, linear in the text) finds where a form's first `KEY_LENGTH` bytes occur; each such
    place is checked against the forms with that prefix by a dictionary lookup per form length.
    Matching each form in turn would cost the number of forms times the text, and an alternation
    of the whole forms outgrows RE2's memory (a token's forms are hundreds of bytes each).
    """

    def __init__(self, forms: Sequence[Form], *, across_breaks: bool = True) -> None:
        """``across_breaks``: also find the base64 forms wrapped over lines (see `spans`)."""
        self.forms = tuple(forms)
        wrapping = [form for form in forms if form.encoding in _WRAPPED] if across_breaks else []
        self._wrapped = Matcher(wrapping, across_breaks=False) if wrapping else None
        self._across_patterns: dict[bytes, Any] = {}
        self.shortest = min((len(form.needle) for form in forms), default=0)
        # prefix -> [(length, {needle: form})], longest first: the longest form at a place wins
        index: dict[bytes, dict[int, dict[bytes, Form]]] = {}
        for form in forms:
            key = form.needle[:KEY_LENGTH]
            index.setdefault(key, {}).setdefault(len(form.needle), {}).setdefault(form.needle, form)
        self._index = {key: sorted(by_length.items(), reverse=True) for key, by_length in index.items()}
        self._key_lengths = sorted({len(key) for key in index})
        alternation = b"|".join(re2.escape(key) for key in sorted(index))
        self._candidates = re2.compile(alternation, _RE2_OPTIONS) if index else None

    def spans(self, folded: bytes) -> list[tuple[int, int, list[Form]]]:
        """Where forms occur in ``folded`` (ASCII lower case): each ``(start, end, forms)`` the
        union of overlapping occurrences, in order, so overlapping forms are replaced as one.

        The base64 forms are also found across line breaks (and ``\\n``, ``\\r`` escapes: a PEM
        key in a JSON string): MIME, PEM and ``openssl base64`` wrap base64 at 64 or 76 columns,
        so a long value's base64 always crosses a line. Only they: a value itself (or its hex,
        ...) with a break inside is a value split, as the limits say, and ordinary lines joined
        could spell a short one."""
        spans = self._spans(folded)
        if self._wrapped is None or (b"\n" not in folded and b"\r" not in folded and b"\\" not in folded):
            return spans
        # Read without the breaks (in C); only each form found there, which is rare, is found
        # again in the text as it is, with breaks allowed between its characters (RE2, linear),
        # one form at a time (an alternation of many outgrows RE2's memory) and overlaps included.
        joined = folded.translate(None, b"\r\n").replace(b"\\n", b"").replace(b"\\r", b"")
        first: dict[Form, int] = {}  # each form found, and where first: it is no earlier in ``folded``
        for start, _, forms in self._wrapped._spans(joined):
            for form in forms:
                first.setdefault(form, start)
        across = []
        for form, start in first.items():
            search, pos = self._across(form.needle).search, start
            while (match := search(folded, pos)) is not None:
                across.append((match.start(), match.end(), [form]))
                pos = match.start() + 1
        return _merged(spans, across) if across else spans

    def _across(self, needle: bytes) -> Any:
        """``needle`` with line breaks (CR, LF, and ``\\n``, ``\\r`` as a JSON string writes them)
        allowed between its characters, compiled once. One form to a pattern: an alternation of
        a few such forms outgrows RE2's memory (it falls back to a slow matcher, and complains)."""
        pattern = self._across_patterns.get(needle)
        if pattern is None:
            between = rb"(?:[\r\n]|\\[rn])*"
            pattern = re2.compile(between.join(re2.escape(bytes([c])) for c in needle), _RE2_OPTIONS)
            self._across_patterns[needle] = pattern
        return pattern

    def _spans(self, folded: bytes) -> list[tuple[int, int, list[Form]]]:
        spans: list[tuple[int, int, list[Form]]] = []
        if self._candidates is None or len(folded) < self.shortest:
            return spans
        search, index = self._candidates.search, self._index
        pos = 0
        while (candidate := search(folded, pos)) is not None:
            start = candidate.start()
            pos = start + 1  # the next search also finds a form starting inside this one
            best: Form | None = None
            for key_length in self._key_lengths:
                for length, needles in index.get(folded[start : start + key_length], ()):
                    if best is not None and length <= len(best.needle):
                        break
                    form = needles.get(folded[start : start + length])
                    if form is not None:
                        best = form
                        break
            if best is None:
                continue
            end = start + len(best.needle)
            if spans and start < spans[-1][1]:
                last_start, last_end, found = spans[-1]
                found.append(best)
                spans[-1] = (last_start, max(last_end, end), found)
            else:
                spans.append((start, end, [best]))
        return spans

    def scrub(self, data: bytes) -> tuple[bytes, list[Form]]:
        """``data`` with each occurrence of a form, and each run of overlapping ones, replaced
        once; and the forms found, in order of first occurrence."""
        if len(data) < self.shortest or self._candidates is None:
            return data, []  # shorter than every form: most log fields and audit values
        # bytes.lower folds ASCII only: offsets in the folded copy are offsets in ``data``
        spans = self.spans(data.lower())
        if not spans:
            return data, []
        pieces: list[bytes] = []
        found: dict[Form, None] = {}
        end = 0
        for start, stop, forms in spans:
            labels = list(dict.fromkeys(form.label for form in forms))
            replacement = forms[0].replacement if len(labels) == 1 else f"[REDACTED:{','.join(labels)}]".encode()
            pieces += (data[end:start], replacement)
            found.update(dict.fromkeys(forms))
            end = stop
        pieces.append(data[end:])
        return b"".join(pieces), list(found)


_WRAPPED = frozenset({"base64", "base64url"})  # the forms encoders wrap over lines


def _merged(
    one: list[tuple[int, int, list[Form]]], other: list[tuple[int, int, list[Form]]]
) -> list[tuple[int, int, list[Form]]]:
    """The spans of ``one`` and ``other`` in order, overlapping ones as one (their forms joined)."""
    merged: list[tuple[int, int, list[Form]]] = []
    for start, end, forms in sorted(one + other, key=lambda span: span[0]):
        if merged and start < merged[-1][1]:
            last_start, last_end, found = merged[-1]
            merged[-1] = (last_start, max(last_end, end), found + [f for f in forms if f not in found])
        else:
            merged.append((start, end, list(forms)))
    return merged


class Forms(tuple[Form, ...]):
    """The forms of a set of secrets, longest first, with the `Matcher` that finds them (built on
    first use, once)."""

    @functools.cached_property
    def matcher(self) -> Matcher:
        return Matcher(self)


def scrub(data: bytes, forms: Sequence[Form] | Matcher) -> tuple[bytes, list[Form]]:
    """``data`` with every occurrence of each of ``forms`` replaced, ASCII case folded, overlapping
    occurrences (of one secret's forms, or of several secrets) as one; and the forms that were found."""
    if isinstance(forms, Forms):
        forms = forms.matcher
    elif not isinstance(forms, Matcher):
        if not forms:
            return data, []
        forms = Matcher(forms)
    return forms.scrub(data)


class StreamScrubber:
    """Scrubs a body that arrives in pieces: the tail of each piece that could begin a form the
    next piece completes is held back until that piece (or the end) arrives."""

    def __init__(self, forms: Sequence[Form] | Matcher) -> None:
        if isinstance(forms, Forms):
            forms = forms.matcher
        self._matcher = forms if isinstance(forms, Matcher) else Matcher(forms)
        longest = max((len(form.needle) for form in self._matcher.forms), default=1)
        # What a form can span here: its own length, and the line breaks of base64 wrapped at
        # `WRAP_MIN` columns or more inside it (each at most 4 bytes: an escaped CR LF).
        self._hold = longest - 1 + 4 * (longest // WRAP_MIN + 1)
        self._pending = b""
        self.found: set[Form] = set()

    def feed(self, data: bytes) -> bytes:
        """What can be passed on of everything received so far, scrubbed."""
        out, found = self._matcher.scrub(self._pending + data)
        self.found.update(found)
        cut = max(len(out) - self._hold, 0)
        self._pending = out[cut:]
        return out[:cut]

    def finish(self) -> bytes:
        """The held-back rest, scrubbed, once the body has ended."""
        out, found = self._matcher.scrub(self._pending)
        self.found.update(found)
        self._pending = b""
        return out
