"""Argument provenance: where each value of a new call was seen before in its session.

Sources, as policy sees them in ``input.provenance[arg]``:

- ``user``: the trusted context the framework declared when it opened the session;
- ``tool:<name>:<call_id>``: output of a tool without ``reads_untrusted``;
- ``untrusted:<name>:<call_id>``: output of a tool with ``reads_untrusted`` (sandboxed, or
  reported by the framework for an ``external`` tool), or of any call an argument of which was
  seen only in untrusted content (the call was steered);
- ``derived:<name>:<call_id>``: output of a tool without ``reads_untrusted``, called after
  untrusted content with an argument that has keys but no trusted source (``calculator("333*3")``
  from a page's "three hundred thirty-three times three"). It is neither trusted nor untrusted:
  a value seen only there counts as seen nowhere, so it is held where a trusted source is
  needed, and a human may endorse it. A trusted tool must not launder what the agent typed in
  from a page into a trusted value.

What is matched. Content is indexed once, when it enters the session; an argument is reduced to
the same keys and looked up, so a lookup costs a few dictionary probes whatever the session size.

====================  =================================================================
key                   taken from
====================  =================================================================
whole string          a string of at most 256 characters, whitespace collapsed (exact case)
email                 ``local@domain.tld``, lower-cased; in indexed content also its domain (as a
                      hostname), but an argument that is one address matches only as that
                      whole address (not by its domain or the digits in it)
URL                   ``http(s)://...``: the whole URL (scheme and host canonical, user info
                      kept, default port, trailing slash and fragment dropped) and, separately,
                      its host
hostname              ``name.tld`` tokens, lower-cased, trailing dot dropped
IBAN                  country, check digits, groups of four (spaced or not), spaces removed,
                      upper-cased; only if the ISO 13616 mod-97 check digits are right
account number        8 or more digits, spaces and dashes removed
number                at least 3 significant digits, in canonical form (``100``, ``100.0`` and
                      ``"100.00"`` match; ``000`` or ``0.005`` are too common to say where they
                      came from); ``2,500.50`` is one number, 2500.5, and not also its pieces
====================  =================================================================

A host is keyed as a resolver reads it, by one function (`canonical_host`) for content and
arguments alike: a URL's host percent-decoded, and a non-ASCII host mapped by UTS-46 (IDNA2008:
case and width folded, ``\u3002`` a dot, ``ß`` kept) to its ``xn--`` form. So
``https://%65vil.example`` is evil.example, and ``straße.example`` is not ``strasse.example``.

Content is also read as its reader takes it (`folded`): the first 64 KiB of a string that is not
plain ASCII, or holds an ``&``, is indexed a second time NFKC-folded, without format characters (Unicode Cf: zero-width
spaces and joiners, bidi marks) and with HTML entities decoded, so a page that writes
``\uff48\uff54\uff54\uff50\uff53\uff1a\uff0f\uff0f\uff45\uff56\uff49\uff4c...`` or
``evil&#46;example`` is a source of the plain link an LLM copies out of it. An argument is read both
ways too: a content argument's identifiers in either form, and a checked value's folded form, if
it reads as another identifier, as a value of its own that needs a trusted source as well (folding
can make a value suspect, never trusted). Plain ASCII without ``&`` costs two scans; the second
reading is linear and spends the same budget as the first. The first 64 KiB of each string of
content is also read as an agent told to decode it would (`unveiled`): re-armed where defanged
(``hxxps://evil[.]example``) and each base64 run that decodes to text.

A destination, amount or sensitive value is matched by what it *is*: its whole string, and an
identifier only if the whole value is exactly one (`checked_values`): the value
``https://evil.example/?d=x`https://news.example/`` is two URLs and so no URL, however trusted the
second. A value that names no place (``Bob``, ``#general``) is also matched case-folded, as the
user may have written it; an identifier never is. Each key of a map in such an argument is a
value of its own.

Strings longer than 256 characters (free text) are matched only by the identifiers they contain.
Nested arguments are matched leaf by leaf (a map's keys and values alike); the provenance of an
argument is every source of any of its keys. A key remembers at most 16 sources.

What a call supplied. A trusted tool's output is a trusted source, except for what it only
repeats: every key its output shares with the call's own arguments keeps the sources it had.
Those are the keys `supplied_keys` reads from the arguments (names and values) with the very
function that indexes content, so an echo can hold no key the call did not put in.

Cost. Every matcher runs in time linear in the text: each is a regular expression without
nested or overlapping quantifiers (possessive where a retry could only fail again), or a scan
anchored on a literal such as ``@`` with bounded work around it. Repeated words and lines are
scanned once, a text that is one unit repeated is read as a few repeats and its end (exactly:
the same keys, `_unrepeated`), and each distinct token is reduced once. Words and lines are
split a span at a time (a long line cut where no match can span it), so a flood of distinct
tokens is read only as far as the budget below. Indexing one piece of content is bounded on top
of that:

- at most `MAX_INDEXED_CHARS` characters of its strings are read, and at most
  `MAX_INDEXED_TOKENS` distinct candidate tokens (and values, and containers) examined; the
  scan stops when the tokens run out;
- containers nested deeper than `MAX_DEPTH` are not entered;
- at most `MAX_MAPPED_HOSTS` non-ASCII hosts are mapped through UTS-46 (pure Python, some 15 us
  each); a link with such a host past that contributes no key.

Which way the bounds fail. Content that is not indexed contributes no key, so a value found only
there has no source from it. Policy reads "no trusted source" as unverified: after untrusted
content, a consequential call with such a value needs a human, whether it is a destination,
amount or sensitive value (``approval.unverified_destination``) or an identifier in the text of a
content argument (``approval.unverified_content``). So a value the user gave past
the bound no longer counts as the user's (the call is held, not let through), and a value from
untrusted content past the bound is held for a human instead of denied outright (the price of
the bound, logged as ``provenance_index_cut``); in no case does content that was not read make a
value pass as ``user`` or as a trusted tool's. (Taint does not depend on indexing: the store
taints the session for the output's tool whatever the index holds.) A cut must not invent keys
either: a string is cut before a character no matcher can span (whitespace other than a single
space, two spaces, or one of ``<>"'`(){}[]``), so every key from a cut string is one the whole
string yields too; a string without such a character within the budget is not read at all.

An argument, on the other hand, is always reduced completely (its size is bounded by
``max_args_bytes``, its nesting by `router.tools.MAX_NESTING`): dropping one of its keys could
hide the untrusted source of a value, which is the unsafe direction.

Indexing is CPU work: `content_keys_async` and `argument_keys_async` run large values in a
worker thread so the event loop keeps serving other calls.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import html
import itertools
import re
import string
import unicodedata
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import structlog
from idna import IDNAError, uts46_remap

log = structlog.get_logger(__name__)

USER = "user"
_MAX_WHOLE = 256
MAX_SOURCES = 16  # per key: enough to name the culprit, bounded whatever the session reads
# Containers below this depth are not indexed (content) and not allowed (arguments: the router
# refuses calls nested deeper, router.tools.MAX_NESTING, so arguments are always walked whole).
MAX_DEPTH = 64
# Per piece of content (one output, one report, one session's trusted context): twice the
# default output cap, so an output and its stderr at the default limits are read whole.
MAX_INDEXED_CHARS = 2 << 20
# Candidate tokens (and values and containers) examined per piece of content: about 25 ms of
# the slowest matcher (URLs) on this machine class; a realistic output has far fewer.
MAX_INDEXED_TOKENS = 8192
# Non-ASCII hosts mapped through UTS-46 per piece of content (`canonical_host`): the mapping is
# pure Python, some 15 us a host; past these, a link with such a host contributes no key.
MAX_MAPPED_HOSTS = 512
# Below this many characters (and nodes) a value is indexed inline: a few milliseconds at most.
INLINE_CHARS = 64 * 1024
_SPAN = 64 * 1024  # characters of distinct words scanned at a time while a budget lasts
_CUT_WITHIN = 4096  # how far past a span's end to look for a place to cut a long line
# A distinct line at least this long is read for the IBAN and account scans as its distinct
# segments, if its cuts repeat (`_Distinct._segments`); its first `_CUT_SAMPLE` characters show
# which cut is common.
_SEGMENT_MIN = 4096
_CUT_SAMPLE = 1024

# The matchers. Each is linear: repeats are possessive where giving characters back could only
# fail again; a pattern that must not start inside a token begins with its first character class
# and checks what precedes it after that (the regex engine then skips other characters fast);
# and where the old greedy patterns backed off one step at a time over a long run, a few scans of
# the run find the same end (`_emails`, `_host_key`, `_account_keys`). The property tests in
# tests/router/test_provenance.py check them against the old patterns.
_LOCAL = "A-Za-z0-9._%+-"  # the characters of an email's local part
# An '@' whose domain has a TLD-like segment ('.' and two letters): the only '@'s an email can
# use. The lazy scan is linear: each segment is taken whole, so a step never revisits one.
_AT_EMAIL = re.compile(r"@(?=[A-Za-z0-9-]++(?:\.[A-Za-z0-9-]++)*?\.[A-Za-z]{2})")
_LOCAL_RUN_REVERSED = re.compile(f"[{_LOCAL}]*+")
_DOMAIN = re.compile(r"[A-Za-z0-9-]++(?:\.[A-Za-z0-9-]++)*\.[A-Za-z]{2,63}")  # an email's, segments whole
_URL = re.compile(r"https?://[^\s<>\"'`(){}\[\]]+", re.IGNORECASE)
# A URL urlsplit reads as scheme, a host of letters, digits, dots and dashes, an optional port,
# path, query and fragment (printable ASCII): (scheme, host, port, path, query).
_PLAIN_URL = re.compile(
    r"(https?)://([A-Za-z0-9.-]+)(?::(\d{1,5}))?(/[!-\"$->@-~]*)?(?:\?([!-\"$-~]*))?(?:#[!-~]*)?", re.I | re.A
)
# A host can only start a run of [A-Za-z0-9.-] that follows none of [\w@.-]; the run is taken
# whole, with whether a word character follows it, and `_host_key` finds the host in it.
_HOST_RUN = re.compile(r"(?<![\w@.-])([A-Za-z0-9][A-Za-z0-9-]*+\.[A-Za-z0-9.-]*+)(?=(\w?))")
_HOST_HINT = re.compile(r"\.[A-Za-z]{2}")  # no host without it: most text skips the run scan
_LONG_LABEL = re.compile(r"[^.]{64}")
_TLD_LABEL_REVERSED = re.compile(r"\.[A-Za-z]{2,63}(?![^.])")  # reversed labels, each after its dot


def _compiled(pattern: str) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """``pattern`` for any text, and with re.ASCII for ASCII text (the same matches there, found
    faster: character classes become table lookups)."""
    return re.compile(pattern), re.compile(pattern, re.ASCII)


# The digit matchers end in a branch like ``|[\w.]{16,}+``: where a token cannot start (a digit
# inside a word, say), it takes the rest of the run in one step instead of one failed try per
# character (no token can start inside such a run either); its matches have every group empty
# (`_SKIPPED2`, `_SKIPPED3`) and are dropped.
_SKIPPED2, _SKIPPED3 = ("", ""), ("", "", "")
# `\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?\b` (on upper-cased text), found from
# its first check digit (the scan skips to digits, rarer than letters): (country, digit, rest).
_IBAN = _compiled(r"\d(?:(?<=(?<!\w)([A-Z]{2})(\d))(\d(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?)\b|\w{16,}+)")
# The same, found from the country's first letter, for ASCII text with fewer letters than digits
# (a page of account numbers): ``(?<!\w)`` is ``\b`` before a letter. Whole matches, no groups
# (cheaper to build when a line repeats one IBAN): `_iban_keys` splits them.
_IBAN_BY_LETTER = re.compile(r"[A-Z](?<!\w[A-Z])[A-Z]\d\d(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?\b", re.ASCII)
# `(?<![\w.])\d(?:[ -]?\d){7,}(?![\w.])`: a run of digits, spaces and dashes from where that may
# start and long enough to hold 8 digits, taken whole, and the character after it: (digit, rest,
# after); `_account_keys` splits the run and counts its digits as that pattern would.
_ACCOUNT_RUN = _compiled(r"\d(?:(?<=(\d))(?<![\w.]\d)(?=[\d -]{7})([\d -]*+)(?=([\w.]?))|[\w.]{16,}+)")
# Where a long line may be cut for the IBAN and account scans (`_Distinct`): after a character no
# match can hold, or two spaces, or (for IBANs, read upper-cased) after a word and its space when
# the word is not whole groups of four (an IBAN ends in such a word, or holds none of it).
_IBAN_CUT = re.compile(r"[^\dA-Z ]|  |(?<![\dA-Z])(?:[\dA-Z]{4})*+[\dA-Z]{1,3} ")
_ACCOUNT_CUT = re.compile(r"[^\d -]")
_NO_SEPARATORS = str.maketrans("", "", " -")
_SEPARATORS = re.compile(r"[ -]{2,}")
# `(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])` for tokens of 3 or more written digits (fewer never make
# a key, `_number_key`), as two scans that skip to a digit or to a '-': unsigned tokens (digit,
# rest), not right after a '-' that could start one; and signed ones.
_UNSIGNED = _compiled(
    r"\d(?:(?<=(\d))(?<![\w.]\d)(?:(?<!-\d)|(?<=[\w.]-\d))(?=(?:\.?\d){2})(\d*+(?:\.\d++)?+)(?![\w.])|[\w.]{16,}+)"
)
# A run of Capitalised words; one that starts inside a word (after a letter, digit or one of
# '&-) is dropped after the scan, which a lookbehind at every position would make ~5x slower.
_CAPITALISED = re.compile(r"[A-Z][\w'&-]*+(?: [A-Z][\w'&-]*+){0,5}")
_WORDISH = re.compile(r"[\w'&-]")
# A quoted phrase: 'x', "x", \u2018x\u2019 or \u201cx\u201d, one to 64 characters, on one line. (An
# apostrophe inside a word, as in "it's", opens no quote: the opening quote follows no letter.)
_QUOTED = re.compile(
    "(?<![\\w])['\u2018]([^'\u2018\u2019\\n]{1,64})['\u2019](?![\\w])|[\"\u201c]([^\"\u201c\u201d\\n]{1,64})[\"\u201d]"
)
_NAME_SCAN_CHARS = 64 << 10
_GROUPED = re.compile(r"(?<![\w.,])\d{1,3}(?:,\d{3})++(?:\.\d++)?+(?![\w,]|\.\d)", re.ASCII)
_CENTS = re.compile(r"-?\d{1,2}\.\d\d")
_SIGNED = _compiled(r"-(?<![\w.]-)(?=\d(?:\.?\d){2})\d++(?:\.\d++)?+(?![\w.])")
# ASCII text in outline (digits as 9, letters as A), to tell from a few substring scans whether a
# digit matcher can find anything: an IBAN needs AA99, a number of 3 digits 999, 9.99 or 99.9.
_OUTLINE = str.maketrans(string.digits + string.ascii_letters, "9" * 10 + "A" * 52)
_IBAN_DIGITS = {ord(ch): str(int(ch, 36)) for ch in string.ascii_uppercase}
_IBAN_COUNTRY = {
    a + b: str(int(a, 36)) + str(int(b, 36)) for a in string.ascii_uppercase for b in string.ascii_uppercase
}
_SPACE = re.compile(r"\s+")
# Characters no matcher can span (see the module docstring): content is only ever cut before one.
_UNSPANNABLE = re.compile(r"[^\S ]|[<>\"'`(){}\[\]]|  ")

# A text at least `_REPEAT_MIN` characters long that repeats one unit of at most `_MAX_PERIOD`
# is read as a few repeats and its end (`_unrepeated`); `_REACH`: the farthest past the character
# it stands on that any line matcher reads (an IBAN: 45).
_REPEAT_MIN = 16 << 10
_MAX_PERIOD = 4 << 10
_REACH = 64

_T = TypeVar("_T")


class _Budget:
    """What indexing one piece of content may still read (characters) and examine (tokens)."""

    __slots__ = ("chars", "cut", "hosts", "tokens")

    def __init__(self, chars: int, tokens: int, hosts: int = MAX_MAPPED_HOSTS) -> None:
        self.chars = chars
        self.tokens = tokens
        self.hosts = hosts
        self.cut = False

    def map_host(self) -> bool:
        """Spend one UTS-46 mapping; False (and the budget marked cut) if none is left."""
        if self.hosts <= 0:
            self.cut = True
            return False
        self.hosts -= 1
        return True

    def spend(self) -> bool:
        """Spend a token; False (and the budget marked cut) if none is left."""
        if self.tokens <= 0:
            self.cut = True
            return False
        self.tokens -= 1
        return True

    def take(self, found: list[_T]) -> list[_T]:
        """As many of ``found`` as the budget still allows, in order."""
        if len(found) <= self.tokens:
            self.tokens -= len(found)
            return found
        kept, self.tokens, self.cut = found[: self.tokens], 0, True
        return kept

    def read(self, text: str) -> tuple[str, bool]:
        """The part of ``text`` to index, and whether that is all of it."""
        if len(text) <= self.chars:
            self.chars -= len(text)
            return text, True
        self.cut = True
        window, self.chars = self.chars, 0
        found = _UNSPANNABLE.search(text[window - 1 :: -1]) if window > 0 else None
        # Cut before the last unspannable character in the window, so no key is a token's prefix.
        return (text[: window - found.end()], False) if found is not None else ("", False)


def _distinct(items: list[_T], budget: _Budget | None, skipped: _T | None = None) -> list[_T]:
    """``items`` without repeats (first occurrence first) nor ``skipped``, as many as ``budget`` allows."""
    found = dict.fromkeys(items)
    if skipped is not None:
        found.pop(skipped, None)
    distinct = list(found)
    return distinct if budget is None else budget.take(distinct)


class _Distinct:
    """The distinct words (``sep`` None) or lines (``sep`` "\\n") of a text, first occurrence
    first, split a span of about `_SPAN` characters at a time as the matchers ask for them: a
    flood of distinct pieces is split only as far as the budget reads, and each span is split once
    however many matchers read it. Lines with a ``cut`` pattern (where no match can span) are
    also read as their distinct segments between cuts when those repeat (`_segments`)."""

    __slots__ = ("_cut", "_cut_end", "_ended", "_pos", "_seen", "_segmenting", "_sep", "_sep_found", "_text", "spans")

    def __init__(self, text: str, sep: str | None, cut: re.Pattern[str] | None = None) -> None:
        self._text = text
        self._sep = sep
        self._cut = cut
        self._cut_end = None if cut is None else _ending(cut)
        self._ended: set[str] = set()  # segments whose end `_cut_end` found to be a cut
        self._segmenting = True  # until splitting a long line into segments does not pay
        self._sep_found = ""  # the separator of the segments that did
        self._pos = 0
        self._seen: set[str] = set()
        self.spans: list[list[str]] = []

    def span(self, index: int) -> list[str] | None:
        """The ``index``-th span's new pieces (possibly none), or None past the end of the text."""
        while index >= len(self.spans):
            text, pos = self._text, self._pos
            if pos >= len(text):
                return None
            # A span ends at a separator (for words, a space or a line break: any whitespace
            # would do, and these two are found fastest), so no piece is split between spans.
            end = resume = len(text)
            if pos + _SPAN < len(text):
                found = text.find(self._sep or " ", pos + _SPAN)
                if found < 0 and self._sep is None:
                    found = text.find("\n", pos + _SPAN)
                if found >= 0:
                    end, resume = found, found + 1
                if self._cut is not None and end > pos + 2 * _SPAN:
                    # A long line is cut after a character ``cut`` finds, where no match can
                    # span; both sides keep it, so what a pattern reads around a match is the same.
                    cut = self._cut.search(text, pos + _SPAN, pos + _SPAN + _CUT_WITHIN)
                    if cut is not None:
                        end, resume = cut.end(), cut.end() - 1
            piece = text[pos:end]
            if self._sep is None:
                fresh = self._words(piece)
            else:
                fresh = list(dict.fromkeys(piece.split(self._sep)))
                if self._cut is not None and max(map(len, fresh)) >= _SEGMENT_MIN:
                    fresh = list(dict.fromkeys([part for line in fresh for part in self._segments(line)]))
            if self._seen:  # the first span (often the whole text) has nothing to compare with
                fresh = [piece for piece in fresh if piece not in self._seen]
            if resume < len(text):  # only a later span needs to know what this one held
                self._seen.update(fresh)
            self.spans.append(fresh)
            self._pos = resume
        return self.spans[index]

    def _words(self, piece: str) -> list[str]:
        """The distinct words of ``piece``, first occurrence first. If it repeats a few runs of
        words (a MiB of a hundred IBANs in any order), it is first split where a space is followed
        by one character (`_separator`), and each distinct run is split into words once. Exact: no
        word spans a space, so the words of ``first + sep + run + sep + run ...`` are those of
        ``first`` and of each ``sep + run``. Once that does not pay, the text is split plainly."""
        if self._segmenting and len(piece) >= _SEGMENT_MIN:
            sep = self._sep_found or _separator(piece)
            parts = piece.split(sep) if sep else []
            rest = dict.fromkeys(parts[1:])
            if len(parts) >= 8 and len(rest) * 4 <= len(parts):
                self._sep_found = sep
                return list(dict.fromkeys(parts[0].split() + (sep + sep.join(rest)).split()))
            self._segmenting = False
        return list(dict.fromkeys(piece.split()))

    def _segments(self, line: str) -> list[str]:
        """``line`` as its distinct segments, if it is long and made of few that repeat (a MiB of
        a hundred IBANs in any order): each segment is scanned once, not every time it occurs.
        Else ``[line]``.

        Exact: ``line`` is cut only where ``cut`` finds a place no match can span, keeping the
        character there on both sides (as a long line is cut between spans), so its segments hold
        the same matches. The cuts are found fast, with ``str.split``: the separator is the
        commonest two characters at a cut in the line's first `_CUT_SAMPLE` (the character a cut
        keeps, and the next), and each distinct piece between two separators must end where
        ``cut`` finds a cut after the separator's first character, with what precedes in the
        line: then every occurrence of the separator is a cut. (``cut`` reads no further back
        than one character: a piece is checked from the separator's first character on, which
        is the character before it in the line.) If one is not, the line is read whole."""
        cut, ending = self._cut, self._cut_end
        if not self._segmenting or len(line) < _SEGMENT_MIN or cut is None or ending is None:
            return [line]
        sep = self._sep_found
        if not sep:
            counts: dict[str, int] = {}
            for match in cut.finditer(line, 1, _CUT_SAMPLE):
                pair = line[match.end() - 1 : match.end() + 1]
                counts[pair] = counts.get(pair, 0) + 1
            sep = max(counts, key=counts.__getitem__) if counts else ""
        parts = line.split(sep) if len(sep) == 2 else []
        # Segments that repeat: a line of distinct ones is read whole, as before (and once that
        # does not pay, no later line is tried).
        if len(parts) < 8 or len(middle := dict.fromkeys(parts[1:-1])) * 4 > len(parts):
            self._segmenting = False
            return [line]
        self._sep_found = sep
        kept, ended = sep[0], self._ended
        segments = []
        if parts[0]:  # else the line starts with the separator, as a segment does: no cut there
            # The first piece follows a line break, or the start of the text, or the character a
            # cut between spans kept (which starts no match of ``cut`` that could read before it).
            first = parts[0] + kept
            if ending.search("\n" + first, 1) is None:
                self._segmenting = False
                return [line]
            segments.append(first)
        middle_segments = [sep + part + kept for part in middle]
        for segment in [segment for segment in middle_segments if segment not in ended]:
            if ending.search(segment, 1) is None:
                self._segmenting = False
                return [line]
            ended.add(segment)
        segments += middle_segments
        segments.append(sep + parts[-1])
        return segments

    def joined(self, index: int, containing: str = "") -> str | None:
        """The ``index``-th span's new pieces (those ``containing`` a character, if given) joined
        by newlines (no match spans one), or None past the end of the text."""
        pieces = self.span(index)
        if pieces is None:
            return None
        return "\n".join([piece for piece in pieces if containing in piece] if containing else pieces)

    def ended(self, index: int) -> bool:
        """Whether the text has no ``index``-th span (without splitting one to find out)."""
        return index >= len(self.spans) and self._pos >= len(self._text)


