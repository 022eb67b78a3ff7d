"""The JSONL log's segments: sealed by size and by UTC day, one chain and one Merkle tree across
them (and across restarts and processes), a seal cut short by a crash finished on restart,
retention leaving signed tombstones, an active segment moved or deleted under the log, masking
before hashing, and checkpoints published as new files only. All on real files."""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from router.audit import AuditEvent, AuditFilter, line_hash, timestamp
from router.audit.chain import GENESIS_HASH, head_of
from router.audit.checkpoint import Checkpoint, SigningKey, VerifyKey
from router.audit.export import export_events, verify_export
from router.audit.jsonl import JsonlAuditLog, LogOptions, publish_file
from router.audit.layout import LogLayout, lines
from router.audit.merkle import CompactRange, inclusion_proof, verify_inclusion
from router.audit.verify import inclusion_proofs, verify_log
from router.errors import AuditError


def event(n: int, at: str | None = None, **fields: object) -> AuditEvent:
    stamp = at or f"2026-11-22T10:{n // 60 % 60:02d}:{n % 60:02d}.000000Z"
    return AuditEvent.model_validate({"decision_id": f"d-{n}", "timestamp": stamp, "kind": "decision",
                                      "outcome": "allow", "agent": "agent-1", "tool": "echo", **fields})  # fmt: skip


def key_of(tmp_path: Path) -> SigningKey:
    return SigningKey.load_or_create(tmp_path / "keys" / "audit.key")


def options(tmp_path: Path, **changes: object) -> LogOptions:
    chosen = {"signer": key_of(tmp_path), "checkpoint_interval_s": 3600, "checkpoint_every": 1000,
              "publish_dir": tmp_path / "published", "segment_max_bytes": 1500, **changes}  # fmt: skip
    return LogOptions(**chosen)  # type: ignore[arg-type]


def all_lines(layout: LogLayout) -> list[bytes]:
    return [line for part in layout.parts() if part.kind != "tombstone" for _, line in lines(part.path)]


def seqs(layout: LogLayout) -> list[int]:
    found = []
    for line in all_lines(layout):
        head = head_of(line)
        assert head is not None
        found.append(head[0])
    return found


def verified(log: JsonlAuditLog) -> tuple[bool, int, str]:
    key = log.options.signer
    assert key is not None
    report = verify_log(log.layout, keys=[key.verify_key], publish_dir=log.options.publish_dir)
    return report.ok, report.events, report.problem


async def appended(log: JsonlAuditLog, numbers: range, at: str | None = None) -> list[AuditEvent]:
    return [await log.append(event(n, at)) for n in numbers]


def check_sealed_segments(layout: LogLayout, key: SigningKey) -> list[tuple[int, int]]:
    """Every sealed segment agrees with its name and its manifest, whose checkpoint is signed;
    returns their ranges."""
    tree, prev, ranges = CompactRange(), GENESIS_HASH, []
    for part in layout.parts():
        raw_lines = [line for _, line in lines(part.path)]
        if part.kind == "sealed":
            raw = part.path.read_bytes()
            manifest = part.manifest()
            first, last = head_of(raw_lines[0]), head_of(raw_lines[-1])
            assert first is not None
            assert last is not None
            assert (manifest.first_seq, manifest.last_seq) == (part.first_seq, part.last_seq) == (first[0], last[0])
            assert (manifest.bytes, manifest.sha256) == (len(raw), hashlib.sha256(raw).hexdigest())
            assert manifest.first_prev_hash == first[1] == prev
        for line in raw_lines:
            tree.append(line_hash(line))
            prev = line_hash(line).hex()
        if part.kind == "sealed":
            assert manifest.last_hash == prev
            assert CompactRange.from_json(manifest.tree) == tree
            assert manifest.checkpoint.verify(key.verify_key)
            assert (manifest.checkpoint.size, manifest.checkpoint.root) == (tree.size, tree.root().hex())
            ranges.append((part.first_seq, part.last_seq))
    return ranges


# -- rotation -------------------------------------------------------------------------------------


