"""The auditor's queries: a real log (written through `JsonlAuditLog.append`, sealed into daily and
size-bound segments), indexed into Parquet by the real indexer, asked through the engine, the CLI
and a real `stockade serve`; every answer checked against a plain scan of the log's lines."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.audit import AuditEvent, JsonlAuditLog, line_hash
from router.audit import index as audit_index
from router.audit import jsonl as audit_jsonl
from router.audit.chain import canonical
from router.audit.checkpoint import SigningKey
from router.audit.factory import BackgroundIndexer, log_options
from router.audit.index import (
    COLUMNS,
    AuditQuery,
    EventFilter,
    index_dir_of,
    index_log,
    index_sealed,
    matches,
    promote,
    snapshot_active,
)
from router.audit.jsonl import LogOptions
from router.audit.layout import LogLayout, lines
from router.audit.redis import RedisAuditLog
from router.errors import AuditError
from router.settings import AuditSettings, Settings
from tests.conftest import stockade_server
from tests.router.test_api import auth, principals

SEGMENT_BYTES = 48_000
START = datetime(2026, 3, 1, 21, 0, tzinfo=UTC)
HOSTILE = [
    "o'brien", 'say "hi"', "'; DROP TABLE events; --", "nul\x00byte", "lone \udc80 surrogate", "ünïcødé ✓",
    "back\\slash", "%_like*", "a=b=c", "x" * 4096,
]  # fmt: skip
BIG = "B" * (1 << 20)  # a 1 MiB argument, in one event
# Argument ``v`` of each call in turn: JSON values whose text DuckDB writes otherwise than Python
# (exponents, -0.0, integers beyond 64 bits, floats in objects), null, and strings that look like them.
ARG_VALUES: list[Any] = [
    1e16, 10**16, 1e-07, 1.5e300, -0.0, 0.0, 0, 2**64 + 1, 10**30, 9007199254740993, 123456789.123456789, -1,
    None, True, False, {"b": [1e16, "ü"], "a": None, "c": {"d": -0.0}}, [1, 2.5, {"x": "y/z"}], [], {},
    "1e+16", "null", "true", '{"a":null}', "",
]  # fmt: skip
# What an auditor may type for them: other spellings of the same numbers, keys in another order, not JSON.
ARG_SPELLINGS = [
    "1e+16", "1e16", "1E16", "10000000000000000", "10000000000000000.0", "1e-07", "1e-7", "1.0E-7", "1.5e+300",
    "1.5e300", "-0.0", "-0", "0", "0.0", "18446744073709551617", "1.8446744073709552e19", "1e+30", "1e30",
    "1000000000000000000000000000000", "9007199254740993", "9007199254740992", "123456789.12345679", "-1", "-1.0",
    "null", " null", "true", "false", '{"a":null,"b":[1e+16,"ü"],"c":{"d":-0.0}}',
    '{"c": {"d": -0.0}, "b": [10000000000000000.0, "\\u00fc"], "a": null}', '[1,2.5,{"x":"y/z"}]', "[]", "{}",
    '"1e+16"', '{"a":null}', "", "NaN", "Infinity", "1e400", "[1,",
]  # fmt: skip
AGENTS = ["agent-a", "agent-b", "agent-'c", "agent-d"]
PRINCIPALS = ["alice@example.com", "o'brien@example.com", "bob@example.com"]
APPROVERS = ["oncall@example.com", "o'brien", "sec-lead"]


# -- a realistic log -------------------------------------------------------------------------


def _ts(at: datetime) -> str:
    return at.isoformat(timespec="microseconds").replace("+00:00", "Z")


class Calls:
    """Tool calls as the control plane records them (decision, approval, credential, egress,
    execution, error), over several days, with hostile text in arguments and names."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)  # noqa: S311  (seeded: the same log every run)
        self.at = START
        self.calls = 0

    def _id(self) -> str:
        return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))

    def session(self, calls: int, *, big: bool = False) -> list[AuditEvent]:  # noqa: PLR0915  (a call's events in order)
        rng = self.rng
        agent, principal = rng.choice(AGENTS), rng.choice(PRINCIPALS)
        session_id = "s-" + rng.randbytes(6).hex()
        taint: list[str] = []
        found: list[AuditEvent] = []
        for n in range(calls):
            tool = rng.choice(["read_web", "send_email", "pay", "github", "word_count"])
            decision_id, call_id = self._id(), "c-" + rng.randbytes(6).hex()
            args: dict[str, Any] = {"to": rng.choice(["bob@example.com", *HOSTILE[:4]]), "n": rng.randint(0, 3),
                                    "text": rng.choice(HOSTILE)}  # fmt: skip
            if big and n == 0:
                args["text"] = BIG
            args["v"] = ARG_VALUES[self.calls % len(ARG_VALUES)]  # not drawn: the log is the same otherwise
            self.calls += 1
            credentials = [{"name": "bank", "scopes": ["pay"], "ttl_s": 60}] if tool == "pay" else (
                [{"name": "gh'token", "scopes": ["read"], "ttl_s": 30}] if tool == "github" else [])  # fmt: skip
            outcome, reasons = "allow", []
            if tool == "pay":
                outcome, reasons = "require_approval", [{"code": "approval.high_risk", "message": "risk is critical"}]
            elif tool == "send_email" and taint:
                outcome, reasons = "deny", [{"code": "provenance.untrusted_destination", "message": "from the web"}]
            elif rng.random() < 0.1:
                outcome, reasons = "deny", [{"code": rng.choice(["rate.exceeded", "tool.denied'x"]), "message": "no"}]
            base = {"session_id": session_id, "agent": agent, "tool": tool, "decision_id": decision_id,
                    "labels": {"instance": rng.choice(["r1", "r2"]), "version": "0.1.0"}}  # fmt: skip
            policy_input = {
                "subject": {"agent": agent, "principal": principal, "labels": {}},
                "session": {"id": session_id, "taint": list(taint), "call_count": n + 1, "trusted_context": []},
                "tool": {"name": tool, "capabilities": [], "risk": "low"}, "args": args, "provenance": {},
                "approval": None, "now": "x",
            }  # fmt: skip
            result = {"outcome": outcome, "reasons": reasons, "mode": "call",
                      "obligations": {"credentials": credentials, "egress": []}}  # fmt: skip
            decision = {**base, "kind": "decision", "call_id": call_id, "outcome": outcome, "input": policy_input,
                        "result": result, "bundles": {"policies": {"revision": "rev-" + str(n % 2)}},
                        "metrics": {"timer_policy_eval_ns": 1000.0}}  # fmt: skip
            events = [decision]
            runs = outcome == "allow"
            if outcome == "require_approval":
                approver = rng.choice(APPROVERS)
                approval_id = "a-" + rng.randbytes(5).hex()
                created = self.at.timestamp()
                record = {"id": approval_id, "decision_id": decision_id, "session_id": session_id, "agent": agent,
                          "principal": principal, "tool": tool, "approver": None, "status": "pending",
                          "reasons": reasons, "created_at": created, "decided_at": None, "note": ""}  # fmt: skip
                granted = rng.random() < 0.7
                events.append({**base, "kind": "approval", "outcome": "requested", "result": record})
                decided = {**record, "approver": approver, "status": "approved" if granted else "denied",
                           "decided_at": created + 30.5, "note": rng.choice(HOSTILE)}  # fmt: skip
                events.append({**base, "kind": "approval", "outcome": "approved" if granted else "denied",
                               "result": decided})  # fmt: skip
                if granted:
                    again = {
                        **policy_input,
                        "approval": {
                            "id": approval_id,
                            "approver": approver,
                            "status": "approved",
                            "reasons": ["approval.high_risk"],
                        },
                    }
                    events.append({**decision, "outcome": "allow", "input": again,
                                   "result": {**result, "outcome": "allow", "reasons": []}})  # fmt: skip
                    events.append(
                        {**base, "kind": "approval", "outcome": "redeemed", "result": {**decided, "status": "used"}}
                    )
                    runs = True
            if runs:
                leases = []
                for credential in credentials:
                    lease = "l-" + rng.randbytes(6).hex()
                    leases.append(lease)
                    events.append(
                        {
                            **base,
                            "kind": "credential",
                            "call_id": call_id,
                            "outcome": "minted",
                            "result": {
                                "lease_id": lease,
                                "name": credential["name"],
                                "scopes": credential["scopes"],
                                "ttl_s": 60,
                                "kind": "token",
                                "hosts": ["api.bank.test"],
                                "issued_at": 1.0,
                                "expires_at": 61.0,
                            },
                        }
                    )
                if tool in ("github", "read_web"):
                    allowed = rng.random() < 0.8
                    host = "api.github.com" if tool == "github" else rng.choice(["www.example.org", "evil'.test"])
                    events.append(
                        {
                            **base,
                            "kind": "egress",
                            "call_id": call_id,
                            "outcome": "allow" if allowed else "deny",
                            "result": {
                                "method": "GET",
                                "host": host,
                                "port": 443,
                                "allowed": allowed,
                                "status": 200,
                                "injected": [c["name"] for c in credentials],
                            },
                        }
                    )
                verdict = rng.choice(["ok", "ok", "ok", "timeout"])
                events.append({**base, "kind": "execution", "call_id": call_id, "outcome": verdict,
                               "result": {"verdict": verdict, "exit_code": 0, "stdout": rng.choice(HOSTILE),
                                          "credentials": leases}})  # fmt: skip
                events += [
                    {
                        **base,
                        "kind": "credential",
                        "call_id": call_id,
                        "outcome": "revoked",
                        "result": {"lease_id": lease, "name": c["name"]},
                    }
                    for lease, c in zip(leases, credentials, strict=True)
                ]
                if tool == "read_web" and "untrusted_content" not in taint:
                    taint.append("untrusted_content")
            if rng.random() < 0.05:
                events.append(
                    {
                        "kind": "error",
                        "decision_id": self._id(),
                        "session_id": session_id,
                        "agent": agent,
                        "tool": tool,
                        "outcome": "invalid",
                        "result": {"code": "call.invalid", "message": rng.choice(HOSTILE)},
                    }
                )
            for event in events:
                event["timestamp"] = _ts(self.at)
                self.at += timedelta(seconds=rng.uniform(60, 900))
                found.append(AuditEvent.model_validate(event))
        return found