def _separator(text: str) -> str:
    """Where to split ``text`` into runs of words that may repeat (`_Distinct._words`): a space
    and the character after it, one that follows at most every fourth space in its first
    `_CUT_SAMPLE` characters; the first character of its first word if that is one (a text that
    repeats a few units in any order likely starts with one), else the commonest. "" if none is."""
    words = text[:_CUT_SAMPLE].split(" ")
    after: dict[str, int] = {}
    for word in words[1:]:
        after[word[:1]] = after.get(word[:1], 0) + 1
    common = {first: count for first, count in after.items() if first and count >= 8 and 4 * count <= len(words)}
    if not common:
        return ""
    start = text.lstrip()[:1]
    return " " + (start if start in common else max(common, key=common.__getitem__))


@functools.cache
def _ending(cut: re.Pattern[str]) -> re.Pattern[str]:
    """``cut`` anchored at the end of the text: whether a text ends where ``cut`` finds a cut."""
    return re.compile(f"(?:{cut.pattern})\\Z", cut.flags)


def _email_scan(words: _Distinct, budget: _Budget | None) -> list[str]:
    """`_emails` in the distinct ``words``, a span at a time while the budget lasts (each '@'
    that may start an address costs a token): distinct, first occurrence first."""
    found: dict[str, None] = {}
    index = 0
    while True:
        if budget is not None and budget.tokens <= 0:
            budget.cut = budget.cut or not words.ended(index)  # a span is left unread
            break
        joined = words.joined(index)
        if joined is None:
            break
        found.update(dict.fromkeys(_emails(joined, budget)))
        index += 1
    return list(found)


