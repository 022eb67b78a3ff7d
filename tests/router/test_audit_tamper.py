"""Tampering with a real audit log, every way the issue names and at every position: each one is
detected by verification against the signed checkpoints (the log's own, the publish directory's,
an auditor's), with the broken seq named. Every test counts what got through: the only passing
count is 0.

The baseline is a real log: 40 events in 1,500-byte segments (7 sealed, one active), a checkpoint
every 4 events and at every seal, each also published as a file. Where a tampering re-links every
later event (a re-chain, a renumbering), the chain itself cannot say where it starts, so the broken
seq must lie after the last checkpoint before the tampered seq and at or before that seq."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import cast

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.audit import AuditEvent, line_hash, timestamp
from router.audit import layout as layout_module
from router.audit.base import VerifyReport
from router.audit.chain import GENESIS_HASH, Unsealed, head_of
from router.audit.checkpoint import Checkpoint, Manifest, SigningKey, Tombstone, sign_checkpoint, sign_tombstone
from router.audit.factory import anchor_path
from router.audit.jsonl import JsonlAuditLog, LogOptions, publish_file
from router.audit.layout import LogLayout
from router.audit.merkle import CompactRange
from router.audit.redis import CHECKPOINTS, HEAD, STREAM, RedisAuditLog
from router.audit.verify import verify_log
from router.errors import AuditError

N = 40
CHECKPOINT_EVERY = 4
SEGMENT_BYTES = 1500


def event(n: int, day: str = "2026-11-22", **fields: object) -> AuditEvent:
    return AuditEvent.model_validate({
        "decision_id": f"d-{n}", "timestamp": f"{day}T10:{n // 60:02d}:{n % 60:02d}.000000Z", "kind": "decision",
        "outcome": "allow", "session_id": "s-1", "agent": "agent-1", "tool": "echo", **fields,
    })  # fmt: skip


@dataclass(frozen=True)
class Baseline:
    root: Path  # log/ (the log and its parts), published/ (the publish directory), keys/
    key: SigningKey
    checkpoints: tuple[int, ...]  # the sizes signed
    segments: tuple[tuple[int, int], ...]  # sealed segments' (first, last)
    active_first: int
    last: Checkpoint  # the latest checkpoint, as an auditor would have saved it

    def before(self, seq: int) -> int:
        """The last checkpoint size before ``seq`` (0 if none)."""
        return max((size for size in self.checkpoints if size < seq), default=0)


def _options(root: Path, key: SigningKey, **changes: object) -> LogOptions:
    settings_ = {"signer": key, "checkpoint_every": CHECKPOINT_EVERY, "checkpoint_interval_s": 3600,
                 "publish_dir": root / "published", "segment_max_bytes": SEGMENT_BYTES, **changes}  # fmt: skip
    return LogOptions(**settings_)  # type: ignore[arg-type]


async def _build(root: Path, events: list[AuditEvent], **changes: object) -> SigningKey:
    key = SigningKey.load_or_create(root / "keys" / "audit.key")
    log = JsonlAuditLog(root / "log" / "audit.jsonl", options=_options(root, key, **changes))
    for item in events:
        await log.append(item)
    await log.aclose()
    return key


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    root = tmp_path_factory.mktemp("baseline")
    key = asyncio.run(_build(root, [event(n) for n in range(1, N + 1)]))
    layout = LogLayout(root / "log" / "audit.jsonl")
    sealed = tuple((p.first_seq, p.last_seq) for p in layout.parts() if p.kind == "sealed")
    checkpoints = layout.read_checkpoints()
    built = Baseline(root, key, tuple(c.size for c in checkpoints), sealed, sealed[-1][1] + 1, checkpoints[-1])
    report = verify_log(layout, keys=[key.verify_key], publish_dir=root / "published")
    assert (report.ok, report.events, report.signed, report.notes) == (True, N, N, ())
    assert len(sealed) >= 5  # several sealed segments, and an active one after them
    assert built.active_first <= N
    assert built.last.size == N
    return built


class Copy:
    """A copy of a log to tamper with: its segment files' lines, part by part, written back by `save`."""

    def __init__(self, root: Path, key: SigningKey) -> None:
        self.root, self.key = root, key
        self.layout = LogLayout(root / "log" / "audit.jsonl")
        self.published = root / "published"
        self.parts = [(p.path, p.path.read_bytes().splitlines(keepends=True)) for p in self.layout.parts()
                      if p.kind != "tombstone"]  # fmt: skip

    def _at(self, seq: int) -> tuple[list[bytes], int]:
        for _, lines in self.parts:
            for index, line in enumerate(lines):
                head = head_of(line.rstrip(b"\n"))
                if head is not None and head[0] == seq:
                    return lines, index
        raise LookupError(seq)

    def line(self, seq: int) -> bytes:
        lines, index = self._at(seq)
        return lines[index]

    def replace(self, seq: int, line: bytes) -> None:
        lines, index = self._at(seq)
        lines[index] = line

    def delete(self, seq: int) -> None:
        lines, index = self._at(seq)
        del lines[index]

    def insert_before(self, seq: int, line: bytes) -> None:
        """Before event ``seq``, or at the very end for the seq after the last."""
        try:
            lines, index = self._at(seq)
        except LookupError:
            lines = self.parts[-1][1]
            index = len(lines)
        lines.insert(index, line)

    def swap(self, seq: int, other: int) -> None:
        first, second = self._at(seq), self._at(other)
        first[0][first[1]], second[0][second[1]] = second[0][second[1]], first[0][first[1]]

    def relink(self, start: int, *, renumber: bool = False, end: int | None = None) -> None:
        """Re-link every line from the ``start``-th (1-based, by position) to the ``end``-th (default:
        the last) to the line before it, as a forger without the key can: hashes recomputed, and with
        ``renumber`` the seqs too."""
        prev, position = GENESIS_HASH, 0
        for _, lines in self.parts:
            for index, line in enumerate(lines):
                position += 1
                if position >= start and (end is None or position <= end):
                    document = json.loads(line)
                    seq = position if renumber else document["seq"]
                    text = Unsealed(document).seal(seq, prev)[1]
                    lines[index] = text + b"\n"
                prev = line_hash(lines[index].rstrip(b"\n")).hex()

    def save(self) -> None:
        for path, lines in self.parts:
            path.write_bytes(b"".join(lines))

    def verify(self, *, publish: bool = True, trusted: tuple[Checkpoint, ...] = ()) -> VerifyReport:
        return verify_log(self.layout, keys=[self.key.verify_key], publish_dir=self.published if publish else None,
                          trusted=trusted)  # fmt: skip


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tampered")


@pytest.fixture
def fresh(baseline: Baseline, scratch: Path) -> Iterator[Callable[[], Copy]]:
    """Makes fresh copies of the baseline; removed after the test."""
    made: list[Path] = []

    def make() -> Copy:
        target = Path(tempfile.mkdtemp(dir=scratch))
        shutil.copytree(baseline.root, target, dirs_exist_ok=True)
        made.append(target)
        return Copy(target, baseline.key)

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


class Tally:
    """What got through: tamperings verification passed (undetected), and ones it detected but
    blamed on the wrong seq (misplaced)."""

    def __init__(self) -> None:
        self.tried = 0
        self.undetected: list[str] = []
        self.misplaced: list[str] = []

    def check(self, what: str, report: VerifyReport, low: int, high: int | None = None) -> None:
        """The broken seq must be ``low`` (or within ``low``..``high``)."""
        self.tried += 1
        high = low if high is None else high
        if report.ok:
            self.undetected.append(what)
        elif report.broken_seq is None or not low <= report.broken_seq <= high:
            wanted = str(low) if low == high else f"{low}..{high}"
            self.misplaced.append(f"{what}: broken_seq {report.broken_seq}, not {wanted} ({report.problem[:140]})")

    def assert_none_got_through(self) -> None:
        assert self.tried > 0
        assert not self.undetected, f"{len(self.undetected)} of {self.tried} tamperings got through:\n" + "\n".join(
            self.undetected
        )
        assert not self.misplaced, f"{len(self.misplaced)} of {self.tried} detected at the wrong seq:\n" + "\n".join(
            self.misplaced
        )


