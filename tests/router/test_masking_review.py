"""A masked argument a call was refused for stays out of the audit log and the operational log:
a schema error about the arguments as a whole (which quotes them all), one about an argument whose
name holds a ``.`` or a ``[``, and the log line of the rejection."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from router import ControlPlane, InvalidCall
from router.logging import configure_logging
from router.settings import AuditSettings, MaskRule, Settings

PIN, DOTTED, BRACKETED, CARD = "PIN-9137", "DOT-5521", "BRK-6602", "CARD-4417"


def masked_settings(tmp_path: Path, *paths: str) -> Settings:
    return Settings(audit=AuditSettings(
        path=tmp_path / "log" / "audit.jsonl", signing_key=tmp_path / "keys" / "audit.key",
        mask=[MaskRule(path=path) for path in paths],
    ))  # fmt: skip


def tool(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "description": name, "risk": "low", "capabilities": [],
            "input_schema": {"type": "object", **schema}, "executor": {"kind": "external"}}  # fmt: skip


def refusals(tmp_path: Path) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in (tmp_path / "log" / "audit.jsonl").read_text().splitlines()]
    return [e for e in events if e["kind"] == "error" and e["outcome"] == "invalid"]


ROOT_SCHEMAS = {
    "any_of": {"anyOf": [{"required": ["x"]}, {"properties": {"pin": {"const": "0000"}}}]},
    "one_of": {"oneOf": [{"required": ["x"]}, {"required": ["y"]}]},
    "not": {"not": {"required": ["pin"]}},
    "max_properties": {"maxProperties": 1},
    "enum": {"enum": [{"x": 1}, {"y": 2}]},
}


@pytest.mark.parametrize("keyword", sorted(ROOT_SCHEMAS))
async def test_a_schema_error_about_all_the_arguments_leaves_a_masked_one_out_of_the_log(
    tmp_path: Path, keyword: str
) -> None:
    """jsonschema quotes the whole arguments when a keyword at the schema's root refuses them
    (``{'pin': ...} is not valid under any of the given schemas``): with any argument masked, what
    that problem says is erased, in the problem and in the message, and the caller is still told."""
    async with ControlPlane.from_settings(masked_settings(tmp_path, "/input/args/pin")) as plane:
        await plane.register(tool("pay", ROOT_SCHEMAS[keyword]))
        session = await plane.open_session("bot", "alice@example.com")
        with pytest.raises(InvalidCall, match=PIN):  # the caller sees its own value
            await plane.call(session, "pay", {"pin": PIN, "z": 1})

    assert PIN not in (tmp_path / "log" / "audit.jsonl").read_text()
    [refused] = refusals(tmp_path)
    assert refused["result"]["problems"] == [{"field": "args", "path": [], "problem": "[masked]"}]
    assert refused["result"]["message"] == "invalid arguments for tool 'pay': args: [masked]"
    assert {"/result/problems/0/problem", "/result/message"} <= set(refused["labels"]["masked"].split(","))


async def test_a_masked_argument_named_with_a_dot_or_a_bracket_is_masked_in_its_schema_error(tmp_path: Path) -> None:
    """The field ``args.a.b`` does not say whether it is the argument ``a.b`` or ``b`` inside
    ``a``: the problem's path does, and a rule erases exactly what is said of the argument it
    names, however its name is spelled; a problem about an unmasked argument is kept."""
    settings = masked_settings(tmp_path, "/input/args/a.b", "/input/args/c[0]", "/input/args/card/number")
    schema = {"properties": {
        "a.b": {"type": "string", "pattern": "^[0-9]{4}$"}, "c[0]": {"type": "string", "pattern": "^[0-9]{4}$"},
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "card": {"type": "object", "properties": {"number": {"type": "string", "pattern": "^[0-9]+$"}}},
        "count": {"type": "integer"},
    }}  # fmt: skip
    async with ControlPlane.from_settings(settings) as plane:
        await plane.register(tool("pay", schema))
        session = await plane.open_session("bot", "alice@example.com")
        args = {"a.b": DOTTED, "c[0]": BRACKETED, "a": {"b": "KEEP-1"}, "card": {"number": CARD}, "count": "KEEP-2"}
        with pytest.raises(InvalidCall):
            await plane.call(session, "pay", args)

    text = (tmp_path / "log" / "audit.jsonl").read_text()
    assert [value for value in (DOTTED, BRACKETED, CARD) if value in text] == []
    [refused] = refusals(tmp_path)
    said = {(p["field"], tuple(p["path"])): p["problem"] for p in refused["result"]["problems"]}
    assert said == {
        ("args.a.b", ("a", "b")): "'KEEP-1' is not of type 'integer'",  # "b" in the argument "a": not masked
        ("args.a.b", ("a.b",)): "[masked]",
        ("args.c[0]", ("c[0]",)): "[masked]",
        ("args.card.number", ("card", "number")): "[masked]",
        ("args.count", ("count",)): "'KEEP-2' is not of type 'integer'",
    }
    assert "KEEP-1" in refused["result"]["message"]
    assert "KEEP-2" in refused["result"]["message"]


@pytest.mark.parametrize("rule", ["/input/args", "/input/*", "/input/*/pin"])
async def test_a_rule_over_all_the_arguments_or_through_a_wildcard_masks_their_schema_errors(
    tmp_path: Path, rule: str
) -> None:
    """A rule on the arguments as a whole, or reaching one through a ``*`` step, masks them in the
    event: what a schema error says of them is erased as well."""
    schema = {"properties": {"pin": {"type": "string", "pattern": "^[0-9]{4}$"}}, "maxProperties": 1}
    async with ControlPlane.from_settings(masked_settings(tmp_path, rule)) as plane:
        await plane.register(tool("pay", schema))
        session = await plane.open_session("bot", "alice@example.com")
        with pytest.raises(InvalidCall):
            await plane.call(session, "pay", {"pin": PIN, "z": 1})

    assert PIN not in (tmp_path / "log" / "audit.jsonl").read_text()
    [refused] = refusals(tmp_path)
    assert [p["problem"] for p in refused["result"]["problems"]] == ["[masked]", "[masked]"]


async def test_a_problem_the_router_words_itself_is_kept_under_a_mask(tmp_path: Path) -> None:
    """A problem without a path quotes no value (``not valid JSON``): a mask leaves it, and the
    message, as they were."""
    async with ControlPlane.from_settings(masked_settings(tmp_path, "/input/args/pin")) as plane:
        await plane.register(tool("pay", {}))
        session = await plane.open_session("bot", "alice@example.com")
        with pytest.raises(InvalidCall) as raised:
            await plane.call(session, "pay", "{not json")

    [refused] = refusals(tmp_path)
    assert refused["result"]["problems"] == [{"field": "args", "problem": "not valid JSON"}]
    assert refused["result"]["message"] == str(raised.value)


@pytest.fixture
def info_logs() -> Iterator[io.StringIO]:
    """The process's logs at info and above, as JSON lines; structlog's configuration restored after."""
    saved = structlog.get_config()
    logs = io.StringIO()
    configure_logging("json", "info", file=logs, cache=False)
    yield logs
    structlog.configure(**saved)


async def test_a_rejected_call_is_logged_by_its_code_and_fields_never_by_its_values(
    tmp_path: Path, info_logs: io.StringIO
) -> None:
    """The operational log is out of the audit masks' reach, so it is told only what a span is:
    the error's code and the fields that were wrong, never the message quoting the values."""
    schema = {"properties": {"pin": {"type": "string", "pattern": "^[0-9]{4}$"}}}
    async with ControlPlane.from_settings(masked_settings(tmp_path, "/input/args/pin")) as plane:
        await plane.register(tool("pay", schema))
        session = await plane.open_session("bot", "alice@example.com")
        with pytest.raises(InvalidCall, match=PIN):
            await plane.call(session, "pay", {"pin": PIN})

    assert PIN not in info_logs.getvalue()
    entries = [json.loads(line) for line in info_logs.getvalue().splitlines()]
    [rejected] = [entry for entry in entries if entry["event"] == "tool_call_rejected"]
    assert (rejected["code"], rejected["fields"]) == ("call.invalid", ["args.pin"])