def _scan(
    pattern: re.Pattern[str],
    pieces: _Distinct,
    budget: _Budget | None,
    skipped: Any = None,
    containing: str = "",
    masked: re.Pattern[str] | None = None,
) -> list[Any]:
    """`_distinct` over ``pattern``'s matches in the distinct ``pieces`` (those ``containing`` a
    character, if given: the others cannot match), read a span at a time and no further than the
    budget needs: a flood of distinct tokens costs what the budget allows, not what the text holds.
    What ``masked`` matches is read as a line break first (a token another matcher took whole)."""
    found: dict[Any, None] = {}
    index = 0
    while budget is None or len(found) <= budget.tokens:
        joined = pieces.joined(index, containing)
        if joined is None:
            break
        if masked is not None:
            joined = masked.sub("\n", joined)
        found.update(dict.fromkeys(pattern.findall(joined)))
        if skipped is not None:
            found.pop(skipped, None)
        index += 1
    return list(found) if budget is None else budget.take(list(found))


def _left(budget: _Budget | None) -> bool:
    """Whether another matcher may run (no point scanning for tokens that cannot be taken)."""
    return budget is None or budget.tokens > 0


def _number_key(text: str, digits: int | None = None) -> str | None:
    """``text``'s number key; ``digits``: how many digits it has, when the caller knows."""
    if (sum(map(str.isdigit, text)) if digits is None else digits) < 3:
        return None
    if text.isascii() and text.isdigit():
        # What Decimal gives a plain integer of at most 28 significant digits (its precision;
        # longer ones are rounded), without building one: the common case, several times faster.
        significant = text.lstrip("0")
        if len(significant) <= 28:
            return "n:" + significant if len(significant) >= 3 else None
    try:
        canonical = format(Decimal(text).normalize(), "f")
    except ArithmeticError:  # not a number, or beyond Decimal's exponent range (Overflow)
        return None
    # Significant digits, not written ones: "000" is 0 and "0.005" is 5 thousandths, as common as 5.
    significant = canonical.lstrip("-").lstrip("0.")
    if len(significant) - significant.count(".") < 3:
        return None
    return "n:" + canonical