def tamper(fresh: Callable[[], Copy], change: Callable[[Copy], None]) -> Copy:
    copy = fresh()
    change(copy)
    copy.save()
    return copy


def edited(line: bytes) -> bytes:
    assert b'"outcome":"allow"' in line
    return line.replace(b'"outcome":"allow"', b'"outcome":"deny"')


def modify(copy: Copy, seq: int) -> None:
    copy.replace(seq, edited(copy.line(seq)))


def replay(copy: Copy, seq: int) -> None:
    """A copy of the event before ``seq`` (of event 2, before the first) inserted before it."""
    copy.insert_before(seq, copy.line(seq - 1 if seq > 1 else 2))


def swap_with_next(copy: Copy, seq: int) -> None:
    copy.swap(seq, seq + 1)


def _set(field: str, value: object, document: dict[str, object]) -> None:
    document[field] = value


# -- each event: modified, deleted, inserted, reordered, renumbered ------------------------------


def test_an_event_modified_in_place_is_named_at_every_position(baseline: Baseline, fresh: Callable[[], Copy]) -> None:
    """Named at its own seq through its successor's prev_hash; the last event, which no successor
    records, through the checkpoint signed at close (the range after the one before it)."""
    tally = Tally()
    for seq in range(1, N + 1):
        copy = tamper(fresh, partial(modify, seq=seq))
        low = seq if seq < N else baseline.before(N) + 1
        tally.check(f"modify {seq}", copy.verify(), low, seq)
    tally.assert_none_got_through()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_byte_of_an_event_changed_is_detected_at_that_event(
    baseline: Baseline, fresh: Callable[[], Copy], data: st.DataObject
) -> None:
    seq = data.draw(st.integers(1, N), label="seq")
    copy = fresh()
    line = copy.line(seq)
    head_length = len(b'{"seq":%d,"prev_hash":"' % seq) + 64 + 2
    at = data.draw(st.integers(head_length, len(line) - 2), label="offset")  # the event's body
    byte = data.draw(st.integers(0, 255).filter(lambda b: b not in (line[at], 10)), label="byte")
    copy.replace(seq, line[:at] + bytes([byte]) + line[at + 1 :])
    copy.save()
    tally = Tally()
    tally.check(f"byte {at} of seq {seq} set to {byte}", copy.verify(), seq if seq < N else baseline.before(N) + 1,
                seq)  # fmt: skip
    tally.assert_none_got_through()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_byte_of_an_events_head_changed_is_detected_there(
    baseline: Baseline, fresh: Callable[[], Copy], data: st.DataObject
) -> None:
    """The head (seq, prev_hash and the character after them) is compared as bytes: any change to
    it is named at that event (the last one, whose hash no successor records, may be named at the
    one before when only its link changed)."""
    seq = data.draw(st.integers(1, N), label="seq")
    copy = fresh()
    line = copy.line(seq)
    head_length = len(b'{"seq":%d,"prev_hash":"' % seq) + 64 + 2
    at = data.draw(st.integers(0, head_length - 1), label="offset")
    byte = data.draw(st.integers(0, 255).filter(lambda b: b not in (line[at], 10)), label="byte")
    copy.replace(seq, line[:at] + bytes([byte]) + line[at + 1 :])
    copy.save()
    tally = Tally()
    low = seq if seq < N else min(seq - 1, baseline.before(N) + 1)
    tally.check(f"head byte {at} of seq {seq} set to {byte}", copy.verify(), low, seq)
    tally.assert_none_got_through()


def test_an_events_prev_hash_rewritten_is_detected_at_every_position(
    baseline: Baseline, fresh: Callable[[], Copy]
) -> None:
    """Its link breaks, and its successor no longer records its hash: the event itself is named.
    The last one has no successor: unless a signed checkpoint vouches for the event before it, the
    change could as well be to that one, and the earlier seq is named."""
    tally = Tally()
    for seq in range(2, N + 1):

        def change(c: Copy, s: int = seq) -> None:
            line = c.line(s)
            start = line.index(b'"prev_hash":"') + 13
            c.replace(s, line[:start] + b"f" * 64 + line[start + 64 :])

        copy = tamper(fresh, change)
        vouched = (seq - 1) in baseline.checkpoints
        tally.check(f"prev_hash of {seq}", copy.verify(), seq if vouched or seq < N else seq - 1)
    tally.assert_none_got_through()


def test_a_deleted_event_is_named_at_every_position(fresh: Callable[[], Copy]) -> None:
    tally = Tally()
    for seq in range(1, N + 1):
        copy = tamper(fresh, partial(Copy.delete, seq=seq))
        tally.check(f"delete {seq}", copy.verify(), seq)
    tally.assert_none_got_through()


def test_a_replayed_event_inserted_is_named_at_every_position(fresh: Callable[[], Copy]) -> None:
    """A copy of another event (a replay) inserted before event ``seq`` (or after the last)."""
    tally = Tally()
    for seq in range(1, N + 2):
        copy = tamper(fresh, partial(replay, seq=seq))
        tally.check(f"insert before {seq}", copy.verify(), seq)
    tally.assert_none_got_through()


def test_a_forged_event_chained_in_is_detected_at_every_position(baseline: Baseline, fresh: Callable[[], Copy]) -> None:
    """A forged event carrying seq ``seq`` and linked to the event before it: the genuine event
    ``seq`` after it no longer fits (or a signed root at ``seq`` disagrees)."""
    tally = Tally()
    for seq in range(1, N + 1):

        def change(c: Copy, s: int = seq) -> None:
            prev = line_hash(c.line(s - 1).rstrip(b"\n")).hex() if s > 1 else GENESIS_HASH
            forged = Unsealed(event(s, outcome="forged").model_dump(mode="json")).seal(s, prev)[1]
            c.insert_before(s, forged + b"\n")

        copy = tamper(fresh, change)
        tally.check(f"forged event at {seq}", copy.verify(), baseline.before(seq) + 1, seq + 1)
    tally.assert_none_got_through()


def test_an_event_appended_without_the_key_is_reported_as_not_signed(
    baseline: Baseline, fresh: Callable[[], Copy]
) -> None:
    """A forged event chained onto the end is what an unsigned genuine append looks like: verification
    passes but says the tail is not signed, until the next checkpoint would have covered it."""

    def change(c: Copy) -> None:
        prev = line_hash(c.line(N).rstrip(b"\n")).hex()
        c.insert_before(N + 1, Unsealed(event(N + 1).model_dump(mode="json")).seal(N + 1, prev)[1] + b"\n")

    copy = tamper(fresh, change)
    report = copy.verify()
    assert (report.ok, report.events, report.signed) == (True, N + 1, N)
    assert report.notes == ("1 events after the last checkpoint are not signed yet",)


def test_adjacent_events_reordered_are_named_at_every_position(fresh: Callable[[], Copy]) -> None:
    tally = Tally()
    for seq in range(1, N):
        copy = tamper(fresh, partial(swap_with_next, seq=seq))
        tally.check(f"swap {seq} and {seq + 1}", copy.verify(), seq)
    tally.assert_none_got_through()


def test_an_event_renumbered_is_named_at_every_position(fresh: Callable[[], Copy]) -> None:
    tally = Tally()
    for seq in range(1, N + 1):

        def change(c: Copy, s: int = seq) -> None:
            line = c.line(s)
            c.replace(s, line.replace(b'{"seq":%d,' % s, b'{"seq":%d,' % (s + 100), 1))

        copy = tamper(fresh, change)
        tally.check(f"renumber {seq}", copy.verify(), seq)
    tally.assert_none_got_through()


def test_a_deletion_hidden_by_renumbering_and_relinking_the_rest_is_detected(
    baseline: Baseline, fresh: Callable[[], Copy]
) -> None:
    """Event ``seq`` removed, every later one renumbered down by one and re-linked: the chain is
    whole again, but the tree no longer matches the next signed root."""
    tally = Tally()
    for seq in range(1, N + 1):

        def change(c: Copy, s: int = seq) -> None:
            c.delete(s)
            c.relink(s, renumber=True)

        copy = tamper(fresh, change)
        tally.check(f"delete {seq}, renumber and re-link the rest", copy.verify(), baseline.before(seq) + 1, seq)
    tally.assert_none_got_through()


