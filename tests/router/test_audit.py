"""The JSONL audit log: chaining, durability, tamper detection and queries, on real files."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.audit import GENESIS_HASH, AuditEvent, AuditFilter, JsonlAuditLog, canonical, event_hash
from router.audit.chain import seal
from router.errors import AuditError
from router.redact import REDACTOR


def event(n: int, **fields: str) -> AuditEvent:
    base = {
        "decision_id": f"d-{n}",
        "timestamp": f"2026-11-22T10:00:{n:02d}.000000Z",
        "kind": "decision",
        "outcome": "allow",
        "session_id": "s-1",
        "agent": "agent-1",
        "tool": "echo",
    }
    base.update(fields)
    return AuditEvent.model_validate(base)


async def filled(path: Path, n: int = 6) -> JsonlAuditLog:
    log = JsonlAuditLog(path)
    for i in range(1, n + 1):
        await log.append(event(i, tool="echo" if i % 2 else "mail", outcome="allow" if i % 3 else "deny"))
    await log.aclose()
    return JsonlAuditLog(path)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@given(st.dictionaries(st.sampled_from(["", "a", "h", "ha", "has", "hasg", "hasi", "hash_", "hash2", "hashes", "i",
                                        "kind", "prev", "prev_hasi", "prev_hash0", "sep", "seq0", "seqs", "\u00e9",
                                        "Z"]), _json), st.integers(), st.text(max_size=4))  # fmt: skip
def test_seal_serialises_once_what_hash_and_canonical_would(fields: dict[str, object], seq: int, prev: str) -> None:
    document = {**fields, "seq": seq, "prev_hash": prev}
    digest, line = seal(document)
    assert digest == event_hash(document)
    assert line == canonical({**document, "hash": digest})


async def test_events_are_chained_from_genesis(tmp_path: Path) -> None:
    log = JsonlAuditLog(tmp_path / "a.jsonl")
    first = await log.append(event(1))
    second = await log.append(event(2))
    assert (first.seq, first.prev_hash) == (1, GENESIS_HASH)
    assert (second.seq, second.prev_hash) == (2, first.hash)
    assert second.hash == event_hash(second.model_dump(mode="json"))
    stored = json.loads(lines(tmp_path / "a.jsonl")[1])
    assert stored["hash"] == second.hash
    report = await log.verify()
    assert (report.ok, report.events, report.head_seq, report.head_hash) == (True, 2, 2, second.hash)


async def test_modified_event_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    log = await filled(path)
    content = lines(path)
    content[2] = content[2].replace('"outcome":"deny"', '"outcome":"allow"')
    path.write_text("".join(content))
    report = await log.verify()
    assert (report.ok, report.broken_seq, report.line) == (False, 3, 3)
    assert "modified" in report.problem


async def test_modified_event_with_recomputed_hash_breaks_the_next_link(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    log = await filled(path)
    content = lines(path)
    doc = json.loads(content[2])
    doc["outcome"] = "allow"
    doc["hash"] = event_hash(doc)  # a careful forger rehashes the event...
    content[2] = json.dumps(doc) + "\n"
    path.write_text("".join(content))
    report = await log.verify()
    assert (report.ok, report.broken_seq) == (False, 4)  # ...and the successor's prev_hash gives it away
    assert "does not link" in report.problem


async def test_deleted_event_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    log = await filled(path)
    content = lines(path)
    del content[3]
    path.write_text("".join(content))
    report = await log.verify()
    assert (report.ok, report.broken_seq) == (False, 4)
    assert "deleted" in report.problem


async def test_inserted_event_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    log = await filled(path)
    content = lines(path)
    content.insert(2, content[1])
    path.write_text("".join(content))
    report = await log.verify()
    assert (report.ok, report.broken_seq) == (False, 3)


async def test_reordered_events_are_detected(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    log = await filled(path)
    content = lines(path)
    content[1], content[2] = content[2], content[1]
    path.write_text("".join(content))
    report = await log.verify()
    assert (report.ok, report.broken_seq) == (False, 2)


async def test_truncation_in_the_middle_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    log = await filled(path)
    content = lines(path)
    content[3] = content[3][: len(content[3]) // 2] + "\n"
    path.write_text("".join(content))
    report = await log.verify()
    assert (report.ok, report.broken_seq, report.line) == (False, 4, 4)
    assert "truncated" in report.problem


async def test_a_torn_tail_is_set_aside_recorded_and_the_chain_goes_on(tmp_path: Path) -> None:
    """A line without its newline was never acknowledged (a crash mid-write): the next append
    moves it to a side file, records that in the chain, and appends; nothing is lost or wedged."""
    path = tmp_path / "a.jsonl"
    await filled(path, 2)
    size = path.stat().st_size
    with path.open("a") as handle:
        handle.write('{"seq": 3, "half an ev')
    log = JsonlAuditLog(path)
    appended = await log.append(event(3))
    assert appended.seq == 4
    assert (tmp_path / f"a.jsonl.torn-{size}").read_bytes() == b'{"seq": 3, "half an ev'
    report = await log.verify()
    assert (report.ok, report.events) == (True, 4)
    recorded = (await log.query(AuditFilter(outcome="audit_torn_tail")))[0]
    assert recorded.result is not None
    assert (recorded.seq, recorded.result["offset"], recorded.result["length"]) == (3, size, 22)


async def test_an_unreadable_whole_last_line_still_refuses_appends(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    await filled(path, 2)
    with path.open("a") as handle:
        handle.write("this is not an event\n")
    with pytest.raises(AuditError, match="stockade audit verify"):
        await JsonlAuditLog(path).append(event(3))


async def test_concurrent_appends_keep_one_chain(tmp_path: Path) -> None:
    log = JsonlAuditLog(tmp_path / "a.jsonl")
    await asyncio.gather(*(log.append(event(i % 60)) for i in range(200)))
    report = await log.verify()
    assert (report.ok, report.events) == (True, 200)


def _append_from_another_process(path: str, count: int) -> None:
    async def go() -> None:
        log = JsonlAuditLog(Path(path))
        for i in range(count):
            await log.append(event(i % 60, agent="other-process"))
        await log.aclose()

    asyncio.run(go())


async def test_two_processes_appending_to_one_file_keep_one_chain(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    log = JsonlAuditLog(path)
    ctx = multiprocessing.get_context("spawn")
    other = ctx.Process(target=_append_from_another_process, args=(str(path), 100))
    other.start()
    for i in range(100):
        await log.append(event(i % 60))
    await asyncio.to_thread(other.join, 60)
    assert other.exitcode == 0
    report = await log.verify()
    assert (report.ok, report.events) == (True, 200)


async def test_query_filters(tmp_path: Path) -> None:
    log = await filled(tmp_path / "a.jsonl")
    assert [e.seq for e in await log.query(AuditFilter(tool="mail"))] == [2, 4, 6]
    assert [e.seq for e in await log.query(AuditFilter(outcome="deny"))] == [3, 6]
    assert [e.seq for e in await log.query(AuditFilter(tool="echo", outcome="deny"))] == [3]
    assert [e.seq for e in await log.query(AuditFilter(decision_id="d-5"))] == [5]
    assert [e.seq for e in await log.query(AuditFilter(agent="nobody"))] == []
    assert [e.seq for e in await log.query(AuditFilter(limit=2))] == [1, 2]
    t0 = datetime(2026, 11, 22, 10, 0, 0, tzinfo=UTC)
    window = AuditFilter(since=t0 + timedelta(seconds=2), until=t0 + timedelta(seconds=4))
    assert [e.seq for e in await log.query(window)] == [2, 3, 4]


async def test_relaxed_durability_still_chains(tmp_path: Path) -> None:
    log = JsonlAuditLog(tmp_path / "a.jsonl", durability="relaxed")
    for i in range(5):
        await log.append(event(i))
    assert (await log.verify()).ok


async def test_concurrent_appends_share_fsyncs_and_each_returns_only_once_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = JsonlAuditLog(tmp_path / "audit.jsonl")
    real_fsync, synced_sizes = os.fsync, []

    def counting_fsync(fd: int) -> None:
        real_fsync(fd)
        synced_sizes.append(os.fstat(fd).st_size)

    monkeypatch.setattr(os, "fsync", counting_fsync)

    durable_at_return: dict[int, int] = {}

    async def append(i: int) -> int:
        written = await log.append(AuditEvent(kind="decision", decision_id=f"d-{i}", timestamp="t", outcome="allow"))
        durable_at_return[written.seq] = max(synced_sizes, default=0)
        return written.seq

    seqs = await asyncio.gather(*(append(i) for i in range(200)))
    await log.aclose()
    assert sorted(seqs) == list(range(1, 201))
    ends, offset = {}, 0
    for line in (tmp_path / "audit.jsonl").read_bytes().splitlines(keepends=True):
        offset += len(line)
        ends[json.loads(line)["seq"]] = offset
    assert all(durable_at_return[seq] >= ends[seq] for seq in seqs)  # none returned before its bytes were synced
    assert 0 < len(synced_sizes) < 200  # batched
    assert synced_sizes[-1] == (tmp_path / "audit.jsonl").stat().st_size  # the last fsync covered everything
    assert log.verify_sync().ok


async def test_every_event_is_written_redacted_whoever_appends_it(tmp_path: Path) -> None:
    """Redaction is the log's: approvals, reports and refusals reach it without the control plane's help."""
    secret = "canary-7f3a9e-upstream-key"
    REDACTOR.add(secret, "upstream")
    try:
        log = JsonlAuditLog(tmp_path / "audit.jsonl")
        written = await log.append(event(1, outcome=f"saw {secret}"))
        await log.append(AuditEvent(kind="approval", decision_id="d-2", timestamp="t", outcome="requested",
                                    result={"note": secret, secret: [secret]}))  # fmt: skip
    finally:
        REDACTOR.discard(secret)
    text = (tmp_path / "audit.jsonl").read_text()
    assert secret not in text
    assert text.count("[REDACTED:upstream]") == 4
    assert written.outcome == "saw [REDACTED:upstream]"
    assert log.verify_sync().ok