def options(key: Path) -> LogOptions:
    return LogOptions(signer=SigningKey.load_or_create(key), segment_max_bytes=SEGMENT_BYTES, rotate_daily=True,
                      checkpoint_interval_s=3600)  # fmt: skip


async def append(path: Path, key: Path, events: list[AuditEvent]) -> None:
    log = JsonlAuditLog(path, durability="relaxed", options=options(key))
    for event in events:
        await log.append(event)
    await log.aclose()


@dataclass(frozen=True)
class Log:
    path: Path
    key: Path


@pytest.fixture(scope="module")
def audit_log(tmp_path_factory: pytest.TempPathFactory) -> Log:
    """Sealed segments over four days, all indexed; then a sealed segment not indexed yet and an
    active segment with no snapshot: every part the engine reads."""
    root = tmp_path_factory.mktemp("log")
    path, key = root / "audit.jsonl", root / "keys" / "audit.key"
    calls = Calls(seed=11)
    first = [e for i in range(70) for e in calls.session(random.Random(i).randint(1, 6), big=i == 3)]  # noqa: S311  (seeded)
    asyncio.run(append(path, key, first))
    report = index_sealed(LogLayout(path), snapshot=False)
    assert report.indexed
    assert not report.problems
    later = [e for i in range(12) for e in calls.session(5)]
    asyncio.run(append(path, key, later))
    return Log(path, key)


def documents(path: Path) -> list[dict[str, Any]]:
    """Every event in the log, from its lines (the reference every query is checked against)."""
    found = []
    for part in LogLayout(path).parts():
        if part.kind == "tombstone":
            continue
        for _, line in lines(part.path):
            document = json.loads(line)
            document["hash"] = line_hash(line).hex()
            document["_line"] = line
            found.append(document)
    return found


def line_offsets(path: Path) -> dict[int, int]:
    """Where each seq's line starts in its segment file."""
    return {
        json.loads(line)["seq"]: offset
        for part in LogLayout(path).parts()
        if part.kind != "tombstone"
        for offset, line in lines(part.path)
    }


# -- the reference: the filters, over parsed lines ------------------------------------------


def _get(document: Any, *keys: str) -> Any:
    for key in keys:
        document = document.get(key) if isinstance(document, dict) else None
    return document


def _as_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def recorded(text: str) -> str:
    """Text as the log records it: a lone surrogate as its backslash escape."""
    return text.encode("utf-8", "backslashreplace").decode()


def scan_selects(document: dict[str, Any], where: EventFilter) -> bool:
    kind, result, given_input = document.get("kind"), document.get("result") or {}, document.get("input") or {}
    at = datetime.fromisoformat(document["timestamp"].replace("Z", "+00:00"))
    if where.since is not None and at < where.since:
        return False
    if where.until is not None and at > where.until:
        return False
    if where.after_seq is not None and document["seq"] <= where.after_seq:
        return False
    if where.to_seq is not None and document["seq"] > where.to_seq:
        return False
    for field in ("session_id", "agent", "outcome", "decision_id", "kind", "call_id"):
        wanted = getattr(where, field) and recorded(getattr(where, field))
        if wanted is not None and document.get(field) != wanted:
            return False
    checks = {
        "tool": document.get("tool") or _get(given_input, "tool", "name"),
        "principal": _get(given_input, "subject", "principal") or result.get("principal"),
        "approver": result.get("approver") or _get(given_input, "approval", "approver"),
        "approval_id": result.get("id") if kind == "approval" else _get(given_input, "approval", "id"),
        "egress_host": result.get("host") if kind == "egress" else None,
    }
    for field, value in checks.items():
        wanted = getattr(where, field) and recorded(getattr(where, field))
        if wanted is not None and value != wanted:
            return False
    names = {"credential": [result.get("name")], "decision": [c.get("name") for c in
             _get(result, "obligations", "credentials") or []], "egress": result.get("injected") or []}  # fmt: skip
    leases = {"credential": [result.get("lease_id")], "execution": result.get("credentials") or []}
    reasons = [r.get("code") for r in result.get("reasons") or []] + [result.get("code")]
    contains = {"credential": names.get(str(kind), []), "lease": leases.get(str(kind), []), "reason": reasons,
                "taint": _get(given_input, "session", "taint") or []}  # fmt: skip
    for field, values in contains.items():
        wanted = getattr(where, field) and recorded(getattr(where, field))
        if wanted is not None and wanted not in values:
            return False
    args = _get(given_input, "args")
    for key, value in where.args:
        if not isinstance(args, dict) or recorded(key) not in args or not is_value(args[recorded(key)], value):
            return False
    return True


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_value(given: Any, value: str) -> bool:
    """Whether an argument the log holds is the filter's ``value`` (docs/audit.md): a string is the
    text; a number is numerically equal; anything else is equal as JSON."""
    if isinstance(given, str):
        return given == recorded(value)
    try:
        wanted = json.loads(value, parse_constant=lambda name: {}["not JSON: " + name])
    except (ValueError, KeyError):
        return False
    if _number(given) or _number(wanted):
        return _number(given) and _number(wanted) and given == wanted
    return not isinstance(wanted, str) and json.dumps(given, sort_keys=True) == json.dumps(wanted, sort_keys=True)


def expected(path: Path, where: EventFilter) -> list[int]:
    return [d["seq"] for d in documents(path) if scan_selects(d, where)]


def _values(docs: list[dict[str, Any]], pick: Any) -> list[Any]:
    found = {v for d in docs for v in pick(d) if v is not None}
    return sorted(found, key=str)[:40]