def test_an_edit_relinked_to_the_end_is_detected_at_every_position(
    baseline: Baseline, fresh: Callable[[], Copy]
) -> None:
    tally = Tally()
    for seq in range(1, N + 1):

        def change(c: Copy, s: int = seq) -> None:
            c.replace(s, edited(c.line(s)))
            c.relink(s + 1)

        copy = tamper(fresh, change)
        tally.check(f"modify {seq} and re-chain the rest", copy.verify(), baseline.before(seq) + 1, seq)
    tally.assert_none_got_through()


# -- the tail -------------------------------------------------------------------------------------


def _cut_tail(copy: Copy, first_gone: int) -> None:
    """Keep events 1..first_gone-1: later lines go, and segments (with their manifests) left empty too."""
    for _, lines in copy.parts:
        lines[:] = [line for line in lines if head_of(line.rstrip(b"\n"))[0] < first_gone]  # type: ignore[index]
    for path, lines in list(copy.parts):
        if not lines and path != copy.layout.active:
            path.unlink()
            path.with_name(path.name[:26] + "manifest.json").unlink()
            copy.parts.remove((path, lines))


def test_a_tail_cut_off_is_named_at_every_length(fresh: Callable[[], Copy]) -> None:
    tally = Tally()
    for first_gone in range(1, N + 1):
        copy = tamper(fresh, partial(_cut_tail, first_gone=first_gone))
        tally.check(f"cut from {first_gone}", copy.verify(), first_gone)
    tally.assert_none_got_through()


def test_a_last_line_cut_mid_way_is_named(fresh: Callable[[], Copy]) -> None:
    copy = fresh()
    copy.replace(N, copy.line(N)[:50])  # no newline: an unacknowledged torn write, or a cut
    copy.save()
    tally = Tally()
    tally.check("last line cut mid-way", copy.verify(), N)
    tally.assert_none_got_through()


def _drop_checkpoints_after(copy: Copy, keep_through: int) -> None:
    """The attacker rolls the log's own checkpoints file back too (a prefix: its chain still holds)."""
    kept = [line for line in copy.layout.checkpoints.read_bytes().splitlines(keepends=True)
            if Checkpoint.model_validate_json(line).size <= keep_through]  # fmt: skip
    copy.layout.checkpoints.write_bytes(b"".join(kept))


def test_a_cut_tail_with_the_checkpoints_rolled_back_is_caught_by_the_publish_dir_or_a_saved_checkpoint(
    baseline: Baseline, fresh: Callable[[], Copy]
) -> None:
    tally = Tally()
    passed_without_outside_checkpoints = 0
    for first_gone in range(baseline.active_first + 1, N + 1):  # cuts inside the active segment
        for how in ("rolled back", "deleted"):

            def change(c: Copy, t: int = first_gone, h: str = how) -> None:
                _cut_tail(c, t)
                if h == "deleted":
                    c.layout.checkpoints.unlink()
                else:
                    _drop_checkpoints_after(c, t - 1)

            copy = tamper(fresh, change)
            tally.check(f"cut from {first_gone}, checkpoints {how}: publish dir", copy.verify(), first_gone)
            tally.check(f"cut from {first_gone}, checkpoints {how}: auditor's checkpoint",
                        copy.verify(publish=False, trusted=(baseline.last,)), first_gone)  # fmt: skip
            passed_without_outside_checkpoints += copy.verify(publish=False).ok
    tally.assert_none_got_through()
    # The control: with nothing kept outside the attacker's reach, the same cut cannot be seen.
    assert passed_without_outside_checkpoints == 2 * (N - baseline.active_first)


@pytest.mark.parametrize(("how", "restart"), [("rewritten", "append"), ("cut", "append"), ("rewritten", "probe")])
async def test_a_restarted_writer_never_signs_history_forged_under_it(tmp_path: Path, how: str, restart: str) -> None:
    """Without the key or any checkpoint kept elsewhere (no publish directory), the attacker
    rewrites (or cuts) the events after an early checkpoint, rolls the checkpoints file back to it
    and deletes the writer's state; then the router restarts and appends. The writer once chained
    on and signed the forged history, and verification found nothing. Now it keeps its last
    checkpoint beside its key (off the log's volume), puts it back into the checkpoints file,
    records that, and verification names the forgery; where the files were rewritten under it
    (their tree disagrees with it), the writer puts it back and refuses to append (calls are
    denied). With ``probe``, the restarted router only answers a readiness probe and is stopped (a
    rollout): its shutdown checkpoint once signed the forged files unrecorded and replaced the
    anchor with it. The control, a writer with nothing kept beside its key, shows the same
    tampering passing."""
    got_through = 0
    passed_without_anchor = 0
    for anchored in (True, False):
        root = tmp_path / ("anchored" if anchored else "control")
        kept = root / "keys" / "anchor.json" if anchored else None
        key = await _build(root, [event(n) for n in range(1, N + 1)], publish_dir=None, anchor=kept)
        copy = Copy(root, key)
        active = [head_of(line.rstrip(b"\n"))[0] for line in copy.parts[-1][1]]  # type: ignore[index]
        first = active[1]  # an event of the active segment, after a checkpoint
        signed_before = max(c.size for c in copy.layout.read_checkpoints() if c.size < first)
        if how == "rewritten":
            copy.replace(first, edited(copy.line(first)))
            copy.relink(first)
        else:
            _cut_tail(copy, first)
        _drop_checkpoints_after(copy, signed_before)
        copy.save()
        copy.layout.state.unlink(missing_ok=True)

        # A rewrite the anchor disagrees with: the writer refuses (fails closed) rather than chain on.
        refuses = anchored and how == "rewritten"
        if restart == "probe":
            probed = JsonlAuditLog(copy.layout.active, options=_options(root, key, publish_dir=None, anchor=kept))
            problem = await probed.check()
            assert (problem is not None and "will not sign" in problem) if refuses else problem is None
            await probed.aclose()
        log = JsonlAuditLog(copy.layout.active, options=_options(root, key, publish_dir=None, anchor=kept))
        if refuses:
            with pytest.raises(AuditError, match=f"checkpoint {N} .*will not sign"):
                await log.append(event(N + 1))
        else:
            await log.append(event(N + 1))
        await log.aclose()
        report = copy.verify(publish=False)
        if not anchored:
            passed_without_anchor += report.ok
            continue
        got_through += report.ok
        assert report.broken_seq is not None
        # A rewrite is named where it starts; a cut where the log stops reaching the checkpoint
        # put back (what the writer appended since takes the seqs that were cut: no root over them
        # can be compared with the signed one, which covers more events than the files hold).
        assert report.broken_seq <= (first if how == "rewritten" else N), report.problem
        lost = [json.loads(line) for _, lines in Copy(root, key).parts for line in lines
                if b"audit.checkpoints_lost" in line]  # fmt: skip
        # (A writer that refuses chains nothing: the checkpoint put back is the record.)
        assert [e["result"]["size"] for e in lost] == ([] if refuses else [N])
        assert max(c.size for c in copy.layout.read_checkpoints()) >= N
    assert got_through == 0
    assert passed_without_anchor == 1


def test_the_anchor_is_named_after_the_configured_path_not_where_a_symlink_leads(tmp_path: Path) -> None:
    """A log directory swapped for a symlink to a forged copy must be held to the same anchor: it
    is named after the path as configured, never after where the path leads."""
    key = tmp_path / "keys" / "audit.key"
    configured = tmp_path / "log" / "audit.jsonl"
    configured.parent.mkdir()
    before = anchor_path(key, configured)
    forged = tmp_path / "forged"
    forged.mkdir()
    configured.parent.rmdir()
    configured.parent.symlink_to(forged)
    assert anchor_path(key, configured) == before
    assert anchor_path(key, forged / "audit.jsonl") != before


