"""What a human approver sees of a held call in `stockade approvals`: nothing hidden, nothing posing
as other text (router.interfaces.render, through the real CLI and a router's local socket)."""

from __future__ import annotations

import asyncio
import json
import unicodedata
from pathlib import Path

from router import ControlPlane, Settings
from router.interfaces.local import approval_socket
from router.settings import AuditSettings
from tests.conftest import ECHO, python_tool
from tests.router.test_cli import run

WIRE = python_tool("wire_money", ECHO, risk="critical", capabilities=["mutates_state"])
HIDDEN = {"Cf", "Zl", "Zp", "Co", "Cs", "Cn"}


async def test_the_approval_screen_shows_hidden_characters_and_mixed_scripts(tmp_path: Path) -> None:
    """A right-to-left override turns ``refund 0005 RUE`` into what reads as ``EUR 5000``, a
    zero-width space hides in a word, and a Cyrillic ``\\u0435`` makes another domain look like
    ``example.com``: the approver sees each as an escape, with a note naming the letter."""
    audit = tmp_path / "audit.jsonl"
    env = {"STOCKADE_AUDIT__PATH": str(audit), "COLUMNS": "160"}
    args = {"memo": "refund \u202e0005 RUE\u202c ok\u200b", "to": "bob@\u0435xample.com", "note": "a\u2028b\u00a0c"}
    async with (
        ControlPlane.from_settings(Settings(audit=AuditSettings(path=audit))) as plane,
        approval_socket(plane) as path,
    ):
        assert path is not None
        await plane.register(WIRE)
        session = await plane.open_session("cl\u0430ude", "alice@example.com")  # Cyrillic a (U+0430)
        held = await plane.call(session, "wire_money", args)
        assert held.approval_id is not None

        shown = await asyncio.to_thread(run, "approvals", "show", held.approval_id, env=env)
        assert shown.returncode == 0, shown.stderr
        for expected in (
            '"memo": "refund \\u202e0005 RUE\\u202c ok\\u200b"',
            '"to": "bob@\\u0435xample.com"',
            '"note": "a\\u2028b\\u00a0c"',
            "mixed scripts: U+0435 CYRILLIC SMALL LETTER IE among LATIN letters",
            "cl\\u0430ude",
            "mixed scripts: U+0430 CYRILLIC SMALL LETTER A among LATIN letters",
        ):
            assert expected in shown.stdout, (expected, shown.stdout)
        assert not [c for c in shown.stdout if unicodedata.category(c) in HIDDEN or c in "\u0435\u0430\u00a0"]

        listed = await asyncio.to_thread(run, "approvals", "list", env=env)
        assert listed.returncode == 0, listed.stderr
        assert "cl\\u0430ude" in listed.stdout
        assert "mixed scripts: U+0430" in listed.stdout

        as_json = await asyncio.to_thread(run, "approvals", "show", held.approval_id, "--json", env=env)
        assert json.loads(json.loads(as_json.stdout)["args"]) == args  # scripts get the exact arguments


async def test_ordinary_text_in_other_scripts_is_shown_as_it_is(tmp_path: Path) -> None:
    """Words in one script (Greek, Cyrillic, Japanese with Latin) are nobody's disguise: shown
    as written, with no note to teach approvers to ignore notes."""
    audit = tmp_path / "audit.jsonl"
    env = {"STOCKADE_AUDIT__PATH": str(audit), "COLUMNS": "160"}
    memo = "Ελλάδα Москва 東京タワーTokyo café, naïve 50 €"
    async with (
        ControlPlane.from_settings(Settings(audit=AuditSettings(path=audit))) as plane,
        approval_socket(plane) as path,
    ):
        assert path is not None
        await plane.register(WIRE)
        session = await plane.open_session("claude", "alice@example.com")
        held = await plane.call(session, "wire_money", {"memo": memo})
        assert held.approval_id is not None
        shown = await asyncio.to_thread(run, "approvals", "show", held.approval_id, env=env)
    assert shown.returncode == 0, shown.stderr
    assert memo in shown.stdout
    assert "(!)" not in shown.stdout