def filters(docs: list[dict[str, Any]]) -> st.SearchStrategy[EventFilter]:
    """Filters built from values the log holds (so they select something) and hostile text."""

    def of(values: list[Any]) -> st.SearchStrategy[Any]:
        return st.sampled_from(values) | st.sampled_from(HOSTILE)

    times = [datetime.fromisoformat(d["timestamp"].replace("Z", "+00:00")) for d in docs]
    args = _values(docs, lambda d: [(k, _as_text(v)) for k, v in (_get(d, "input", "args") or {}).items()
                                    if v is not None and len(_as_text(v) or "") < 5000])  # fmt: skip
    fields: dict[str, st.SearchStrategy[Any]] = {
        "since": st.sampled_from(times).map(lambda t: t - timedelta(seconds=1)),
        "until": st.sampled_from(times),
        "after_seq": st.integers(0, len(docs) + 2),
        "session_id": of(_values(docs, lambda d: [d.get("session_id")])),
        "agent": of(AGENTS),
        "tool": of(["read_web", "send_email", "pay", "github", "word_count"]),
        "outcome": of(_values(docs, lambda d: [d.get("outcome")])),
        "kind": of(["decision", "approval", "credential", "execution", "egress", "error"]),
        "decision_id": of(_values(docs, lambda d: [d.get("decision_id")])),
        "principal": of(PRINCIPALS),
        "approver": of(APPROVERS),
        "credential": of(["bank", "gh'token"]),
        "lease": of(_values(docs, lambda d: [_get(d, "result", "lease_id")])),
        "egress_host": of(["api.github.com", "www.example.org", "evil'.test"]),
        "reason": of(["approval.high_risk", "provenance.untrusted_destination", "tool.denied'x", "call.invalid"]),
        "taint": of(["untrusted_content"]),
        "args": st.lists(st.sampled_from(args) | st.tuples(st.just("v"), st.sampled_from(ARG_SPELLINGS))
                         | st.tuples(st.sampled_from(["to", "text", "n", "v", "a'b"]), st.sampled_from(HOSTILE)),
                         max_size=2).map(tuple),
    }  # fmt: skip
    return st.fixed_dictionaries({}, optional=fields).map(lambda chosen: EventFilter(**chosen))


# -- the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(audit_log: Log) -> Iterator[AuditQuery]:
    with AuditQuery(audit_log.path) as query:
        yield query


@pytest.fixture(scope="module")
def docs(audit_log: Log) -> list[dict[str, Any]]:
    return documents(audit_log.path)