def test_a_kept_checkpoint_outranks_the_logs_own_when_they_disagree(
    baseline: Baseline, fresh: Callable[[], Copy]
) -> None:
    """The events after a checkpoint are re-chained, and every later checkpoint in the log's file is
    replaced by one signed over the forged tree with the real key (a router made to sign it, or a
    leaked key). A checkpoint the auditor kept disagrees at the same size: the files are held to the
    auditor's, so the forgery is found within what it covers (it was once named past the end of the
    log, as if every event were sound). Where within, the re-signed checkpoints cannot tell: they
    are signed by the key too."""
    tally = Tally()
    for seq in range(baseline.active_first, N + 1):
        copy = fresh()
        copy.replace(seq, edited(copy.line(seq)))
        copy.relink(seq)
        copy.save()
        forged = CompactRange()
        roots = {}
        for _, lines in copy.parts:
            for line in lines:
                forged.append(line_hash(line.rstrip(b"\n")))
                roots[forged.size] = forged.root()
        kept = [c for c in copy.layout.read_checkpoints() if c.size < seq]
        resigned = list(kept)
        for size in sorted(c.size for c in copy.layout.read_checkpoints() if c.size >= seq):
            resigned.append(sign_checkpoint(baseline.key, log="stockade", size=size, root=roots[size],
                                            prev=resigned[-1] if resigned else None))  # fmt: skip
        copy.layout.checkpoints.write_bytes(b"".join(c.signed_text() + b"\n" for c in resigned))
        assert copy.verify(publish=False).ok  # the log's own files agree with themselves
        report = copy.verify(publish=False, trusted=(baseline.last,))
        tally.check(f"re-chained from {seq}, checkpoints re-signed", report, baseline.before(seq) + 1, N)
    tally.assert_none_got_through()


# -- segments -------------------------------------------------------------------------------------


def test_bytes_added_to_a_sealed_segment_or_its_manifest_edited_are_named(
    baseline: Baseline, fresh: Callable[[], Copy]
) -> None:
    """Reading lines does not see bytes after a segment's last newline, and a manifest's size,
    first hash and tree are not signed: each is held to what the segment's events make. (Once,
    garbage appended to a sealed segment, or its manifest's size edited, verified as intact.)"""
    tally = Tally()
    for first, last in baseline.segments:
        segment = baseline.root / "log" / "audit.jsonl.segments" / f"{first:012d}-{last:012d}.jsonl"
        for how in ("a partial line appended", "manifest size", "manifest first hash", "manifest tree"):

            def change(c: Copy, f: int = first, la: int = last, h: str = how) -> None:
                path = c.layout.segments_dir / f"{f:012d}-{la:012d}.jsonl"
                manifest = path.with_name(path.name[:26] + "manifest.json")
                document = json.loads(manifest.read_bytes())
                if h == "a partial line appended":  # no newline: `save` writes the part's lines back
                    lines = next(lines for p, lines in c.parts if p == path)
                    lines.append(b'{"seq":' + str(la + 1).encode() + b',"garbage":1')
                elif h == "manifest size":
                    document["bytes"] += 1
                elif h == "manifest first hash":
                    document["first_prev_hash"] = "f" * 64
                else:
                    document["tree"] = CompactRange().to_json()
                manifest.write_text(json.dumps(document))

            assert segment.exists()
            copy = tamper(fresh, change)
            tally.check(f"segment {first}..{last}: {how}", copy.verify(), first, last + 1)
    tally.assert_none_got_through()


def test_a_sealed_segment_deleted_is_named(baseline: Baseline, fresh: Callable[[], Copy]) -> None:
    tally = Tally()
    for first, last in baseline.segments:
        for with_manifest in (True, False):

            def change(c: Copy, a: int = first, b: int = last, m: bool = with_manifest) -> None:
                path = c.layout.segment_path(a, b)
                path.unlink()
                if m:
                    c.layout.segment_path(a, b, "manifest.json").unlink()
                c.parts = [(p, lines) for p, lines in c.parts if p != path]

            copy = tamper(fresh, change)
            tally.check(f"segment {first}-{last} deleted (manifest too: {with_manifest})", copy.verify(), first)

    def delete_active(c: Copy) -> None:
        c.layout.active.unlink()
        c.parts = [(p, lines) for p, lines in c.parts if p != c.layout.active]

    copy = tamper(fresh, delete_active)
    tally.check("the active segment deleted", copy.verify(), baseline.active_first)
    tally.assert_none_got_through()


def test_a_sealed_segment_replaced_by_a_rechained_copy_is_detected(
    baseline: Baseline, fresh: Callable[[], Copy]
) -> None:
    """Each sealed segment rewritten from each of its events on, re-linked to its end (so its own
    chain holds), with or without its manifest's unsigned fields rewritten to match."""
    tally = Tally()
    for first, last in baseline.segments:
        for seq in range(first, last + 1):
            for manifest_too in (False, True):

                def change(c: Copy, a: int = first, b: int = last, s: int = seq, m: bool = manifest_too) -> None:
                    c.replace(s, edited(c.line(s)))
                    c.relink(s + 1, end=b)
                    if m:
                        _rewrite_manifest(c, a, b)

                copy = tamper(fresh, change)
                tally.check(f"segment {first}-{last} re-chained from {seq} (manifest too: {manifest_too})",
                            copy.verify(), baseline.before(seq) + 1, seq)  # fmt: skip
    tally.assert_none_got_through()


def _rewrite_manifest(copy: Copy, first: int, last: int) -> None:
    """What a forger can change in a manifest without the key: everything but its checkpoint."""
    path = copy.layout.segment_path(first, last)
    raw = b"".join(dict(copy.parts)[path])
    tree = CompactRange()
    for part_path, lines in copy.parts:
        for line in lines:
            tree.append(line_hash(line.rstrip(b"\n")))
        if part_path == path:
            break
    manifest_path = copy.layout.segment_path(first, last, "manifest.json")
    manifest = Manifest.model_validate_json(manifest_path.read_bytes())
    forged = manifest.model_copy(update={
        "bytes": len(raw), "sha256": __import__("hashlib").sha256(raw).hexdigest(), "tree": tree.to_json(),
        "last_hash": line_hash(raw.splitlines()[-1]).hex(),
    })  # fmt: skip
    manifest_path.write_text(forged.model_dump_json())


def test_a_sealed_segment_swapped_for_another_is_named(baseline: Baseline, fresh: Callable[[], Copy]) -> None:
    tally = Tally()
    for index, (first, last) in enumerate(baseline.segments):
        other_first, other_last = baseline.segments[(index + 1) % len(baseline.segments)]

        def change(c: Copy, a: int = first, b: int = last, oa: int = other_first, ob: int = other_last) -> None:
            lines = dict(c.parts)
            lines[c.layout.segment_path(a, b)][:] = list(lines[c.layout.segment_path(oa, ob)])

        copy = tamper(fresh, change)
        tally.check(f"segment {first}-{last} holds {other_first}-{other_last}", copy.verify(), first)
    tally.assert_none_got_through()


def test_an_incremental_verify_catches_a_later_tampering_and_a_forged_resume_point(
    baseline: Baseline, fresh: Callable[[], Copy]
) -> None:
    first = baseline.segments[3][0]
    tally = Tally()

    def incremental(c: Copy) -> VerifyReport:
        return verify_log(c.layout, keys=[baseline.key.verify_key], publish_dir=c.published, from_seq=first)

    copy = tamper(fresh, lambda c: c.delete(first + 1))
    tally.check("delete in a later segment, verified from it", incremental(copy), first + 1)

    before_first, before_last = baseline.segments[2]

    def forge_resume(c: Copy) -> None:  # the manifest the incremental check resumes from, its tree forged
        path = c.layout.segment_path(before_first, before_last, "manifest.json")
        manifest = Manifest.model_validate_json(path.read_bytes())
        tree = CompactRange()
        for n in range(before_last):
            tree.append(line_hash(b"forged %d" % n))
        path.write_text(manifest.model_copy(update={"tree": tree.to_json()}).model_dump_json())

    copy = tamper(fresh, forge_resume)
    tally.check("the resume point's tree forged", incremental(copy), before_last)
    tally.assert_none_got_through()


# -- checkpoints ----------------------------------------------------------------------------------


def _checkpoint_lines(copy: Copy) -> list[bytes]:
    return copy.layout.checkpoints.read_bytes().splitlines(keepends=True)