async def test_segments_are_sealed_by_size_and_the_chain_and_tree_go_on(tmp_path: Path) -> None:
    log = JsonlAuditLog(tmp_path / "audit.jsonl", options=options(tmp_path))
    written = await appended(log, range(1, 31))
    await log.aclose()
    layout = log.layout
    ranges = check_sealed_segments(layout, key_of(tmp_path))
    assert len(ranges) >= 4
    assert [first for first, _ in ranges] == [1] + [last + 1 for _, last in ranges[:-1]]  # contiguous
    for first, last in ranges:
        size = layout.segment_path(first, last).stat().st_size
        line = len(layout.segment_path(first, last).read_bytes().splitlines()[-1]) + 1
        assert 1500 <= size < 1500 + line  # sealed at the first append past the limit
    assert layout.active.read_bytes().startswith(b'{"seq":%d,' % (ranges[-1][1] + 1))
    assert seqs(layout) == list(range(1, 31))
    assert [e.hash for e in written] == [line_hash(line).hex() for line in all_lines(layout)]
    assert verified(JsonlAuditLog(layout.active, options=options(tmp_path))) == (True, 30, "")
    reopened = JsonlAuditLog(layout.active, options=options(tmp_path))
    assert [e.seq for e in await reopened.query(AuditFilter())] == list(range(1, 31))
    assert [e.decision_id for e in await reopened.query(AuditFilter(decision_id="d-7"))] == ["d-7"]


async def test_inclusion_proofs_for_old_and_new_segments_verify_against_the_checkpoints(tmp_path: Path) -> None:
    log = JsonlAuditLog(tmp_path / "audit.jsonl", options=options(tmp_path))
    await appended(log, range(1, 31))
    await log.aclose()
    layout = log.layout
    raw = all_lines(layout)
    sealed = [p for p in layout.parts() if p.kind == "sealed"]
    wanted = [1, sealed[0].last_seq, sealed[1].first_seq, sealed[-1].last_seq, sealed[-1].last_seq + 1, 30]
    checkpoint, proofs = inclusion_proofs(layout, wanted)
    assert checkpoint.size == 30
    assert checkpoint.verify(key_of(tmp_path).verify_key)
    root = bytes.fromhex(checkpoint.root)
    for seq in wanted:
        proof = [bytes.fromhex(node) for node in proofs[seq]]
        assert verify_inclusion(line_hash(raw[seq - 1]), seq - 1, checkpoint.size, proof, root)
        assert not verify_inclusion(line_hash(raw[seq - 1] + b" "), seq - 1, checkpoint.size, proof, root)
        assert not verify_inclusion(line_hash(raw[seq - 1]), seq % 30, checkpoint.size, proof, root)
    # An old segment's events, against the checkpoint its manifest carries (signed when it was sealed).
    leaves = [line_hash(line) for line in raw]
    for part in sealed:
        signed = part.manifest().checkpoint
        for seq in range(1, signed.size + 1):
            proof = inclusion_proof(leaves, seq - 1, signed.size)
            assert verify_inclusion(leaves[seq - 1], seq - 1, signed.size, proof, bytes.fromhex(signed.root))
    with pytest.raises(AuditError, match="not covered"):
        inclusion_proofs(layout, [31])


@pytest.mark.parametrize("rotate_daily", [True, False])
async def test_a_segment_is_sealed_when_the_utc_day_changes(tmp_path: Path, rotate_daily: bool) -> None:
    log = JsonlAuditLog(tmp_path / "audit.jsonl", options=options(tmp_path, segment_max_bytes=1 << 20,
                                                                  rotate_daily=rotate_daily))  # fmt: skip
    stamps = ["2026-11-22T23:59:58.000000Z", "2026-11-22T23:59:59.999999Z", "2026-11-23T00:00:00.000000Z",
              "2026-11-23T00:00:01.000000Z", "2026-11-23T23:59:59.000000Z", "2026-11-24T00:00:00.000001Z"]  # fmt: skip
    for n, stamp in enumerate(stamps, start=1):
        await log.append(event(n, stamp))
    await log.aclose()
    layout = log.layout
    sealed = [p for p in layout.parts() if p.kind == "sealed"]
    if not rotate_daily:
        assert sealed == []
    else:
        assert [(p.first_seq, p.last_seq) for p in sealed] == [(1, 2), (3, 5)]
        assert [(p.manifest().first_time, p.manifest().last_time) for p in sealed] == [
            (stamps[0], stamps[1]), (stamps[2], stamps[4])]  # fmt: skip
        check_sealed_segments(layout, key_of(tmp_path))
    assert seqs(layout) == [1, 2, 3, 4, 5, 6]
    assert verified(log) == (True, 6, "")