def _iban_in(match: str) -> list[str]:
    """The IBAN keys an IBAN match gives (country, check digits, groups of four, as
    `_IBAN_BY_LETTER` finds it). A spaced IBAN's last groups may have run into the next word
    ("... 7034 BEFORE"): the longest run of whole groups whose check digits are right is the IBAN.
    If none is right, the string is still an account an agent could be told to pay (an attacker
    need not write valid check digits): every run of whole groups of an IBAN's length (15 to 34)
    is a key, so the one the argument holds is among them."""
    compact = match.replace(" ", "")
    size = len(compact)
    # ISO 13616 check: the IBAN with its first four characters moved to the end, letters as
    # numbers (A = 10 ... Z = 35), mod 97 is 1.
    tail = _IBAN_COUNTRY[compact[:2]] + compact[2:4]
    if not compact[4:].isdecimal():
        return _lettered_iban_in(match, compact, tail)
    # Past the country, most IBANs are digits only: then a shorter run's number is the whole
    # run's without its last digits, followed by the same six of the tail (t), and
    # ``x * 10**6 + t`` is 1 mod 97 exactly when x is ``(1 - t) * 18`` (18 * 10**6 is 1 mod 97).
    number = int(compact[4:] + tail)
    whole = 15 <= size <= 34
    if whole and number % 97 == 1:
        return ["i:" + compact]
    keys = ["i:" + compact] if whole else []
    if " " in match:
        target = (1 - number % 1_000_000) * 18 % 97
        for end, scale in _shorter_runs(tuple(map(len, match.split(" ")))):
            if number // scale % 97 == target:
                return ["i:" + compact[:end]]
            keys.append("i:" + compact[:end])
    return keys