def test_checkpoints_removed_reordered_edited_or_forged_are_refused(
    baseline: Baseline, fresh: Callable[[], Copy]
) -> None:
    other = SigningKey.generate()
    tally = Tally()
    count = len(baseline.checkpoints)
    for index in range(1, count - 1):  # one removed from the middle
        copy = fresh()
        lines = _checkpoint_lines(copy)
        del lines[index]
        copy.layout.checkpoints.write_bytes(b"".join(lines))
        report = copy.verify()
        tally.check(f"checkpoint {index} removed", report, 1, N + 1)
        assert report.ok or "removed, reordered or replaced" in report.problem
    for index in range(count - 1):  # two swapped
        copy = fresh()
        lines = _checkpoint_lines(copy)
        lines[index], lines[index + 1] = lines[index + 1], lines[index]
        copy.layout.checkpoints.write_bytes(b"".join(lines))
        tally.check(f"checkpoints {index} and {index + 1} swapped", copy.verify(), 1, N + 1)
    for index in range(count):  # a root edited
        copy = fresh()
        lines = _checkpoint_lines(copy)
        document = json.loads(lines[index])
        document["root"] = "ab" * 32
        lines[index] = json.dumps(document, sort_keys=True, separators=(",", ":")).encode() + b"\n"
        copy.layout.checkpoints.write_bytes(b"".join(lines))
        tally.check(f"checkpoint {index}'s root edited", copy.verify(), 1, N + 1)
    tally.assert_none_got_through()

    for where in ("checkpoints file", "publish dir"):  # signed with another key, in the right chain
        copy = fresh()
        forged = sign_checkpoint(other, log="stockade", size=N, root=bytes(32), prev=baseline.last)
        if where == "checkpoints file":
            with copy.layout.checkpoints.open("ab") as handle:
                handle.write(forged.signed_text() + b"\n")
        else:
            (copy.published / "999999999999-forged.json").write_bytes(forged.signed_text())
        report = copy.verify()
        assert not report.ok
        assert "not signed by a trusted key" in report.problem


def test_a_cut_tail_covered_by_checkpoints_forged_with_another_key_is_refused(
    baseline: Baseline, fresh: Callable[[], Copy]
) -> None:
    """The attacker cuts the tail and replaces every checkpoint by ones of their own key that match
    what is left: their signatures are refused (and the publish dir still has the real ones)."""
    other = SigningKey.generate()
    tally = Tally()
    first_gone = baseline.active_first + 2
    copy = fresh()
    _cut_tail(copy, first_gone)
    copy.save()
    tree = CompactRange()
    for _, lines in copy.parts:
        for line in lines:
            tree.append(line_hash(line.rstrip(b"\n")))
    forged = sign_checkpoint(other, log="stockade", size=tree.size, root=tree.root(), prev=None)
    copy.layout.checkpoints.write_bytes(forged.signed_text() + b"\n")
    tally.check("cut with forged checkpoints, publish dir", copy.verify(), first_gone)
    report = copy.verify(publish=False)
    tally.check("cut with forged checkpoints, no publish dir", report, 1, N + 1)
    assert "not signed by a trusted key" in report.problem
    tally.assert_none_got_through()


# -- a log verified in two processes --------------------------------------------------------------

LARGE = 8200  # events of ~4.3 KB: past the size at which verification splits the log between two processes


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    root = tmp_path_factory.mktemp("large")
    key = SigningKey.load_or_create(root / "keys" / "audit.key")

    async def build() -> None:
        chosen = _options(root, key, checkpoint_every=1000, segment_max_bytes=4 << 20)
        log = JsonlAuditLog(root / "log" / "audit.jsonl", durability="relaxed", options=chosen)
        for n in range(1, LARGE + 1):
            await log.append(event(n, result={"pad": "x" * 4000}))
        await log.aclose()

    asyncio.run(build())
    layout = LogLayout(root / "log" / "audit.jsonl")
    parts = layout.parts()
    sealed = tuple((p.first_seq, p.last_seq) for p in parts if p.kind == "sealed")
    assert sum(p.path.stat().st_size for p in parts) > 32 << 20
    checkpoints = layout.read_checkpoints()
    return Baseline(root, key, tuple(c.size for c in checkpoints), sealed, sealed[-1][1] + 1, checkpoints[-1])


