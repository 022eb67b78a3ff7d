"""What the auditor's queries answer when the index, the log's lines or its listing are not what a
query expects: a forged or cut index, a line longer than DuckDB's reader takes, a damaged line, a
segment retired while the log is listed, and a stream that fails once its status is sent. Real logs
written through `JsonlAuditLog.append`, the real indexer, real DuckDB and the real API app."""

from __future__ import annotations

import asyncio
import hashlib
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import httpx
import pytest

from router.audit import AuditEvent, JsonlAuditLog, line_hash
from router.audit import index as audit_index
from router.audit.checkpoint import SigningKey
from router.audit.index import AuditQuery, EventFilter, index_dir_of, index_sealed
from router.audit.jsonl import LogOptions
from router.audit.layout import LogLayout, Part, lines
from router.control import ControlPlane
from router.errors import AuditError
from router.interfaces.api.app import create_app
from router.settings import ApiPrincipal, AuditSettings, PolicySettings, Settings

REPO = Path(__file__).resolve().parents[2]
TOKEN = "tok-auditor"


def make_log(root: Path, count: int, *, segment_bytes: int = 8000, big: dict[int, int] | None = None) -> Path:
    """A log of ``count`` decisions (seq 1 first; every 7th a deny, sessions s-0..s-3), sealed
    every ``segment_bytes``; ``big`` maps an event's index to the size of a string in its result."""
    path = root / "audit.jsonl"
    key = SigningKey.load_or_create(root / "keys" / "audit.key")
    options = LogOptions(signer=key, segment_max_bytes=segment_bytes, checkpoint_interval_s=3600, rotate_daily=False)

    async def write() -> None:
        log = JsonlAuditLog(path, durability="relaxed", options=options)
        at = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
        for i in range(count):
            result: dict[str, Any] = {"reasons": [{"code": "x.y"}]}
            if big and i in big:
                result["stdout"] = "y" * big[i]
            await log.append(AuditEvent.model_validate({
                "decision_id": f"d-{i}", "timestamp": at.isoformat().replace("+00:00", "Z"), "kind": "decision",
                "outcome": "deny" if i % 7 == 0 else "allow", "tool": "pay" if i % 5 == 0 else "read_web",
                "agent": f"agent-{i % 3}", "session_id": f"s-{i % 4}", "input": {"args": {"n": i}}, "result": result,
            }))  # fmt: skip
            at += timedelta(seconds=30)
        await log.aclose()

    asyncio.run(write())
    return path


def scan(path: Path) -> list[dict[str, Any]]:
    """Every event the log's files hold, from their lines: the truth a query is checked against."""
    found = []
    for part in LogLayout(path).parts():
        if part.kind != "tombstone":
            for _, line in lines(part.path):
                found.append(json.loads(line) | {"_line": line.decode()})
    return found


def index_file_of(path: Path, seq: int) -> Path:
    """The Parquet file of the index that holds event ``seq``."""
    for file in index_dir_of(path).glob("day=*/*.parquet"):
        first, last = (int(n) for n in file.stem.split("-"))
        if first <= seq <= last:
            return file
    raise AssertionError(f"no index file holds {seq}")


def rewrite(file: Path, select: str, params: list[Any] | None = None) -> None:
    """Replace an index file by ``select`` over it (``{file}``), as someone who can write the index would."""
    staged = file.with_suffix(".staged")
    query = select.replace("{file}", f"read_parquet('{file}')")
    duckdb.execute(f"COPY ({query}) TO '{staged}' (FORMAT parquet)", params or [])
    staged.replace(file)


def seqs(query: AuditQuery, where: EventFilter) -> list[int]:
    return [seq for seq, _, _ in query.events(where)]


@pytest.fixture
def indexed(tmp_path: Path) -> Path:
    path = make_log(tmp_path, 120)
    report = index_sealed(LogLayout(path), snapshot=False)
    assert report.indexed
    assert not report.problems
    return path


# -- the index is where to look, the log is the answer ----------------------------------------


