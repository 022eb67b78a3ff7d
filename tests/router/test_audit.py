"""The JSONL audit log: chaining, durability, tamper detection and queries, on real files."""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import os
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.audit import GENESIS_HASH, AuditEvent, AuditFilter, JsonlAuditLog, canonical, line_hash, timestamp
from router.audit.chain import Unsealed, check_link, document_of, head_of
from router.audit.checkpoint import SigningKey
from router.audit.jsonl import LogOptions
from router.errors import AuditError
from router.redact import REDACTOR
from tests.faults.conftest import fill, small_tmpfs


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


async def filled(path: Path, n: int = 6, options: LogOptions | None = None) -> JsonlAuditLog:
    log = JsonlAuditLog(path, options=options)
    for i in range(1, n + 1):
        await log.append(event(i, tool="echo" if i % 2 else "mail", outcome="allow" if i % 3 else "deny"))
    await log.aclose()
    return JsonlAuditLog(path, options=options)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def signed(tmp_path: Path) -> LogOptions:
    """Options with a signing key (checkpoints on close), no rotation."""
    return LogOptions(signer=SigningKey.load_or_create(tmp_path / "keys" / "audit.key"), segment_max_bytes=None,
                      checkpoint_interval_s=3600)  # fmt: skip


def rechain(content: list[str], start: int) -> list[str]:
    """``content`` with every line from index ``start`` on re-linked to the one before it, as a forger
    without the key would: each line's bytes hashed, and the next line's prev_hash set to that."""
    out = list(content)
    prev = line_hash(out[start - 1].rstrip("\n").encode()).hex() if start else GENESIS_HASH
    for i in range(start, len(out)):
        document = json.loads(out[i])
        _, text = Unsealed(document).seal(document["seq"], prev)
        out[i] = text.decode() + "\n"
        prev = line_hash(text).hex()
    return out


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_hex64 = st.text("0123456789abcdef", min_size=64, max_size=64)


@given(st.dictionaries(st.sampled_from(["", "a", "h", "ha", "has", "hasg", "hasi", "hash", "hash_", "hash2", "hashes",
                                        "i", "kind", "prev", "prev_hash", "prev_hasi", "prev_hash0", "sep", "seq",
                                        "seq0", "seqs", "\u00e9", "Z"]), _json),
       st.integers(min_value=1, max_value=10**18), _hex64)  # fmt: skip
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_seal_puts_the_chain_in_front_of_the_canonical_rest(fields: dict[str, object], seq: int, prev: str) -> None:
    digest, line = Unsealed(fields).seal(seq, prev)
    rest = {k: v for k, v in fields.items() if k not in ("seq", "prev_hash", "hash")}
    assert json.loads(line) == {**rest, "seq": seq, "prev_hash": prev}  # the chain fields win over the event's
    body = canonical(rest)
    assert line == f'{{"seq":{seq},"prev_hash":"{prev}"{"," + body[1:] if body != "{}" else "}"}'.encode()
    assert b"\n" not in line
    assert digest == line_hash(line).hex()
    assert head_of(line) == (seq, prev)
    read = document_of(line)
    assert read is not None
    assert read["hash"] == digest  # the hash is the line's, not a field in it
    assert check_link(line, seq, prev) == ("", seq)


@pytest.mark.parametrize("prev", ["", "0" * 63, "0" * 65, "A" * 64, "g" * 64, "0" * 64 + "\n"])
def test_seal_refuses_a_prev_hash_that_is_not_64_lowercase_hex(prev: str) -> None:
    with pytest.raises(ValueError, match="prev_hash"):
        Unsealed({"kind": "decision"}).seal(1, prev)


@pytest.mark.parametrize(
    "line",
    [b"", b"{}", b'{"seq":0,"prev_hash":"' + b"0" * 64 + b'"}', b'{"seq":01,"prev_hash":"' + b"0" * 64 + b'"}',
     b'{"prev_hash":"' + b"0" * 64 + b'","seq":1}', b'{"seq": 1,"prev_hash":"' + b"0" * 64 + b'"}',
     b'{"seq":1,"prev_hash":"' + b"0" * 63 + b'"}', b'{"seq":1,"prev_hash":"' + b"0" * 64 + b'"x'],
)  # fmt: skip
def test_a_line_that_does_not_start_as_a_chained_event_has_no_head(line: bytes) -> None:
    assert head_of(line) is None
    assert "not a chained event" in check_link(line, 1, GENESIS_HASH)[0]


