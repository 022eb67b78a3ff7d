"""The embedded audit log: JSONL segments, hash-chained, under a Merkle tree with signed checkpoints.

Events are appended to the active segment (``audit.jsonl``), one line each (`router.audit.chain`).
Appends, rotations and checkpoints are serialised across processes by ``flock`` on
``audit.jsonl.lock``; a process that sees the file grew (another appended) or was replaced (another
rotated it) catches up by reading the new lines, so several processes keep one chain and one tree.

- **Durable.** In the default ``fsync`` durability no append returns before an fsync covering its
  bytes has completed. An append alone syncs inline; appends that overlap share one sync run in a
  thread (group commit).
- **Provable.** Every line is a leaf of an RFC 6962 Merkle tree kept as it is appended. Every
  ``checkpoint_interval_s`` (if anything was appended), every ``checkpoint_every`` events, at each
  rotation and on close, the tree's size and root are signed with the operator's Ed25519 key
  (`router.audit.checkpoint`) and written to ``audit.jsonl.checkpoints`` and, if configured, to a
  publish directory the router only ever adds files to.
- **Segments.** At ``segment_max_bytes`` or when the UTC day changes, the active segment is sealed:
  renamed into ``audit.jsonl.segments/`` with a manifest (range, sha256, end tree, checkpoint).
  Seq and the tree go on in the next segment. Retention deletes whole sealed segments only, each
  replaced by a signed tombstone. See `router.audit.layout`.
- **Replaced under it.** A renamed or deleted active segment is noticed at the next append: the
  chain goes on (seq and tree continue) in a new file, and the first event there records what was
  missing, so the gap is on record; `stockade audit verify` names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import hashlib
import multiprocessing
import os
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal

import structlog

from router.audit.base import AuditEvent, AuditFilter, VerifyReport, as_written, matches, timestamp
from router.audit.chain import GENESIS_HASH, Unsealed, document_of, head_of, line_hash, sha256_hex
from router.audit.checkpoint import (
    Checkpoint,
    Manifest,
    SigningKey,
    Tombstone,
    VerifyKey,
    sign_checkpoint,
    sign_tombstone,
    unvouched_end,
)
from router.audit.layout import LogLayout, last_line_of, lines, sync_directory, timestamp_of, write_json_atomically
from router.audit.merkle import CompactRange
from router.errors import AuditError

log = structlog.get_logger(__name__)

_TAIL_CHUNK = 1 << 16
_PROBE_BYTES = 1 << 16  # room for a large event: the readiness probe reserves this much
_FALLOC_FL_KEEP_SIZE = 1
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def _fallocate(fd: int, mode: int, offset: int, length: int) -> int:
    return int(_libc.fallocate(fd, mode, offset, length))


GROWN_MIN_BYTES = 1 << 20  # the least growth of the active segment that calls `LogOptions.on_grown`


@dataclass(frozen=True, slots=True)
class LogOptions:
    """How a JSONL log seals, signs and keeps its segments (from `AuditSettings`)."""

    signer: SigningKey | None = None  # None: no checkpoints (a spool, a test of the chain alone)
    log_name: str = "stockade"
    checkpoint_interval_s: float = 1.0
    checkpoint_every: int = 10_000
    publish_dir: Path | None = None
    segment_max_bytes: int | None = 64 << 20  # None: never rotate
    rotate_daily: bool = True
    retention_days: int | None = None
    masks: tuple[tuple[str, bool], ...] = ()  # see router.audit.masking
    mask_key: bytes | None = field(default=None, repr=False)  # hashed masks are an HMAC under it
    on_sealed: Callable[[Path], None] | None = field(default=None, compare=False)
    # Called (after the append) each time the active segment has grown by a quarter since the
    # last call, and by at least GROWN_MIN_BYTES: the factory then has the indexer snapshot it, so
    # a fresh query reads few of its lines one by one, with no `audit index --follow` running.
    on_grown: Callable[[Path], None] | None = field(default=None, compare=False)
    # Called (in a worker thread) when the log closes, first: the factory waits there for the
    # indexers it started, and starts none after, so nothing writes beside a closed log.
    on_close: Callable[[], None] | None = field(default=None, compare=False)
    # Where the writer keeps the last checkpoint it signed, off the log's volume (beside the
    # signing key): at load, a checkpoints file that no longer holds it (cut back with the events
    # it covered, or rewritten with them) gets it back, so verification checks the files against
    # it, and the loss is recorded. None: the writer trusts the checkpoints file.
    anchor: Path | None = None


@dataclass(slots=True)
class _Active:
    """What the writer knows of the active segment."""

    fd: int
    ino: int
    size: int  # bytes covered by the writer's state
    first_seq: int  # 0: empty
    first_time: str
    last_time: str
    digest: Any  # running sha256 of its bytes (a hashlib object; None once it no longer applies)


class JsonlAuditLog:
    """`AuditLog` on JSONL segments (see the module docstring)."""

    def __init__(
        self,
        path: Path,
        *,
        durability: Literal["fsync", "relaxed"] = "fsync",
        options: LogOptions | None = None,
    ) -> None:
        self.path = path
        self.layout = LogLayout(path)
        self.durability = durability
        self.options = options or LogOptions(segment_max_bytes=None)
        self._lock_fd: int | None = None
        self._active: _Active | None = None
        self._seq = 0
        self._head = GENESIS_HASH
        self._tree = CompactRange()
        self._loaded = False
        self._pending_notes: list[AuditEvent] = []  # to chain before the next event (gaps found at load)
        self._checkpoint: Checkpoint | None = None
        self._checkpoints_size = -1  # size of the checkpoints file when last read
        self._timer: asyncio.TimerHandle | None = None
        self._synced = 0  # bytes of the active segment known durable
        self._waiting = 0  # appends written and waiting for their sync
        self._sync_task: asyncio.Task[None] | None = None
        # Retention after a seal runs in a worker thread (`_start_retention`): it reads and hashes
        # whole segments, which must hold neither the event loop nor the log's lock for that long.
        self._retention_due = False
        self._retention: asyncio.Task[None] | None = None
        self.failed: str | None = None  # why the last append failed; None after a good one
        self._grown_at = 0  # the active segment's size at the last on_grown call
        self._anchored = 0  # the size of the checkpoint kept at `LogOptions.anchor`: it never goes down
        # At load: the roots of the signed checkpoints the writer knows (the checkpoints file's last,
        # the anchor), by size, which the tree rebuilt from the files must match (see `_load`).
        self._known: dict[int, tuple[str, str]] = {}
        self._forged: str | None = None  # why the files disagree with a checkpoint (set at load)

    # -- state ------------------------------------------------------------------------------

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return _flock(self._lock())

    def _lock(self) -> int:
        if self._lock_fd is None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._lock_fd = os.open(self.layout.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
            except OSError as exc:
                raise AuditError(f"cannot open audit log {self.path}: {exc.strerror}; fix its permissions") from exc
        return self._lock_fd

    def _open_active(self) -> _Active:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        except OSError as exc:
            raise AuditError(f"cannot open audit log {self.path}: {exc.strerror}; fix its permissions") from exc
        return _Active(fd, os.fstat(fd).st_ino, 0, 0, "", "", hashlib.sha256())

    def _catch_up(self) -> list[AuditEvent]:
        """Bring the writer's state up to the files (under the lock): load it on first use, read
        what other processes appended, follow a rotation. Returns the events that must be chained
        before the next one (a torn tail set aside, a segment that went missing)."""
        notes: list[AuditEvent] = []
        if not self._loaded:
            self._load()
            self._loaded = True
        active = self._active
        assert active is not None  # noqa: S101  (_load opens it)
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            on_disk = None
        if on_disk is None or on_disk.st_ino != active.ino:
            self._read_rest(active)  # another process rotated, or someone moved the file: finish the old one
            old_first, old_size = active.first_seq, active.size
            os.close(active.fd)
            self._follow_sealed()  # segments sealed since, whole, while this writer was idle
            self._active = self._open_active()
            self._read_rest(self._active)
            sealed = old_first and self.layout.segment_path(old_first, self._seq, "manifest.json").exists()
            if self._active.size == 0 and old_size and not sealed:
                notes.append(_missing(self.path, old_first, self._seq, "the active segment was moved or deleted"))
        else:
            torn = self._read_rest(active)
            if torn is not None:
                notes.append(torn)
        self._read_checkpoints()
        return notes

    def _follow_sealed(self) -> None:
        """Take the chain past every segment other processes sealed (and, retention, retired)
        since this writer last read the files: several rotations can happen while it is idle, so
        the active segment it opens next may start far past where it stopped. Each segment must
        continue the chain from here; its manifest (or tombstone), written under the lock, holds
        the state at its end, as `_load` trusts it.

        Raises:
            AuditError: a sealed segment that does not continue the chain, or that cannot be read.
        """
        for part in self.layout.parts():
            if part.kind == "active" or part.last_seq <= self._seq:
                continue
            try:
                end = part.manifest() if part.kind == "sealed" else part.tombstone()
            except (OSError, ValueError) as exc:
                raise AuditError(f"{part.path} cannot be read ({exc}); run `stockade audit verify`") from exc
            first_prev = end.first_prev_hash if isinstance(end, Manifest) else self._head
            if end.first_seq != self._seq + 1 or first_prev != self._head:
                raise AuditError(
                    f"{part.path} does not continue the chain at seq {self._seq + 1}; run `stockade audit verify`"
                )
            self._seq, self._head, self._tree = end.last_seq, end.last_hash, CompactRange.from_json(end.tree)

    def _load(self) -> None:
        """The state at the end of the log, rebuilt from the last sealed segment's manifest (or
        tombstone) and the active segment's lines. If the state cache remembers the chain further
        (the active segment was deleted, truncated or moved while no writer was running), the chain
        goes on from there, so there is one chain and no second seq 1, and the gap is recorded."""
        self._finish_interrupted_seal()
        self._finish_interrupted_retirement()
        self._active = self._open_active()
        try:
            self._load_state()
        except BaseException:
            os.close(self._active.fd)  # tried again at the next append: no descriptor left behind
            self._active = None
            raise
        finally:
            self._known, self._forged = {}, None

    def _load_state(self) -> None:
        """`_load` once the active segment is open.

        Raises:
            AuditError: the files do not hold the history a known signed checkpoint covers (they
                were changed under the writer): it never signs on top of them.
        """
        self._seq, self._head, self._tree = 0, GENESIS_HASH, CompactRange()
        self._forged = None
        self._known = self._known_checkpoints()  # (sets `_forged` if two of them disagree)
        for part in reversed(self.layout.parts()):
            if part.kind == "active":
                continue
            try:
                end = part.manifest() if part.kind == "sealed" else part.tombstone()
                self._seq, self._head, self._tree = end.last_seq, end.last_hash, CompactRange.from_json(end.tree)
            except (OSError, ValueError) as exc:
                raise AuditError(f"{part.path} cannot be read ({exc}); run `stockade audit verify`") from exc
            problem = _unsigned_end(end, self.options.signer)
            if problem is not None:
                self._forged = self._forged or (
                    f"{part.path}: {problem}. The writer resumes the chain and the tree where it ends, so it "
                    "will not sign on top of it, and refuses every append until the log is repaired; run "
                    "`stockade audit verify`"
                )
            self._compare_known()
            break
        assert self._active is not None  # noqa: S101  (_load opened it)
        torn = self._read_rest(self._active)
        self._pending_notes = [torn] if torn is not None else []
        state = _read_state(self.layout.state)
        if state is not None and int(state["seq"]) > self._seq:
            missing = _missing(self.path, self._seq + 1, int(state["seq"]), "events the log had are not in its files")
            self._seq, self._head = int(state["seq"]), str(state["head"])
            self._tree = CompactRange.from_json(state["tree"])
            self._pending_notes.append(missing)
            self._compare_known()
        self._read_checkpoints()
        lost = self._restore_anchor()  # first: verification then checks the files against it
        if self._forged is not None:
            self._pending_notes = []
            log.error("audit_history_forged", path=str(self.path), problem=self._forged)
            raise AuditError(self._forged)
        if lost is not None:
            self._pending_notes.append(lost)
        if self._checkpoint is not None and self._checkpoint.size > self._seq:
            # A signed checkpoint covers events no file holds: the chain goes on, the gap on record
            # (verify reports it against that checkpoint for as long as the log exists).
            why = "a signed checkpoint covers events the log's files no longer hold"
            self._pending_notes.append(_missing(self.path, self._seq + 1, self._checkpoint.size, why))

    def _known_checkpoints(self) -> dict[int, tuple[str, str]]:
        """The roots the rebuilt tree must match, by size: the checkpoints file's last checkpoint
        and the one kept at `LogOptions.anchor` (where it is, for the message)."""
        known: dict[int, tuple[str, str]] = {}
        try:
            last = last_line_of(self.layout.checkpoints, os.stat(self.layout.checkpoints).st_size)
        except FileNotFoundError:
            last = None
        found: list[tuple[bytes | None, str]] = [(last, str(self.layout.checkpoints))]
        if self.options.anchor is not None:
            with contextlib.suppress(OSError):
                found.append((self.options.anchor.read_bytes(), str(self.options.anchor)))
        for text, where in found:
            if text is None:
                continue
            try:
                checkpoint = Checkpoint.model_validate_json(text)
            except ValueError:
                continue  # an unreadable one is reported where it is read
            if checkpoint.log == self.options.log_name and checkpoint.size > 0:
                known.setdefault(checkpoint.size, (checkpoint.root, where))
                if known[checkpoint.size][0] != checkpoint.root:  # two signed roots for one size
                    self._forged = self._forged or (
                        f"{self.path}: checkpoint {checkpoint.size} in {where} and in {known[checkpoint.size][1]} "
                        "disagree; the writer will not sign on top of either. Run `stockade audit verify`"
                    )
        return known

    def _compare_known(self) -> None:
        """At load: note (once) where the tree rebuilt so far disagrees with a known checkpoint."""
        known = self._known.get(self._seq)
        if known is None or self._forged is not None:
            return
        root = self._tree.root().hex()
        if root != known[0]:
            self._forged = (
                f"{self.path}: the log's files do not hold the history checkpoint {self._seq} (in {known[1]}) "
                f"signed: its root is {known[0][:16]}…, the events up to seq {self._seq} give {root[:16]}… "
                "(changed after they were signed). The writer will not sign on top of them, and refuses "
                "every append until the log is repaired; run `stockade audit verify`"
            )

    def _finish_interrupted_seal(self) -> None:
        """A seal writes the manifest, then renames the segment: finish one a crash cut short."""
        try:
            names = sorted(os.listdir(self.layout.segments_dir))
        except FileNotFoundError:
            return
        manifests = [name for name in names if name.endswith(".manifest.json")]
        if not manifests:
            return
        last = manifests[-1]
        target = self.layout.segments_dir / (last[:26] + "jsonl")
        if target.exists() or not self.path.exists():
            return
        head = None
        for _, line in lines(self.path):
            head = head_of(line)
            break
        if head is not None and head[0] == int(last[:12]):
            os.rename(self.path, target)
            sync_directory(self.path.parent)
            log.warning("audit_seal_completed", segment=target.name)

    def _finish_interrupted_retirement(self) -> None:
        """Retention writes a segment's tombstone, then deletes it: finish one a crash cut short,
        if the tombstone is this log's, signed, and records the segment's bytes as its manifest does."""
        signer = self.options.signer
        if signer is None:
            return
        parts = self.layout.parts()
        for segment, part in pairwise(parts):
            if (segment.kind, part.kind) != ("sealed", "tombstone") or (segment.first_seq, segment.last_seq) != (
                part.first_seq, part.last_seq
            ):  # fmt: skip
                continue
            try:
                retired, manifest = part.tombstone(), segment.manifest()
                with segment.path.open("rb") as handle:
                    digest = hashlib.file_digest(handle, "sha256").hexdigest()
                matches = (retired.verify(signer.verify_key) and retired.log == self.options.log_name
                           and retired.records(manifest, digest))  # fmt: skip
            except (OSError, ValueError):
                matches = False
            if not matches:  # left as it is: `stockade audit verify` names it
                log.error("audit_retirement_unfinished", segment=segment.path.name, tombstone=part.path.name)
                continue
            segment.path.unlink()
            self.layout.segment_path(segment.first_seq, segment.last_seq, "manifest.json").unlink(missing_ok=True)
            sync_directory(self.layout.segments_dir)
            log.warning("audit_retirement_completed", segment=segment.path.name)

    def _read_rest(self, active: _Active) -> AuditEvent | None:
        """Chain into the state every complete line past what the state covers; a last line
        without its newline is set aside (see `_set_aside_torn_tail`) and recorded."""
        size = os.fstat(active.fd).st_size
        if size == active.size:
            return None
        if size < active.size:  # cut short under the writer: its running digest no longer applies
            active.size, active.digest = size, None
            return _missing(self.path, self._seq, self._seq, "the active segment was truncated under the writer")
        torn = None
        if os.pread(active.fd, 1, size - 1) != b"\n":
            size, torn = self._set_aside_torn_tail(active.fd, size)
        for _, line in lines(_fd_path(active.fd), active.size):
            if active.size >= size:
                break
            head = head_of(line)
            if head is None or head[0] != self._seq + 1 or head[1] != self._head:
                raise AuditError(
                    f"{self.path} holds an event that does not continue the chain at seq {self._seq + 1}; "
                    "run `stockade audit verify` before appending"
                )
            leaf = line_hash(line)
            self._tree.append(leaf)
            self._seq, self._head = head[0], leaf.hex()
            if self._known:
                self._compare_known()
            stamp = timestamp_of(line)
            if not active.first_seq:
                active.first_seq, active.first_time = self._seq, stamp
            active.last_time = stamp
            if active.digest is not None:
                active.digest.update(line + b"\n")
            active.size += len(line) + 1
        return torn

    def _set_aside_torn_tail(self, fd: int, size: int) -> tuple[int, AuditEvent]:
        """A last line without its newline was never acknowledged (a crash or a full disk mid-write,
        before this process truncated it): move its bytes to ``<log>.torn-<offset>`` for the
        auditor and cut them off, so the chain goes on from the last whole event. Returns the new
        size. Called under the lock."""
        start = size
        while start > 0:
            chunk = os.pread(fd, min(_TAIL_CHUNK, start), max(0, start - _TAIL_CHUNK))
            cut = chunk.rfind(b"\n")
            if cut != -1:
                start = max(0, start - _TAIL_CHUNK) + cut + 1
                break
            start = max(0, start - _TAIL_CHUNK)
        torn = os.pread(fd, size - start, start)
        aside = self.path.with_name(f"{self.path.name}.torn-{start}")
        with aside.open("wb") as handle:  # kept before it is cut off, durably
            handle.write(torn)
            handle.flush()
            os.fsync(handle.fileno())
        os.ftruncate(fd, start)
        log.error("audit_torn_tail_set_aside", path=str(aside), offset=start, length=len(torn))
        record = AuditEvent(
            kind="error", decision_id=str(uuid.uuid4()), timestamp=timestamp(), outcome="audit_torn_tail",
            result={"code": "audit.torn_tail", "offset": start, "length": len(torn), "sha256": sha256_hex(torn),
                    "set_aside": aside.name,
                    "message": "a last line without its newline (never acknowledged) was moved aside"},
        )  # fmt: skip
        return start, record

    # -- appending --------------------------------------------------------------------------

    def _write(self, event: AuditEvent) -> AuditEvent:
        # Serialised before the lock: other processes wait on it.
        event, unsealed = as_written(event, self.options.masks, self.options.mask_key)
        try:
            with self._locked():
                caught = self._catch_up()
                if self._rotation_due(event.timestamp):
                    self._seal()
                self._chain_notes(caught)
                chain = self._write_locked(unsealed, event.timestamp)
                if self.options.signer is not None and self._seq - self._signed() >= self.options.checkpoint_every:
                    self._checkpoint_or_log()  # the event is written: a checkpoint's failure is not its own
        except OSError as exc:
            self._loaded = False  # re-read everything next time
            self.failed = f"cannot append to audit log {self.path}: {exc.strerror or exc}"
            raise AuditError(self.failed) from exc
        self.failed = None
        if self.options.on_grown is not None:
            self._note_growth(self.options.on_grown)
        # The event was validated when it was built; only the chain fields are new.
        return event.model_copy(update=chain)

    def _chain_notes(self, caught: list[AuditEvent]) -> None:
        """Write the events the writer owes the chain (found at load, or by ``_catch_up``: a torn
        tail, a segment gone, checkpoints lost) before anything else goes on it (under the lock)."""
        notes, self._pending_notes = self._pending_notes + caught, []
        for note in notes:
            self._write_locked(as_written(note)[1], note.timestamp)

    def _note_growth(self, on_grown: Callable[[Path], None]) -> None:
        """Call ``on_grown`` when the active segment has grown enough since the last call (see
        `LogOptions.on_grown`): geometrically, so re-snapshotting it stays linear in its size."""
        active = self._active
        if active is None:
            return
        if active.size < self._grown_at:  # sealed since: a new active segment
            self._grown_at = 0
        if active.size - self._grown_at < max(GROWN_MIN_BYTES, self._grown_at // 4):
            return
        self._grown_at = active.size
        try:
            on_grown(self.path)
        except Exception:  # indexing is best effort; the log itself is complete
            log.exception("audit_on_grown_failed", path=str(self.path))

    def _write_locked(self, unsealed: Unsealed, stamp: str) -> dict[str, Any]:
        """Chain and write one event under the lock; its chain fields. Raises `OSError`, with the
        file left exactly as it was."""
        active = self._active
        assert active is not None  # noqa: S101  (_catch_up opened it)
        digest, text = unsealed.seal(self._seq + 1, self._head)
        line = text + b"\n"
        try:
            written = os.write(active.fd, line)
            if written != len(line):
                raise OSError(errno.ENOSPC, f"short write ({written} of {len(line)} bytes)")
        except OSError:
            # A failed append leaves the file exactly as it was: no half line for the next
            # append (or the next process) to chain onto. Shrinking needs no free space.
            os.ftruncate(active.fd, active.size)
            raise
        chain = {"seq": self._seq + 1, "prev_hash": self._head, "hash": digest}
        self._tree.append(bytes.fromhex(digest))
        self._seq, self._head = self._seq + 1, digest
        if not active.first_seq:
            active.first_seq, active.first_time = self._seq, stamp
        active.last_time = stamp
        if active.digest is not None:
            active.digest.update(line)
        active.size += written  # under the lock nobody else wrote: no second fstat
        return chain

    def _rotation_due(self, stamp: str) -> bool:
        active = self._active
        if active is None or not active.first_seq or self.options.signer is None:
            return False  # a sealed segment carries a signed checkpoint: without a key, one segment
        limit = self.options.segment_max_bytes
        if limit is not None and active.size >= limit:
            return True
        return self.options.rotate_daily and limit is not None and stamp[:10] != active.first_time[:10]

    def _seal(self) -> None:
        """Seal the active segment (under the lock): durable, checkpointed, renamed into the
        segments directory with its manifest; then apply retention."""
        active = self._active
        assert active is not None  # noqa: S101  (_rotation_due checked)
        os.fsync(active.fd)
        self._synced = 0
        checkpoint = self._checkpoint_locked(force=True)
        self.layout.segments_dir.mkdir(parents=True, exist_ok=True)
        target = self.layout.segment_path(active.first_seq, self._seq)
        first_prev = _prev_of_first(self.path)
        digest = active.digest.hexdigest() if active.digest is not None else _file_sha256(active.fd)
        manifest = Manifest(
            first_seq=active.first_seq, last_seq=self._seq, bytes=active.size, sha256=digest,
            first_prev_hash=first_prev, last_hash=self._head, tree=self._tree.to_json(), checkpoint=checkpoint,
            first_time=active.first_time, last_time=active.last_time,
        )  # fmt: skip
        # The manifest first: a crash before the rename is finished at the next start.
        write_json_atomically(self.layout.segment_path(active.first_seq, self._seq, "manifest.json"),
                              manifest.model_dump(mode="json"))  # fmt: skip
        os.rename(self.path, target)
        sync_directory(self.path.parent)
        sync_directory(self.layout.segments_dir)
        os.close(active.fd)
        self._active = self._open_active()
        self._write_state()
        log.info("audit_segment_sealed", segment=target.name, events=self._seq - active.first_seq + 1)
        self._retention_due = self.options.retention_days is not None and self.options.signer is not None
        if self.options.on_sealed is not None:
            try:
                self.options.on_sealed(self.path)
            except Exception:  # indexing is best effort; the log itself is complete
                log.exception("audit_on_sealed_failed", path=str(self.path))

    def _start_retention(self) -> None:
        """Apply retention in a worker thread after a seal, one pass at a time (a seal while one
        runs is covered by the next pass: each pass reads the segments as they are then)."""
        if not self._retention_due or (self._retention is not None and not self._retention.done()):
            return
        self._retention_due = False
        self._retention = asyncio.get_running_loop().create_task(asyncio.to_thread(self._retention_pass))

    def _retention_pass(self) -> None:
        try:
            self._apply_retention()
        except Exception:  # the log itself is complete; the next seal tries again
            log.exception("audit_retention_failed", path=str(self.path))

    def _apply_retention(self) -> None:
        """Replace each sealed segment older than the retention days by a signed tombstone. The
        segments are checked without the log's lock (they never change once sealed); each is
        retired under it, if its file is still the one checked."""
        days, signer = self.options.retention_days, self.options.signer
        if days is None or signer is None:
            return
        cutoff = (datetime.now(UTC) - timedelta(days=days)).isoformat()[:19]
        before = CompactRange()  # the tree where the next segment's events resume
        for part in self.layout.parts():
            if part.kind == "active":
                break
            if part.kind == "tombstone":
                try:
                    end = part.tombstone()
                except (OSError, ValueError) as exc:
                    log.error("audit_retention_stopped", segment=part.path.name, why=f"unreadable: {exc}")
                    return
                resumes = CompactRange.from_json(end.tree)
                if not end.verify(signer.verify_key) or resumes.root().hex() != end.checkpoint.root:
                    log.error("audit_retention_stopped", segment=part.path.name, why="the tombstone does not check")
                    return
                before = resumes
                continue
            # By the segment's own last event, never the manifest's unsigned times: a newer-looking
            # file only keeps it longer, and an old-looking one is checked in full before it goes.
            if _last_time_of(part.path)[:19] >= cutoff:
                break  # segments are in seq order, and so in time order
            try:
                checked = _identity(part.path)
                manifest = part.manifest()
                problem, tree = _retirable(part.path, manifest, before, signer.verify_key)
            except (OSError, ValueError) as exc:
                problem, tree, checked = f"cannot be read: {exc}", before, None
            if problem is not None:
                # Nothing is signed over a segment that does not check: it stays for `audit verify`.
                log.error("audit_retention_stopped", segment=part.path.name, why=problem)
                return
            before = tree
            tombstone = sign_tombstone(
                signer, log=self.options.log_name, first_seq=manifest.first_seq, last_seq=manifest.last_seq,
                bytes=manifest.bytes, sha256=manifest.sha256, last_hash=manifest.last_hash, tree=manifest.tree,
                checkpoint=manifest.checkpoint, reason=f"retention: older than {days} days", time=timestamp(),
            )  # fmt: skip
            # A descriptor of its own: flock excludes another open file description, even this
            # process's event loop appending under the writer's.
            lock = os.open(self.layout.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
            try:
                with _flock(lock):
                    if not _unchanged(part.path, checked):
                        log.error("audit_retention_stopped", segment=part.path.name, why="changed while checked")
                        return
                    write_json_atomically(
                        self.layout.segment_path(manifest.first_seq, manifest.last_seq, "tombstone.json"),
                        tombstone.model_dump(mode="json"),
                    )
                    part.path.unlink()
                    self.layout.segment_path(manifest.first_seq, manifest.last_seq, "manifest.json").unlink(
                        missing_ok=True
                    )
                    sync_directory(self.layout.segments_dir)
            finally:
                os.close(lock)
            log.info("audit_segment_retired", segment=part.path.name)

    # -- checkpoints ------------------------------------------------------------------------

    def _signed(self) -> int:
        return self._checkpoint.size if self._checkpoint is not None else 0

    def _read_checkpoints(self) -> None:
        """Pick up the last checkpoint (another process may have signed one)."""
        try:
            size = os.stat(self.layout.checkpoints).st_size
        except FileNotFoundError:
            size = 0
        if size == self._checkpoints_size:
            return
        self._checkpoints_size = size
        last = last_line_of(self.layout.checkpoints, size)
        if last is not None:
            try:
                self._checkpoint = Checkpoint.model_validate_json(last)
            except ValueError as exc:
                raise AuditError(f"the last checkpoint in {self.layout.checkpoints} is unreadable") from exc

    def _restore_anchor(self) -> AuditEvent | None:
        """Put back the last checkpoint this writer signed (`LogOptions.anchor`) if the checkpoints
        file no longer holds it; the audit event recording that (None: nothing was missing)."""
        anchor = self.options.anchor
        if anchor is None:
            return None
        anchored = read_anchor(anchor, self.options.log_name)
        if anchored is None:
            return None
        self._anchored = max(self._anchored, anchored.size)
        # Almost always the file's last (just read); else (another writer signed since, or a crash
        # between the two writes) somewhere before it.
        if self._checkpoint == anchored or anchored in self.layout.read_checkpoints():
            return None
        self._append_checkpoint(anchored)
        self._checkpoint = anchored  # the next checkpoint follows it
        message = (
            f"the checkpoints file no longer held checkpoint {anchored.size} (root {anchored.root[:16]}…), the "
            f"last this writer signed (kept at {anchor}): put back; `stockade audit verify` checks the log against it"
        )
        log.error("audit_checkpoints_lost", path=str(self.path), size=anchored.size, anchor=str(anchor))
        return AuditEvent(
            kind="error", decision_id=str(uuid.uuid4()), timestamp=timestamp(), outcome="audit_checkpoints_lost",
            result={"code": "audit.checkpoints_lost", "size": anchored.size, "root": anchored.root, "message": message},
        )  # fmt: skip

    def _append_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Append ``checkpoint`` to the checkpoints file, durably, or leave the file as it was."""
        text = checkpoint.signed_text() + b"\n"
        fd = os.open(self.layout.checkpoints, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            before = os.fstat(fd).st_size
            try:
                if os.write(fd, text) != len(text):
                    raise OSError(errno.ENOSPC, "short write of a checkpoint")
                os.fsync(fd)
            except OSError:
                os.ftruncate(fd, before)  # no torn checkpoint line: the file stays as it was
                raise
        finally:
            os.close(fd)
        self._checkpoints_size = os.stat(self.layout.checkpoints).st_size

    def _checkpoint_locked(self, *, force: bool = False) -> Checkpoint:
        """Sign the tree as it stands (under the lock, the state caught up) and publish it."""
        signer = self.options.signer
        if signer is None:
            raise AuditError("this audit log has no signing key")
        current = self._checkpoint
        if (
            current is not None
            and current.size == self._seq
            and current.log == self.options.log_name
            and current.root == self._tree.root().hex()
            and current.verify(signer.verify_key)
        ):
            return current  # (a seal puts it in its manifest: never one this key did not sign over this tree)
        if self._active is not None:
            os.fsync(self._active.fd)  # a checkpoint never covers bytes that are not durable
        name = self.options.log_name
        prev = self._checkpoint
        if prev is not None and (prev.log != name or prev.size > self._seq):
            prev = None  # another log's, or one the files no longer reach (recorded at load): a new chain
        checkpoint = sign_checkpoint(signer, log=name, size=self._seq, root=self._tree.root(), prev=prev)
        self._append_checkpoint(checkpoint)
        self._checkpoint = checkpoint
        if self.options.anchor is not None and checkpoint.size >= self._anchored:
            # Never a smaller one: after a loss (the files end before the anchor), the anchor
            # stays the evidence until the log has grown past it.
            self._anchored = checkpoint.size
            keep_anchor(self.options.anchor, checkpoint)
        if self.options.publish_dir is not None:
            publish_file(self.options.publish_dir, checkpoint)
        self._write_state()
        return checkpoint

    def _checkpoint_or_log(self) -> None:
        try:
            self._checkpoint_locked()
        except (OSError, ValueError, AuditError) as exc:  # the next interval tries again
            log.error("audit_checkpoint_failed", path=str(self.path), error=str(exc))

    def checkpoint_sync(self) -> Checkpoint | None:
        """Sign a checkpoint now if anything was appended since the last (None: no signing key)."""
        if self.options.signer is None:
            return None
        with self._locked():
            # Recorded before they are signed over: a router stopped with no call since it started
            # (its shutdown checkpoint) must not sign a loss it found without recording it.
            try:
                self._chain_notes(self._catch_up())
            except OSError:
                self._loaded = False  # re-read everything next time: the load finds the loss again
                raise
            return self._checkpoint_locked()

    def _timed_checkpoint(self) -> None:
        self._timer = None
        try:
            self.checkpoint_sync()
        except (OSError, ValueError, AuditError) as exc:  # the next append or timer tries again
            log.error("audit_checkpoint_failed", path=str(self.path), error=str(exc))

    def _schedule_checkpoint(self) -> None:
        if self.options.signer is None or self._timer is not None:
            return
        self._timer = asyncio.get_running_loop().call_later(self.options.checkpoint_interval_s, self._timed_checkpoint)

    def _write_state(self) -> None:
        """The cache a restarted writer resumes from (not trusted: verification reads the log)."""
        active = self._active
        if active is None:
            return
        state = {"seq": self._seq, "head": self._head, "tree": self._tree.to_json(), "ino": active.ino,
                 "size": active.size, "first_seq": active.first_seq, "first_time": active.first_time,
                 "last_time": active.last_time}  # fmt: skip
        with contextlib.suppress(OSError):
            write_json_atomically(self.layout.state, state, sync=False)

    async def checkpoints(self) -> list[Checkpoint]:
        """Every checkpoint signed so far, oldest first."""
        return await asyncio.to_thread(self.layout.read_checkpoints)

    # -- the AuditLog protocol --------------------------------------------------------------

    async def check(self) -> str | None:
        # On the loop, not in a thread: it shares the descriptor with appends (one syscall, no I/O wait).
        return self.check_sync()

    def check_sync(self) -> str | None:
        """Whether the next append can be written: the file opens read-write and the disk can hold
        another event. Space is reserved past the end without changing the file's size
        (``fallocate`` with ``FALLOC_FL_KEEP_SIZE``), so the probe writes nothing into the log."""
        try:
            with self._locked():
                if self._active is None:
                    caught = self._catch_up()  # (a load sets the pending notes anew: read them after it)
                    self._pending_notes += caught  # chained before the next event
                    self._loaded = True
            assert self._active is not None  # noqa: S101
            fd = self._active.fd
            size = os.fstat(fd).st_size
            if _fallocate(fd, _FALLOC_FL_KEEP_SIZE, size, _PROBE_BYTES) != 0:
                err = ctypes.get_errno()
                if err not in (errno.EOPNOTSUPP, errno.ENOSYS):
                    raise OSError(err, os.strerror(err))
                if os.statvfs(self.path).f_bavail * os.statvfs(self.path).f_frsize < _PROBE_BYTES:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except (OSError, AuditError) as exc:
            return f"audit log {self.path} cannot take an append: {getattr(exc, 'strerror', None) or exc}"
        return None

    async def append(self, event: AuditEvent) -> AuditEvent:
        try:
            return await self._append(event)
        except AuditError:
            raise
        except Exception as exc:  # any fault here must deny the call, not escape as a 500
            log.exception("audit_append_raised", path=str(self.path))
            raise AuditError(f"cannot append to audit log {self.path}: {type(exc).__name__}: {exc}") from exc

    async def _append(self, event: AuditEvent) -> AuditEvent:
        # The write is synchronous (no await), so appends on one event loop cannot interleave.
        chained = self._write(event)
        self._schedule_checkpoint()
        self._start_retention()
        if self.durability == "relaxed":
            return chained
        active = self._active
        assert active is not None  # noqa: S101  (_write opened it)
        end, fd = active.size, active.fd
        # By occupancy, not timing: an append alone (no other waiting, no sync running) lets the
        # loop turn once, so appends ready now can join, and if still alone syncs inline (a thread
        # hop costs more than the sync: ~0.3 ms against ~0.2 ms here). Otherwise appends share one
        # sync in a thread, and those arriving meanwhile share the next (group commit).
        self._waiting += 1
        try:
            if self._sync_task is None and self._waiting == 1:
                await asyncio.sleep(0)
                if self._synced < end and self._sync_task is None and self._waiting == 1 and self._active is active:
                    target = active.size
                    try:
                        os.fdatasync(fd)
                    except OSError as exc:
                        raise AuditError(f"cannot sync audit log {self.path}: {exc.strerror or exc}") from exc
                    self._synced = max(self._synced, target)
            await self._synced_to(end, fd)  # none returns before its bytes are synced
        finally:
            self._waiting -= 1
        return chained

    async def _synced_to(self, end: int, fd: int) -> None:
        while self._synced < end and self._active is not None and self._active.fd == fd:
            if self._sync_task is None:
                self._sync_task = asyncio.get_running_loop().create_task(self._fsync())
            try:
                await asyncio.shield(self._sync_task)
            except OSError as exc:
                raise AuditError(f"cannot sync audit log {self.path}: {exc.strerror or exc}") from exc
        # A segment sealed meanwhile was fsynced before it was renamed: its bytes are durable.

    async def _fsync(self) -> None:
        """One sync covering every line written so far; appends arriving meanwhile wait for the next."""
        try:
            active = self._active
            assert active is not None  # noqa: S101
            target, fd = active.size, active.fd
            # In a thread: the event loop goes on serving requests, whose appends the next sync covers.
            # fdatasync: the data and the size (what reading it back needs), not the times.
            await asyncio.get_running_loop().run_in_executor(None, os.fdatasync, fd)
            if self._active is active:
                self._synced = max(self._synced, target)
        finally:
            self._sync_task = None

    async def query(self, where: AuditFilter) -> list[AuditEvent]:
        return await asyncio.to_thread(self.query_sync, where)

    def query_sync(self, where: AuditFilter) -> list[AuditEvent]:
        """`query` by scanning every segment, without the event loop (the indexed engine is
        `router.audit.index`; this is the reference it is tested against)."""
        found: list[AuditEvent] = []
        for document in self.documents():
            if document is None or not matches(document, where):
                continue
            found.append(AuditEvent.model_validate(document))
            if where.limit is not None and len(found) >= where.limit:
                break
        return found

    def documents(self) -> Iterator[dict[str, Any] | None]:
        """Every event of every segment still kept, oldest first (None for an unreadable line)."""
        for part in self.layout.parts():
            if part.kind != "tombstone":
                for _, line in lines(part.path):
                    yield document_of(line)

    async def verify(self) -> VerifyReport:
        """`verify_sync`; a large log is checked in worker processes, so the router's event loop
        (and its appends) never waits on the hashing."""
        size = sum(part.path.stat().st_size for part in self.layout.parts() if part.kind != "tombstone")
        if size < _VERIFY_IN_PROCESS_BYTES:
            return await asyncio.to_thread(self.verify_sync)
        signer = self.options.signer
        pems = [signer.public_pem()] if signer is not None else []
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(1, mp_context=context) as pool:
            return await asyncio.get_running_loop().run_in_executor(
                pool, _verify_elsewhere, self.path, pems, self.options.publish_dir
            )

    def verify_sync(self, *, workers: int = 1) -> VerifyReport:
        """`verify` without the event loop: `router.audit.verify.verify_log` with this log's key."""
        from router.audit.verify import verify_log  # noqa: PLC0415  (verify imports this module)

        signer = self.options.signer
        keys = [signer.verify_key] if signer is not None else []
        return verify_log(self.layout, keys=keys, publish_dir=self.options.publish_dir, workers=workers)

    async def aclose(self) -> None:
        if self.options.on_close is not None:
            # First: an append made while it waits starts no indexer (`LogOptions.on_close`).
            await asyncio.to_thread(self.options.on_close)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._retention is not None:
            await self._retention  # (it logs its own failures)
            self._retention = None
        if self._retention_due:  # a seal while the last pass ran: its segments are not left waiting
            self._retention_due = False
            await asyncio.to_thread(self._retention_pass)
        if self._sync_task is not None:
            with contextlib.suppress(OSError):
                await self._sync_task
        if self.options.signer is not None and self._active is not None:
            try:
                self.checkpoint_sync()  # the tail is signed at shutdown, not left unprovable
            except (OSError, ValueError, AuditError) as exc:
                log.error("audit_checkpoint_failed", path=str(self.path), error=str(exc))
        if self._active is not None:
            os.close(self._active.fd)
            self._active = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self._loaded = False


@contextlib.contextmanager
def _flock(fd: int) -> Iterator[None]:
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


_VERIFY_IN_PROCESS_BYTES = 16 << 20


def _verify_elsewhere(path: Path, pems: list[bytes], publish_dir: Path | None) -> VerifyReport:
    """`verify_log` in a worker process (see `JsonlAuditLog.verify`)."""
    from router.audit.verify import verify_log  # noqa: PLC0415

    keys = [VerifyKey.from_pem(pem) for pem in pems]
    return verify_log(LogLayout(path), keys=keys, publish_dir=publish_dir, workers=2)


def _identity(path: Path) -> tuple[int, int, int]:
    """What tells a file from its replacement or from itself changed: inode, size, mtime."""
    found = path.stat()
    return found.st_ino, found.st_size, found.st_mtime_ns


def _unchanged(path: Path, checked: tuple[int, int, int] | None) -> bool:
    try:
        return checked is not None and _identity(path) == checked
    except OSError:
        return False


def _last_time_of(path: Path) -> str:
    """The timestamp of a segment's last event, read from its end ("" if none)."""
    line = last_line_of(path, path.stat().st_size)
    return timestamp_of(line) if line is not None else ""


def _retirable(path: Path, manifest: Manifest, before: CompactRange, key: VerifyKey) -> tuple[str | None, CompactRange]:
    """Whether retention may sign a tombstone from ``manifest`` and delete the segment at ``path``:
    its bytes are those the manifest records (size, sha256), its events continue the tree from
    ``before`` up to the root of the manifest's checkpoint, which this log's key signed, and they
    end where the manifest says, its last event older than the cutoff as read (the caller).
    Returns why not (None: it may), and the tree at its end."""
    checkpoint, tree = manifest.checkpoint, before.copy()
    if not checkpoint.verify(key) or checkpoint.size != manifest.last_seq:
        return "its manifest's checkpoint is not one this log's key signed at its end", before
    digest, size, last, seq = hashlib.sha256(), 0, b"", before.size
    for _, line in lines(path):
        head = head_of(line)
        if head is None or head[0] != seq + 1:
            return f"it does not hold seq {seq + 1} where expected", before
        seq, last = head[0], line
        tree.append(line_hash(line))
        digest.update(line + b"\n")
        size += len(line) + 1
    if size != manifest.bytes or digest.hexdigest() != manifest.sha256 or size != path.stat().st_size:
        return "its bytes are not those its manifest records", before
    if (manifest.first_seq, seq) != (before.size + 1, manifest.last_seq) or tree.root().hex() != checkpoint.root:
        return "its events do not hash to the root its signed checkpoint records", before
    if line_hash(last).hex() != manifest.last_hash or manifest.tree != tree.to_json():
        return "its manifest records another last event or tree than its events make", before
    return None, tree


def _file_sha256(fd: int) -> str:
    digest = hashlib.sha256()
    with _fd_path(fd).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fd_path(fd: int) -> Path:
    return Path(f"/proc/self/fd/{fd}")


def _prev_of_first(path: Path) -> str:
    for _, line in lines(path):
        head = head_of(line)
        return head[1] if head is not None else ""
    return ""


def _missing(path: Path, first: int, last: int, why: str) -> AuditEvent:
    log.error("audit_segment_missing", path=str(path), first_seq=first, last_seq=last, why=why)
    return AuditEvent(
        kind="error", decision_id=str(uuid.uuid4()), timestamp=timestamp(), outcome="audit_segment_missing",
        result={"code": "audit.segment_missing", "first_seq": first, "last_seq": last, "path": str(path),
                "message": f"{why}: events {first}..{last} are not in the log's files; the chain goes on"},
    )  # fmt: skip


def _unsigned_end(end: Manifest | Tombstone, signer: SigningKey | None) -> str | None:
    """Why the writer may not resume where the last sealed part ends (`unvouched_end`, and a
    tombstone signed by this log's key): files changed under a stopped writer (a segment replaced
    with a manifest of its own making) were otherwise adopted, and signed over. None: it may."""
    keys = [signer.verify_key] if signer is not None else []
    problem = unvouched_end(end, keys)
    if problem is None and isinstance(end, Tombstone) and keys and not end.signed_by(keys):
        problem = "the tombstone is not signed by a trusted key"
    if problem is not None and keys:
        problem += (f" (this log's key is {keys[0].key_id}): forged, or the signing key was replaced; verify with "
                    "the old public key, and start a new log for the new key")  # fmt: skip
    return problem


def _read_state(path: Path) -> dict[str, Any] | None:
    import json  # noqa: PLC0415  (only at startup)

    try:
        value = json.loads(path.read_bytes())
        CompactRange.from_json(value["tree"])
        return value if isinstance(value, dict) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_anchor(anchor: Path, log_name: str) -> Checkpoint | None:
    """The checkpoint a writer keeps at ``anchor`` (`LogOptions.anchor`) for the log ``log_name``:
    None if there is none, it is another log's, or it cannot be read (logged)."""
    try:
        kept = Checkpoint.model_validate_json(anchor.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.error("audit_anchor_unreadable", path=str(anchor), error=str(exc))
        return None
    return kept if kept.log == log_name else None


def keep_anchor(anchor: Path, checkpoint: Checkpoint) -> None:
    """Keep ``checkpoint`` at ``anchor``, beside the signing key (0600 in a 0700 directory); a
    failure is logged: the checkpoint stands, only the check at the next start is weaker."""
    try:
        anchor.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_json_atomically(anchor, checkpoint.model_dump(mode="json"), mode=0o600)
    except OSError as exc:
        log.error("audit_anchor_unwritable", path=str(anchor), error=str(exc))


def publish_file(directory: Path, checkpoint: Checkpoint) -> None:
    """Add the checkpoint to the publish directory as a new file (never rewriting one)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / f"{checkpoint.size:012d}-{checkpoint.digest()[:16]}.json"
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
        try:
            os.write(fd, checkpoint.signed_text())
            os.fsync(fd)
        finally:
            os.close(fd)
    except FileExistsError:
        return
    except OSError as exc:  # the local checkpoints file has it; the publish target is reported
        log.error("audit_checkpoint_publish_failed", directory=str(directory), error=str(exc))