def test_an_index_row_forged_with_its_hash_is_refused_never_returned(indexed: Path) -> None:
    """An event's copy in the index edited, and its hash recomputed to match: the line at its
    offset in the log does not hash to it, so the query fails naming the seq, instead of answering
    the forged copy."""
    docs = {d["seq"]: d for d in scan(indexed)}
    forged_seq = 15  # a deny (index 14)
    assert docs[forged_seq]["outcome"] == "deny"
    forged = docs[forged_seq]["_line"].replace('"tool":"read_web"', '"tool":"FORGED"')
    assert forged != docs[forged_seq]["_line"]
    rewrite(
        index_file_of(indexed, forged_seq),
        "SELECT * REPLACE (CASE WHEN seq = 15 THEN ? ELSE event END AS event, "
        "CASE WHEN seq = 15 THEN ? ELSE hash END AS hash) FROM {file}",
        [forged, line_hash(forged.encode()).hex()],
    )
    with AuditQuery(indexed) as query:
        for where in (EventFilter(outcome="deny"), EventFilter(), EventFilter(session_id="s-2")):
            with pytest.raises(AuditError, match=r"event 15 .*the index does not match the log"):
                list(query.events(where))
        assert seqs(query, EventFilter(to_seq=14)) == list(range(1, 15))


def test_an_index_column_that_says_more_than_its_line_does_not_select_it(indexed: Path) -> None:
    """An index row whose outcome column was flipped (its event and hash left as they are): a query
    for the forged outcome does not return it, since the filter is checked on the line read from the
    log; every answer is what a scan of the log's lines gives."""
    rewrite(
        index_file_of(indexed, 8),
        "SELECT * REPLACE (CASE WHEN seq = 8 THEN 'allow' ELSE outcome END AS outcome) FROM {file}",
    )
    docs = scan(indexed)
    with AuditQuery(indexed) as query:
        assert not query.unindexed
        allowed = seqs(query, EventFilter(outcome="allow"))
        assert 8 not in allowed
        assert allowed == [d["seq"] for d in docs if d["outcome"] == "allow"]
        found = list(query.events(EventFilter(outcome="allow"), columns=("seq", "outcome", "event")))
        assert all(outcome == "allow" == json.loads(line)["outcome"] for _, outcome, line in found)


def test_an_index_file_with_a_row_removed_is_not_used(indexed: Path) -> None:
    """A row deleted from an index file (the event hidden from every query the index answers): the
    file's footers no longer hold one row per seq of its segment, so the segment is read from the
    log instead, and the next indexer run indexes it again."""
    file = index_file_of(indexed, 9)
    rewrite(file, "SELECT * FROM {file} WHERE seq <> 9")
    docs = scan(indexed)
    with AuditQuery(indexed) as query:
        assert query.unindexed == [file.stem]
        assert seqs(query, EventFilter(session_id="s-0")) == [d["seq"] for d in docs if d["session_id"] == "s-0"]
        assert seqs(query, EventFilter()) == [d["seq"] for d in docs]
    again = index_sealed(LogLayout(indexed), snapshot=False)
    assert len(again.indexed) == 1
    with AuditQuery(indexed) as query:
        assert not query.unindexed
        assert 9 in seqs(query, EventFilter(session_id="s-0"))


# -- lines DuckDB's reader does not take -------------------------------------------------------


def test_an_event_longer_than_duckdbs_reader_takes_is_answered_and_indexed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line over the longest DuckDB's CSV reader takes (lowered here to keep the test small; 64 MiB
    in use) is read in Python: a filtered query and a seq range both return it, before the index
    covers its segment and after, and the indexer indexes that segment."""
    monkeypatch.setattr(audit_index, "_MAX_LINE", 16 << 10)
    path = make_log(tmp_path, 40, big={5: 20 << 10, 38: 20 << 10})  # one sealed, one in the active segment
    docs = scan(path)
    long = [d["seq"] for d in docs if len(d["_line"]) > audit_index._MAX_LINE]
    assert long == [6, 39]
    parts = LogLayout(path).parts()
    assert any(p.kind == "sealed" and p.first_seq <= 6 <= p.last_seq for p in parts)

    def check() -> None:
        with AuditQuery(path) as query:
            for where in (EventFilter(session_id="s-1"), EventFilter(agent="agent-2"), EventFilter(args=(("n", "5"),))):
                want = [d["seq"] for d in docs if audit_index.matches(audit_index.promote(d["_line"].encode()), where)]
                assert seqs(query, where) == want
            got = {seq: line for seq, _, line in query.events(EventFilter())}
            assert got == {d["seq"]: d["_line"] for d in docs}

    check()
    report = index_sealed(LogLayout(path))
    assert not report.problems
    check()


def test_a_line_that_is_not_an_event_is_named_not_taken_for_a_seal(tmp_path: Path) -> None:
    """A damaged line in a sealed segment (not JSON): a seq range that would skip it fails saying the
    line is not a readable event and to verify the log, not that a segment was sealed meanwhile."""
    path = make_log(tmp_path, 30)
    sealed = next(p for p in LogLayout(path).parts() if p.kind == "sealed")
    raw = sealed.path.read_bytes()
    second = raw.index(b"\n") + 1
    sealed.path.write_bytes(raw[:second] + b"#" + raw[second + 1 :])  # seq 2's line, its length kept
    with AuditQuery(path) as query:
        with pytest.raises(AuditError, match=r"event 2 .*not a readable event.*stockade audit verify") as found:
            list(query.events(EventFilter()))
        assert "sealed while" not in str(found.value)


# -- retention while a query lists the log -----------------------------------------------------


def test_a_segment_retired_while_the_log_is_listed_is_a_gap_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention deletes the oldest (unindexed) sealed segment right after a query listed the log,
    before it read it: the query lists again and answers without those events, as it would a
    moment later, instead of failing with DuckDB's I/O error."""
    path = make_log(tmp_path, 60)
    listed = LogLayout.parts
    retired: list[Part] = []

    def parts_then_retention(self: LogLayout) -> list[Part]:
        found = listed(self)
        if not retired:
            retired.append(next(p for p in found if p.kind == "sealed"))
            retired[0].path.unlink()  # what retention does to the segment's bytes
        return found

    monkeypatch.setattr(LogLayout, "parts", parts_then_retention)
    with AuditQuery(path) as query:
        got = seqs(query, EventFilter())
    assert retired
    assert got == list(range(retired[0].last_seq + 1, 61))