@functools.lru_cache(maxsize=1024)
def _shorter_runs(lengths: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """For an IBAN match whose space-separated parts are ``lengths`` long: the runs of its whole
    groups shorter than all of it and of an IBAN's length, longest first, as (run length, the
    power of ten its number is the whole run's number divided by, tail included)."""
    size = end = sum(lengths)
    runs = []
    for length in reversed(lengths[1:]):
        end -= length
        if 15 <= end <= 34:
            runs.append((end, 10 ** (6 + size - end)))
    return tuple(runs)


def _lettered_iban_in(match: str, compact: str, tail: str) -> list[str]:
    """`_iban_in` of a match with letters past its country (``compact``: without spaces;
    ``tail``: its first four characters as the check moves them to the end, as digits)."""
    keys = []
    end = len(compact)
    for group in reversed(match.split(" ")):  # the runs of whole groups, longest first
        if 15 <= end <= 34:
            iban = compact[:end]
            if int(iban[4:].translate(_IBAN_DIGITS) + tail) % 97 == 1:
                return ["i:" + iban]
            keys.append("i:" + iban)
        end -= len(group)
    return keys


def canonical_host(host: str, budget: _Budget | None = None) -> str | None:
    """``host`` as a resolver reads it, the one form every key holds it in: ASCII lower-cased;
    otherwise mapped by UTS-46 (IDNA2008: case and width folded, ``\u3002`` a dot, but ``ß`` kept,
    not made ``ss`` as casefold or IDNA2003 would) with each non-ASCII label as its A-label
    (``xn--...``); no trailing dot. None if UTS-46 disallows a character of it, or ``budget`` has
    no mapping left: such a host gives no key, so a value naming it has no source (unverified)."""
    if host.isascii():
        return host.lower().rstrip(".")
    if budget is not None and not budget.map_host():
        return None
    return _mapped_host(host)


@functools.lru_cache(maxsize=4096)
def _mapped_host(host: str) -> str | None:
    """`canonical_host` of a non-ASCII host (cached: a page names the same few hosts many times)."""
    try:
        mapped = uts46_remap(host, std3_rules=False)
        labels = [
            label if label.isascii() else "xn--" + label.encode("punycode").decode("ascii")
            for label in mapped.split(".")
        ]
    except (IDNAError, UnicodeError):
        return None
    return ".".join(labels).rstrip(".")


def _url_keys(url: str, budget: _Budget | None = None) -> list[str]:
    """The keys of a URL `_URL` found: the whole URL (normalised: scheme and host canonical, default
    port, trailing slash and fragment dropped, user info kept) and its host."""
    url = url.rstrip(".,;:!?")
    plain = _PLAIN_URL.fullmatch(url)
    userinfo = ""
    host: str | None
    if plain is not None and (plain[3] is None or int(plain[3]) <= 65535):
        # What urlsplit gives for this common shape, without its per-call cost (a flood of
        # distinct URLs spends its budget here); anything else goes through urlsplit itself.
        scheme, host, written_port, path, query = plain.groups("")
        scheme, host = scheme.lower(), host.lower().rstrip(".")
        port: int | None = int(written_port) if written_port else None
    else:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            return []
        # A host is read as a browser reads it: percent-escapes decoded, then UTS-46
        # (``%65vil.example``, ``evil\u3002example`` and fullwidth ``evil`` are all evil.example).
        raw = parts.hostname or ""
        host = canonical_host(unquote(raw) if "%" in raw else raw, budget)
        userinfo = parts.netloc.rpartition("@")[0]  # who the request claims to be is part of where it goes
        scheme, path, query = parts.scheme.lower(), parts.path, parts.query
    if not host:
        return []
    default = {"http": 80, "https": 443}.get(scheme)
    netloc = host if port in (None, default) else f"{host}:{port}"
    netloc = f"{userinfo}@{netloc}" if userinfo else netloc
    query = f"?{query}" if query else ""
    return [f"u:{scheme}://{netloc}{path.rstrip('/')}{query}", f"h:{host}"]


def _emails(text: str, budget: _Budget | None) -> list[str]:
    """Every ``local@domain.tld`` in ``text``, left to right, as the pattern
    ``[local]+@[A-Za-z0-9-]+(?:\\.[A-Za-z0-9-]+)*\\.[A-Za-z]{2,63}`` finds them (greedy, no
    overlaps), in linear time: that pattern retried every start of a long local part. Each '@'
    that may start one costs a token."""
    found_ats = _AT_EMAIL.finditer(text)
    if budget is not None:  # no further than the budget reads (and one more, to know it was cut)
        found_ats = itertools.islice(found_ats, max(budget.tokens, 0) + 1)
    ats = [at.start() for at in found_ats]
    if budget is not None and len(ats) > budget.tokens:
        ats, budget.cut = ats[: max(budget.tokens, 0)], True
    if budget is not None:
        budget.tokens -= len(ats)
    found: list[str] = []
    reversed_text = text[::-1] if ats else ""
    size, last_end = len(text), 0
    for start in ats:
        # The local part: the run of local characters ending at '@', not reaching into the
        # previous address (the pattern resumes where its last match ended).
        local = _LOCAL_RUN_REVERSED.match(reversed_text, size - start)
        begin = max(size - local.end(), last_end) if local is not None else start
        if begin == start:
            continue
        # The domain, as the greedy pattern takes it (each segment whole, then backing off to
        # the last that starts with two letters): linear, as the domains of two '@' never overlap.
        domain = _DOMAIN.match(text, start + 1)
        if domain is None:  # pragma: no cover - _AT_EMAIL saw one
            continue
        found.append(text[begin : domain.end()])
        last_end = domain.end()
    return found


def _host_key(run: str, after_is_word: bool) -> str | None:
    """The host ``(?<![\\w@.-])(?:label\\.)+[A-Za-z]{2,63}\\.?(?![\\w-])`` finds at the start of
    ``run`` (a whole run of [A-Za-z0-9.-]; ``after_is_word``: a word character follows it), as its key.

    The pattern takes every leading label followed by a dot, then backs off to the last one that
    is 2 to 63 letters (and, if it ends the run, not followed by a word character). This finds
    the same one with a few scans instead of a step per label."""
    # The labels stop at the first segment that is empty, starts or ends with '-', or is over
    # 63 characters: find where that segment starts.
    bad = len(run)
    at = run.find("..")
    if at >= 0:
        bad = at + 1
    if "-" in run:  # most hosts have none: two scans of a long run saved
        at = run.find(".-")
        if 0 <= at < bad:
            bad = at + 1
        at = run.find("-.")
        if 0 <= at < bad:
            bad = run.rfind(".", 0, at) + 1
    long = _LONG_LABEL.search(run, 0, bad)
    if long is not None:
        bad = long.start()
    first_dot = run.index(".")
    chain_end = bad if bad < len(run) else run.rfind(".") + 1
    if chain_end <= first_dot:
        return None
    next_dot = run.find(".", chain_end)
    last_end = len(run) if next_dot < 0 else next_dot
    last = run[chain_end:last_end]
    if (
        2 <= len(last) <= 63
        and last.isascii()
        and last.isalpha()
        and not (next_dot < 0 and after_is_word)  # the pattern's (?![\\w-]) after the run
    ):
        return "h:" + run[:last_end].lower()
    # Backwards from the dot ending the labels: each label follows its (forward) trailing dot.
    tld = _TLD_LABEL_REVERSED.search(run[chain_end - 1 : first_dot : -1])
    if tld is None:
        return None
    return "h:" + run[: chain_end - 1 - tld.start()].lower()


def _unrepeated(text: str, line_patterns: list[tuple[re.Pattern[str], bool]]) -> str:
    """``text`` (ASCII) without whole repeats of its unit from its middle, if it is one unit of at
    most `_MAX_PERIOD` characters repeated at least 8 times; else ``text`` itself.

    Exact: the shorter text has the same distinct words, lines and matches of ``line_patterns``
    (each with whether it reads upper-cased text). Where the scans are all free (next to a
    whitespace character, inside no match of any pattern) before a position ``a`` and again some
    whole units later, every scan repeats itself from there, that many units at a time, until it
    comes within its reach (`_REACH`) of the end. Dropping such repeats between leaves the same
    text at every place a scan reads, so the same tokens; the end is read as it is. (A match may
    be longer than a unit: an IBAN of nine "DE89 " units repeats every nine units.) Each
    pattern's matches are found at the start of the text to see where they are free."""
    unit = text.find(text[:64], 1, _MAX_PERIOD + 64)
    if unit <= 0 or len(text) < 8 * unit or _SPACE.search(text, 0, unit) is None:
        return text  # no unit, or one without whitespace: one word, which no repeat leaves out
    if text[unit:] != text[:-unit]:
        return text
    first = max(unit, 4)  # a lookbehind reads up to 3 characters back: from here, all repeats
    longest = min(_MAX_PERIOD // unit, 64, len(text) // (8 * unit)) * unit  # the longest repeat tried
    window = first + 2 * longest + _REACH
    inside = bytearray(window)  # 1 where a match of some pattern spans the gap before a character
    for pattern, upper in line_patterns:
        sample = text[:window].upper() if upper else text[:window]
        for match in pattern.finditer(sample):
            start, end = match.span()
            inside[start + 1 : end] = b"\x01" * max(0, end - start - 1)
    free = [
        a for a in range(first, first + 2 * longest) if (text[a - 1].isspace() or text[a].isspace()) and not inside[a]
    ]
    is_free = set(free)
    for period in range(unit, longest + 1, unit):
        a = next((a for a in free if a < first + period and a + period in is_free), None)
        if a is not None:
            repeats = (len(text) - a - 2 * period - _REACH) // period
            return text[: len(text) - repeats * period] if repeats > 0 else text
    return text


def _string_keys(text: str, indexing: bool, budget: _Budget | None) -> list[str]:
    keys: list[str] = []
    whole = True
    if budget is not None:
        text, whole = budget.read(text)
        if not text:
            return keys
    if whole and len(text) <= _MAX_WHOLE:
        collapsed = _SPACE.sub(" ", text).strip()
        if collapsed:
            keys.append("s:" + collapsed)
            keys.append(_NAME + _name(collapsed))
    if not indexing:
        stripped = text.strip()
        if stripped.count("@") == 1 and _emails(stripped, None) == [stripped]:
            # An argument that is one email address is matched as that address only: not by its
            # domain, nor by a number in it (``123@a.example`` is not ``123@b.example``).
            keys.append("e:" + stripped.lower())
            return keys
    # Which matchers can find anything at all, from a few scans of the text (for ASCII text, of
    # its outline): most text skips most of them.
    ascii_ = text.isascii()
    outline = text.translate(_OUTLINE) if ascii_ else ""
    emails, urls, hosts = "@" in text, "://" in text, _HOST_HINT.search(text) is not None
    digits = outline.count("9") if ascii_ else len(text)
    ibans = digits >= 2 and (not ascii_ or "AA99" in outline)
    # Eight digits joined by single separators: eight in a row once separators are dropped.
    accounts = digits >= 8 and (
        not ascii_
        or "99999999" in outline
        or (("-" in outline or " " in outline) and "99999999" in outline.translate(_NO_SEPARATORS))
    )
    signed = digits >= 3 and (not ascii_ or "-9" in outline)
    unsigned = digits >= 3 and (not ascii_ or "999" in outline or "9.99" in outline or "99.9" in outline)
    # IBANs are found from the rarer of their first letter and their first check digit: the scan
    # tries fewer starts. (`_IBAN_BY_LETTER` gives whole matches, `_IBAN` groups.)
    iban_pattern = _IBAN_BY_LETTER if ibans and ascii_ and outline.count("A") < digits else _IBAN[ascii_]
    # One unit repeated is read as a few repeats and its end (the same words, lines and matches).
    scanned = text
    if ascii_ and len(text) >= _REPEAT_MIN:
        line_patterns = [(iban_pattern, True)] if ibans else []
        line_patterns += [(_ACCOUNT_RUN[True], False)] if accounts else []
        scanned = _unrepeated(text, line_patterns)
    # Emails, URLs, hosts and numbers never span whitespace, and whitespace is all their patterns
    # can see around a word: each distinct word, scanned once (joined by newlines), gives the same
    # keys as the text, at a fraction of the cost when words repeat.
    words = _Distinct(scanned, None)
    if emails:
        for found in _email_scan(words, budget):
            email = found.lower()
            keys.extend(("e:" + email, "h:" + email.rsplit("@", 1)[1]) if indexing else ("e:" + email,))
    if urls and _left(budget):
        for url in _scan(_URL, words, budget):
            keys.extend(_url_keys(url, budget))
    if hosts and _left(budget):
        for run, after in _scan(_HOST_RUN, words, budget, containing="."):
            key = _host_key(run, bool(after))
            if key:
                keys.append(key)
    # IBANs and account numbers span single spaces, never a line break: they are read from the
    # text's distinct lines.
    if ibans and _left(budget):
        keys.extend(_iban_keys(scanned, iban_pattern, budget))
    if accounts and _left(budget):
        for digit, rest, after in _scan(
            _ACCOUNT_RUN[ascii_], _Distinct(scanned, "\n", _ACCOUNT_CUT), budget, _SKIPPED3
        ):
            keys.extend(_account_keys(digit + rest, bool(after), budget))
    if signed and _left(budget):
        for number in _scan(_SIGNED[ascii_], words, budget):
            keys.extend(_number_keys(number))
    if unsigned and _left(budget):
        keys.extend(_unsigned_keys(words, "," in text, ascii_, budget))
    if indexing:  # last: names take only what budget the identifiers left, never theirs
        keys.extend(_name_keys(text, budget))
    return keys


def _iban_keys(text: str, pattern: re.Pattern[str], budget: _Budget | None) -> list[str]:
    """The IBAN keys in ``text``'s distinct lines (upper-cased), found with ``pattern``:
    `_IBAN_BY_LETTER` (whole matches) or `_IBAN` (groups)."""
    lines = _Distinct(text.upper(), "\n", _IBAN_CUT)
    found: list[str]
    if pattern is _IBAN_BY_LETTER:
        found = _scan(pattern, lines, budget)
    else:
        found = [country + digit + rest for country, digit, rest in _scan(pattern, lines, budget, _SKIPPED3)]
    return [key for match in found for key in _iban_in(match)]


def _unsigned_keys(words: _Distinct, grouped: bool, ascii_: bool, budget: _Budget | None) -> list[str]:
    """Keys of the unsigned numbers in ``words`` (``grouped``: the text has a ',' and may write
    some with thousands separators)."""
    keys = []
    if grouped:
        # A number written with thousands separators is one amount: "2,500.50" is 2500.5, never
        # also 2 and 500.5 (read first, then masked out of the plain number scan).
        keys.extend(_grouped_keys(words, budget))
    for digit, rest in _scan(_UNSIGNED[ascii_], words, budget, _SKIPPED2, masked=_GROUPED if grouped else None):
        token = digit + rest
        if token.isdigit() and token.isascii():
            # `_number_keys` of a plain integer, inline: a flood of distinct numbers spends its
            # whole budget here.
            significant = token.lstrip("0")
            if len(significant) <= 28:
                if len(significant) >= 3:
                    keys.append("n:" + significant)
                continue
        keys.extend(_number_keys(token))
    return keys


def _grouped_keys(words: _Distinct, budget: _Budget | None) -> list[str]:
    """Keys of numbers written with thousands separators (``1,150.00`` is 1150)."""
    found = []
    for token in _scan(_GROUPED, words, budget):
        found.extend(_number_keys(token.replace(",", "")))
    return found


def _name_keys(text: str, budget: _Budget | None) -> list[str]:
    """Names in content of more than one word, as an argument that is a name is matched
    (`_NAME`; a whole short string is one already): in its first `_NAME_SCAN_CHARS`, every run of
    up to four Capitalised words ("Riverside View Hotel", "SpeedyRent") and every quoted phrase of
    up to 64 characters ('Nw-Sec!2024-reset', "Kalvariju g. 14"), so a value planted in a sentence
    is seen there, as it is in a field of its own. (Past that, it is "seen nowhere": held.)"""
    if " " not in text or not _left(budget):
        return []
    head = text[:_NAME_SCAN_CHARS]
    runs = [m for m in _CAPITALISED.finditer(head) if m.start() == 0 or not _WORDISH.match(head, m.start() - 1)]
    phrases: list[str] = []
    for run in _distinct([m.group(0) for m in runs], budget):
        phrases.extend(_phrases(run.split(" ")))
    if "'" in head or '"' in head or "\u2018" in head or "\u201c" in head:
        phrases += _distinct([q for pair in _QUOTED.findall(head) for q in pair if q.strip()], budget)
    return [_NAME + _name(phrase) for phrase in phrases]


def _number_keys(token: str) -> list[str]:
    """The key of a number token (digits, at most one '.', a leading '-'), as a list of 0 or 1.
    A price written with cents (``35.00``, ``4.50``) is keyed whatever its size: it is an amount."""
    key = _number_key(token, len(token) - token.count(".") - token.count("-"))
    if key is None and _CENTS.fullmatch(token):  # any decimal digits, as the number matchers read
        key = "n:" + format(Decimal(token).normalize(), "f")
    return [key] if key else []


def _account_keys(run: str, after_is_word: bool, budget: _Budget | None) -> list[str]:
    """The account numbers ``(?<![\\w.])\\d(?:[ -]?\\d){7,}(?![\\w.])`` finds in ``run`` (digits,
    spaces and dashes from a digit where that pattern may start; ``after_is_word``: a word
    character or '.' follows it), as keys."""
    # The pattern cannot span two separators: it stops, then starts again after them (after a
    # separator, always a valid start).
    doubled = "  " in run.replace("-", " ") if "-" in run else "  " in run
    groups = _SEPARATORS.split(run) if doubled else [run]
    last = groups.pop()
    keys = []
    for group in [*_distinct(groups, budget), last]:
        chain = group
        if group is last and not group.endswith((" ", "-")) and after_is_word:
            # Its (?![\\w.]) fails after the whole run: it backs off to the last separator (a
            # shorter end inside a group of digits is followed by a digit, and fails too).
            cut = max(group.rfind(" "), group.rfind("-"))
            chain = group[:cut] if cut >= 0 else ""
        digits = chain.translate(_NO_SEPARATORS)
        if len(digits) >= 8:
            keys.append("a:" + digits)
    return keys


@functools.cache
def _format_chars() -> re.Pattern[str]:
    """Every format character (Unicode category Cf: zero-width spaces and joiners, bidi marks,
    the soft hyphen), built once (some 10 ms), on the first text that is not plain ASCII. The
    class is written as ranges: a class of single characters is several times slower to scan."""
    ranges: list[list[int]] = []
    # Format characters are in planes 0, 1 and 14 only; scanning just those keeps the build short.
    for code in (*range(0x20000), *range(0xE0000, 0xE1000)):
        if unicodedata.category(chr(code)) == "Cf":
            if ranges and ranges[-1][1] == code - 1:
                ranges[-1][1] = code
            else:
                ranges.append([code, code])
    spans = (re.escape(chr(a)) + (f"-{re.escape(chr(z))}" if z > a else "") for a, z in ranges)
    return re.compile("[" + "".join(spans) + "]+")


def _unicode_folded(text: str) -> str:
    # The ideographic full stop is a dot to a reader (and to UTS-46), though not to NFKC.
    return _format_chars().sub("", unicodedata.normalize("NFKC", text)).replace("\u3002", ".")


def folded(text: str) -> str | None:
    """``text`` as a reader (or an LLM copying it) takes it, if that differs: NFKC-folded
    (full-width ``\uff48\uff54\uff54\uff50\uff53\uff1a`` is ``https:``) without format
    characters, and HTML entities decoded (``evil&#46;example`` is ``evil.example``). None for
    plain ASCII without an ``&``: the common case costs two scans. Linear in the text."""
    ascii_ = text.isascii()
    if ascii_ and "&" not in text:
        return None
    result = text if ascii_ else _unicode_folded(text)
    if "&" in result:
        result = html.unescape(result)
        if not result.isascii():  # an entity may name a full-width or zero-width character
            result = _unicode_folded(result)
    return result if result != text else None


# Defanged links and addresses, as threat reports write them and an injection may ask an agent to
# re-arm: ``hxxp``, ``[.]`` ``(.)`` ``[dot]`` ``(dot)``, ``[at]`` ``(at)``, ``[:]``, a bracketed
# word with a space each side at most (no repeat: linear).
_DEFANGED = re.compile(r"(?i:hxxp)|(?i: ?[\[({](at|dot|\.)[\])}] ?)|\[:\]")
# A run that may be base64 (or base64url): 16 characters or more, at most 4 KiB decoded at once.
_BASE64_RUN = re.compile(r"[A-Za-z0-9+/_-]{16,4096}={0,2}")
_UNVEIL_SCAN_CHARS = 64 << 10  # of each string: as for names, an injection is short and early
_MAX_DECODED_RUNS = 256


def _rearmed(match: re.Match[str]) -> str:
    word = match.group(1)
    if word is not None:
        return "@" if word.lower() == "at" else "."
    return "http" if match.group(0).lower() == "hxxp" else ":"


def unveiled(text: str) -> list[str]:
    """Readings of content an injection may ask an agent to decode, to be indexed beside it, from
    its first `_UNVEIL_SCAN_CHARS` (cut at a space): the text re-armed where it is defanged
    (``hxxps://evil[.]example``, ``eve (at) evil (dot) example``), and what each base64 run in it
    decodes to, if that is text. Past the head, a decoded value is simply not seen: one the agent
    then sends is held for a human (``approval.unverified_content``), never passed."""
    head = _head(text)
    readings = []
    if "[" in head or "(" in head or "{" in head or "xxp" in head or "XXP" in head:
        armed = _DEFANGED.sub(_rearmed, head)
        if armed != head:
            readings.append(armed)
    for n, run in enumerate(_BASE64_RUN.finditer(head)):
        if n >= _MAX_DECODED_RUNS:
            break
        if (decoded := _base64_text(run.group(0))) is not None:
            readings.append(decoded)
    return readings


def _head(text: str) -> str:
    """The first `_UNVEIL_SCAN_CHARS` of ``text``, cut at a space if it goes on: the part read the
    other ways (`folded`, `unveiled`), so a MiB of entities or wide characters costs what 64 KiB
    does, whatever it expands to."""
    head = text[:_UNVEIL_SCAN_CHARS]
    if len(text) > len(head) and (space := head.rfind(" ")) > 0:
        head = head[:space]
    return head


def _other_readings(text: str) -> list[str]:
    """``text``'s head `folded` (bounded: NFKC may make one character eighteen) and `unveiled`."""
    head = _head(text)
    plain = folded(head)
    return ([] if plain is None else [plain[: 2 * _UNVEIL_SCAN_CHARS]]) + unveiled(head)


def _base64_text(run: str) -> str | None:
    """What ``run`` decodes to as base64 or base64url, if that is printable UTF-8 text."""
    data = run.rstrip("=")
    try:
        raw = base64.b64decode(data + "=" * (-len(data) % 4), altchars=b"-_" if "-" in data or "_" in data else None)
        decoded = raw.decode("utf-8")
    except (ValueError, UnicodeDecodeError):  # binascii.Error is a ValueError
        return None
    return decoded if decoded.replace("\n", " ").replace("\t", " ").isprintable() else None


def string_keys(text: str, *, indexing: bool = True) -> Iterator[str]:
    """The keys a string contributes (see the module docstring). Indexed content also contributes
    each email's domain as a hostname, so host and URL arguments match it; an email argument
    matches only as a whole address (any address at a domain a page mentions is not suspect)."""
    yield from _string_keys(text, indexing, None)


def _value_keys(value: Any, indexing: bool, budget: _Budget | None, depth: int = 0) -> list[str]:
    """The keys of a JSON value, walked without recursion (a value may be nested deeper than
    Python's recursion limit): strings as above, numbers canonically, containers leaf by leaf,
    none below `MAX_DEPTH`."""
    keys: list[str] = []
    stack: list[tuple[Any, int]] = [(value, depth)]
    while stack:
        if budget is not None and budget.tokens <= 0:
            budget.cut = True
            break
        item, level = stack.pop()
        if level > MAX_DEPTH:
            if budget is not None:
                budget.cut = True
            continue
        if isinstance(item, str):
            keys.extend(_string_keys(item, indexing, budget))
            # Content is also read as its reader takes it (`folded`), so a link written full-width
            # or with an entity meets the plain argument an LLM rewrote it as.
            if indexing:  # and as a reader, or an agent told to decode it, would
                for reading in _other_readings(item):
                    keys.extend(_string_keys(reading, indexing, budget))
            continue
        if budget is not None:
            budget.tokens -= 1
        if isinstance(item, bool) or item is None:
            continue
        if isinstance(item, int | float):
            try:
                key = _number_key(repr(item) if isinstance(item, float) else str(item))
            except ValueError:  # an int over Python's 4300-digit str() limit: no JSON holds one
                continue
            if key:
                keys.append(key)
        elif isinstance(item, dict):
            # Reversed, so the stack pops them in order: a cut then keeps the first ones. A map is
            # read key and value alike (a map keyed by addresses names them too).
            children = [v for pair in item.items() for v in pair]
            stack.extend((child, level + 1) for child in reversed(children))
        elif isinstance(item, list | tuple):
            stack.extend((child, level + 1) for child in reversed(item))
    return keys


def value_keys(value: Any, depth: int = 0, *, indexing: bool = True) -> Iterator[str]:
    """The keys of any JSON value: strings as above, numbers canonically, containers leaf by leaf."""
    yield from _value_keys(value, indexing, None, depth)


def source_label(tool: str, call_id: str, *, untrusted: bool, derived: bool = False) -> str:
    """``untrusted:``, ``derived:`` or ``tool:`` + ``<tool>:<call_id>`` (see the module docstring)."""
    kind = "untrusted" if untrusted else "derived" if derived else "tool"
    return f"{kind}:{tool}:{call_id}"


def has_trusted_source(sources: Collection[str], endorsed: Collection[str] = ()) -> bool:
    """Whether ``sources`` name the user, a trusted tool or a source a human endorsed (policy's
    ``has_trusted_source``, for the router's own use)."""
    return any(s == USER or s.startswith("tool:") or s in endorsed for s in sources)


def is_untrusted_only(sources: Collection[str], endorsed: Collection[str] = ()) -> bool:
    """Whether ``sources`` name untrusted content and nothing trusted: not the user, no trusted
    tool, no source a human endorsed (policy's ``is_untrusted_only``, for the router's own use)."""
    return not has_trusted_source(sources, endorsed) and any(s.startswith("untrusted:") for s in sources)


def content_keys(items: Iterable[Any]) -> set[str]:
    """The keys content entering a session contributes, within the per-content bounds (see the
    module docstring: what is not read contributes nothing, so a cut fails toward refusal)."""
    budget = _Budget(MAX_INDEXED_CHARS, MAX_INDEXED_TOKENS)
    keys: set[str] = set()
    for item in items:
        keys.update(_value_keys(item, True, budget))
    if budget.cut:
        log.warning("provenance_index_cut", keys=len(keys), max_chars=MAX_INDEXED_CHARS, max_tokens=MAX_INDEXED_TOKENS)
    return keys


def argument_keys(args: dict[str, Any]) -> dict[str, set[str]]:
    """The keys each top-level argument of a call is looked up by (every one of them: see the
    module docstring for why arguments are never cut)."""
    return {name: set(_value_keys(value, False, None)) for name, value in args.items()}


def supplied_keys(args: dict[str, Any]) -> set[str]:
    """Every key the call's own arguments would give as content: its argument names and values,
    read by the very function that indexes content (`content_keys`), only never cut. A trusted
    tool's output that repeats any of them (an echo, a formatter) is no source for it: whatever
    content indexing can find in an output, it finds here first in what the call put in."""
    return set(_value_keys(args, True, None))


@dataclass(frozen=True, slots=True)
class CheckedValue:
    """One value policy checks by itself: a leaf of a destination, amount or sensitive argument
    (``key`` None: every key of the leaf counts), or one identifier in a content argument's text."""

    arg: str
    path: str
    key: str | None
    keys: frozenset[str]


# Identifiers in free text that say where it points or pays: e-mails, URLs, hosts, IBANs and
# account numbers. (Whole strings and bare numbers in a message body say nothing of the kind.)
_IDENTIFIER_PREFIXES = ("e:", "u:", "h:", "i:", "a:")


def checked_values(
    args: Mapping[str, Any], watched: Iterable[str], content: Iterable[str], amounts: Iterable[str] = ()
) -> list[CheckedValue]:
    """The values of ``args`` policy checks one by one: each leaf of every ``watched`` argument
    (a list of recipients is as many values, each needing its own trusted source), and each
    identifier in the text of every ``content`` argument. Arguments absent from ``args`` give none.
    A leaf of an ``amounts`` argument is also keyed as an amount of any size (``4.0``, ``"0.01"``),
    which the user's own words are indexed by (`trusted_context_keys`)."""
    found: list[CheckedValue] = []
    money = set(amounts)
    for arg in dict.fromkeys(watched):
        if arg in args:
            for path, leaf in _leaves(arg, args[arg]):
                keys = _identity_keys(leaf)
                if arg in money and (amount := _amount_key(leaf)):
                    keys.add(amount)
                found.append(CheckedValue(arg, path, None, frozenset(keys)))
                # Its `folded` form, if that reads as another identifier (a full-width IBAN), is a
                # value of its own: it too needs a trusted source, so folding can make a value
                # suspect, never make one trusted.
                if isinstance(leaf, str) and (plain := folded(_head(leaf))) is not None:
                    plain_keys = _identity_keys(plain)
                    if any(key.startswith(_IDENTIFIER_PREFIXES) and key not in keys for key in plain_keys):
                        found.append(CheckedValue(arg, path, None, frozenset(plain_keys)))
    for arg in dict.fromkeys(content):
        if arg in args:
            for path, leaf in _leaves(arg, args[arg]):
                if isinstance(leaf, str):
                    text_keys = _string_keys(leaf, True, None)
                    # Read as content is (a defanged or wide link is one the recipient re-arms).
                    for reading in _other_readings(leaf):
                        text_keys += _string_keys(reading, True, None)
                    for key in dict.fromkeys(text_keys):
                        if key.startswith(_IDENTIFIER_PREFIXES):
                            found.append(CheckedValue(arg, path, key, frozenset((key,))))
    return found


_MAX_PHRASE_WORDS = 4
_NAME = "m:"  # a name as the user may write it: case-folded, without a leading '#' or '@'


def _name(text: str) -> str:
    return " ".join(text.split()).casefold().lstrip("#@")


_PHRASE_EDGES = ".,;:!?\"'()[]{}<>\u201c\u201d\u2018\u2019\u00ab\u00bb"  # punctuation around a word, not part of a name
_AMOUNT = re.compile(r"(?<![\w.])-?\d{1,15}(?:\.\d{1,8})?(?![\w]|\.\d)", re.ASCII)


def _amount_key(value: Any) -> str | None:
    """An amount's key whatever its size (a JSON number, or a string holding only one), in the
    canonical form of number keys: ``4``, ``4.0`` and ``"4.00"`` match."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    text = (repr(value) if isinstance(value, float) else str(value)).strip()
    if not _AMOUNT.fullmatch(text):
        return None
    return "n:" + format(Decimal(text).normalize(), "f")


def trusted_context_keys(texts: Iterable[str]) -> set[str]:
    """The keys of what the user gave: as any content's, plus every amount in it whatever its
    size. Small numbers are too common to index in tool output, but in the user's own request
    "pay 4 EUR" is exactly what a payment of 4 must be traced to."""
    values = list(texts)
    keys = content_keys(values)
    phrases = 0
    for text in values:
        head = text[:MAX_INDEXED_CHARS]
        for token in _GROUPED.findall(head):
            if key := _amount_key(token.replace(",", "")):
                keys.add(key)
        # "2,500.50" is one amount, not also 2 and 500.50: grouped numbers are masked out first.
        for token in _AMOUNT.findall(_GROUPED.sub("\n", head)):
            if key := _amount_key(token):
                keys.add(key)
        # The names the user writes in a sentence ("post it in #general", "DM Bob", "book the
        # Hotel Adlon"): every run of one to four words, as a whole-string key, so an argument
        # that is exactly such a name traces to the user. Only the user's own words: in tool
        # output every phrase would be far too many keys, and too weak a sign.
        for line in text[:MAX_INDEXED_CHARS].splitlines():
            for phrase in _phrases(line.split()):
                keys.add("s:" + phrase)
                keys.add(_NAME + _name(phrase))
                phrases += 1
                if phrases >= MAX_INDEXED_TOKENS * _MAX_PHRASE_WORDS:
                    return keys
    return keys


def _phrases(words: list[str]) -> Iterator[str]:
    """Every run of one to `_MAX_PHRASE_WORDS` of ``words``, each without the punctuation around it."""
    stripped = [word for word in (w.strip(_PHRASE_EDGES) for w in words) if word]
    for start in range(len(stripped)):
        for end in range(start + 1, min(start + _MAX_PHRASE_WORDS, len(stripped)) + 1):
            yield " ".join(stripped[start:end])


def _identity_keys(leaf: Any) -> set[str]:
    """The keys that say what a destination-like value *is*: the whole string, and an identifier
    only if the whole value is exactly one (`_identifier`). A piece of a larger value proves
    nothing about it: a password ``Nw-Sec!2024`` is not the user's because the user wrote "2024",
    and ``https://evil.example/?d=x`https://news.example/`` is not the news site because it ends
    with its address. A value that names no place at all (``bob``, ``#general``) is also keyed
    as a name, the way the user may have written it."""
    if not isinstance(leaf, str):
        return set(_value_keys(leaf, False, None))
    keys = _string_keys(leaf, False, None)
    text = leaf.strip()
    kept = {key for key in keys if key.startswith("s:")}
    identity = _identifier(text, keys)
    kept.update(identity)
    if _AMOUNT.fullmatch(text) is not None:
        kept.update(key for key in keys if key.startswith("n:"))
    # Case-folded name matching is for names only: folded, an address or a host would match
    # another one (``straße.example`` is not ``strasse.example``).
    if not identity and text and len(text) <= _MAX_WHOLE and not _names_a_place(text, keys):
        kept.add(_NAME + _name(text))  # "bob" or "#general" is the "Bob" or "general" the user wrote
    return kept


_SCHEME = re.compile(r"https?://", re.IGNORECASE)
_HOST_SHAPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*+")  # and a '.': what `_host_key` may read


def _identifier(text: str, keys: list[str]) -> list[str]:
    """The keys of the one identifier ``text`` (stripped) is, whole: an address, a URL, a host, an
    IBAN or an account number, each parsed from the whole value once, hosts in their canonical
    form (`canonical_host`); none if ``text`` is not exactly one identifier (two URLs, a URL and
    text around it). ``keys``: ``text``'s argument keys, where IBANs and accounts are found."""
    if "@" in text and "://" not in text:
        local, _, domain = text.partition("@")
        if domain.isascii():  # its argument keys hold it already if it is one address, whole
            return ["e:" + text.lower()] if "e:" + text.lower() in keys else []
        host = canonical_host(domain)
        address = f"{local}@{host}"
        if host and "@" not in domain and _emails(address, None) == [address]:
            return ["e:" + address.lower()]
        return []
    if _SCHEME.match(text):
        if _URL.fullmatch(text) is None or len(_SCHEME.findall(text)) != 1:
            return []
        return [key for key in _url_keys(text) if key.startswith("u:")]
    compact = "".join(text.split()).upper()
    digits = text.replace(" ", "").replace("-", "")
    found = [key for key in keys if (key[:2] == "i:" and key[2:] == compact) or (key[:2] == "a:" and key[2:] == digits)]
    if found:
        return found
    host = canonical_host(text)
    if host and "." in host and _HOST_SHAPE.fullmatch(host) and _host_key(host, after_is_word=False) == "h:" + host:
        return ["h:" + host]
    return []


def _names_a_place(text: str, keys: list[str]) -> bool:
    """Whether ``text`` holds an identifier, or looks like an address or a link: not a name."""
    return "@" in text.lstrip("#@") or "://" in text or any(key.startswith(_IDENTIFIER_PREFIXES) for key in keys)


def _leaves(path: str, value: Any) -> Iterator[tuple[str, Any]]:
    """``(path, leaf)`` for each non-container value under ``value`` (``to[1]``, ``payee.iban``)
    and each key of a map in it (``to[key bob@x.example]``: a map keyed by addresses names them),
    walked without recursion; an empty container has none."""
    stack: list[tuple[str, Any, int]] = [(path, value, 0)]
    while stack:
        where, item, level = stack.pop()
        if isinstance(item, dict) and level <= MAX_DEPTH:
            children = [(f"{where}[key {k}]", k, level + 1) for k in item]
            children += [(f"{where}.{k}", v, level + 1) for k, v in item.items()]
            stack.extend(reversed(children))
        elif isinstance(item, list | tuple) and level <= MAX_DEPTH:
            stack.extend((f"{where}[{i}]", v, level + 1) for i, v in reversed(list(enumerate(item))))
        elif not isinstance(item, dict | list | tuple):
            yield where, item


OUTPUT_PATH = re.compile(r"\$(?:\.[A-Za-z0-9_-]+|\.\*|\[\*\]|\[\d+\])*")


def split_output(output: Any, untrusted_paths: Iterable[str]) -> tuple[list[Any], list[Any]]:
    """``output`` as (trusted parts, third-party parts): the values under any of
    ``untrusted_paths`` (``$.messages[*].body``; `OUTPUT_PATH` syntax: ``.name``, ``.*``,
    ``[*]``, ``[n]``), and the rest, leaf by leaf (a dict's keys go with its part)."""
    patterns = [_path_pattern(path) for path in untrusted_paths]
    trusted: list[Any] = []
    untrusted: list[Any] = []
    stack: list[tuple[str, Any, int]] = [("$", output, 0)]
    while stack:
        where, item, level = stack.pop()
        if any(p.fullmatch(where) for p in patterns):
            untrusted.append(item)
        elif isinstance(item, dict) and level <= MAX_DEPTH:
            trusted.extend(k for k in item if isinstance(k, str))
            stack.extend((f"{where}.{k}", v, level + 1) for k, v in item.items())
        elif isinstance(item, list | tuple) and level <= MAX_DEPTH:
            stack.extend((f"{where}[{i}]", v, level + 1) for i, v in enumerate(item))
        elif not isinstance(item, dict | list | tuple):
            trusted.append(item)
        else:  # nested past MAX_DEPTH: what cannot be placed is third-party
            untrusted.append(item)
    return trusted, untrusted


def _path_pattern(path: str) -> re.Pattern[str]:
    parts = re.findall(r"\.\*|\[\*\]|\.[A-Za-z0-9_-]+|\[\d+\]|\$", path)
    regex = "".join(
        r"\.[^.\[]+" if part == ".*" else r"\[\d+\]" if part == "[*]" else re.escape(part) for part in parts
    )
    return re.compile(regex)


def _is_small(values: Iterable[Any]) -> bool:
    """Whether ``values`` hold fewer than `INLINE_CHARS` characters and nodes (walked no further)."""
    left = INLINE_CHARS
    stack = list(values)
    while stack:
        item = stack.pop()
        left -= len(item) if isinstance(item, str) else 1
        if left < 0:
            return False
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return True


async def content_keys_async(items: Iterable[Any]) -> set[str]:
    """`content_keys`, in a worker thread when the content is large, so the event loop keeps
    serving other calls while it is indexed."""
    values = list(items)
    if _is_small(values):
        return content_keys(values)
    return await asyncio.to_thread(content_keys, values)


async def argument_keys_async(args: dict[str, Any]) -> dict[str, set[str]]:
    """`argument_keys`, in a worker thread when the arguments are large."""
    if _is_small(args.values()):
        return argument_keys(args)
    return await asyncio.to_thread(argument_keys, args)


def call_keys(
    args: dict[str, Any], watched: list[str], content: list[str], amounts: list[str]
) -> tuple[dict[str, set[str]], list[CheckedValue]]:
    """`argument_keys` and `checked_values` of one call, in one pass of the caller's thread."""
    return argument_keys(args), checked_values(args, watched, content, amounts)


async def call_keys_async(
    args: dict[str, Any], watched: list[str], content: list[str], amounts: list[str]
) -> tuple[dict[str, set[str]], list[CheckedValue]]:
    """`call_keys`, in a worker thread when the arguments are large."""
    if _is_small(args.values()):
        return call_keys(args, watched, content, amounts)
    return await asyncio.to_thread(call_keys, args, watched, content, amounts)


async def supplied_keys_async(args: dict[str, Any]) -> set[str]:
    """`supplied_keys`, in a worker thread when the arguments are large."""
    if _is_small(args.values()):
        return supplied_keys(args)
    return await asyncio.to_thread(supplied_keys, args)


async def trusted_context_keys_async(texts: list[str]) -> set[str]:
    """`trusted_context_keys`, in a worker thread when the context is large."""
    if _is_small(texts):
        return trusted_context_keys(texts)
    return await asyncio.to_thread(trusted_context_keys, texts)


class ProvenanceIndex:
    """One session's index from value keys to the sources they were seen in, in this process
    (`MemoryStore` keeps one per session; `RedisStore` keeps the same map in a Redis hash)."""

    __slots__ = ("_keys",)

    def __init__(self) -> None:
        self._keys: dict[str, list[str]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def add_keys(self, source: str, keys: Iterable[str]) -> None:
        for key in keys:
            sources = self._keys.setdefault(key, [])
            if source not in sources and len(sources) < MAX_SOURCES:
                sources.append(source)

    def lookup_keys(self, keys_by_arg: Mapping[str, Iterable[str]]) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for name, keys in keys_by_arg.items():
            sources: set[str] = set()
            for key in keys:
                sources.update(self._keys.get(key, ()))
            if sources:
                found[name] = sorted(sources)
        return found

    def add(self, source: str, content: Any) -> None:
        """Index ``content`` (any JSON value, or text) as seen from ``source``."""
        self.add_keys(source, content_keys([content]))

    def lookup(self, args: dict[str, Any]) -> dict[str, list[str]]:
        """For each top-level argument, every source any of its keys was seen in (sorted)."""
        return self.lookup_keys(argument_keys(args))