@pytest.fixture(scope="module")
def rows(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each event's row as the Python twin makes it (`promote`), for `matches`."""
    return [row for d in docs if (row := promote(d["_line"])) is not None]


def test_the_log_under_test_has_every_part_an_engine_reads(audit_log: Log, engine: AuditQuery) -> None:
    """Indexed segments over several days, a sealed segment not indexed, and an active segment."""
    parts = LogLayout(audit_log.path).parts()
    days = {p.name for p in index_dir_of(audit_log.path).glob("day=*")}
    assert len(days) >= 4
    assert engine.unindexed, "a segment sealed after indexing"
    assert parts[-1].kind == "active"
    assert any(True for _ in lines(parts[-1].path))
    sizes = [len(line) for p in parts for _, line in lines(p.path)]
    assert max(sizes) > len(BIG)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(data=st.data())
def test_every_filter_selects_what_a_scan_of_the_lines_selects(
    audit_log: Log, engine: AuditQuery, docs: list[dict[str, Any]], rows: list[dict[str, Any]], data: st.DataObject
) -> None:
    """The index (SQL), its Python twin (the Redis path, an export's verifier) and a scan agree."""
    where = data.draw(filters(docs))
    limit = data.draw(st.none() | st.integers(1, 50))
    found = [seq for (seq,) in engine.events(where, limit=limit, columns=("seq",))]
    want = [d["seq"] for d in docs if scan_selects(d, where)]
    assert found == (want if limit is None else want[:limit])
    assert [row["seq"] for row in rows if matches(row, where)] == want


def _seqs(engine: AuditQuery, where: EventFilter) -> list[int]:
    return [seq for (seq,) in engine.events(where, columns=("seq",))]


def test_an_argument_is_selected_by_its_value_however_it_is_written(
    engine: AuditQuery, docs: list[dict[str, Any]], rows: list[dict[str, Any]]
) -> None:
    """A number by its value, whatever its spelling (DuckDB writes 1e+16 as 10000000000000000.0);
    null, true and objects as JSON; a string as its text. The index and its twin agree."""
    holds = {d["seq"]: canonical(d["input"]["args"]["v"]) for d in docs if "v" in (_get(d, "input", "args") or {})}
    assert sorted(set(holds.values())) == sorted({canonical(v) for v in ARG_VALUES})
    big, obj = [1e16, 10**16, "1e+16"], {"b": [1e16, "ü"], "a": None, "c": {"d": -0.0}}
    selects = {
        "1e+16": big, "1e16": big[:2], "1E16": big[:2], "10000000000000000": big[:2],
        "10000000000000000.0": big[:2], "1e-07": [1e-07], "1e-7": [1e-07], "1.0E-7": [1e-07], "1.5e+300": [1.5e300],
        "1.5e300": [1.5e300], "-0.0": [-0.0, 0.0, 0], "-0": [-0.0, 0.0, 0], "0": [-0.0, 0.0, 0],
        "0.0": [-0.0, 0.0, 0],
        "18446744073709551617": [2**64 + 1], "1.8446744073709552e19": [], "1e30": [], "1e+30": [],
        "1000000000000000000000000000000": [10**30], "9007199254740993": [9007199254740993], "9007199254740992": [],
        "123456789.12345679": [123456789.123456789], "-1": [-1], "-1.0": [-1], "null": [None, "null"], " null": [None],
        "true": [True, "true"], "false": [False], '{"a":null,"b":[1e+16,"ü"],"c":{"d":-0.0}}': [obj],
        '{"c": {"d": -0.0}, "b": [10000000000000000.0, "\\u00fc"], "a": null}': [obj], "[]": [[]], "{}": [{}],
        '[1,2.5,{"x":"y/z"}]': [[1, 2.5, {"x": "y/z"}]], '"1e+16"': [], '{"a":null}': ['{"a":null}'], "": [""],
        "NaN": [], "Infinity": [], "1e400": [], "[1,": [],
    }  # fmt: skip
    assert set(selects) == set(ARG_SPELLINGS)
    for value, wanted in selects.items():
        where = EventFilter(args=(("v", value),))
        want = [seq for seq, held in holds.items() if held in {canonical(w) for w in wanted}]
        assert len(want) >= len(wanted), value
        assert _seqs(engine, where) == want, value
        assert [row["seq"] for row in rows if matches(row, where)] == want, value
        assert [d["seq"] for d in docs if scan_selects(d, where)] == want, value


def test_each_event_is_found_as_written_with_its_hash(engine: AuditQuery, docs: list[dict[str, Any]]) -> None:
    found = {seq: (digest, line) for seq, digest, line in engine.events(EventFilter())}
    assert sorted(found) == [d["seq"] for d in docs] == list(range(1, len(docs) + 1))
    for document in docs:
        digest, line = found[document["seq"]]
        assert line.encode() == document["_line"]
        assert digest == document["hash"]


def test_the_promoted_columns_are_what_the_python_twin_computes(
    audit_log: Log, engine: AuditQuery, docs: list[dict[str, Any]]
) -> None:
    """The Redis path filters with `promote`; the index with SQL: they agree on every event, and
    each line is where its ``line_offset`` says, in the indexed, unindexed and active segments."""
    names, rows = engine.sql("SELECT * FROM events ORDER BY seq")
    assert names == list(COLUMNS)
    by_seq = {d["seq"]: d for d in docs}
    offsets = line_offsets(audit_log.path)
    for row in rows:
        from_sql = dict(zip(names, row, strict=True))
        assert from_sql == promote(by_seq[from_sql["seq"]]["_line"], offsets[from_sql["seq"]])


def test_index_files_keep_the_rare_kinds_apart_and_each_agents_rows_together(audit_log: Log) -> None:
    """An index file's rows are in the order that lets a row group's statistics skip most of a
    file: the bulk (decisions, executions, egress) apart from the rest (approvals, credentials,
    errors), and by agent, session and seq within each. A file in seq order had every kind and
    agent in every row group, so a per-agent count or an approvals join read all of them."""
    import duckdb  # noqa: PLC0415  (the audit extra, as the engine loads it)

    files = sorted(index_dir_of(audit_log.path).glob("day=*/*.parquet"))
    assert files
    bulk = {"decision", "execution", "egress"}
    clustered = 0
    with duckdb.connect() as db:
        for file in files:
            rows = db.execute(
                "SELECT kind, agent, session_id, seq FROM read_parquet(?, file_row_number = true) "
                "ORDER BY file_row_number",
                [str(file)],
            ).fetchall()
            # NULLs last, as DuckDB sorts them.
            keys = [(kind in bulk, agent is None, agent or "", session is None, session or "", seq)
                    for kind, agent, session, seq in rows]  # fmt: skip
            assert keys == sorted(keys), file.name
            clustered += len({kind in bulk for kind, *_ in rows}) == 2
    assert clustered, "no index file holds both bulk and rare kinds: the log under test does not show the order"


def test_the_live_tail_is_included_as_it_grows(tmp_path: Path, audit_log: Log) -> None:
    """An engine that stays open sees events appended since (the active segment, a snapshot of
    it, lines past the snapshot, and a segment sealed meanwhile)."""
    root = tmp_path / "copy"
    shutil.copytree(audit_log.path.parent, root)
    path = root / "audit.jsonl"
    with AuditQuery(path) as query:
        before = [seq for (seq,) in query.events(EventFilter(), columns=("seq",))]
        calls = Calls(seed=99)
        calls.at = START + timedelta(days=5)
        asyncio.run(append(path, root / "keys" / "audit.key", calls.session(4)))
        grown = [seq for (seq,) in query.events(EventFilter(), columns=("seq",))]
        assert grown[: len(before)] == before
        assert len(grown) > len(before)
        assert snapshot_active(LogLayout(path)) > 0
        asyncio.run(append(path, root / "keys" / "audit.key", calls.session(3)))
        after_snapshot = [seq for (seq,) in query.events(EventFilter(), columns=("seq",))]
        asyncio.run(append(path, root / "keys" / "audit.key", [e for _ in range(8) for e in calls.session(6)]))
        last = [seq for (seq,) in query.events(EventFilter(), columns=("seq",))]
    assert after_snapshot == list(range(1, len(after_snapshot) + 1))
    assert len(after_snapshot) > len(grown)
    assert last == [d["seq"] for d in documents(path)] == list(range(1, len(last) + 1))


def test_events_are_read_from_the_log_at_their_offsets_and_checked(tmp_path: Path, audit_log: Log) -> None:
    """An event is read from the log's file at its ``line_offset`` and checked against its indexed
    hash, not copied out of the index (here the index's copies are stand-ins); a line whose bytes
    changed under the index is never returned: the query stops there, naming it."""
    import duckdb  # noqa: PLC0415  (the audit extra)

    root = tmp_path / "copy"
    shutil.copytree(audit_log.path.parent, root)
    path = root / "audit.jsonl"
    for file in index_dir_of(path).glob("day=*/*.parquet"):
        staged = file.with_suffix(".staged")
        duckdb.sql(
            f"COPY (SELECT * REPLACE ('stand-in ' || seq AS event) FROM read_parquet('{file}')) "  # noqa: S608  (test paths)
            f"TO '{staged}' (FORMAT parquet)"
        )
        os.replace(staged, file)
    docs = documents(path)
    with AuditQuery(path) as query:
        found = {seq: (digest, line) for seq, digest, line in query.events(EventFilter())}
        assert found == {d["seq"]: (d["hash"], d["_line"].decode()) for d in docs}
        from_index = {seq for (seq,) in query.sql("SELECT seq FROM events WHERE event LIKE 'stand-in %'")[1]}
    assert len(from_index) > len(docs) // 2, "most events are in indexed segments"

    # One indexed line changes under the index, its length kept (so every offset still holds).
    changed = sorted(from_index)[len(from_index) // 2]
    sealed = next(p for p in LogLayout(path).parts() if p.kind == "sealed" and p.first_seq <= changed <= p.last_seq)
    raw = sealed.path.read_bytes()
    start = line_offsets(path)[changed]
    at = raw.index(b'"kind":"', start) + len(b'"kind":"')
    edited = raw[:at] + b"X" + raw[at + 1 :]
    sealed.path.write_bytes(edited)
    tampered = edited[start : edited.index(b"\n", start)]
    again: list[str] = []
    with AuditQuery(path) as query:
        found = (line for _, _, line in query.events(EventFilter()))
        with pytest.raises(AuditError, match=rf"event {changed} .*does not match the log"):
            again.extend(found)
    assert tampered.decode() not in again
    assert again == [d["_line"].decode() for d in docs if d["seq"] < changed]


def test_a_line_read_again_from_the_index_is_returned_once(tmp_path: Path, audit_log: Log) -> None:
    """A damaged log with two lines of one seq (a forged copy appended): the forged line is not
    where the index says an event is, so the rest of its batch comes from the index's copies, from
    that row on: every row the index holds comes out once, in its order, whatever columns are asked."""
    root = tmp_path / "copy"
    shutil.copytree(audit_log.path.parent, root)
    path = root / "audit.jsonl"
    original = path.read_bytes().splitlines()[2]
    # A copy whose hash sorts after the original's: the original row is read from the log first.
    for n in itertools.count():
        forged = original.replace(b'"kind":"', b'"kind":"forged-%d-' % n, 1)
        if line_hash(forged).hex() > line_hash(original).hex():
            break
    path.write_bytes(path.read_bytes() + forged + b"\n")
    with AuditQuery(path) as query:
        indexed = list(query.sql("SELECT seq, hash, event FROM events ORDER BY seq, hash")[1])
        assert len({row[0] for row in indexed}) == len(indexed) - 1, "one seq twice"
        for columns in (("seq", "hash", "event"), ("event", "seq"), ("hash", "event"), ("seq", "kind", "event")):
            names = ("seq", "hash", "event")
            want = [tuple(row[names.index(c)] for c in columns if c in names) for row in indexed]
            got = [tuple(v for c, v in zip(columns, row, strict=True) if c in names) for row in
                   query.events(EventFilter(), columns=columns)]  # fmt: skip
            assert got == want, columns
        assert [r[0] for r in query.events(EventFilter(), limit=7)] == [row[0] for row in indexed[:7]]


def test_hostile_text_in_filters_is_a_value_never_sql(engine: AuditQuery, docs: list[dict[str, Any]]) -> None:
    for text in [*HOSTILE, BIG]:
        where = EventFilter(agent=text, args=(("text", text),))
        assert [s for s, in engine.events(where, columns=("seq",))] == [d["seq"] for d in docs
                                                                          if scan_selects(d, where)]  # fmt: skip
    big = [s for (s,) in engine.events(EventFilter(args=(("text", BIG),)), columns=("seq",))]
    assert len(big) == 1
    assert engine.sql("SELECT count(*) FROM events")[1].__next__() == (len(docs),)


# -- the index -------------------------------------------------------------------------------


def test_indexing_again_changes_nothing_and_a_replaced_segment_is_reindexed(tmp_path: Path, audit_log: Log) -> None:
    root = tmp_path / "copy"
    shutil.copytree(audit_log.path.parent, root)
    path = root / "audit.jsonl"
    layout = LogLayout(path)
    first = index_sealed(layout)
    assert first.indexed
    assert not first.problems  # the segment sealed after the fixture indexed
    again = index_sealed(layout)
    assert again.indexed == []
    assert again.unchanged == len([p for p in layout.parts() if p.kind == "sealed"])

    # A segment whose bytes no longer match its manifest is not indexed: it is read line by line.
    sealed = [p for p in layout.parts() if p.kind == "sealed"]
    victim = sealed[1]
    content = victim.path.read_bytes().replace(b'"outcome":"allow"', b'"outcome":"ALLOW"', 1)
    victim.path.write_bytes(content)
    name = victim.path.name.removesuffix(".jsonl")
    marker = index_dir_of(path) / "segments" / f"{name}.json"
    marker.write_text(marker.read_text().replace('"sha256":"', '"sha256":"0', 1))  # as if indexed from other bytes
    tampered = index_sealed(layout)
    assert name in tampered.replaced
    assert [p for p in tampered.problems if p.startswith(name) and "run `stockade audit verify`" in p]
    assert not marker.exists()
    with AuditQuery(path) as query:
        assert name in query.unindexed
        assert [s for (s,) in query.events(EventFilter(outcome="ALLOW"), columns=("seq",))] == expected(
            path, EventFilter(outcome="ALLOW")
        )

    # Retention deleted a segment: its index goes too.
    gone = sealed[0]
    gone.path.unlink()
    gone.path.with_name(gone.path.name[:26] + "manifest.json").unlink()
    dropped = index_sealed(layout)
    assert dropped.removed == [gone.path.name.removesuffix(".jsonl")]
    assert not list(index_dir_of(path).glob(f"day=*/{gone.path.stem}.parquet"))


def test_the_writer_starts_the_indexer_in_its_own_low_priority_process(tmp_path: Path, audit_log: Log) -> None:
    """`spawn_indexer` returns at once without loading DuckDB; the process it starts indexes."""
    root = tmp_path / "copy"
    shutil.copytree(audit_log.path.parent, root)
    path = root / "audit.jsonl"
    script = (
        "import sys, time; from pathlib import Path; from router.audit.index import spawn_indexer\n"
        "started = time.perf_counter(); spawn_indexer(Path(sys.argv[1]))\n"
        "assert not {'duckdb', '_duckdb'} & set(sys.modules), 'DuckDB loaded in the writer'\n"
        "print(time.perf_counter() - started)\n"
    )
    took = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True)
    assert float(took.stdout) < 0.5
    markers = index_dir_of(path) / "segments"
    sealed = {p.path.stem for p in LogLayout(path).parts() if p.kind == "sealed"}
    deadline = time.monotonic() + 60
    while {m.stem for m in markers.glob("*.json")} != sealed:
        assert time.monotonic() < deadline, (index_dir_of(path) / "indexer.log").read_text()[-2000:]
        time.sleep(0.1)
    with AuditQuery(path) as query:
        assert query.unindexed == []


def test_a_fresh_process_queries_with_the_engine_module_alone(audit_log: Log) -> None:
    """A question from a new process (`stockade audit sql`, a point query) loads DuckDB's engine
    module, never the `duckdb` package, whose Python layer costs ~0.2 s of the start (router.audit.duck)."""
    script = (
        "import sys; from pathlib import Path; from router.audit.index import AuditQuery\n"
        "with AuditQuery(Path(sys.argv[1])) as query:\n"
        "    names, rows = query.sql('SELECT seq, kind, timestamp, day FROM events ORDER BY seq LIMIT 3')\n"
        "    print(len(list(rows)), '_duckdb' in sys.modules, 'duckdb' in sys.modules)\n"
    )
    said = subprocess.run(
        [sys.executable, "-c", script, str(audit_log.path)], capture_output=True, text=True, check=True
    )
    assert said.stdout.split() == ["3", "True", "False"], said.stdout + said.stderr


def test_queries_read_times_as_utc_and_keep_footers_whatever_the_hosts_zone(audit_log: Log) -> None:
    """Each query runs on a cursor of its own: the engine's settings must be the database's, not
    the first connection's. On a host in another zone, a timestamp compared with a zoned time was
    read in the host's zone (hours off), and every query read every Parquet footer again."""
    first = min(documents(audit_log.path), key=lambda d: d["seq"])
    script = (
        "import sys; from pathlib import Path; from router.audit.index import AuditQuery\n"
        "with AuditQuery(Path(sys.argv[1])) as query:\n"
        "    sql = ('SELECT count(*) FILTER (WHERE timestamp::TIMESTAMPTZ = ?::TIMESTAMPTZ), '\n"
        "           \"current_setting('TimeZone'), current_setting('parquet_metadata_cache') FROM events\")\n"
        "    print(*list(query.sql(sql, [sys.argv[2]])[1])[0])\n"
    )
    at = datetime.fromisoformat(first["timestamp"]).astimezone(UTC).isoformat()
    env = {**os.environ, "TZ": "Asia/Kolkata"}  # +05:30: no whole-hour coincidence
    said = subprocess.run(
        [sys.executable, "-c", script, str(audit_log.path), at], capture_output=True, text=True, check=True, env=env
    )
    same_time, zone, cached = said.stdout.split()
    assert int(same_time) >= 1, said.stdout + said.stderr  # the first event, at least, is at its own time
    assert (zone, cached) == ("UTC", "True")


def _thread_nice() -> dict[int, int]:
    """This process's threads and each one's nice value (on Linux, a thread's own)."""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            found[int(tid)] = int(stat[stat.rindex(")") + 2 :].split()[16])
    return found


def test_queries_run_behind_the_router_for_cpu_and_leave_the_callers_priority(audit_log: Log) -> None:
    """Every thread a query runs on, DuckDB's own included, is niced (a query at the router's
    priority took a third of its appends on two cores); the calling thread is not."""
    before = _thread_nice()
    mine = threading.get_native_id()
    with AuditQuery(audit_log.path) as query:
        names, rows = query.sql("SELECT agent, count(*) FROM events GROUP BY agent ORDER BY agent")
        assert names == ["agent", "count_star()"]
        assert list(rows)
        assert [row[0] for row in query.events(EventFilter(kind="decision"), limit=3, columns=("seq",))]
        started = {tid: nice for tid, nice in _thread_nice().items() if tid not in before}
    assert len(started) >= 2, started  # the engine's query threads and DuckDB's workers
    assert set(started.values()) == {before[mine] + 10}, started
    assert _thread_nice()[mine] == before[mine]


def test_the_writer_asks_for_a_snapshot_each_time_the_active_segment_grows_by_a_quarter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`LogOptions.on_grown` is called at geometric steps of the active segment's size (so the
    snapshots it leads to stay linear work), and from the start again in each new segment."""
    monkeypatch.setattr(audit_jsonl, "GROWN_MIN_BYTES", 4096)
    path = tmp_path / "audit.jsonl"
    sizes: list[int] = []

    def grown(at: Path) -> None:
        assert at == path
        sizes.append(path.stat().st_size)

    async def write() -> None:
        key = SigningKey.load_or_create(tmp_path / "keys" / "audit.key")
        chosen = LogOptions(signer=key, segment_max_bytes=200_000, rotate_daily=False, on_grown=grown)
        log = JsonlAuditLog(path, durability="relaxed", options=chosen)
        calls = Calls(seed=5)
        while len([p for p in LogLayout(path).parts() if p.kind == "sealed"]) < 1 or path.stat().st_size < 50_000:
            for event in calls.session(3):
                await log.append(event)
        await log.aclose()

    asyncio.run(write())
    restart = next(i for i in range(1, len(sizes)) if sizes[i] < sizes[i - 1])  # the first call in the new segment
    first, second = sizes[:restart], sizes[restart:]
    assert first[0] >= 4096
    assert second[0] >= 4096
    for run in (first, second):
        assert all(b - a >= max(4096, a // 4) for a, b in itertools.pairwise(run))
    assert len(first) <= 2 + 200_000 // 4096  # geometric: far fewer than one call per append


def test_the_active_segment_is_snapshotted_without_an_operator(tmp_path: Path) -> None:
    """With the settings' log (the router's), a MiB appended to the active segment has the indexer
    snapshot it in the background: a fresh query reads those events from the index, not line by
    line, though no `stockade audit index --follow` runs. Closing the log waits for that indexer,
    so once it is closed nothing writes beside it and its directory can be removed (a benchmark's
    temporary directory once failed to go: the indexer was still writing in it)."""
    path = tmp_path / "audit.jsonl"
    # One segment: the generated calls span days, and each new day would seal the active segment.
    audit = AuditSettings(path=path, signing_key=tmp_path / "keys" / "audit.key", rotate_daily=False)
    chosen = log_options(Settings(audit=audit))

    _write_until(path, chosen, 6, lambda: path.exists() and path.stat().st_size >= 5 * audit_jsonl.GROWN_MIN_BYTES // 4)
    assert _indexers_of(path) == []
    marker = index_dir_of(path) / "active.json"
    assert marker.exists(), (index_dir_of(path) / "indexer.log").read_text()[-2000:]
    snapshot = json.loads(marker.read_text())
    assert snapshot["last_seq"] >= 1000
    with AuditQuery(path) as query:
        assert [s for (s,) in query.events(EventFilter(), columns=("seq",))] == expected(path, EventFilter())


@pytest.mark.parametrize("manifest", ["not json", '["a list"]', '{"sha256": "not a digest"}', '{"bytes": 1}'])
def test_a_manifest_a_query_cannot_read_leaves_its_segment_read_line_by_line(
    tmp_path: Path, audit_log: Log, manifest: str
) -> None:
    """The query reads only a manifest's recorded sha256 (as plain JSON) to match the segment to
    its index; a manifest without a readable one matches nothing, so the segment's own lines answer."""
    root = tmp_path / "copy"
    shutil.copytree(audit_log.path.parent, root)
    path = root / "audit.jsonl"
    victim = next(p for p in LogLayout(path).parts() if p.kind == "sealed")
    victim.path.with_name(victim.path.name[:26] + "manifest.json").write_text(manifest)
    with AuditQuery(path) as query:
        assert victim.path.name.removesuffix(".jsonl") in query.unindexed
        assert [s for (s,) in query.events(EventFilter(), columns=("seq",))] == expected(path, EventFilter())