def test_a_log_verified_in_two_processes_misses_nothing_the_single_pass_sees(large: Baseline, scratch: Path) -> None:
    """``workers=2`` (what `stockade audit verify` uses) checks the older half of a large log in
    another process: every tampering in either half, or across the split, is still reported, at
    the seq the single pass names."""
    parts = LogLayout(large.root / "log" / "audit.jsonl").parts()
    whole = verify_log(LogLayout(large.root / "log" / "audit.jsonl"), keys=[large.key.verify_key], workers=2)
    assert (whole.ok, whole.events, whole.signed) == (True, LARGE, LARGE)
    split = next(p for p in parts if p.kind == "sealed" and p.last_seq >= LARGE // 2)  # about where it splits
    older, newer = split.first_seq - 500, split.last_seq + 500
    cases: list[tuple[str, Callable[[Copy], None], int, int]] = [
        ("modify in the older half", partial(modify, seq=older), older, older),
        ("modify in the newer half", partial(modify, seq=newer), newer, newer),
        ("delete in the older half", partial(Copy.delete, seq=older), older, older),
        ("swap across the split", partial(swap_with_next, seq=split.last_seq), split.last_seq, split.last_seq),
        ("cut the tail", partial(_cut_tail, first_gone=LARGE - 10), LARGE - 10, LARGE - 10),
    ]

    def rechain(c: Copy, s: int = older) -> None:
        modify(c, s)
        c.relink(s + 1)

    cases.append(("re-chain from the older half to the end", rechain, large.before(older) + 1, older))
    for first, last in large.segments[:3]:

        def drop(c: Copy, a: int = first, b: int = last) -> None:
            c.layout.segment_path(a, b).unlink()
            c.layout.segment_path(a, b, "manifest.json").unlink()
            c.parts = [(path, lines) for path, lines in c.parts if path != c.layout.segment_path(a, b)]

        cases.append((f"segment {first}-{last} deleted", drop, first, first))
    tally = Tally()
    for what, change, low, high in cases:
        copy = _copy_of(large, scratch)
        change(copy)
        copy.save()
        single = verify_log(copy.layout, keys=[large.key.verify_key], publish_dir=copy.published, workers=1)
        double = verify_log(copy.layout, keys=[large.key.verify_key], publish_dir=copy.published, workers=2)
        tally.check(what + " (one process)", single, low, high)
        tally.check(what + " (two processes)", double, low, high)
        if (single.ok, single.broken_seq) != (double.ok, double.broken_seq):
            tally.misplaced.append(f"{what}: one process says {single.broken_seq}, two say {double.broken_seq}")
        shutil.rmtree(copy.root)
    tally.assert_none_got_through()


# -- tombstones -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def retired(tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    """A log whose first 10 events are from 2020: retention (30 days) replaced their segments by tombstones."""
    root = tmp_path_factory.mktemp("retired")
    old = [event(n, day="2020-01-01") for n in range(1, 11)]
    new = [event(n, day=timestamp()[:10]) for n in range(11, 31)]
    key = asyncio.run(_build(root, old + new, retention_days=30))
    layout = LogLayout(root / "log" / "audit.jsonl")
    parts = layout.parts()
    tombstones = [(p.first_seq, p.last_seq) for p in parts if p.kind == "tombstone"]
    assert tombstones
    assert tombstones[-1][1] == 10
    report = verify_log(layout, keys=[key.verify_key], publish_dir=root / "published")
    assert (report.ok, report.events, report.retired) == (True, 30, 10)
    sealed = tuple((p.first_seq, p.last_seq) for p in parts if p.kind == "sealed")
    checkpoints = layout.read_checkpoints()
    return Baseline(root, key, tuple(c.size for c in checkpoints), tuple(tombstones), sealed[0][0], checkpoints[-1])


def _copy_of(base: Baseline, scratch: Path) -> Copy:
    target = Path(tempfile.mkdtemp(dir=scratch))
    shutil.copytree(base.root, target, dirs_exist_ok=True)
    return Copy(target, base.key)


def test_tombstones_edited_forged_or_deleted_are_refused(retired: Baseline, scratch: Path) -> None:
    other = SigningKey.generate()
    tally = Tally()
    for first, last in retired.segments:  # here: the tombstones' ranges
        path = LogLayout(retired.root / "log" / "audit.jsonl").segment_path(first, last, "tombstone.json")
        genuine = Tombstone.model_validate_json(path.read_bytes())
        other_signature = genuine.checkpoint.signature
        edits: dict[str, Callable[[dict[str, object]], None]] = {
            "reason": lambda d: d.update(reason="routine"),
            "time": lambda d: d.update(time="2031-01-01T00:00:00.000000Z"),
            "sha256": lambda d: d.update(sha256="cd" * 32),
            "bytes": lambda d: d.update(bytes=1),
            "last_hash": lambda d: d.update(last_hash="ef" * 32),
            "signature": partial(_set, "signature", other_signature),
        }
        for name, edit in edits.items():
            copy = _copy_of(retired, scratch)
            document = json.loads(genuine.signed_text())
            edit(document)
            copy.layout.segment_path(first, last, "tombstone.json").write_text(json.dumps(document))
            tally.check(f"tombstone {first}-{last}: {name} edited", copy.verify(), first)
        copy = _copy_of(retired, scratch)
        fields = {k: v for k, v in genuine.model_dump().items() if k not in ("key_id", "signature", "checkpoint")}
        checkpoint = sign_checkpoint(other, log="stockade", size=last, root=bytes.fromhex(genuine.checkpoint.root),
                                     prev=None)  # fmt: skip
        forged = sign_tombstone(other, **fields, checkpoint=checkpoint)
        copy.layout.segment_path(first, last, "tombstone.json").write_bytes(forged.signed_text())
        tally.check(f"tombstone {first}-{last} re-signed with another key", copy.verify(), first)
        copy = _copy_of(retired, scratch)
        copy.layout.segment_path(first, last, "tombstone.json").unlink()
        tally.check(f"tombstone {first}-{last} deleted", copy.verify(), first)
        # Verified from just after it, it is where the tree resumes: its own signature is checked
        # there too, not only the (genuine, copied) checkpoint inside it.
        copy = _copy_of(retired, scratch)
        document = json.loads(genuine.signed_text())
        document["signature"] = other_signature
        copy.layout.segment_path(first, last, "tombstone.json").write_text(json.dumps(document))
        report = verify_log(copy.layout, keys=[retired.key.verify_key], from_seq=last + 1)
        tally.check(f"tombstone {first}-{last}: signature edited, verified from seq {last + 1}", report, first)
    tally.assert_none_got_through()


def test_a_live_segment_hidden_under_a_forged_tombstone_is_refused(retired: Baseline, scratch: Path) -> None:
    """A sealed segment deleted and a tombstone of another key written in its place."""
    other = SigningKey.generate()
    layout = LogLayout(retired.root / "log" / "audit.jsonl")
    tally = Tally()
    for part in [p for p in layout.parts() if p.kind == "sealed"]:
        copy = _copy_of(retired, scratch)
        manifest = part.manifest()
        checkpoint = sign_checkpoint(other, log="stockade", size=manifest.last_seq,
                                     root=bytes.fromhex(manifest.checkpoint.root), prev=None)  # fmt: skip
        forged = sign_tombstone(
            other, log="stockade", first_seq=manifest.first_seq, last_seq=manifest.last_seq, bytes=manifest.bytes,
            sha256=manifest.sha256, last_hash=manifest.last_hash, tree=manifest.tree, checkpoint=checkpoint,
            reason="retention: older than 30 days",
        )  # fmt: skip
        copy.layout.segment_path(part.first_seq, part.last_seq).unlink()
        copy.layout.segment_path(part.first_seq, part.last_seq, "manifest.json").unlink()
        copy.layout.segment_path(part.first_seq, part.last_seq, "tombstone.json").write_bytes(forged.signed_text())
        tally.check(f"segment {part.first_seq}-{part.last_seq} under a forged tombstone", copy.verify(),
                    part.first_seq)  # fmt: skip
    tally.assert_none_got_through()


# -- the Redis stream -----------------------------------------------------------------------------

R = 15
R_CHECKPOINT_EVERY = 3


async def _stream(url: str, key: SigningKey) -> list[Checkpoint]:
    """R events in the stream, a checkpoint after every third; returns the checkpoints."""
    log = RedisAuditLog(url, options=LogOptions(signer=key, checkpoint_interval_s=3600))
    signed: list[Checkpoint] = []
    try:
        for n in range(1, R + 1):
            await log.append(event(n))
            if n % R_CHECKPOINT_EVERY == 0:
                checkpoint = await log.checkpoint()
                assert checkpoint is not None
                signed.append(checkpoint)
    finally:
        await log.aclose()
    return signed


async def _verify_stream(url: str, key: SigningKey, trusted: tuple[Checkpoint, ...] = ()) -> VerifyReport:
    log = RedisAuditLog(url, options=LogOptions(signer=key, checkpoint_interval_s=3600))
    try:
        return await log.verify(keys=[key.verify_key], trusted=trusted)
    finally:
        await log._redis.aclose()  # not aclose(): that would sign the (tampered) head


def xrange(db: redis.Redis, key: str) -> list[tuple[str, dict[str, str]]]:
    """A stream's entries (id, fields), as the test's decoding client reads them."""
    return cast("list[tuple[str, dict[str, str]]]", db.xrange(key))


def _xdel_nth(db: redis.Redis, seq: int) -> None:
    db.xdel(STREAM, xrange(db, STREAM)[seq - 1][0])


def _before(seq: int) -> int:
    return (seq - 1) // R_CHECKPOINT_EVERY * R_CHECKPOINT_EVERY


def _rewrite_stream(db: redis.Redis, lines: list[bytes]) -> None:
    """The stream replaced by ``lines`` (XADD again, new ids), the head moved to match."""
    db.delete(STREAM)
    tree = CompactRange()
    for line in lines:
        leaf = line_hash(line)
        tree.append(leaf)
        db.xadd(STREAM, {"event": line.decode(), "hash": leaf.hex()})
    head = line_hash(lines[-1]).hex() if lines else GENESIS_HASH
    db.hset(HEAD, mapping={"seq": str(len(lines)), "hash": head, "tree": json.dumps(tree.to_json())})


def _stream_lines(db: redis.Redis) -> list[bytes]:
    return [fields["event"].encode() for _, fields in xrange(db, STREAM)]


async def test_the_redis_stream_tampered_every_way_is_detected(tmp_path: Path, redis_url: str) -> None:
    key = SigningKey.load_or_create(tmp_path / "keys" / "audit.key")
    db = redis.Redis.from_url(redis_url, decode_responses=True)
    tally = Tally()
    passed_without_a_saved_checkpoint = 0

    async def case(what: str, change: Callable[[], None], low: int, high: int | None = None) -> None:
        db.flushdb()
        signed = await _stream(redis_url, key)
        change()
        tally.check(what, await _verify_stream(redis_url, key), low, high)
        tally.check(what + ", against a saved checkpoint", await _verify_stream(redis_url, key, (signed[-1],)), low,
                    high)  # fmt: skip

    try:
        for seq in range(1, R + 1):  # an entry deleted
            await case(f"XDEL {seq}", partial(_xdel_nth, db, seq), seq)
        for seq in range(1, R + 1):  # rewritten with an edit, re-linked to the end

            def rewrite(s: int = seq) -> None:
                lines = _stream_lines(db)
                lines[s - 1] = edited(lines[s - 1])
                prev = line_hash(lines[s - 2]).hex() if s > 1 else GENESIS_HASH
                for i in range(s - 1, len(lines)):
                    lines[i] = Unsealed(json.loads(lines[i])).seal(i + 1, prev)[1]
                    prev = line_hash(lines[i]).hex()
                _rewrite_stream(db, lines)

            await case(f"rewrite from {seq}", rewrite, _before(seq) + 1, seq)
        for first_gone in range(1, R + 1):  # rolled back: the tail deleted and the head moved back

            def roll_back(t: int = first_gone, checkpoints_too: bool = False) -> None:
                _rewrite_stream(db, _stream_lines(db)[: t - 1])
                if checkpoints_too:
                    for entry_id, fields in xrange(db, CHECKPOINTS):
                        if Checkpoint.model_validate_json(fields["checkpoint"]).size >= t:
                            db.xdel(CHECKPOINTS, entry_id)
                    db.hdel(HEAD, "checkpoint", "checkpoint_digest")

            await case(f"rolled back to {first_gone - 1}", roll_back, first_gone)
            db.flushdb()  # and the checkpoints stream rolled back too: only a saved checkpoint sees it
            signed = await _stream(redis_url, key)
            roll_back(first_gone, checkpoints_too=True)
            tally.check(f"rolled back to {first_gone - 1} with its checkpoints, against a saved checkpoint",
                        await _verify_stream(redis_url, key, (signed[-1],)), first_gone)  # fmt: skip
            passed_without_a_saved_checkpoint += (await _verify_stream(redis_url, key)).ok
    finally:
        db.close()
    tally.assert_none_got_through()
    # The control: with the checkpoints rolled back too, and no checkpoint saved elsewhere, a
    # rollback to a signed size cannot be told from a log that never grew.
    assert passed_without_a_saved_checkpoint == R


@pytest.mark.parametrize("how", ["hash forged", "moved back two events"])
async def test_a_redis_head_rewritten_is_caught_once_a_router_chains_onto_it(
    tmp_path: Path, redis_url: str, how: str
) -> None:
    """The head alone rewritten (the stream as it was): a router that never appended here (so
    remembers nothing) chains the next event onto it, and that event is where the chain breaks;
    event R before it is vouched for by the checkpoint signed at R."""
    key = SigningKey.load_or_create(tmp_path / "keys" / "audit.key")
    signed = await _stream(redis_url, key)
    db = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        if how == "hash forged":
            db.hset(HEAD, "hash", "ab" * 32)
        else:
            entries = xrange(db, STREAM)
            tree = CompactRange()
            for _, fields in entries[: R - 2]:
                tree.append(bytes.fromhex(fields["hash"]))
            db.hset(HEAD, mapping={"seq": str(R - 2), "hash": entries[R - 3][1]["hash"],
                                   "tree": json.dumps(tree.to_json())})  # fmt: skip
    finally:
        db.close()
    newcomer = RedisAuditLog(redis_url)
    try:
        await newcomer.append(event(R + 1))
    finally:
        await newcomer.aclose()
    tally = Tally()
    tally.check(f"head {how}", await _verify_stream(redis_url, key), R + 1)
    tally.check(f"head {how}, against a saved checkpoint", await _verify_stream(redis_url, key, (signed[-1],)), R + 1)
    tally.assert_none_got_through()


# -- `stockade audit verify` ------------------------------------------------------------------------

STOCKADE = str(Path(sys.executable).parent / "stockade")


def stockade_verify(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, object]]:
    """``stockade audit verify --json`` as a process; its exit code and report. No signing key of
    the developer's is found: the key comes from ``--public-key``."""
    result = subprocess.run(
        [STOCKADE, "audit", "verify", "--json", *args], capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "STOCKADE_AUDIT__SIGNING_KEY": "/nonexistent/audit.key", **(env or {})},
    )  # fmt: skip
    assert result.returncode in (0, 1), result.stderr[-2000:]
    return result.returncode, json.loads(result.stdout)