# -- restarts and other processes -----------------------------------------------------------------


@pytest.mark.parametrize("state", ["kept", "deleted"])
async def test_a_restart_continues_the_chain(tmp_path: Path, state: str) -> None:
    """The state file is a cache: without it the chain resumes from the last manifest and the active segment."""
    path = tmp_path / "audit.jsonl"
    for round_ in range(3):
        log = JsonlAuditLog(path, options=options(tmp_path))
        written = await appended(log, range(round_ * 7 + 1, round_ * 7 + 8))
        assert written[0].seq == round_ * 7 + 1
        await log.aclose()
        if state == "deleted":
            log.layout.state.unlink()
    layout = LogLayout(path)
    assert seqs(layout) == list(range(1, 22))  # no second seq 1
    assert verified(JsonlAuditLog(path, options=options(tmp_path))) == (True, 21, "")
    checkpoints = layout.read_checkpoints()
    assert [c.prev for c in checkpoints[1:]] == [c.digest() for c in checkpoints[:-1]]  # one chain of tree heads


async def test_the_active_segment_and_the_state_deleted_while_stopped_are_caught_by_the_checkpoint(
    tmp_path: Path,
) -> None:
    """With the state cache gone too, nothing but the last manifest says where the chain was: the
    restarted writer resumes from it, and the events it writes over the lost ones contradict the
    checkpoint signed at close, which verification reports."""
    path = tmp_path / "audit.jsonl"
    log = JsonlAuditLog(path, options=options(tmp_path))
    await appended(log, range(1, 9))
    await log.aclose()
    layout = LogLayout(path)
    sealed_last = max(p.last_seq for p in layout.parts() if p.kind == "sealed")
    assert sealed_last < 8
    path.unlink()
    layout.state.unlink()
    restarted = JsonlAuditLog(path, options=options(tmp_path))
    # From the last manifest, the gap first: the checkpoint signed at close covers events no file holds.
    assert (await restarted.append(event(99))).seq == sealed_last + 2
    [gap] = restarted.query_sync(AuditFilter(outcome="audit_segment_missing"))
    assert gap.seq == sealed_last + 1
    assert gap.result is not None
    assert (gap.result["first_seq"], gap.result["last_seq"]) == (sealed_last + 1, 8)
    report = verify_log(layout, keys=[key_of(tmp_path).verify_key], publish_dir=tmp_path / "published")
    assert report.ok is False
    # No checkpoint between the manifest and the one signed at close: a cut or a rewrite, somewhere there.
    assert report.broken_seq is not None
    assert sealed_last + 1 <= report.broken_seq <= 8
    await restarted.aclose()  # closing signs the tail: a log behind its last checkpoint must not crash it


def _append_and_rotate(path: str, key: str, count: int) -> None:
    async def go() -> None:
        chosen = LogOptions(signer=SigningKey.load_or_create(Path(key)), checkpoint_interval_s=3600,
                            checkpoint_every=7, segment_max_bytes=1200)  # fmt: skip
        log = JsonlAuditLog(Path(path), options=chosen)
        for n in range(count):
            await log.append(event(n, agent="other-process"))
        await log.aclose()

    asyncio.run(go())


