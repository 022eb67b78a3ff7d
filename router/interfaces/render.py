"""Tables for people: how audit events and approvals look in a terminal.

What an approver is shown of an approval (the agent's arguments, names and reasons) goes through
`revealed` first: a bidi override, a zero-width space or a Cyrillic letter in a Latin word could
otherwise make the approver read another amount or address than the one they approve.
"""

from __future__ import annotations

import json
import unicodedata
from collections import Counter
from datetime import UTC, datetime

from rich.table import Table
from rich.text import Text

from router.approvals import SELECTORS, Approval, invisible
from router.audit import AuditEvent
from router.text import json_escape

# Format characters (bidi overrides and isolates, zero-width spaces and joiners), line and
# paragraph separators, private-use, lone surrogates and unassigned code points: none shows as
# itself, and each can hide, reorder or fake text around it. Whitespace but the ASCII space, tab
# and newline is escaped too (a no-break or ideographic space reads as a plain one), and so is
# every other character that shows as nothing (`router.approvals.invisible`: the combining
# grapheme joiner, Hangul and Mongolian fillers), but for variation selectors.
_HIDDEN = frozenset({"Cf", "Zl", "Zp", "Co", "Cs", "Cn"})
_PLAIN_WHITESPACE = frozenset(" \t\n")
# Scripts written together in one word in ordinary text (Japanese, Chinese, Korean, with Latin):
# a word mixing only these is not flagged (as Unicode's "highly restrictive" profile, UTS #39).
_EAST_ASIAN = frozenset({"LATIN", "CJK", "HIRAGANA", "KATAKANA", "KATAKANA-HIRAGANA", "BOPOMOFO", "HANGUL",
                         "IDEOGRAPHIC"})  # fmt: skip
_MAX_NOTES = 8


def _hidden(char: str) -> bool:
    if char in _PLAIN_WHITESPACE:
        return False
    return char.isspace() or unicodedata.category(char) in _HIDDEN or (invisible(char) and not _selector(char))


def _selector(char: str) -> bool:
    # Shown: escaped, they would break ordinary text (emoji, CJK names). `identity` still ignores them.
    return ord(char) in SELECTORS


def _script(char: str) -> str | None:
    """The script of a letter or non-ASCII digit, as the first word of its Unicode name
    (``LATIN``, ``CYRILLIC``, ``GREEK``...); a compatibility form (fullwidth, mathematical) has the
    script of what it stands for. None for anything else (ASCII digits, marks, punctuation)."""
    category = unicodedata.category(char)
    if not (category[0] == "L" or (category == "Nd" and not char.isascii())):
        return None
    folded = unicodedata.normalize("NFKC", char)
    if folded != char and folded and folded[0] != char:
        return _script(folded[0]) or "COMMON"
    name = unicodedata.name(char, "")
    return name.split(" ", 1)[0] if name else None


def _code_point(char: str) -> str:
    return f"U+{ord(char):04X} {unicodedata.name(char, 'unnamed')}"


def _token_marks(token: str) -> tuple[set[int], list[str]]:
    """Which letters of one token (a run of text between spaces and quotes: a word, an address, a
    URL) to escape, and why: a compatibility form (it reads as a plain letter or digit), or a
    letter outside the token's main script when the token mixes scripts (an address whose domain
    is spelled in Cyrillic letters that look Latin)."""
    flagged: set[int] = set()
    notes: list[str] = []
    for i, char in enumerate(token):
        folded = unicodedata.normalize("NFKC", char)
        if folded != char and unicodedata.category(char)[0] in "LN":
            flagged.add(i)
            notes.append(f"look-alike: {_code_point(char)} reads as {folded!r}")
    scripts = Counter(s for s in map(_script, token) if s is not None)
    if len(scripts) > 1 and not set(scripts) <= _EAST_ASIAN:
        main = sorted(scripts, key=lambda s: (-scripts[s], s != "LATIN"))[0]  # the most letters; Latin on a tie
        odd = [(i, c) for i, c in enumerate(token) if (_script(c) or main) != main and i not in flagged]
        flagged.update(i for i, _ in odd)
        notes.extend(f"mixed scripts: {_code_point(c)} among {main} letters" for _, c in odd)
    return flagged, notes