def test_the_cli_never_calls_a_log_intact_it_could_not_check(baseline: Baseline, fresh: Callable[[], Copy]) -> None:
    """Without a public key, anyone able to write the log's volume could have signed its
    checkpoints (a forged tombstone with a zero signature passed as "OK"); and a publish directory
    that is not there (unmounted) once counted as one holding nothing. Both are usage errors now,
    naming what to pass."""
    copy = fresh()
    base = [STOCKADE, "audit", "verify", "--path", str(copy.layout.active)]
    env = {**os.environ, "STOCKADE_AUDIT__SIGNING_KEY": "/nonexistent/audit.key"}
    no_key = subprocess.run(base, capture_output=True, text=True, timeout=120, check=False, env=env)
    assert no_key.returncode == 2
    assert "--public-key" in no_key.stderr
    public = str(baseline.root / "keys" / "audit.key.pub")
    env["STOCKADE_AUDIT__PUBLISH_DIR"] = str(copy.root / "gone")
    unmounted = subprocess.run([*base, "--public-key", public], capture_output=True, text=True, timeout=120,
                               check=False, env=env)  # fmt: skip
    assert unmounted.returncode == 2
    assert "not a directory" in unmounted.stderr


def test_the_cli_exits_1_and_names_the_broken_seq(baseline: Baseline, fresh: Callable[[], Copy]) -> None:
    public = str(baseline.root / "keys" / "audit.key.pub")
    copy = fresh()
    code, report = stockade_verify("--path", str(copy.layout.active), "--public-key", public)
    assert (code, report["ok"], report["events"], report["signed"], report["broken_seq"]) == (0, True, N, N, None)
    tally = Tally()
    for what, change, expected in (
        ("modify 12", lambda c: c.replace(12, edited(c.line(12))), 12),
        ("delete 23", lambda c: c.delete(23), 23),
        ("swap 30 and 31", lambda c: c.swap(30, 31), 30),
        ("cut from 38", lambda c: _cut_tail(c, 38), 38),
    ):
        copy = tamper(fresh, change)
        code, report = stockade_verify("--path", str(copy.layout.active), "--public-key", public)
        tally.tried += 1
        if code == 0 or report["ok"]:
            tally.undetected.append(what)
        elif (code, report["broken_seq"]) != (1, expected):
            tally.misplaced.append(f"{what}: exit {code}, broken_seq {report['broken_seq']}, not {expected}")
    tally.assert_none_got_through()


def test_the_cli_catches_a_cut_tail_with_its_checkpoints_rolled_back_through_a_kept_checkpoint(
    baseline: Baseline, fresh: Callable[[], Copy], tmp_path: Path
) -> None:
    public = str(baseline.root / "keys" / "audit.key.pub")
    first_gone = N - 2

    def change(c: Copy) -> None:
        _cut_tail(c, first_gone)
        _drop_checkpoints_after(c, first_gone - 1)

    copy = tamper(fresh, change)
    log = str(copy.layout.active)
    kept = tmp_path / "kept.json"
    kept.write_bytes(baseline.last.signed_text())
    code, report = stockade_verify("--path", log, "--public-key", public)
    assert (code, report["ok"]) == (0, True)  # the control: nothing outside the attacker's reach was given
    for how, args, env in (
        ("--checkpoint file", ["--checkpoint", str(kept)], {}),
        ("--checkpoint directory", ["--checkpoint", str(copy.published)], {}),
        ("publish dir setting", [], {"STOCKADE_AUDIT__PUBLISH_DIR": str(copy.published)}),
    ):
        code, report = stockade_verify("--path", log, "--public-key", public, *args, env=env)
        assert (how, code, report["ok"], report["broken_seq"]) == (how, 1, False, first_gone)
        assert "cut off" in str(report["problem"])


def test_the_cli_refuses_checkpoints_of_another_key(
    baseline: Baseline, fresh: Callable[[], Copy], tmp_path: Path
) -> None:
    other = tmp_path / "other.pub"
    other.write_bytes(SigningKey.generate().public_pem())
    copy = fresh()
    code, report = stockade_verify("--path", str(copy.layout.active), "--public-key", str(other))
    assert (code, report["ok"]) == (1, False)
    assert "not signed by a trusted key" in str(report["problem"])


def test_the_cli_verifies_incrementally_from_a_seq(baseline: Baseline, fresh: Callable[[], Copy]) -> None:
    public = str(baseline.root / "keys" / "audit.key.pub")
    first, _ = baseline.segments[-2]
    copy = tamper(fresh, lambda c: c.delete(first + 1))
    code, report = stockade_verify("--path", str(copy.layout.active), "--public-key", public, "--from-seq",
                                   str(first))  # fmt: skip
    assert (code, report["broken_seq"]) == (1, first + 1)


async def test_a_redis_checkpoints_stream_deleted_under_an_intact_stream_is_named(
    tmp_path: Path, redis_url: str
) -> None:
    """The checkpoints stream deleted (or emptied) while the events and the head are intact: the
    head's own checkpoint is no longer among the stream's, which verify names (it once said OK)."""
    key = SigningKey.load_or_create(tmp_path / "keys" / "audit.key")
    await _stream(redis_url, key)
    db = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        db.delete(CHECKPOINTS)
        report = await _verify_stream(redis_url, key)
        assert not report.ok
        assert "does not hold the head's checkpoint" in report.problem, report.problem
    finally:
        db.close()