async def test_two_processes_appending_and_rotating_keep_one_chain(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    key = tmp_path / "keys" / "audit.key"
    chosen = LogOptions(signer=SigningKey.load_or_create(key), checkpoint_interval_s=3600, checkpoint_every=5,
                        segment_max_bytes=1200)  # fmt: skip
    log = JsonlAuditLog(path, options=chosen)
    ctx = multiprocessing.get_context("spawn")
    others = [ctx.Process(target=_append_and_rotate, args=(str(path), str(key), 80)) for _ in range(2)]
    for other in others:
        other.start()
    for n in range(80):
        await log.append(event(n))
    for other in others:
        await asyncio.to_thread(other.join, 120)
    assert [other.exitcode for other in others] == [0, 0]
    await log.aclose()
    layout = LogLayout(path)
    assert seqs(layout) == list(range(1, 241))
    assert sum(b'"agent":"other-process"' in line for line in all_lines(layout)) == 160
    ranges = check_sealed_segments(layout, chosen.signer)  # type: ignore[arg-type]
    assert len(ranges) >= 10
    report = verify_log(layout, keys=[chosen.signer.verify_key])  # type: ignore[union-attr]
    assert (report.ok, report.events, report.signed, report.problem) == (True, 240, 240, "")
    checkpoints = layout.read_checkpoints()
    assert [c.prev for c in checkpoints[1:]] == [c.digest() for c in checkpoints[:-1]]
    assert [c.size for c in checkpoints] == sorted({c.size for c in checkpoints})  # growing, none twice


# -- a seal cut short -----------------------------------------------------------------------------


async def test_a_writer_idle_while_others_seal_several_segments_continues_the_chain(tmp_path: Path) -> None:
    """Found under CI load: a writer that sleeps through two rotations by another process opens
    an active segment that starts past a whole segment it never read. It must follow the sealed
    segments' manifests, not refuse the log as broken (or fork the chain)."""
    path = tmp_path / "audit.jsonl"
    chosen = LogOptions(signer=key_of(tmp_path), checkpoint_interval_s=3600, segment_max_bytes=1200)
    idle = JsonlAuditLog(path, options=chosen)
    busy = JsonlAuditLog(path, options=chosen)  # its own descriptors and lock: another process, to the file
    await idle.append(event(0, agent="idle"))
    for n in range(14):  # four events a segment: three seals while `idle` waits
        await busy.append(event(n, agent="busy"))
    layout = LogLayout(path)
    assert sum(part.kind == "sealed" for part in layout.parts()) >= 3
    await idle.append(event(1, agent="idle"))
    await busy.append(event(99, agent="busy"))
    await idle.aclose()
    await busy.aclose()
    assert seqs(layout) == list(range(1, 18))
    assert verify_log(layout, keys=[key_of(tmp_path).verify_key]).ok


async def test_a_crash_between_the_manifest_and_the_rename_is_finished_on_restart(tmp_path: Path) -> None:
    """A seal writes the manifest, then renames the segment. The state between the two is made
    from a completed seal: the sealed file put back as the active one, and what came after removed."""
    built = tmp_path / "built"
    log = JsonlAuditLog(built / "audit.jsonl", options=options(built))
    await appended(log, range(1, 8))
    await log.aclose()
    layout = log.layout
    first, last = next((p.first_seq, p.last_seq) for p in layout.parts() if p.kind == "sealed")
    assert last < 7

    crashed = tmp_path / "crashed"
    shutil.copytree(built, crashed)
    state = LogLayout(crashed / "audit.jsonl")
    os.replace(state.segment_path(first, last), state.active)  # the rename never happened
    kept = [c for c in state.read_checkpoints() if c.size <= last]  # nor did anything after it
    state.checkpoints.write_bytes(b"".join(c.signed_text() + b"\n" for c in kept))
    for published in (crashed / "published").iterdir():
        if Checkpoint.model_validate_json(published.read_bytes()).size > last:
            published.unlink()
    state.state.unlink()
    assert state.segment_path(first, last, "manifest.json").exists()

    restarted = JsonlAuditLog(state.active, options=options(crashed))
    resumed = await restarted.append(event(99))
    await restarted.aclose()
    assert resumed.seq == last + 1
    assert state.segment_path(first, last).read_bytes() == layout.segment_path(first, last).read_bytes()
    assert seqs(state) == list(range(1, last + 2))
    assert [e.outcome for e in restarted.query_sync(AuditFilter(kind="error"))] == []  # nothing was missing
    check_sealed_segments(state, key_of(crashed))
    assert verified(JsonlAuditLog(state.active, options=options(crashed))) == (True, last + 1, "")


async def test_a_manifest_whose_segment_does_not_start_the_active_file_is_left_alone(tmp_path: Path) -> None:
    log = JsonlAuditLog(tmp_path / "audit.jsonl", options=options(tmp_path))
    await appended(log, range(1, 8))
    await log.aclose()
    sealed = [p.path.name for p in log.layout.parts() if p.kind == "sealed"]
    first_active = log.layout.active.read_bytes()
    restarted = JsonlAuditLog(log.layout.active, options=options(tmp_path))
    assert (await restarted.append(event(8))).seq == 8
    await restarted.aclose()
    assert [p.path.name for p in log.layout.parts() if p.kind == "sealed"] == sealed
    assert log.layout.active.read_bytes().startswith(first_active)


# -- retention ------------------------------------------------------------------------------------


async def test_retention_deletes_whole_old_segments_and_leaves_signed_tombstones(tmp_path: Path) -> None:
    today = timestamp()[:10]
    log = JsonlAuditLog(tmp_path / "audit.jsonl", options=options(tmp_path, retention_days=30))
    old = await appended(log, range(1, 13), at="2020-01-01T10:00:00.000000Z")
    new = [await log.append(event(n, f"{today}T00:00:{n:02d}.000000Z")) for n in range(13, 33)]
    await log.aclose()
    layout = log.layout
    key = key_of(tmp_path)
    parts = layout.parts()
    tombstones = [p for p in parts if p.kind == "tombstone"]
    assert tombstones
    assert tombstones[0].first_seq == 1
    assert tombstones[-1].last_seq == 12  # every segment of 2020, whole, and none of today's
    assert {p.kind for p in parts if p.first_seq > 12 or p.kind == "active"} <= {"sealed", "active"}
    tree = CompactRange()
    hashes = [e.hash for e in old]
    for part in tombstones:
        tombstone = part.tombstone()
        assert tombstone.verify(key.verify_key)
        assert tombstone.checkpoint.verify(key.verify_key)
        for digest in hashes[part.first_seq - 1 : part.last_seq]:
            tree.append(bytes.fromhex(digest))
        assert tombstone.last_hash == hashes[part.last_seq - 1]
        assert CompactRange.from_json(tombstone.tree) == tree
        assert tombstone.reason == "retention: older than 30 days"
        assert not layout.segment_path(part.first_seq, part.last_seq).exists()
        assert not layout.segment_path(part.first_seq, part.last_seq, "manifest.json").exists()
    assert seqs(layout) == list(range(13, 33))
    report = verify_log(layout, keys=[key.verify_key], publish_dir=tmp_path / "published")
    assert (report.ok, report.events, report.retired, report.problem) == (True, 32, 12, "")
    restarted = JsonlAuditLog(layout.active, options=options(tmp_path, retention_days=30))
    assert [e.seq for e in await restarted.query(AuditFilter())] == [e.seq for e in new]
    assert (await restarted.append(event(33, f"{today}T00:01:00.000000Z"))).seq == 33
    await restarted.aclose()
    # Held events are proven from the last tombstone's tree state on; retired ones are refused.
    checkpoint, proofs = inclusion_proofs(layout, [13, 20])
    by_seq = {head[0]: line for line in all_lines(layout) if (head := head_of(line)) is not None}
    for seq in (13, 20):
        nodes = [bytes.fromhex(node) for node in proofs[seq]]
        root = bytes.fromhex(checkpoint.root)
        assert verify_inclusion(line_hash(by_seq[seq]), seq - 1, checkpoint.size, nodes, root)
    with pytest.raises(AuditError, match=r"seq 5 was retired \(events 1\.\.\d+ were deleted by retention\)"):
        inclusion_proofs(layout, [5])
    # An export of the whole log starts after the retired range, and proves every event it holds.
    export = tmp_path / "export.jsonl"
    done = export_events(layout.active, export)
    assert (done.first_seq, done.last_seq, done.events) == (13, 33, 21)
    check = verify_export(export, key.verify_key)
    assert (check.ok, check.problem, check.events) == (True, "", 21)
    assert check.selection == {"filter": {}, "after_seq": 12, "to_seq": 33, "complete": True}


async def test_retention_checks_a_segment_off_the_append_that_sealed_it(tmp_path: Path) -> None:
    """Before a segment is retired, all of it is read and hashed against its signed checkpoint (some
    1.5 s for 64 MiB here, far more on a busy machine). Done inside the seal, that held the
    router's event loop and every writer's lock: now a worker thread does it, after the append."""
    limit = 12 << 20
    log = JsonlAuditLog(tmp_path / "audit.jsonl", durability="relaxed",
                        options=options(tmp_path, retention_days=30, segment_max_bytes=limit))  # fmt: skip
    pad, n = "x" * 4000, 0
    while os.stat(log.path).st_size < limit if log.path.exists() else True:
        n += 1
        await log.append(event(n, "2020-01-01T10:00:00.000000Z", input={"pad": pad}))
    started = asyncio.get_running_loop().time()
    await log.append(event(n + 1, timestamp()))  # seals 2020's segment: retention is due
    sealing = asyncio.get_running_loop().time() - started
    started = asyncio.get_running_loop().time()
    await log.aclose()  # waits for the retention pass
    closing = asyncio.get_running_loop().time() - started
    parts = log.layout.parts()
    assert [(p.kind, p.first_seq, p.last_seq) for p in parts if p.kind != "active"] == [("tombstone", 1, n)]
    assert seqs(log.layout) == [n + 1]
    assert sealing < closing, (sealing, closing)


async def test_retention_never_touches_the_active_segment(tmp_path: Path) -> None:
    log = JsonlAuditLog(tmp_path / "audit.jsonl", options=options(tmp_path, retention_days=1,
                                                                  segment_max_bytes=1 << 20))  # fmt: skip
    await appended(log, range(1, 6), at="2020-01-01T10:00:00.000000Z")
    await log.aclose()
    assert [p.kind for p in log.layout.parts()] == ["active"]
    assert seqs(log.layout) == [1, 2, 3, 4, 5]


# -- the active segment moved or deleted ----------------------------------------------------------


async def test_an_active_segment_renamed_mid_run_is_recorded_and_the_chain_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = JsonlAuditLog(path, options=options(tmp_path, segment_max_bytes=1 << 20))
    written = await appended(log, range(1, 6))
    os.rename(path, tmp_path / "moved-away.jsonl")
    after = await log.append(event(6))
    await log.aclose()
    assert after.seq == 7  # seq 6 records the gap
    found = [json.loads(line) for line in path.read_bytes().splitlines()]
    assert [d["seq"] for d in found] == [6, 7]
    assert found[0]["prev_hash"] == written[-1].hash  # the chain goes on from where it was
    assert (found[0]["kind"], found[0]["outcome"]) == ("error", "audit_segment_missing")
    assert (found[0]["result"]["first_seq"], found[0]["result"]["last_seq"]) == (1, 5)
    report = verify_log(LogLayout(path), keys=[key_of(tmp_path).verify_key])
    assert (report.ok, report.broken_seq) == (False, 1)  # verification names the gap
    assert "missing" in report.problem


async def test_an_active_segment_renamed_after_seals_is_recorded_with_its_range(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = JsonlAuditLog(path, options=options(tmp_path))
    await appended(log, range(1, 13))
    active_first = head_of(path.read_bytes().splitlines()[0])[0]  # type: ignore[index]
    os.rename(path, tmp_path / "moved-away.jsonl")
    after = await log.append(event(13))
    await log.aclose()
    assert after.seq == 14
    missing = log.query_sync(AuditFilter(outcome="audit_segment_missing"))
    assert [(e.seq, e.result["first_seq"], e.result["last_seq"]) for e in missing] == [(13, active_first, 12)]  # type: ignore[index]
    report = verify_log(log.layout, keys=[key_of(tmp_path).verify_key])
    assert (report.ok, report.broken_seq) == (False, active_first)


async def test_an_active_segment_deleted_while_stopped_is_recorded_on_restart(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = JsonlAuditLog(path, options=options(tmp_path, segment_max_bytes=1 << 20))
    written = await appended(log, range(1, 6))
    await log.aclose()
    path.unlink()
    restarted = JsonlAuditLog(path, options=options(tmp_path, segment_max_bytes=1 << 20))
    after = await restarted.append(event(6))
    await restarted.aclose()
    assert after.seq == 7  # no second seq 1
    found = [json.loads(line) for line in path.read_bytes().splitlines()]
    assert [d["seq"] for d in found] == [6, 7]
    assert found[0]["prev_hash"] == written[-1].hash
    assert found[0]["outcome"] == "audit_segment_missing"
    assert (found[0]["result"]["first_seq"], found[0]["result"]["last_seq"]) == (1, 5)
    report = verify_log(LogLayout(path), keys=[key_of(tmp_path).verify_key], publish_dir=tmp_path / "published")
    assert (report.ok, report.broken_seq) == (False, 1)


# -- masking --------------------------------------------------------------------------------------

MASKS = (("/input/args/card", False), ("/input/args/token", True), ("/result/*/secret", False))
SECRETS = ("4111-1111-1111-1111", "tok-7f3a9e2b", "s3cr3t-one", "s3cr3t-two")


def masked_event(n: int) -> AuditEvent:
    return event(n, input={"args": {"card": SECRETS[0], "token": SECRETS[1], "keep": "visible"}},
                 result={"a": {"secret": SECRETS[2], "n": 1}, "b": {"secret": SECRETS[3]}, "c": "plain"})  # fmt: skip


async def test_masked_values_are_erased_or_hashed_before_hashing_and_never_reach_a_file(tmp_path: Path) -> None:
    log = JsonlAuditLog(tmp_path / "log" / "audit.jsonl", options=options(tmp_path, masks=MASKS))
    for n in range(1, 21):
        await log.append(masked_event(n))
    await log.aclose()
    for file in tmp_path.rglob("*"):  # segments, manifests, checkpoints, state, published: every byte
        if file.is_file():
            raw = file.read_bytes()
            assert [s for s in SECRETS if s.encode() in raw] == [], file
    assert [p.kind for p in log.layout.parts()].count("sealed") >= 2
    first = json.loads(all_lines(log.layout)[0])
    assert first["input"]["args"] == {"card": "[masked]", "keep": "visible",
                                      "token": "sha256:" + hashlib.sha256(b'"tok-7f3a9e2b"').hexdigest()}  # fmt: skip
    assert first["result"] == {"a": {"secret": "[masked]", "n": 1}, "b": {"secret": "[masked]"}, "c": "plain"}
    assert first["labels"]["masked"] == "/input/args/card,/input/args/token,/result/a/secret,/result/b/secret"
    assert verified(JsonlAuditLog(log.layout.active, options=options(tmp_path))) == (True, 20, "")


async def test_append_returns_the_masked_event_it_wrote(tmp_path: Path) -> None:
    """The event handed back carries the masked line's hash; its fields must be that line's too."""
    log = JsonlAuditLog(tmp_path / "audit.jsonl", options=options(tmp_path, masks=MASKS))
    written = await log.append(masked_event(1))
    await log.aclose()
    stored = log.query_sync(AuditFilter())[0]
    assert written.hash == stored.hash == line_hash(all_lines(log.layout)[0]).hex()
    assert [s for s in SECRETS if s in written.model_dump_json()] == []
    assert written.model_dump() == stored.model_dump()


# -- checkpoints ----------------------------------------------------------------------------------


def snapshot(directory: Path) -> dict[str, tuple[int, int, bytes]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(directory.iterdir())}


async def test_checkpoints_are_published_as_new_files_only(tmp_path: Path) -> None:
    published = tmp_path / "published"
    published.mkdir()
    (published / "README").write_text("the operator's own file\n")
    key = key_of(tmp_path)
    log = JsonlAuditLog(tmp_path / "audit.jsonl", options=options(tmp_path, checkpoint_every=3))
    await appended(log, range(1, 11))
    await log.aclose()
    before = snapshot(published)
    await asyncio.sleep(0.01)  # a rewrite would show in mtime
    for round_ in range(2):
        log = JsonlAuditLog(tmp_path / "audit.jsonl", options=options(tmp_path, checkpoint_every=3))
        await appended(log, range(11 + round_ * 10, 21 + round_ * 10))
        assert log.checkpoint_sync() is not None
        await log.aclose()
    after = snapshot(published)
    assert {name: after[name] for name in before} == before  # nothing rewritten, nothing removed
    added = sorted(set(after) - set(before))
    assert added
    files = [name for name in after if name != "README"]
    mine = await log.checkpoints()
    assert sorted(files) == sorted(f"{c.size:012d}-{c.digest()[:16]}.json" for c in mine)
    for name in files:
        path = published / name
        assert stat.S_IMODE(path.stat().st_mode) == 0o444
        checkpoint = Checkpoint.model_validate_json(path.read_bytes())
        assert checkpoint.verify(key.verify_key)
        assert name.startswith(f"{checkpoint.size:012d}-")
    latest = mine[-1]
    snapshot_before = snapshot(published)
    publish_file(published, latest)  # publishing one again leaves the file as it was
    assert snapshot(published) == snapshot_before


async def test_a_checkpoint_is_signed_an_interval_after_an_append(tmp_path: Path) -> None:
    log = JsonlAuditLog(tmp_path / "audit.jsonl", options=options(tmp_path, checkpoint_interval_s=0.1))
    try:
        await appended(log, range(1, 4))
        for _ in range(200):
            signed = await log.checkpoints()
            if signed and signed[-1].size == 3:
                break
            await asyncio.sleep(0.02)
        sizes = [c.size for c in await log.checkpoints()]
        assert sizes[-1:] == [3]  # signed without closing
        assert sizes == sorted(set(sizes))  # one per interval at most, each larger
        published = sorted(p.name[:13] for p in (tmp_path / "published").iterdir())
        assert published == [f"{size:012d}-" for size in sizes]
    finally:
        await log.aclose()


async def test_checkpoint_every_signs_at_that_many_events(tmp_path: Path) -> None:
    log = JsonlAuditLog(tmp_path / "audit.jsonl", options=options(tmp_path, checkpoint_every=4,
                                                                  segment_max_bytes=None))  # fmt: skip
    await appended(log, range(1, 14))
    assert [c.size for c in await log.checkpoints()] == [4, 8, 12]
    await log.aclose()
    assert [c.size for c in await log.checkpoints()] == [4, 8, 12, 13]


async def test_stockade_audit_prove_and_verify_from_the_cli_across_segments(tmp_path: Path) -> None:
    """The auditor's commands on a sealed, rotated log: proofs for events in old and new segments
    check out against the signed checkpoint with only the public key; verify --from-seq checks
    the newest segments alone."""
    path = tmp_path / "audit.jsonl"
    log = JsonlAuditLog(path, options=options(tmp_path))
    await appended(log, range(1, 31))
    await log.aclose()
    sealed = [p for p in LogLayout(path).parts() if p.kind == "sealed"]
    assert len(sealed) >= 2
    stockade = Path(sys.executable).parent / "stockade"
    public = tmp_path / "keys" / "public.pem"
    public.write_bytes(key_of(tmp_path).public_pem())
    argv = [str(stockade), "audit", "prove", "--path", str(path), "--public-key", str(public), "--seq", "1",
            "--seq", str(sealed[-1].first_seq), "--seq", "30", "--json"]  # fmt: skip
    said = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=60, check=False)
    assert said.returncode == 0, said.stderr
    verify_key = VerifyKey.load(public)
    for proof in json.loads(said.stdout):
        signed = Checkpoint.model_validate(proof["checkpoint"])
        assert signed.verify(verify_key)
        leaf = line_hash(proof["line"].encode())
        nodes = [bytes.fromhex(node) for node in proof["proof"]]
        assert verify_inclusion(leaf, proof["seq"] - 1, signed.size, nodes, bytes.fromhex(signed.root))
    argv = [str(stockade), "audit", "verify", "--path", str(path), "--public-key", str(public), "--from-seq",
            str(sealed[-1].first_seq), "--json"]  # fmt: skip
    checked = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert json.loads(checked.stdout)["ok"] is True


async def test_a_seal_never_puts_a_checkpoint_this_key_did_not_sign_in_its_manifest(tmp_path: Path) -> None:
    """A signing key replaced while the log had no sealed segment yet: the next day's seal reused
    the checkpoints file's last checkpoint, the old key's, as its manifest's, and the writer's
    next restart refused the log for good (its manifest not signed by the log's key). A seal now
    signs afresh unless that checkpoint is this key's, over this tree."""
    path = tmp_path / "audit.jsonl"

    def stamped(n: int, day: str) -> AuditEvent:
        fields = {"decision_id": f"d-{day}-{n}", "timestamp": f"{day}T10:00:{n:02d}.000000Z", "kind": "decision",
                  "outcome": "allow", "agent": "agent-1", "tool": "echo"}  # fmt: skip
        return AuditEvent.model_validate(fields)

    async def run(key: SigningKey, day: str, n: int) -> None:
        log = JsonlAuditLog(path, options=LogOptions(signer=key, segment_max_bytes=1 << 20, checkpoint_interval_s=3600))
        for i in range(n):
            await log.append(stamped(i, day))
        await log.aclose()

    old, new = SigningKey.load_or_create(tmp_path / "old.key"), SigningKey.load_or_create(tmp_path / "new.key")
    await run(old, "2026-11-22", 3)
    await run(new, "2026-11-23", 2)  # its first append seals yesterday's segment
    [manifest] = [part.manifest() for part in LogLayout(path).parts() if part.kind == "sealed"]
    assert manifest.checkpoint.key_id == new.key_id
    await run(new, "2026-11-23", 1)  # and it restarts