# -- the stream over HTTP ----------------------------------------------------------------------


@pytest.fixture
def api(tmp_path: Path) -> tuple[Path, Settings]:
    """An API app over a log of 700 events, indexed, for an auditor's token."""
    path = make_log(tmp_path, 700, segment_bytes=64_000)
    index_sealed(LogLayout(path), snapshot=False)
    settings = Settings(
        audit=AuditSettings(path=path, signing_key=tmp_path / "keys" / "audit.key"),
        policy=PolicySettings(dir=REPO / "policies"),
        api_principals=[ApiPrincipal.model_validate(
            {"name": "audit", "role": "auditor", "token_sha256": hashlib.sha256(TOKEN.encode()).hexdigest()})],
    )  # fmt: skip
    return path, settings


async def _get_stream(settings: Settings, params: dict[str, Any]) -> httpx.Response:
    async with ControlPlane.from_settings(settings) as plane:
        transport = httpx.ASGITransport(create_app(plane))
        async with httpx.AsyncClient(transport=transport, base_url="http://stockade") as client:
            headers = {"Authorization": f"Bearer {TOKEN}", "Accept": "application/x-ndjson"}
            return await client.get("/v1/audit/events", params=params, headers=headers)


def test_a_stream_that_fails_partway_ends_with_a_problem_line(api: tuple[Path, Settings]) -> None:
    """A query that fails once the first events are sent (here at an index row that does not match
    the log) ends its stream with one problem line, no ``seq`` in it, code ``audit.unavailable``:
    a client reading seqs sees the answer stop short, and where to continue from."""
    path, settings = api
    forged_seq = 600
    line = next(d["_line"] for d in scan(path) if d["seq"] == forged_seq)
    forged = line.replace('"agent":"', '"agent":"forged-')
    rewrite(
        index_file_of(path, forged_seq),
        "SELECT * REPLACE (CASE WHEN seq = ? THEN ? ELSE event END AS event, "
        "CASE WHEN seq = ? THEN ? ELSE hash END AS hash) FROM {file}",
        [forged_seq, forged, forged_seq, line_hash(forged.encode()).hex()],
    )
    answer = asyncio.run(_get_stream(settings, {"limit": 1000}))
    assert answer.status_code == 200
    sent = [json.loads(text) for text in answer.text.splitlines()]
    events, last = sent[:-1], sent[-1]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert 0 < len(events) < forged_seq
    assert "seq" not in last
    assert last["code"] == "audit.unavailable"
    assert last["type"] == "urn:stockade:problem:audit.unavailable"
    assert f"event {forged_seq}" in last["detail"]

    # Asked again from the last seq received: the failure is a 503 problem before any event.
    again = asyncio.run(_get_stream(settings, {"after_seq": forged_seq - 1, "limit": 10}))
    assert again.status_code == 503
    assert again.json()["code"] == "audit.unavailable"