async def test_events_are_chained_from_genesis(tmp_path: Path) -> None:
    log = JsonlAuditLog(tmp_path / "a.jsonl")
    first = await log.append(event(1))
    second = await log.append(event(2))
    assert (first.seq, first.prev_hash) == (1, GENESIS_HASH)
    assert (second.seq, second.prev_hash) == (2, first.hash)
    raw = (tmp_path / "a.jsonl").read_bytes().splitlines()
    assert [line_hash(line).hex() for line in raw] == [first.hash, second.hash]
    assert raw[1].startswith(b'{"seq":2,"prev_hash":"' + first.hash.encode() + b'",')
    stored = json.loads(raw[1])
    assert "hash" not in stored  # the successor (or a checkpoint) holds an event's hash, not its own line
    assert stored["prev_hash"] == first.hash
    report = await log.verify()
    assert (report.ok, report.events, report.head_seq, report.head_hash) == (True, 2, 2, second.hash)


async def test_an_event_modified_in_place_is_named_by_its_successors_link(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    log = await filled(path)
    content = lines(path)
    content[2] = content[2].replace('"outcome":"deny"', '"outcome":"allow"')
    path.write_text("".join(content))
    report = await log.verify()
    assert (report.ok, report.broken_seq, report.line) == (False, 3, 4)  # found at line 4: seq 4's prev_hash
    assert "event seq 3 was modified" in report.problem
    assert "line 4" in report.problem


async def test_the_last_event_modified_is_seen_only_through_a_signed_checkpoint(tmp_path: Path) -> None:
    """No successor records the last event's hash: the chain alone cannot see it changed (and
    says that it only checked the chain); the checkpoint signed at close does."""
    for options, detected in ((None, False), (signed(tmp_path), True)):
        path = tmp_path / f"{detected}.jsonl"
        log = await filled(path, options=options)
        content = lines(path)
        content[5] = content[5].replace('"outcome":"deny"', '"outcome":"allow"')
        path.write_text("".join(content))
        report = await log.verify()
        assert report.ok is not detected
        if detected:  # no checkpoint before the one at close: the whole unvouched range is suspect
            assert report.broken_seq is not None
            assert 1 <= report.broken_seq <= 6
            assert "differs from its signed checkpoint" in report.problem
        else:
            assert any("only the chain was checked" in note for note in report.notes)


async def test_a_forger_who_relinks_the_successor_moves_the_break_but_a_full_rechain_needs_a_checkpoint(
    tmp_path: Path,
) -> None:
    path = tmp_path / "a.jsonl"
    log = await filled(path)
    original = lines(path)
    content = list(original)
    content[2] = content[2].replace('"outcome":"deny"', '"outcome":"allow"')
    relinked = rechain(content, 3)[:4] + content[4:]  # seq 4 records the forged seq 3's hash; seq 5 does not
    path.write_text("".join(relinked))
    report = await log.verify()
    assert (report.ok, report.broken_seq) == (False, 4)

    path.write_text("".join(rechain(content, 3)))  # every later event re-linked: the chain alone is fooled
    assert (await log.verify()).ok

    keyed = tmp_path / "keyed.jsonl"
    keyed_log = await filled(keyed, options=signed(tmp_path))
    forged = lines(keyed)
    forged[2] = forged[2].replace('"outcome":"deny"', '"outcome":"allow"')
    keyed.write_text("".join(rechain(forged, 3)))
    report = await keyed_log.verify()
    assert (report.ok, report.broken_seq) == (False, 1)  # no checkpoint before the close: the whole range
    assert "re-chained" in report.problem


async def test_deleted_event_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    log = await filled(path)
    content = lines(path)
    del content[3]
    path.write_text("".join(content))
    report = await log.verify()
    assert (report.ok, report.broken_seq, report.line) == (False, 4, 4)
    assert "deleted" in report.problem


async def test_inserted_event_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    log = await filled(path)
    content = lines(path)
    content.insert(2, content[1])
    path.write_text("".join(content))
    report = await log.verify()
    assert (report.ok, report.broken_seq) == (False, 3)
    assert "inserted" in report.problem


async def test_reordered_events_are_detected(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    log = await filled(path)
    content = lines(path)
    content[1], content[2] = content[2], content[1]
    path.write_text("".join(content))
    report = await log.verify()
    assert (report.ok, report.broken_seq) == (False, 2)


@pytest.mark.parametrize(("keep", "problem"), [(40, "truncated"), (200, "modified")])
async def test_a_line_cut_short_in_the_middle_is_detected(tmp_path: Path, keep: int, problem: str) -> None:
    """Cut inside the chain fields, the line is no event; cut after them, a changed one."""
    path = tmp_path / "a.jsonl"
    log = await filled(path)
    content = lines(path)
    content[3] = content[3][:keep] + "\n"
    path.write_text("".join(content))
    report = await log.verify()
    assert (report.ok, report.broken_seq) == (False, 4)
    assert problem in report.problem


async def test_the_tail_cut_off_is_seen_only_through_a_signed_checkpoint(tmp_path: Path) -> None:
    for options, detected in ((None, False), (signed(tmp_path), True)):
        path = tmp_path / f"{detected}.jsonl"
        log = await filled(path, options=options)
        path.write_text("".join(lines(path)[:4]))
        report = await log.verify()
        assert report.ok is not detected
        if detected:
            assert (report.broken_seq, report.events) == (5, 4)
            assert "cut off" in report.problem


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
    assert recorded.result["set_aside"] == f"a.jsonl.torn-{size}"


async def test_a_torn_tail_under_a_running_writer_is_set_aside_too(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    log = JsonlAuditLog(path, options=signed(tmp_path))
    for i in range(1, 3):
        await log.append(event(i))
    size = path.stat().st_size
    with path.open("ab") as handle:  # another process crashed mid-write
        handle.write(b'{"seq":3,"prev_')
    assert (await log.append(event(3))).seq == 4
    await log.aclose()
    assert (tmp_path / f"a.jsonl.torn-{size}").read_bytes() == b'{"seq":3,"prev_'
    report = JsonlAuditLog(path, options=signed(tmp_path)).verify_sync()
    assert (report.ok, report.events, report.signed) == (True, 4, 4)


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


def _append_from_another_process(path: str, count: int, key: str | None) -> None:
    async def go() -> None:
        options = None
        if key is not None:
            options = LogOptions(signer=SigningKey.load_or_create(Path(key)), checkpoint_every=7,
                                 segment_max_bytes=None, checkpoint_interval_s=3600)  # fmt: skip
        log = JsonlAuditLog(Path(path), options=options)
        for i in range(count):
            await log.append(event(i % 60, agent="other-process"))
        await log.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("with_key", [False, True])
async def test_two_processes_appending_to_one_file_keep_one_chain(tmp_path: Path, with_key: bool) -> None:
    path = tmp_path / "a.jsonl"
    key = tmp_path / "keys" / "audit.key"
    options = None
    if with_key:
        options = LogOptions(signer=SigningKey.load_or_create(key), checkpoint_every=5, segment_max_bytes=None,
                             checkpoint_interval_s=3600)  # fmt: skip
    log = JsonlAuditLog(path, options=options)
    ctx = multiprocessing.get_context("spawn")
    other = ctx.Process(target=_append_from_another_process, args=(str(path), 100, str(key) if with_key else None))
    other.start()
    for i in range(100):
        await log.append(event(i % 60))
    await asyncio.to_thread(other.join, 60)
    assert other.exitcode == 0
    await log.aclose()
    report = JsonlAuditLog(path, options=options).verify_sync()
    assert (report.ok, report.events) == (True, 200)
    seqs = [json.loads(line)["seq"] for line in lines(path)]
    assert seqs == list(range(1, 201))
    assert sum('"agent":"other-process"' in line for line in lines(path)) == 100
    if with_key:
        assert report.signed == 200  # both processes' checkpoints form one chain of tree heads
        assert report.checkpoints >= 200 // 7


async def test_query_filters(tmp_path: Path) -> None:
    log = await filled(tmp_path / "a.jsonl")
    assert [e.seq for e in await log.query(AuditFilter(tool="mail"))] == [2, 4, 6]
    assert [e.seq for e in await log.query(AuditFilter(outcome="deny"))] == [3, 6]
    assert [e.seq for e in await log.query(AuditFilter(tool="echo", outcome="deny"))] == [3]
    assert [e.seq for e in await log.query(AuditFilter(decision_id="d-5"))] == [5]
    assert [e.seq for e in await log.query(AuditFilter(agent="nobody"))] == []
    assert [e.seq for e in await log.query(AuditFilter(limit=2))] == [1, 2]
    assert [e.seq for e in await log.query(AuditFilter(kind="decision", session_id="s-1", limit=1))] == [1]
    t0 = datetime(2026, 11, 22, 10, 0, 0, tzinfo=UTC)
    window = AuditFilter(since=t0 + timedelta(seconds=2), until=t0 + timedelta(seconds=4))
    assert [e.seq for e in await log.query(window)] == [2, 3, 4]


async def test_queried_events_carry_the_hash_the_chain_and_the_successor_record(tmp_path: Path) -> None:
    log = await filled(tmp_path / "a.jsonl")
    events = await log.query(AuditFilter())
    assert [e.seq for e in events] == [1, 2, 3, 4, 5, 6]
    assert [e.prev_hash for e in events[1:]] == [e.hash for e in events[:-1]]
    assert events[0].prev_hash == GENESIS_HASH
    assert [e.hash for e in events] == [line_hash(raw).hex() for raw in (tmp_path / "a.jsonl").read_bytes().split()]


async def test_relaxed_durability_still_chains(tmp_path: Path) -> None:
    log = JsonlAuditLog(tmp_path / "a.jsonl", durability="relaxed")
    for i in range(5):
        await log.append(event(i))
    report = await log.verify()
    assert (report.ok, report.events) == (True, 5)


async def test_concurrent_appends_share_fsyncs_and_each_returns_only_once_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = JsonlAuditLog(tmp_path / "audit.jsonl")
    synced_sizes: list[int] = []

    def counted(real: Callable[[int], None]) -> Callable[[int], None]:
        def sync(fd: int) -> None:  # the real fsync (or fdatasync), counted
            real(fd)
            synced_sizes.append(os.fstat(fd).st_size)

        return sync

    monkeypatch.setattr(os, "fsync", counted(os.fsync))
    monkeypatch.setattr(os, "fdatasync", counted(os.fdatasync))

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
    raw = (tmp_path / "audit.jsonl").read_bytes()
    assert secret.encode() not in raw
    assert raw.count(b"[REDACTED:upstream]") == 4
    assert written.outcome == "saw [REDACTED:upstream]"
    assert written.hash == line_hash(raw.splitlines()[0]).hex()  # the hash is of the redacted line
    assert log.verify_sync().ok


async def test_text_utf8_cannot_hold_is_escaped_and_the_paths_recorded(tmp_path: Path) -> None:
    log = JsonlAuditLog(tmp_path / "audit.jsonl")
    written = await log.append(AuditEvent(kind="execution", decision_id="d-1", timestamp=timestamp(), outcome="ok",
                                          result={"name": "bad\udc80name", "ok": "caf\u00e9"}))  # fmt: skip
    raw = (tmp_path / "audit.jsonl").read_bytes()
    raw.decode()  # valid UTF-8 throughout
    assert "caf\u00e9".encode() in raw  # non-ASCII kept as UTF-8, not escaped
    assert written.escaped == ["result.name"]
    stored = json.loads(raw)
    assert stored["escaped"] == ["result.name"]
    assert stored["result"]["name"] != "bad\udc80name"
    assert "udc80" in stored["result"]["name"]
    assert written.hash == line_hash(raw.rstrip(b"\n")).hex()
    report = await log.verify()
    assert (report.ok, report.events) == (True, 1)


def _page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


async def _with_checkpoint_room_smaller_than_event_room(disk: Path) -> tuple[JsonlAuditLog, SigningKey, int]:
    """A signed log (a checkpoint after every event) on ``disk``, its events file 16 bytes into a
    fresh page and its checkpoints file somewhere in its last page: once the disk is full, the
    checkpoints file runs out of room before the events file does. Returns the log, its key and
    the events appended."""
    key = SigningKey.generate()
    path = disk / "audit.jsonl"
    log = JsonlAuditLog(path, options=LogOptions(signer=key, checkpoint_every=1, segment_max_bytes=None,
                                                 checkpoint_interval_s=3600))  # fmt: skip
    await log.append(AuditEvent(kind="decision", decision_id="d-0", timestamp=timestamp(), outcome="allow"))
    before = path.stat().st_size
    await log.append(AuditEvent(kind="decision", decision_id="d-1", timestamp=timestamp(), outcome="allow",
                                result={"p": ""}))  # fmt: skip
    unpadded = path.stat().st_size - before
    pad = (_page_size() - path.stat().st_size % _page_size()) + 16 - unpadded
    await log.append(AuditEvent(kind="decision", decision_id="d-2", timestamp=timestamp(), outcome="allow",
                                result={"p": "x" * pad}))  # fmt: skip
    assert path.stat().st_size % _page_size() == 16
    return log, key, 3


async def test_a_full_disk_while_a_checkpoint_is_written_leaves_the_checkpoints_readable(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", 256) as disk:
        log, key, _ = await _with_checkpoint_room_smaller_than_event_room(disk)
        filler = fill(disk)
        failures = 0
        for i in range(3, 40):
            try:
                await log.append(AuditEvent(kind="decision", decision_id=f"d-{i}", timestamp=timestamp(),
                                            outcome="allow"))  # fmt: skip
            except AuditError:
                failures += 1
        assert failures > 0
        filler.unlink()  # space returns
        await log.append(AuditEvent(kind="decision", decision_id="d-99", timestamp=timestamp(), outcome="allow"))
        await log.aclose()
        checkpoints = (disk / "audit.jsonl.checkpoints").read_bytes()
        torn = []
        for line in checkpoints.splitlines():
            try:
                json.loads(line)
            except ValueError:
                torn.append(line[-60:])
        assert torn == []  # a checkpoint the disk could not hold is not left half-written
        report = JsonlAuditLog(disk / "audit.jsonl", options=LogOptions(signer=key)).verify_sync()
        assert (report.ok, report.problem) == (True, "")


async def test_an_append_that_reports_failure_leaves_no_event_in_the_log(tmp_path: Path) -> None:
    """`append` raising means the call is denied: an event it reported as not written must not be
    in the log (the log would record, say, an allow for a call that never ran)."""
    with small_tmpfs(tmp_path / "disk", 256) as disk:
        log, _, acknowledged = await _with_checkpoint_room_smaller_than_event_room(disk)
        filler = fill(disk)
        refused: list[str] = []
        for i in range(3, 40):
            try:
                await log.append(AuditEvent(kind="decision", decision_id=f"d-{i}", timestamp=timestamp(),
                                            outcome="allow"))  # fmt: skip
                acknowledged += 1
            except AuditError:
                refused.append(f"d-{i}")
        filler.unlink()
        await log.aclose()
        recorded = {json.loads(line)["decision_id"] for line in (disk / "audit.jsonl").read_bytes().splitlines()}
        assert len(recorded) == acknowledged
        assert sorted(recorded & set(refused)) == []  # refused, yet on record: none


async def test_event_lines_are_what_the_module_docstring_says(tmp_path: Path) -> None:
    log = JsonlAuditLog(tmp_path / "a.jsonl")
    written = await log.append(event(1))
    await log.aclose()
    raw = (tmp_path / "a.jsonl").read_bytes()
    assert re.fullmatch(rb'\{"seq":1,"prev_hash":"0{64}","agent":"agent-1",.*\}\n', raw)
    assert written.hash == hashlib.sha256(b"\x00" + raw[:-1]).hexdigest()