def revealed(text: str) -> tuple[str, list[str]]:
    """``text`` as an approver must see it, and notes on what in it poses as something else.

    Every hidden character (see `_HIDDEN`; whitespace but space, tab and newline) is written as a
    ``\\uXXXX`` escape, and so is every letter that poses as another: a compatibility form (a
    fullwidth or mathematical letter) and, in a token mixing scripts (``bob@\\u0435xample.com``,
    a Cyrillic ``e``), each letter outside the token's main script. Each such letter gets a note
    naming its code point. Controls are left to `SafeConsole`, which shows them as pictures.
    """
    shown: list[str] = []
    notes: list[str] = []
    token: list[str] = []

    def end_token() -> None:
        flagged, found = _token_marks("".join(token)) if not all(c.isascii() for c in token) else (set(), [])
        shown.extend(json_escape(c) if i in flagged or _hidden(c) else c for i, c in enumerate(token))
        notes.extend(n for n in found if n not in notes)
        token.clear()

    for char in text:
        if char == '"' or char.isspace():
            end_token()
            shown.append(json_escape(char) if _hidden(char) else char)
        else:
            token.append(char)
    end_token()
    if len(notes) > _MAX_NOTES:
        notes[_MAX_NOTES:] = [f"and {len(notes) - _MAX_NOTES} more"]
    return "".join(shown), notes


def _revealed_text(text: str, limit: int | None = None) -> Text:
    """``text`` `revealed`, cut to ``limit`` characters, with its notes after it in bold red."""
    shown, notes = revealed(text)
    cell = Text(shown if limit is None else shown[:limit])
    if notes:
        cell.append("\n" + "\n".join(f"(!) {note}" for note in notes), style="bold red")
    return cell


def audit_table(events: list[AuditEvent]) -> Table:
    """The audit events as a table, one row per event."""
    table = Table(show_lines=False, pad_edge=False)
    for column in ("seq", "time", "kind", "tool", "outcome", "decision"):
        table.add_column(column, no_wrap=True)
    table.add_column("reasons / detail", overflow="fold", min_width=24)
    for e in events:
        result = e.result or {}
        detail = (
            ", ".join(r["code"] for r in result.get("reasons", [])) or result.get("code") or result.get("detail", "")
        )
        table.add_row(
            str(e.seq),
            e.timestamp[11:19],
            e.kind,
            (e.tool or "")[:16],
            e.outcome,
            e.decision_id[:8],
            str(detail)[:80],
        )
    return table


def _when(epoch: float | None) -> str:
    return "" if epoch is None else datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def approvals_table(approvals: list[Approval]) -> Table:
    """Approvals, one row each. Agent-supplied text is shown as text, never as markup, and
    `revealed` (what hides or poses as other text is escaped, and noted)."""
    table = Table(show_lines=False, pad_edge=False)
    for column in ("id", "status", "tool", "agent", "expires", "decided by"):
        table.add_column(column, no_wrap=True)
    table.add_column("reasons", overflow="fold", min_width=20)
    for a in approvals:
        table.add_row(
            Text(a.id), Text(a.status.value), _revealed_text(a.tool, 24), _revealed_text(a.agent, 24),
            _when(a.expires_at), _revealed_text(a.approver or ""),
            _revealed_text(", ".join(r["code"] for r in a.reasons)),
        )  # fmt: skip
    return table


def approval_panel(approval: Approval) -> Table:
    """One approval in full: what exactly would run, for whom, why it was held. Every value is
    `revealed`: what hides or poses as other text is escaped, with a note under the value."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    rows = [
        ("approval", approval.id), ("status", approval.status.value), ("tool", approval.tool),
        ("arguments", json.dumps(json.loads(approval.args), indent=2, ensure_ascii=False)),
        ("input files", "\n".join(f"/in/{i['name']}  {i['size']} bytes  sha256 {i['sha256']}"
                                   for i in approval.inputs)),
        ("agent", approval.agent), ("principal", approval.principal), ("session", approval.session_id),
        ("reasons", "\n".join(f"{r['code']}: {r.get('message', '')}" for r in approval.reasons)),
        ("requested", _when(approval.created_at)), ("expires", _when(approval.expires_at)),
        ("decided by", approval.approver or ""), ("decided", _when(approval.decided_at)), ("note", approval.note),
        ("decision id", approval.decision_id), ("binding", approval.binding),
    ]  # fmt: skip
    for name, value in rows:
        if value:
            table.add_row(name, _revealed_text(value))
    return table