def test_closing_the_log_ends_an_indexer_that_outlasts_the_grace(tmp_path: Path) -> None:
    """An indexer still at work when the grace runs out is ended, and what it left is never read:
    the next run indexes everything, and queries answer as the log says meanwhile."""
    path = tmp_path / "audit.jsonl"
    key = SigningKey.load_or_create(tmp_path / "keys" / "audit.key")
    indexer = BackgroundIndexer(grace_s=0)
    chosen = LogOptions(signer=key, segment_max_bytes=300_000, rotate_daily=False,
                        on_sealed=indexer, on_close=indexer.stop)  # fmt: skip

    _write_until(path, chosen, 7, lambda: len([p for p in LogLayout(path).parts() if p.kind == "sealed"]) >= 3)
    assert _indexers_of(path) == []
    with AuditQuery(path) as query:
        assert [s for (s,) in query.events(EventFilter(), columns=("seq",))] == expected(path, EventFilter())
    report = index_log(path)
    assert report.problems == []
    with AuditQuery(path) as query:
        assert query.unindexed == []
        assert [s for (s,) in query.events(EventFilter(), columns=("seq",))] == expected(path, EventFilter())


def test_appends_while_the_log_closes_start_no_indexer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing waits for the indexers in a worker thread, and appends made meanwhile (calls still
    in flight) would once start new ones nobody waited for: the indexer stops first, for good."""
    monkeypatch.setattr(audit_jsonl, "GROWN_MIN_BYTES", 4096)
    path = tmp_path / "audit.jsonl"
    key = SigningKey.load_or_create(tmp_path / "keys" / "audit.key")
    indexer = BackgroundIndexer()
    chosen = LogOptions(signer=key, segment_max_bytes=150_000, rotate_daily=False,
                        on_sealed=indexer, on_grown=indexer, on_close=indexer.stop)  # fmt: skip
    appended_while_closing = 0

    async def write() -> None:
        nonlocal appended_while_closing
        log = JsonlAuditLog(path, durability="relaxed", options=chosen)
        calls = Calls(seed=8)
        while path.stat().st_size < 100_000 if path.exists() else True:
            for event in calls.session(3):
                await log.append(event)
        assert _indexers_of(path), "no indexer was started"
        closing = asyncio.create_task(log.aclose())
        while not closing.done():
            for event in calls.session(3):
                await log.append(event)
                appended_while_closing += 1
            await asyncio.sleep(0)
        await closing

    asyncio.run(write())
    assert appended_while_closing > 100  # enough to have grown the segment, sealed it, or both
    assert _indexers_of(path) == []


def test_stopping_the_indexer_takes_the_grace_once_however_many_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`BackgroundIndexer.stop` waits its grace for all its processes together, not once each (a
    router stopping with several would otherwise wait several graces), then ends them all."""
    started: list[subprocess.Popen[bytes]] = []

    def sleeper(_: Path) -> subprocess.Popen[bytes]:  # a process that outlasts any grace
        started.append(subprocess.Popen(["sleep", "60"]))
        return started[-1]

    monkeypatch.setattr(audit_index, "spawn_indexer", sleeper)
    indexer = BackgroundIndexer(grace_s=0.5)
    for _ in range(4):
        indexer(tmp_path / "audit.jsonl")
    began = time.monotonic()
    indexer.stop()
    assert time.monotonic() - began < 2.0
    assert [p.poll() for p in started] == [-9] * 4
    indexer(tmp_path / "audit.jsonl")
    assert len(started) == 4  # stopped for good: nothing started after