async def test_the_cli_catches_a_redis_stream_rolled_back_with_its_checkpoints(tmp_path: Path, redis_url: str) -> None:
    key = SigningKey.load_or_create(tmp_path / "keys" / "audit.key")
    signed = await _stream(redis_url, key)
    kept = tmp_path / "kept.json"
    kept.write_bytes(signed[-1].signed_text())
    db = redis.Redis.from_url(redis_url, decode_responses=True)
    env = {"STOCKADE_AUDIT__BACKEND": "redis", "STOCKADE_STORE__URL": redis_url}
    public = str(tmp_path / "keys" / "audit.key.pub")
    try:
        code, report = await asyncio.to_thread(stockade_verify, "--public-key", public, env=env)
        assert (code, report["ok"], report["signed"]) == (0, True, R)
        _rewrite_stream(db, _stream_lines(db)[: R - 4])
        code, report = await asyncio.to_thread(stockade_verify, "--public-key", public, env=env)
        assert (code, report["broken_seq"]) == (1, R - 3)  # against the checkpoints stream
        for entry_id, fields in xrange(db, CHECKPOINTS):
            if Checkpoint.model_validate_json(fields["checkpoint"]).size > R - 4:
                db.xdel(CHECKPOINTS, entry_id)
        # The head still records the latest checkpoint, which the stream no longer reaches.
        code, report = await asyncio.to_thread(stockade_verify, "--public-key", public, env=env)
        assert (code, report["broken_seq"]) == (1, R - 3)
        last = [c for c in signed if c.size <= R - 4][-1]
        db.hset(HEAD, mapping={"checkpoint": last.signed_text().decode(), "checkpoint_digest": last.digest()})
        code, report = await asyncio.to_thread(stockade_verify, "--public-key", public, env=env)
        assert (code, report["ok"]) == (0, True)  # the control: all of Redis rolled back, nothing outside given
        code, report = await asyncio.to_thread(stockade_verify, "--public-key", public, "--checkpoint", str(kept),
                                               env=env)  # fmt: skip
        assert (code, report["broken_seq"]) == (1, R - 3)
        # The routers' publish directory (out of Redis's reach) shows it too: it was once ignored here.
        published = tmp_path / "published"
        published.mkdir()
        publish_file(published, signed[-1])
        code, report = await asyncio.to_thread(stockade_verify, "--public-key", public,
                                               env={**env, "STOCKADE_AUDIT__PUBLISH_DIR": str(published)})  # fmt: skip
        assert (code, report["broken_seq"]) == (1, R - 3)
        assert "cut off" in str(report["problem"])
        # Without a public key nothing signed is checked: not "OK" but exit 2.
        unkeyed = await asyncio.to_thread(subprocess.run, [STOCKADE, "audit", "verify"], capture_output=True,
                                          text=True, env={**os.environ, **env, "STOCKADE_AUDIT__SIGNING_KEY":
                                                          str(tmp_path / "none" / "audit.key")},
                                          timeout=120, check=False)  # fmt: skip
        assert unkeyed.returncode == 2, unkeyed.stdout + unkeyed.stderr
        assert "the Redis stream holds signed checkpoints" in " ".join(unkeyed.stderr.split())
    finally:
        db.close()


def _rechained(lines: list[bytes], prev: str, seq: int) -> tuple[list[bytes], str]:
    """``lines`` edited (tool FORGED), renumbered from ``seq`` and chained from ``prev``."""
    out = []
    for i, line in enumerate(lines):
        document = json.loads(line)
        for name in ("seq", "prev_hash"):
            document.pop(name)
        document["tool"] = "FORGED"
        body = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        chained = f'{{"seq":{seq + i},"prev_hash":"{prev}",'.encode() + body[1:].encode()
        out.append(chained)
        prev = line_hash(chained).hex()
    return out, prev


@pytest.mark.parametrize("manifest", ["the last checkpoint copied", "signed with another key", "a forged tree"])
async def test_a_restarted_writer_never_resumes_from_a_segment_sealed_under_it(tmp_path: Path, manifest: str) -> None:
    """With the router stopped, the attacker rewrites the signed events of the active segment
    (and adds one), seals them as a segment with a manifest of their own making, and restarts the
    router. The writer resumed the chain and the tree from that manifest unchecked, appended and
    signed over the forgery (anchor and all); the attacker then put the lines back, and verify
    and prove vouched for forged events. Now the writer checks the manifest it resumes from (its
    checkpoint at its last seq, over its tree, signed by the log's key) and refuses."""
    anchor = tmp_path / "keys" / "anchor.json"
    key = await _build(tmp_path, [event(n) for n in range(1, N + 1)], publish_dir=None, anchor=anchor)
    layout = LogLayout(tmp_path / "log" / "audit.jsonl")
    sealed = [line for part in layout.parts() if part.kind == "sealed" for line in part.path.read_bytes().splitlines()]
    active = layout.active.read_bytes().splitlines()
    first, prev = head_of(active[0])
    added = [*active, active[-1]] if manifest != "a forged tree" else active  # one more event, or as many
    forged, last = _rechained(added, prev, first)
    tree = CompactRange()
    for line in sealed + forged:
        tree.append(line_hash(line))
    end = first + len(forged) - 1
    genuine = layout.read_checkpoints()[-1]
    # Copied: at size N, while the segment ends at N + 1 (or, with a forged tree, the genuine root).
    checkpoint = genuine
    if manifest == "signed with another key":
        other = SigningKey.load_or_create(tmp_path / "other.key")
        checkpoint = sign_checkpoint(other, log=genuine.log, size=end, root=tree.root(), prev=genuine)
    segment = layout.segment_path(first, end)
    segment.write_bytes(b"".join(line + b"\n" for line in forged))
    layout.segment_path(first, end, "manifest.json").write_text(Manifest(
        first_seq=first, last_seq=end, bytes=segment.stat().st_size, sha256="0" * 64, first_prev_hash=prev,
        last_hash=last, tree=tree.to_json(), checkpoint=checkpoint, first_time="x", last_time="x",
    ).model_dump_json())  # fmt: skip
    layout.active.unlink()
    layout.state.unlink(missing_ok=True)

    log = JsonlAuditLog(layout.active, options=_options(tmp_path, key, publish_dir=None, anchor=anchor))
    with pytest.raises(AuditError, match="will not sign on top of it"):
        await log.append(event(N + 2))
    await log.aclose()
    assert max(c.size for c in layout.read_checkpoints()) == N  # nothing signed over the forgery
    assert json.loads(anchor.read_text())["size"] == N


@pytest.mark.parametrize("where", ["a sealed segment", "the active segment"])
def test_a_fifo_in_a_parts_place_is_reported_not_waited_on(baseline: Baseline, fresh: Callable[[], Copy],
                                                           where: str) -> None:  # fmt: skip
    """A FIFO put where a segment was made every reader (verify, the API, the indexer) wait for a
    writer for ever; it is a part that cannot be read, reported as such."""
    copy = fresh()
    sealed = [p for p in copy.layout.parts() if p.kind == "sealed"]
    path = sealed[-1].path if where == "a sealed segment" else copy.layout.active
    path.unlink()
    os.mkfifo(path)
    public = copy.layout.active.parent / "audit.pub"
    public.write_bytes(baseline.key.public_pem())
    said = subprocess.run([STOCKADE, "audit", "verify", "--path", str(copy.layout.active), "--public-key", str(public),
                           "--json"], capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert said.returncode == 2, said.stdout + said.stderr
    assert "is not a regular file" in said.stderr


def test_a_huge_unterminated_last_line_is_read_in_linear_time(tmp_path: Path) -> None:
    """Each read of a line longer than a read joined it again: 512 MiB took 23 s and 1 GB."""
    path = tmp_path / "audit.jsonl"
    path.write_bytes(b'{"seq":1}\n' + b"x" * (256 << 20))
    started = time.perf_counter()
    assert [line for _, line in layout_module.lines(path)] == [b'{"seq":1}']
    assert time.perf_counter() - started < 2  # (0.24 s here; read the square way, 4.9 s)
