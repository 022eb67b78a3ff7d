"""Verifying an audit log against its signed checkpoints, and proving that an event is in it.

`verify_log` reads every line once and hashes its bytes (never re-serialising), checks that each
event links to the one before, rebuilds the RFC 6962 Merkle tree, and compares its root with every
signed checkpoint it knows: the log's own checkpoints file, the operator's publish directory and
any checkpoint the auditor brings. So it finds what the chain alone cannot: a cut-off tail, a
rewrite re-chained from the edit on, renumbering, a replaced or missing segment, a checkpoint
removed from the file. It names the first seq that does not check out (for a rewrite that re-chained
every later event, the first seq after the last checkpoint that still matches: the chain gives no
finer answer, which is why checkpoints come every second).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
from binascii import hexlify
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

from router.audit.base import VerifyReport
from router.audit.chain import GENESIS_HASH, head_of, line_hash
from router.audit.checkpoint import Checkpoint, Tombstone, VerifyKey, latest_signed, unvouched_end
from router.audit.layout import LogLayout, Part, last_line_of, line_blocks, lines, read_checkpoint_source, timestamp_of
from router.audit.merkle import CompactRange, MerkleTree
from router.errors import AuditError


@dataclass(slots=True)
class _Checkpoints:
    """The signed checkpoints a verification checks the log against, by size."""

    roots: dict[int, str] = field(default_factory=dict)
    count: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unchecked: bool = False

    def add(self, checkpoint: Checkpoint, where: str, keys: Sequence[VerifyKey]) -> None:
        self.count += 1
        if keys and not checkpoint.signed_by(keys):
            self.problems.append(f"the checkpoint at size {checkpoint.size} in {where} is not signed by a trusted key")
            return
        if not keys:
            self.unchecked = True
        known = self.roots.setdefault(checkpoint.size, checkpoint.root)
        if known != checkpoint.root:
            self.problems.append(
                f"two signed checkpoints at size {checkpoint.size} disagree ({where}): the log was forked or rewritten"
            )

    @property
    def largest(self) -> int:
        return max(self.roots, default=0)


def gather_checkpoints(
    sources: Iterable[tuple[str, Iterable[Checkpoint | None]]], keys: Sequence[VerifyKey], *, chained: str = ""
) -> _Checkpoints:
    """Every checkpoint from ``sources`` (name, checkpoints), signature-checked. In the source named
    ``chained`` (the log's own file) each checkpoint must also name the one before it (``prev``):
    one removed from the middle, or the file replaced, shows. A first one that names another is
    noted, not failed: checkpoints were removed from the start, which hides no event (the later
    roots cover them), and is also how a file the writer put back from its anchor after a loss
    begins (recorded as ``audit.checkpoints_lost``)."""
    found = _Checkpoints()
    for name, checkpoints in sources:
        previous: Checkpoint | None = None
        for checkpoint in checkpoints:
            if checkpoint is None:
                found.problems.append(f"{name} holds an unreadable checkpoint")
                continue
            if name == chained and previous is None and checkpoint.prev:
                found.notes.append(
                    f"{name}: its first checkpoint (at size {checkpoint.size}) follows another: checkpoints were "
                    "removed from the start of the file (or put back from the writer's anchor after a loss, which "
                    "the log records as audit.checkpoints_lost)"
                )
            elif name == chained and previous is not None and checkpoint.prev != previous.digest():
                found.problems.append(
                    f"{name}: the checkpoint at size {checkpoint.size} does not follow the one at size "
                    f"{previous.size}: checkpoints were removed, reordered or replaced"
                )
            previous = checkpoint
            found.add(checkpoint, name, keys)
    return found


_HEAD_ENDS = (b",", b"}")  # what follows a line's head (`router.audit.chain`'s _HEAD)
_SUSPECT = b"?"  # a link no line holds: the line after a `Walk.suspect` one goes to `Walk._resolve`


class Walk:
    """The chain and the tree, rebuilt one line at a time, and the first thing that is wrong."""

    def __init__(self, checkpoints: _Checkpoints) -> None:
        self.expected = 1
        self.prev = GENESIS_HASH
        self.tree = CompactRange()
        self.roots = checkpoints.roots
        self.matched = 0  # the largest checkpoint size whose root the data matched
        self.retired = 0
        self.mismatch: tuple[int, int, str] | None = None  # a root that did not match: (size, line, where)
        # An event whose link to the one before does not hold, when nothing vouches for that one:
        # (seq, line, where, its line's hash, the hash before it). The next line says which of the
        # two was changed.
        self.suspect: tuple[int, int, str, bytes, str] | None = None
        self.report: VerifyReport | None = None
        self.torn = 0  # bytes of an unfinished line the active segment ends in (a write cut short)

    def fail(self, seq: int, problem: str, line: int | None = None) -> None:
        if self.report is None:
            events = self.expected - 1
            self.report = VerifyReport(False, events, events, self.prev, seq, line, problem)

    def start_at(self, seq: int, prev: str, tree: CompactRange) -> None:
        self.expected, self.prev, self.tree = seq, prev, tree

    def tombstone(self, tombstone: Tombstone, keys: Sequence[VerifyKey]) -> None:
        self.settle()
        if self.report is not None:
            return
        if keys and not tombstone.signed_by(keys):
            self.fail(tombstone.first_seq, f"the tombstone for seq {tombstone.first_seq}..{tombstone.last_seq} "
                                           "is not signed by a trusted key")  # fmt: skip
            return
        if tombstone.first_seq != self.expected:
            self.fail(self.expected, f"events {self.expected}..{tombstone.first_seq - 1} are missing before a "
                                     "retired segment")  # fmt: skip
            return
        self.retired += tombstone.last_seq - tombstone.first_seq + 1
        self.start_at(tombstone.last_seq + 1, tombstone.last_hash, CompactRange.from_json(tombstone.tree))
        if self.roots.get(tombstone.last_seq, tombstone.checkpoint.root) != tombstone.checkpoint.root:
            self.fail(tombstone.last_seq, "a retired segment's tombstone disagrees with the signed checkpoints")

    def feed(self, lines: Iterable[bytes], where: str, first: int = 1) -> None:
        """Check lines of one part (``first``: the first one's line number in it); stops at the
        first problem. The inner loop is the whole cost of a verification past the hashing: a
        line's head is compared with the one expected as bytes (`head_of` parses only a line
        that differs), and hashes stay bytes until the walk stops."""
        roots, append = self.roots, self.tree.append
        expected, prev = self.expected, self.prev.encode()
        try:
            for number, line in enumerate(lines, start=first):
                head = b'{"seq":%d,"prev_hash":"%s"' % (expected, prev)
                if not (line.startswith(head) and line.startswith(_HEAD_ENDS, len(head))):
                    self.expected, self.prev = expected, prev.decode()
                    if self.suspect is not None:
                        self._resolve(line)
                        return
                    self._broken(line, number, where)
                    if self.suspect is None:
                        return
                    # On to the next line, which must link to this one as it is; `_SUSPECT` as
                    # the link expected sends it to `_resolve` (the loop itself stays as it was).
                    prev, expected = _SUSPECT, expected + 1
                    continue
                if self.mismatch is not None:  # the line after a root that did not match links to it
                    self.expected, self.prev = expected, prev.decode()
                    self._rewritten()
                    return
                leaf = line_hash(line)
                append(leaf)
                prev, expected = hexlify(leaf), expected + 1
                if expected - 1 in roots:
                    size = expected - 1
                    if self.tree.root().hex() != roots[size]:
                        # Which event? If the next line does not link to this one, this one was edited
                        # in place; if it does, everything was re-chained and only the stretch is known.
                        self.mismatch = (size, number, where)
                        continue
                    self.matched = size
        finally:
            if self.report is None:
                self.expected, self.prev = expected, prev.decode()

    def _rewritten(self) -> None:
        assert self.mismatch is not None  # noqa: S101  (the callers check)
        size, number, where = self.mismatch
        problem = (
            f"{where}: the log's Merkle root at size {size} differs from its signed checkpoint: events after "
            f"seq {self.matched} up to {size} were rewritten, re-chained, inserted, removed or renumbered"
        )
        self.fail(self.matched + 1, problem, number)

    def _broken(self, line: bytes, number: int, where: str) -> None:
        head = head_of(line)
        if head is None:
            self.fail(self.expected, f"{where} line {number} is not a chained event (truncated, overwritten or "
                                     "not written by stockade)", number)  # fmt: skip
        elif head[0] != self.expected:
            kind = "missing (deleted) or reordered" if head[0] > self.expected else "inserted, duplicated or reordered"
            self.fail(self.expected, f"{where} line {number}: expected seq {self.expected}, found {head[0]}: events "
                                     f"were {kind}", number)  # fmt: skip
        elif self.matched >= self.expected - 1 and self.mismatch is None:
            # The event before is vouched for by a signed root: this line's link was rewritten.
            problem = (
                f"{where} line {number}: event seq {self.expected} was modified: it does not link to the "
                "event before it, which a signed checkpoint vouches for"
            )
            self.fail(self.expected, problem, number)
        elif self.mismatch is None and self.expected > 1:
            # Either the event before was changed (this line records the hash it had) or this
            # line's own link was: the next line, which records this one's hash, tells.
            self.suspect = (self.expected, number, where, hexlify(line_hash(line)), self.prev)
        else:
            blame = max(self.expected - 1, 1)
            self.fail(blame, f"{where} line {number}: event seq {blame} was modified or replaced: seq {head[0]} "
                             "records a different hash for it", number)  # fmt: skip

    def _resolve(self, following: bytes | None) -> None:
        """Name the event the `suspect` link blames, from the line ``following`` it (None: the log
        ends there)."""
        assert self.suspect is not None  # noqa: S101  (the callers check)
        seq, number, where, digest, prev = self.suspect
        self.suspect = None
        self.expected, self.prev = seq, prev  # the walk stands where the suspect link is
        head = head_of(following) if following is not None else None
        if head is not None and head == (seq + 1, digest.decode()):
            self.fail(seq - 1, f"{where} line {number}: event seq {seq - 1} was modified or replaced: seq {seq} "
                               "records a different hash for it", number)  # fmt: skip
        elif head is not None and head[0] == seq + 1:
            self.fail(seq, f"{where} line {number}: event seq {seq} was modified: it links neither to the event "
                           f"before it nor does seq {seq + 1} record its hash", number)  # fmt: skip
        else:  # the log ends (or breaks again) there: nothing tells which of the two changed
            self.fail(seq - 1, f"{where} line {number}: event seq {seq - 1}, or seq {seq}'s link to it, was "
                               f"modified: seq {seq} records a different hash for seq {seq - 1}", number)  # fmt: skip

    def settle(self) -> None:
        """Name a `suspect` link the data ended on (the caller has no line after it)."""
        if self.suspect is not None and self.report is None:
            self._resolve(None)

    def finish(self, checkpoints: _Checkpoints) -> VerifyReport:
        self.settle()
        if self.mismatch is not None and self.report is None:
            self._rewritten()
        if self.report is not None:
            return self.report
        events = self.expected - 1
        if checkpoints.largest > events:
            self.fail(events + 1, f"the log ends at seq {events}, but a checkpoint signed {checkpoints.largest} "
                                  f"events: events {events + 1}..{checkpoints.largest} were cut off")  # fmt: skip
            return self.report  # type: ignore[return-value]  # set by fail
        if checkpoints.problems:
            self.fail(self.matched + 1, "; ".join(checkpoints.problems[:3]))
            return self.report  # type: ignore[return-value]
        notes = []
        if events > checkpoints.largest:
            notes.append(f"{events - checkpoints.largest} events after the last checkpoint are not signed yet")
        if checkpoints.unchecked and checkpoints.count:
            notes.append("no public key given: checkpoint signatures were not checked")
        if not checkpoints.count:
            notes.append("no checkpoints: only the chain was checked (a cut-off tail cannot be seen)")
        notes.extend(checkpoints.notes)
        if self.torn:
            notes.append(f"the active segment ends in {self.torn} bytes of an unfinished line after seq {events}: a "
                         "write cut short (never acknowledged, so no event), which the writer sets aside when it "
                         "next starts; or one being written as this check read it")  # fmt: skip
        return VerifyReport(True, events, events, self.prev, signed=checkpoints.largest, checkpoints=checkpoints.count,
                            retired=self.retired, notes=tuple(notes))  # fmt: skip


def verify_log(
    layout: LogLayout,
    *,
    keys: Sequence[VerifyKey] = (),
    publish_dir: Path | None = None,
    trusted: Sequence[Checkpoint] = (),
    from_seq: int | None = None,
    workers: int = 1,
) -> VerifyReport:
    """Check a JSONL log (every segment, tombstone and checkpoint) against ``keys``. ``trusted``:
    checkpoints the auditor kept (they must match too). ``from_seq``: check only the segments from
    the one holding that seq on (an incremental check: the tree resumes from the previous sealed
    segment's manifest, whose root its signed checkpoint vouches for). ``workers`` > 1: the older
    half of the segments is checked in another process meanwhile, the newer half resuming from the
    signed manifest between them (which the older half's check vouches for)."""
    # Those the log's writer cannot rewrite first: where two disagree at one size, theirs is the
    # root the files are held to, so the broken seq is named against it, not the log's own.
    sources: list[tuple[str, Iterable[Checkpoint | None]]] = [("the auditor's checkpoint", trusted)]
    if publish_dir is not None:
        sources.append((str(publish_dir), read_checkpoint_source(publish_dir)))
    sources.append((layout.checkpoints.name, read_checkpoint_source(layout.checkpoints)))
    checkpoints = gather_checkpoints(sources, keys, chained=layout.checkpoints.name)
    parts = layout.parts()
    split = _split_point(parts) if workers > 1 and from_seq is None else 0
    if not split:
        return _verify_parts(parts, checkpoints, keys, from_seq, last=True)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        older = pool.submit(_verify_older, layout.active, parts[:split], [k.public_pem() for k in keys],
                            checkpoints.roots)  # fmt: skip
        newer = _verify_parts(parts, checkpoints, keys, parts[split].first_seq, last=True)
        first = older.result()
    if not first.ok:
        return first
    if not newer.ok:
        return newer
    return dataclasses.replace(newer, retired=newer.retired + first.retired)


def _split_point(parts: list[Part]) -> int:
    """Where to split the parts into two halves of about equal bytes (0: not worth it)."""
    sizes = [part.path.stat().st_size if part.kind != "tombstone" else 0 for part in parts]
    total, running = sum(sizes), 0
    if total < 32 << 20:
        return 0
    for index, size in enumerate(sizes):
        running += size
        if running >= total / 2:
            # The newer half must start after a sealed segment (its manifest is where it resumes).
            return index + 1 if index + 1 < len(parts) and parts[index].kind == "sealed" else 0
    return 0


def _verify_older(active: Path, parts: list[Part], pems: list[bytes], roots: dict[int, str]) -> VerifyReport:
    """The older half, in a worker process: its segments against the same checkpoints."""
    del active
    keys = [VerifyKey.from_pem(pem) for pem in pems]
    return _verify_parts(parts, _Checkpoints(roots=dict(roots), count=len(roots)), keys, None, last=False)


def _verify_parts(
    parts: list[Part], checkpoints: _Checkpoints, keys: Sequence[VerifyKey], from_seq: int | None, *, last: bool
) -> VerifyReport:
    walk = Walk(checkpoints)
    if from_seq is not None:
        parts = _from(parts, from_seq, walk, keys)
    for index, part in enumerate(parts):
        if walk.report is not None:
            break
        before = parts[index - 1] if index else None
        if part.kind == "tombstone" and before is not None and _same_range(before, part) and before.kind == "sealed":
            _check_retiring(before, part, walk, keys)  # a retirement cut short: the segment is still there
            continue
        if part.kind == "tombstone":
            try:
                walk.tombstone(part.tombstone(), keys)
            except (OSError, ValueError) as exc:
                walk.fail(part.first_seq, f"{part.path.name} is unreadable: {exc}")
            continue
        first, first_prev = walk.expected, walk.prev
        walk.feed(chain.from_iterable(line_blocks(part.path)), part.path.name)
        if part.kind == "active":
            walk.torn = _unfinished_tail(part.path)
        if part.kind == "sealed" and walk.report is None and walk.mismatch is None and walk.suspect is None:
            _check_sealed(part, first, first_prev, walk, checkpoints, keys)
    if not last:
        walk.settle()  # the newer half, walked elsewhere, holds the line after
    if not last and walk.mismatch is not None and walk.report is None:
        walk._rewritten()
    if not last and walk.report is None:
        events = walk.expected - 1
        return VerifyReport(True, events, events, walk.prev, retired=walk.retired)
    return walk.finish(checkpoints)


def _unfinished_tail(path: Path) -> int:
    """How many bytes follow the last newline of ``path`` (what `line_blocks` leaves out)."""
    try:
        with path.open("rb") as handle:
            end = at = handle.seek(0, os.SEEK_END)
            while at > 0:
                step = min(at, 1 << 16)
                at -= step
                handle.seek(at)
                cut = handle.read(step).rfind(b"\n")
                if cut != -1:
                    return end - (at + cut + 1)
            return end
    except OSError:
        return 0


def _from(parts: list[Part], seq: int, walk: Walk, keys: Sequence[VerifyKey]) -> list[Part]:
    """The parts from the one holding ``seq`` on, with the walk resumed where the one before ends."""
    for index, part in enumerate(parts):
        if part.kind == "active" or part.last_seq >= seq:
            if index == 0:
                return parts
            before = parts[index - 1]
            try:
                end = before.manifest() if before.kind == "sealed" else before.tombstone()
            except (OSError, ValueError) as exc:
                walk.fail(before.first_seq, f"{before.path.name}: its manifest is unreadable: {exc}")
                return []
            problem = unvouched_end(end, keys)
            if problem is not None:
                walk.fail(
                    before.last_seq, f"{before.path.name}: no signed checkpoint vouches for its end state: {problem}"
                )
                return []
            if isinstance(end, Tombstone) and keys and not end.signed_by(keys):
                # The checkpoint inside may be a genuine one, copied: the tombstone itself must be signed.
                walk.fail(before.first_seq, f"{before.path.name}: the tombstone is not signed by a trusted key")
                return []
            walk.roots.setdefault(end.last_seq, end.checkpoint.root)
            walk.matched = end.last_seq
            walk.start_at(end.last_seq + 1, end.last_hash, CompactRange.from_json(end.tree))
            return parts[index:]
    return []


def _check_sealed(
    part: Part, first: int, first_prev: str, walk: Walk, checkpoints: _Checkpoints, keys: Sequence[VerifyKey]
) -> None:
    """A sealed segment holds exactly the range its name says, and its manifest agrees with it:
    its signed checkpoint, its size (so no byte was added after the last line, where reading
    lines would not see it), its first and last hashes and its tree state. (Its sha256 is the
    indexer's check: with every line's hash and the size as recorded, the bytes are those sealed.)"""
    name = part.path.name
    if (first, walk.expected - 1) != (part.first_seq, part.last_seq):
        blame = walk.expected if walk.expected - 1 < part.last_seq else part.last_seq + 1
        walk.fail(blame, f"{name} holds seq {first}..{walk.expected - 1}, not {part.first_seq}..{part.last_seq} as "
                         "its name says: events are missing or were added")  # fmt: skip
        return
    try:
        manifest = part.manifest()
    except (OSError, ValueError) as exc:
        walk.fail(part.first_seq, f"{name}: its manifest is missing or unreadable: {exc}")
        return
    if keys and not manifest.checkpoint.signed_by(keys):
        walk.fail(part.first_seq, f"{name}: its manifest's checkpoint is not signed by a trusted key")
    elif manifest.checkpoint.size != part.last_seq or walk.tree.root().hex() != manifest.checkpoint.root:
        walk.fail(part.first_seq, f"{name}: its events do not hash to the root its manifest's signed checkpoint "
                                  "records: the segment was replaced or rewritten")  # fmt: skip
    elif manifest.last_hash != walk.prev:
        walk.fail(part.last_seq, f"{name}: its manifest records another last event")
    elif manifest.first_prev_hash != first_prev or manifest.tree != walk.tree.to_json():
        walk.fail(part.first_seq, f"{name}: its manifest records another chain or tree than its events make")
    elif (size := _size(part.path)) != manifest.bytes:
        walk.fail(part.last_seq + 1, f"{name} holds {size} bytes, but its manifest records {manifest.bytes}: bytes "
                                     "were added after its last event, or the manifest was edited")  # fmt: skip
    elif (times := _first_and_last_time(part.path)) != (manifest.first_time[:19], manifest.last_time[:19]):
        # Unsigned, but retention once went by them: held to the events they summarise (to the
        # second: the writer records a time read back from the file in its first 27 characters).
        walk.fail(part.first_seq, f"{name}: its manifest records times {manifest.first_time}..{manifest.last_time}, "
                                  f"its events run {times[0]}..{times[1]}: the manifest was edited")  # fmt: skip
    else:
        checkpoints.roots.setdefault(part.last_seq, manifest.checkpoint.root)
        walk.matched = max(walk.matched, part.last_seq)


def _check_retiring(segment: Part, tombstone: Part, walk: Walk, keys: Sequence[VerifyKey]) -> None:
    """A sealed segment (checked) beside the tombstone retiring it: retention wrote the tombstone
    and stopped before deleting the segment (the writer finishes it at its next start). The
    tombstone must be signed and record that segment, as its manifest does."""
    try:
        manifest, retired = segment.manifest(), tombstone.tombstone()
    except (OSError, ValueError) as exc:
        walk.fail(tombstone.first_seq, f"{tombstone.path.name} is unreadable: {exc}")
        return
    if keys and not retired.signed_by(keys):
        walk.fail(retired.first_seq, f"the tombstone for seq {retired.first_seq}..{retired.last_seq} is not signed "
                                     "by a trusted key")  # fmt: skip
    elif not retired.records(manifest):
        walk.fail(retired.first_seq, f"{tombstone.path.name} does not record the segment still beside it")


def _same_range(one: Part, other: Part) -> bool:
    return (one.first_seq, one.last_seq) == (other.first_seq, other.last_seq)


def _first_and_last_time(path: Path) -> tuple[str, str]:
    """The timestamps of a segment's first and last events (to the second), read from its two ends."""
    first = next((line for _, line in lines(path)), b"")
    last = last_line_of(path, path.stat().st_size) or b""
    return timestamp_of(first)[:19], timestamp_of(last)[:19]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


class Proofs(Mapping[int, list[str]]):
    """The inclusion proofs (hex, deepest sibling first) of ``seqs`` in ``tree``, each made when it is
    read: an export proves each of its events, and made at once, the proofs of 300,000 events held a
    gigabyte."""

    def __init__(self, tree: MerkleTree, seqs: Sequence[int]) -> None:
        self._tree = tree
        self._seqs = dict.fromkeys(seqs)

    def __getitem__(self, seq: int) -> list[str]:
        if seq not in self._seqs:
            raise KeyError(seq)
        return [node.hex() for node in self._tree.inclusion_proof(seq - 1)]

    def __iter__(self) -> Iterator[int]:
        return iter(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)


def inclusion_proofs(
    layout: LogLayout,
    seqs: Sequence[int],
    *,
    keys: Sequence[VerifyKey] | None = None,
    checkpoint: Checkpoint | None = None,
) -> tuple[Checkpoint, Proofs]:
    """An RFC 9162 inclusion proof for each of ``seqs`` against the log's latest checkpoint, which
    anyone holding the public key can check (`router.audit.merkle.verify_inclusion`, index = seq - 1).
    After retention, the tree resumes from the last tombstone's tree state (its perfect subtrees
    stand for the deleted leaves), so every event the log still holds can be proven.

    With ``keys``, the latest checkpoint one of them signed: anyone who can write the log's volume
    can add a checkpoint to its file, and a proof against one unsigned proves nothing. With
    ``checkpoint``, against that one (the caller chose it, as `latest_signed` does).

    Raises:
        AuditError: no checkpoint (signed by ``keys``) covers a seq, or a seq lies in a segment
            retention deleted.
    """
    if checkpoint is None:
        checkpoints = layout.read_checkpoints()
        if not checkpoints:
            raise AuditError(f"{layout.checkpoints} holds no checkpoint yet: nothing to prove against")
        checkpoint = latest_signed(checkpoints, keys)
    if checkpoint is None:
        raise AuditError(f"no checkpoint in {layout.checkpoints} is signed by the log's public key: nothing to "
                         "prove against; run `stockade audit verify`")  # fmt: skip
    for seq in seqs:
        if not 1 <= seq <= checkpoint.size:
            raise AuditError(f"seq {seq} is not covered by the latest checkpoint (size {checkpoint.size})")
    prefix, leaves, retired = _leaves(layout, checkpoint.size)
    for seq in seqs:
        if seq <= prefix.size:
            raise AuditError(_retired_message(seq, retired, prefix.size))
    tree = MerkleTree(leaves, checkpoint.size, prefix=prefix)  # once: each proof is then a few lookups
    if tree.root().hex() != checkpoint.root:
        raise AuditError("the log does not match its latest checkpoint; run `stockade audit verify`")
    return checkpoint, Proofs(tree, seqs)


def _retired_message(seq: int, retired: Sequence[tuple[int, int]], through: int) -> str:
    for first, last in retired:
        if first <= seq <= last:
            return (
                f"seq {seq} was retired (events {first}..{last} were deleted by retention): its proof is the one "
                "made before retention, kept with the export that carried it"
            )
    return (
        f"seq {seq} lies before seq {through}, where the log's tree resumes after segments retention deleted: "
        "only events after it can be proven now"
    )


def _leaves(layout: LogLayout, size: int) -> tuple[CompactRange, list[bytes], list[tuple[int, int]]]:
    """The tree state the log's leaves resume from (empty, or the last tombstone's: leaves before
    it are not needed), the leaf hashes after it up to ``size``, and the retired ranges."""
    parts = layout.parts()
    retired = [(p.first_seq, p.last_seq) for p in parts if p.kind == "tombstone"]
    prefix = CompactRange()
    start = 0
    for index, part in enumerate(parts):
        if part.kind == "tombstone" and part.last_seq <= size:
            try:
                prefix = CompactRange.from_json(part.tombstone().tree)
            except (OSError, ValueError) as exc:
                raise AuditError(f"{part.path.name} is unreadable: {exc}; run `stockade audit verify`") from exc
            start = index + 1
    leaves: list[bytes] = []
    wanted = size - prefix.size
    for part in parts[start:]:
        if part.kind == "tombstone":
            break  # past ``size``: nothing after it is needed
        for block in line_blocks(part.path):  # a read's lines at a time, hashed at C speed
            leaves.extend(map(line_hash, block[: wanted - len(leaves)]))
            if len(leaves) >= wanted:
                return prefix, leaves, retired
    if len(leaves) < wanted:
        raise AuditError(f"the log holds {prefix.size + len(leaves)} events, fewer than its checkpoint's {size}")
    return prefix, leaves, retired


def proof_document(checkpoint: Checkpoint, seq: int, line: bytes, proof: list[str]) -> dict[str, object]:
    """What `stockade audit prove` prints: enough for anyone with the public key to check."""
    return {"seq": seq, "index": seq - 1, "leaf_hash": line_hash(line).hex(), "line": line.decode(errors="replace"),
            "proof": proof, "checkpoint": json.loads(checkpoint.signed_text())}  # fmt: skip