def _write_until(path: Path, options: LogOptions, seed: int, done: Callable[[], bool]) -> None:
    """Append generated sessions to the log at ``path`` until ``done``, check that an indexer was
    started meanwhile, and close the log (which waits for it)."""

    async def write() -> None:
        log = JsonlAuditLog(path, durability="relaxed", options=options)
        calls = Calls(seed=seed)
        while not done():
            for event in calls.session(3):
                await log.append(event)
        assert _indexers_of(path), "no indexer was started"
        await log.aclose()

    asyncio.run(write())


def _indexers_of(path: Path) -> list[int]:
    """The pids of the indexer processes (`spawn_indexer`'s) at work on the log at ``path``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if b"router.audit.index" in argv and str(path).encode() in argv and state != "Z":
                found.append(int(pid))
    return found


def test_a_fresh_query_process_loads_neither_the_models_nor_the_signature_library(audit_log: Log) -> None:
    """A query lists the parts and matches manifests to index markers by their recorded sha256:
    it answers without pydantic or cryptography (and structlog, and the sandbox runner), which
    cost a fresh `stockade audit query` process more than the query itself."""
    script = (
        "import sys; from pathlib import Path; from router.audit.index import AuditQuery\n"
        "with AuditQuery(Path(sys.argv[1])) as query:\n"
        "    names, rows = query.sql('SELECT count(*) FROM events')\n"
        "    print(list(rows)[0][0])\n"
        "print(sorted(m for m in ('pydantic', 'cryptography', 'structlog', 'runner') if m in sys.modules))\n"
    )
    said = subprocess.run(
        [sys.executable, "-c", script, str(audit_log.path)], capture_output=True, text=True, check=True
    )
    count, loaded = said.stdout.splitlines()
    assert int(count) > 0
    assert loaded == "[]"


# -- the command line ------------------------------------------------------------------------


def stockade(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).parent / "stockade"), *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"}, check=False, **kwargs)  # fmt: skip


def test_audit_query_streams_json_lines_that_match_the_scan(audit_log: Log) -> None:
    path = str(audit_log.path)
    cases = [
        (["--agent", "agent-'c", "--kind", "decision"], EventFilter(agent="agent-'c", kind="decision")),
        (["--credential", "gh'token", "--approver", "x"], EventFilter(credential="gh'token", approver="x")),
        (["--reason", "approval.high_risk", "--taint", "untrusted_content"],
         EventFilter(reason="approval.high_risk", taint="untrusted_content")),
        (["--arg", "text='; DROP TABLE events; --", "--after-seq", "10"],
         EventFilter(args=(("text", "'; DROP TABLE events; --"),), after_seq=10)),
        (["--since", "2026-03-02T00:00:00Z", "--until", "2026-03-02T12:00:00+00:00", "--egress-host", "evil'.test"],
         EventFilter(since=datetime(2026, 3, 2, tzinfo=UTC), until=datetime(2026, 3, 2, 12, tzinfo=UTC),
                     egress_host="evil'.test")),
        (["--after-seq", "3", "--to-seq", "9"], EventFilter(after_seq=3, to_seq=9)),
        (["--after-seq", "10", "--to-seq", "400", "--kind", "decision"],
         EventFilter(after_seq=10, to_seq=400, kind="decision")),
    ]  # fmt: skip
    by_seq = {d["seq"]: d for d in documents(audit_log.path)}
    for args, where in cases:
        result = stockade("audit", "query", "--path", path, "--json", *args)
        assert result.returncode == 0, result.stderr
        found = [json.loads(line) for line in result.stdout.splitlines()]
        assert [e["seq"] for e in found] == expected(audit_log.path, where)
        for event in found:
            document = by_seq[event["seq"]]
            assert event == {k: v for k, v in document.items() if k != "_line"}
    table = stockade("audit", "query", "--path", path, "--tool", "pay", "--outcome", "denied")
    assert table.returncode == 0
    assert "denied" in table.stdout
    assert "pay" in table.stdout


def test_audit_query_says_which_option_is_wrong(audit_log: Log) -> None:
    bad_arg = stockade("audit", "query", "--path", str(audit_log.path), "--arg", "no-equals-sign")
    bad_time = stockade("audit", "query", "--path", str(audit_log.path), "--since", "yesterday")
    assert (bad_arg.returncode, bad_time.returncode) == (2, 2)
    assert "--arg" in bad_arg.stderr
    assert "KEY=VALUE" in bad_arg.stderr
    assert "--since" in bad_time.stderr
    backwards = stockade("audit", "query", "--path", str(audit_log.path), "--after-seq", "9", "--to-seq", "9")
    assert backwards.returncode == 2
    assert "--after-seq 9 is not before --to-seq 9" in " ".join(backwards.stderr.split())


@pytest.mark.parametrize(
    "statement",
    [
        "DROP VIEW events", "COPY (SELECT 1) TO '/tmp/stockade-pwned.csv'", "ATTACH '/tmp/stockade-pwned.db'",
        "INSTALL httpfs", "LOAD httpfs", "SELECT 1; DROP VIEW events", "SET threads = 64", "PRAGMA version",
        "CREATE TABLE t AS SELECT 1", "SELECT * FROM read_csv('/etc/passwd')",
        "SELECT * FROM query('DROP VIEW events')",
        "DELETE FROM fed", "",
    ],
)  # fmt: skip
def test_audit_sql_refuses_anything_but_one_read_only_select(audit_log: Log, statement: str) -> None:
    result = stockade("audit", "sql", "--path", str(audit_log.path), statement)
    assert result.returncode == 2, result.stdout
    assert "error" in result.stderr
    assert not Path("/tmp/stockade-pwned.csv").exists()
    assert not Path("/tmp/stockade-pwned.db").exists()
    still = stockade("audit", "sql", "--path", str(audit_log.path), "SELECT count(*) AS n FROM events", "--json")
    assert json.loads(still.stdout) == {"n": len(documents(audit_log.path))}


def test_audit_sql_answers_as_a_table_json_lines_or_csv(audit_log: Log) -> None:
    path = str(audit_log.path)
    sql = "SELECT kind, count(*) AS n FROM events GROUP BY kind ORDER BY kind"
    want: dict[str, int] = {}
    for document in documents(audit_log.path):
        want[document["kind"]] = want.get(document["kind"], 0) + 1
    as_json = [json.loads(line) for line in stockade("audit", "sql", "--path", path, sql, "--json").stdout.splitlines()]
    assert {row["kind"]: row["n"] for row in as_json} == want
    as_csv = stockade("audit", "sql", "--path", path, sql, "--csv").stdout.splitlines()
    assert as_csv[0] == "kind,n"
    assert len(as_csv) == len(want) + 1
    markup = stockade("audit", "sql", "--path", path, "SELECT '[bold]x[/bold]' AS s")
    assert "[bold]x[/bold]" in markup.stdout  # shown as text, never as markup


def test_reports_give_the_answers_a_scan_gives(audit_log: Log) -> None:
    path = str(audit_log.path)
    docs = documents(audit_log.path)

    def report(*args: str) -> list[dict[str, Any]]:
        result = stockade("audit", "report", *args, "--path", path, "--json")
        assert result.returncode == 0, result.stderr
        rows: list[dict[str, Any]] = json.loads(result.stdout)
        return rows

    tainted = report("sessions-after-untrusted")
    calls = [d for d in docs if d["kind"] == "decision" and "untrusted_content" in d["input"]["session"]["taint"]]
    first = {}
    for d in calls:
        first.setdefault(d["session_id"], d["seq"])
    assert [r["seq"] for r in tainted] == [
        d["seq"] for d in sorted(calls, key=lambda d: (first[d["session_id"]], d["seq"]))
    ]
    assert all(r["tool"] and r["decision_id"] for r in tainted)

    minted = report("credentials", "--agent", "agent-'c")
    want = [d for d in docs if d["kind"] == "credential" and d["outcome"] == "minted" and d["agent"] == "agent-'c"]
    assert [r["seq"] for r in minted] == [d["seq"] for d in want]
    for row, document in zip(minted, want, strict=True):
        approvers = sorted(
            {
                d["result"]["approver"]
                for d in docs
                if d["kind"] == "approval"
                and d["outcome"] == "approved"
                and d["decision_id"] == document["decision_id"]
            }
        )
        assert row["approver"] == (", ".join(approvers) or None)
        assert (row["credential"], row["lease"], row["scopes"]) == (
            document["result"]["name"],
            document["result"]["lease_id"],
            document["result"]["scopes"],
        )
        assert row["run"] in ("ok", "timeout")
        assert row["revoked_at"] is not None

    decided = report("approvals", "--since", "2026-03-02T00:00:00Z")
    want = [d for d in docs if d["kind"] == "approval" and d["outcome"] in ("approved", "denied")
            and d["timestamp"] >= "2026-03-02T00:00:00"]  # fmt: skip
    assert [(r["approver"], r["outcome"], r["waited_s"]) for r in decided] == [
        (d["result"]["approver"], d["outcome"], 30.5) for d in want
    ]

    denials = report("denials")
    counted: dict[tuple[str, str], int] = {}
    for d in docs:
        if d["kind"] == "decision" and d["outcome"] == "deny":
            for reason in [r["code"] for r in d["result"]["reasons"]]:
                key = (d["tool"], reason)
                counted[key] = counted.get(key, 0) + 1
    summed: dict[tuple[str, str], int] = {}
    for row in denials:
        summed[(row["tool"], row["reason"])] = summed.get((row["tool"], row["reason"]), 0) + row["denials"]
    assert summed == counted


def test_audit_index_reports_progress_and_is_idempotent(tmp_path: Path, audit_log: Log) -> None:
    root = tmp_path / "copy"
    shutil.copytree(audit_log.path.parent, root)
    path = str(root / "audit.jsonl")
    first = stockade("audit", "index", "--path", path, "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["indexed"]
    assert "indexed" in first.stderr
    second = json.loads(stockade("audit", "index", "--path", path, "--json").stdout)
    assert second["indexed"] == []
    assert second["problems"] == []


# -- over HTTP -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(audit_log: Log, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    env = {"STOCKADE_AUDIT__PATH": str(audit_log.path), "STOCKADE_AUDIT__SIGNING_KEY": str(audit_log.key),
           "STOCKADE_AUDIT__SEGMENT_MAX_BYTES": str(SEGMENT_BYTES), "STOCKADE_LOG_LEVEL": "error",
           "STOCKADE_API_PRINCIPALS": json.dumps(principals())}  # fmt: skip
    with stockade_server(["serve"], env, tmp_path_factory.mktemp("serve") / "serve.log", "/healthz") as url:
        yield url


def params(where: EventFilter) -> list[tuple[str, str]]:
    """``where`` as query parameters; text with a lone surrogate (which a URL cannot carry) as the
    log records it, which selects the same events."""
    found: list[tuple[str, str]] = []
    for field in ("session_id", "agent", "tool", "outcome", "kind", "decision_id", "principal", "approver",
                  "credential", "lease", "egress_host", "reason", "taint", "after_seq"):  # fmt: skip
        if getattr(where, field) is not None:
            found.append((field, recorded(str(getattr(where, field)))))
    for field in ("since", "until"):
        if getattr(where, field) is not None:
            found.append((field, getattr(where, field).isoformat()))
    found += [("arg", recorded(f"{key}={value}")) for key, value in where.args]
    return found


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(data=st.data())
def test_the_api_selects_what_the_scan_selects(
    server: str, audit_log: Log, docs: list[dict[str, Any]], data: st.DataObject
) -> None:
    where = data.draw(filters(docs))
    query = params(where)
    page = httpx.get(f"{server}/v1/audit/events", params=[*query, ("limit", "100000")], headers=auth("audit"),
                     timeout=30)  # fmt: skip
    assert page.status_code == 200, page.text
    want = expected(audit_log.path, where)
    assert [e["seq"] for e in page.json()["events"]] == want
    assert page.json()["next_after_seq"] is None


def test_api_pages_cover_every_event_once_and_stream_json_lines(server: str, audit_log: Log) -> None:
    total = len(documents(audit_log.path))
    seen: list[int] = []
    cursor: int | None = 0
    while cursor is not None:
        page = httpx.get(f"{server}/v1/audit/events", params={"after_seq": cursor, "limit": 37},
                         headers=auth("audit"), timeout=30).json()  # fmt: skip
        seen += [e["seq"] for e in page["events"]]
        cursor = page["next_after_seq"]
    assert seen == list(range(1, total + 1))

    with httpx.stream("GET", f"{server}/v1/audit/events", params={"limit": 100000, "kind": "decision"},
                      headers={**auth("audit"), "Accept": "application/x-ndjson"}, timeout=30) as streamed:  # fmt: skip
        assert streamed.headers["content-type"].startswith("application/x-ndjson")
        events = [json.loads(line) for line in streamed.iter_lines() if line]
    by_seq = {d["seq"]: d for d in documents(audit_log.path)}
    assert [e["seq"] for e in events] == expected(audit_log.path, EventFilter(kind="decision"))
    assert all(e == {k: v for k, v in by_seq[e["seq"]].items() if k != "_line"} for e in events)

    decision_id = events[5]["decision_id"]
    trail = httpx.get(f"{server}/v1/audit/decisions/{decision_id}", headers=auth("audit"), timeout=30).json()
    assert [e["seq"] for e in trail] == expected(audit_log.path, EventFilter(decision_id=decision_id))
    refused = httpx.get(f"{server}/v1/audit/events", headers=auth("agent-1"), timeout=30)
    bad = httpx.get(f"{server}/v1/audit/events", params={"arg": "no-equals"}, headers=auth("audit"), timeout=30)
    assert (refused.status_code, bad.status_code) == (403, 422)


def test_the_api_reads_the_redis_stream_with_the_same_filters(tmp_path: Path, redis_url: str) -> None:
    calls = Calls(seed=5)
    events = [e for i in range(25) for e in calls.session(random.Random(i).randint(1, 5))]  # noqa: S311  (seeded)

    async def fill() -> None:
        log = RedisAuditLog(redis_url, spool_dir=tmp_path / "spool", instance="writer")
        for event in events:
            await log.append(event)
        await log.aclose()

    asyncio.run(fill())
    stream = redis.Redis.from_url(redis_url).xrange("stockade:audit")
    docs = []
    for _, fields in stream:
        line = fields[b"event"]
        docs.append({**json.loads(line), "hash": line_hash(line).hex()})
    assert len(docs) == len(events)
    env = {"STOCKADE_AUDIT__BACKEND": "redis", "STOCKADE_STORE__URL": redis_url, "STOCKADE_LOG_LEVEL": "error",
           "STOCKADE_AUDIT__PATH": str(tmp_path / "unused.jsonl"), "STOCKADE_AUDIT__SIGNING_KEY": str(tmp_path / "k"),
           "STOCKADE_API_PRINCIPALS": json.dumps(principals())}  # fmt: skip
    with stockade_server(["serve"], env, tmp_path / "serve.log", "/healthz") as url:
        for where in [EventFilter(), EventFilter(kind="approval", approver="o'brien"), EventFilter(credential="bank"),
                      EventFilter(agent="agent-'c", after_seq=20), EventFilter(args=(("text", HOSTILE[2]),)),
                      EventFilter(taint="untrusted_content", tool="send_email")]:  # fmt: skip
            answer = httpx.get(f"{url}/v1/audit/events", params=[*params(where), ("limit", "100000")],
                               headers=auth("audit"), timeout=30)  # fmt: skip
            assert answer.status_code == 200, answer.text
            current = [d for d in redis_docs(redis_url) if scan_selects(d, where)]
            assert [e["seq"] for e in answer.json()["events"]] == [d["seq"] for d in current]
        paged, cursor = [], 0
        while cursor is not None:
            page = httpx.get(f"{url}/v1/audit/events", params={"after_seq": cursor, "limit": 7},
                             headers=auth("audit"), timeout=30).json()  # fmt: skip
            paged += [e["seq"] for e in page["events"]]
            cursor = page["next_after_seq"]
        assert paged == [d["seq"] for d in redis_docs(redis_url)]


def redis_docs(url: str) -> list[dict[str, Any]]:
    found = []
    for _, fields in redis.Redis.from_url(url).xrange("stockade:audit"):
        line = fields[b"event"]
        found.append({**json.loads(line), "hash": line_hash(line).hex()})
    return found


def test_a_segment_that_spans_midnight_is_split_across_days(tmp_path: Path) -> None:
    path, key = tmp_path / "audit.jsonl", tmp_path / "keys" / "audit.key"

    async def write() -> None:
        log = JsonlAuditLog(path, durability="relaxed", options=LogOptions(
            signer=SigningKey.load_or_create(key), segment_max_bytes=400_000, rotate_daily=False))  # fmt: skip
        calls = Calls(seed=21)
        for _ in range(40):
            for event in calls.session(4):
                await log.append(event)
        await log.aclose()

    asyncio.run(write())
    report = index_sealed(LogLayout(path))
    assert report.indexed
    markers = [json.loads(m.read_text()) for m in (index_dir_of(path) / "segments").glob("*.json")]
    spanning = [m for m in markers if len(m["files"]) > 1]
    assert spanning, "a segment over midnight is one file per day"
    days = sorted(f.split("/")[0] for f in spanning[0]["files"])
    assert days == sorted(set(days))
    midnight = datetime(2026, 3, 2, tzinfo=UTC)
    with AuditQuery(path) as query:
        for where in [EventFilter(since=midnight), EventFilter(until=midnight), EventFilter()]:
            assert [s for (s,) in query.events(where, columns=("seq",))] == expected(path, where)
        _, rows = query.sql("SELECT day, count(*) FROM events GROUP BY day ORDER BY day")
        counted = {day.isoformat(): n for day, n in rows}
    by_day: dict[str, int] = {}
    for document in documents(path):
        by_day[document["timestamp"][:10]] = by_day.get(document["timestamp"][:10], 0) + 1
    assert counted == by_day


async def test_a_full_segment_of_one_mib_events_is_read_and_indexed_within_the_memory_caps(tmp_path: Path) -> None:
    """An agent's ordinary calls with 1 MiB arguments fill a default 64 MiB segment with ~68
    lines. DuckDB's reader holds such a file's buffers whole: past the reader's 128 MB cap a
    query of the unindexed segment failed (503 until indexed), and past the indexer's 256 MB cap
    the segment was never indexed, so every later query, report and export failed. Both now read
    the file in Python, a chunk of lines at a time, where DuckDB's reader cannot."""
    path = tmp_path / "audit.jsonl"
    options = LogOptions(signer=SigningKey.load_or_create(tmp_path / "keys" / "audit.key"), rotate_daily=False)
    log = JsonlAuditLog(path, durability="relaxed", options=options)
    blob = "A" * 1_000_000
    count = 0
    while not any(p.kind == "sealed" for p in LogLayout(path).parts()):
        count += 1
        await log.append(AuditEvent.model_validate({
            "timestamp": "2026-11-29T09:00:00Z", "kind": "decision", "outcome": "allow", "agent": "agent-1",
            "session_id": "s-1", "tool": "echo", "decision_id": f"d-{count}",
            "input": {"args": {"blob": blob}, "tool": {"name": "echo"}},
        }))  # fmt: skip
    await log.aclose()
    sealed = next(p for p in LogLayout(path).parts() if p.kind == "sealed")
    assert sealed.last_seq > 60  # a whole default segment

    def decisions() -> list[str]:
        with AuditQuery(path) as query:
            return [json.loads(line)["decision_id"] for _, _, line in query.events(EventFilter(), limit=None)]

    assert decisions() == [f"d-{n}" for n in range(1, count + 1)]  # unindexed: read line by line
    report = index_sealed(LogLayout(path), snapshot=False)
    assert (report.problems, len(report.indexed)) == ([], 1)
    assert decisions() == [f"d-{n}" for n in range(1, count + 1)]  # from the index
    with AuditQuery(path) as query:
        _, rows = query.sql("SELECT count(*), count(DISTINCT decision_id) FROM events WHERE agent = 'agent-1'")
        assert list(rows) == [(count, count)]
