"""Where a JSONL audit log keeps its parts, and how they are read.

For a log at ``audit.jsonl`` (`AuditSettings.path`)::

    audit.jsonl                      the active segment: events are appended here
    audit.jsonl.lock                 appends, rotations and checkpoints take this flock
    audit.jsonl.checkpoints          signed checkpoints (tree heads), one JSON per line
    audit.jsonl.state                the writer's cached tree state (a cache: never trusted)
    audit.jsonl.segments/
        000000000001-000000041234.jsonl           a sealed segment: seq 1..41234, never written again
        000000000001-000000041234.manifest.json   its range, sha256, end state and signed checkpoint
        000000041235-000000090000.tombstone.json  a segment retention deleted, signed

Seq and the Merkle tree continue across segments: a segment's first event links to the previous
segment's last. Nothing here trusts what it reads; `router.audit.verify` checks it.

The models of what the files hold (`router.audit.checkpoint`: pydantic, and the signature
library) are imported where a file is parsed, not with this module: a fresh `stockade audit
query` process lists the parts and reads lines, and starts faster without them.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

if TYPE_CHECKING:
    from router.audit.checkpoint import Checkpoint, Manifest, Tombstone

_SEGMENT = re.compile(r"(\d{12})-(\d{12})\.(jsonl|manifest\.json|tombstone\.json)")
_READ_CHUNK = 8 << 20


@dataclass(frozen=True, slots=True)
class Part:
    """One stretch of the log in seq order: a segment file (sealed or active) or a tombstone."""

    kind: Literal["sealed", "active", "tombstone"]
    path: Path
    first_seq: int  # 0 for the active segment until it is read
    last_seq: int  # 0 for the active segment

    def manifest(self) -> Manifest:
        from router.audit.checkpoint import Manifest  # noqa: PLC0415  (see the module docstring)

        return Manifest.model_validate_json(self.path.with_name(self.path.name[:26] + "manifest.json").read_bytes())

    def tombstone(self) -> Tombstone:
        from router.audit.checkpoint import Tombstone  # noqa: PLC0415  (see the module docstring)

        return Tombstone.model_validate_json(self.path.read_bytes())


@dataclass(frozen=True, slots=True)
class LogLayout:
    """The paths of one JSONL audit log (see the module docstring)."""

    active: Path

    @property
    def lock(self) -> Path:
        return self._beside(".lock")

    @property
    def checkpoints(self) -> Path:
        return self._beside(".checkpoints")

    @property
    def state(self) -> Path:
        return self._beside(".state")

    @property
    def segments_dir(self) -> Path:
        return self._beside(".segments")

    def _beside(self, suffix: str) -> Path:
        return self.active.with_name(self.active.name + suffix)

    def segment_path(self, first_seq: int, last_seq: int, suffix: str = "jsonl") -> Path:
        return self.segments_dir / f"{first_seq:012d}-{last_seq:012d}.{suffix}"

    def parts(self) -> list[Part]:
        """Sealed segments and tombstones in seq order, then the active segment (if it exists)."""
        found: list[Part] = []
        try:
            names = os.listdir(self.segments_dir)
        except FileNotFoundError:
            names = []
        for name in names:
            match = _SEGMENT.fullmatch(name)
            if match is None or match.group(3) == "manifest.json":
                continue
            kind: Literal["sealed", "tombstone"] = "sealed" if match.group(3) == "jsonl" else "tombstone"
            found.append(Part(kind, self.segments_dir / name, int(match.group(1)), int(match.group(2))))
        found.sort(key=lambda part: (part.first_seq, part.kind))
        if self.active.exists():
            found.append(Part("active", self.active, 0, 0))
        return found

    def read_checkpoints(self, path: Path | None = None) -> list[Checkpoint]:
        """The checkpoints in a checkpoints file (one JSON per line), or in a directory of
        ``<size>.json`` files (a publish directory); unreadable entries are skipped here and
        reported by verification, which counts them."""
        source = path or self.checkpoints
        return [checkpoint for checkpoint in read_checkpoint_source(source) if checkpoint is not None]


def read_checkpoint_source(source: Path) -> Iterator[Checkpoint | None]:
    """Checkpoints from a JSON-lines file or a directory of JSON files; None for an unreadable one
    (in a directory, also an entry that cannot be read as a file: a subdirectory, a denied file).

    Raises:
        OSError: ``source`` itself exists but cannot be read.
    """
    if source.is_dir():
        for name in sorted(os.listdir(source)):
            if name.endswith(".json"):
                try:
                    raw = source.joinpath(name).read_bytes()
                except OSError:  # one entry of a publish directory: counted as unreadable, the rest still read
                    yield None
                    continue
                yield _checkpoint(raw)
        return
    try:
        raw = source.read_bytes()
    except FileNotFoundError:
        return
    for line in raw.splitlines():
        if line.strip():
            yield _checkpoint(line)


def _checkpoint(raw: bytes) -> Checkpoint | None:
    from router.audit.checkpoint import Checkpoint  # noqa: PLC0415  (see the module docstring)

    try:
        return Checkpoint.model_validate_json(raw)
    except ValueError:
        return None


def timestamp_of(line: bytes) -> str:
    """The ``timestamp`` of an event as written (its first occurrence: the event's own, which
    comes before any field an agent fills), without parsing the line; "" if it has none."""
    at = line.find(b'"timestamp":"')
    return line[at + 13 : at + 40].split(b'"', 1)[0].decode(errors="replace") if at != -1 else ""


_TAIL_CHUNK = 1 << 16


def last_line_of(path: Path, size: int) -> bytes | None:
    """The last complete line of the first ``size`` bytes of a file, read from their end (None if
    the last 64 KiB hold no line break and do not start the file)."""
    if size <= 0:
        return None
    with path.open("rb") as handle:
        start = max(0, size - _TAIL_CHUNK)
        handle.seek(start)
        block = handle.read(size - start).rstrip(b"\n")
    cut = block.rfind(b"\n")
    return block[cut + 1 :] if cut != -1 or start == 0 else None


def lines(path: Path, start: int = 0) -> Iterator[tuple[int, bytes]]:
    """The complete lines of a segment from byte ``start`` on, each with its byte offset, without
    newlines. A last line without its newline (never acknowledged) is not yielded."""
    try:
        handle = open_part(path)
    except FileNotFoundError:
        return
    with handle:
        yield from complete_lines(handle, start)


def complete_lines(handle: BinaryIO, start: int = 0) -> Iterator[tuple[int, bytes]]:
    """`lines` of an open file."""
    offset = start
    for block in _blocks(handle, start):
        for line in block:
            yield offset, line
            offset += len(line) + 1


def line_blocks(path: Path) -> Iterator[list[bytes]]:
    """The complete lines of a segment as `lines` reads them, without offsets, a read's worth at a
    time: for a reader that goes through every line (verification), at C speed."""
    try:
        handle = open_part(path)
    except FileNotFoundError:
        return
    with handle:
        yield from _blocks(handle, 0)


def _blocks(handle: BinaryIO, start: int) -> Iterator[list[bytes]]:
    handle.seek(start)
    # The pieces of a line longer than a read, joined once it ends: joining them read by read
    # made a huge unterminated line cost the square of its length (512 MiB: 23 s).
    pending: list[bytes] = []
    while chunk := handle.read(_READ_CHUNK):
        cut = chunk.rfind(b"\n")
        if cut == -1:
            pending.append(chunk)
            continue
        block = b"".join([*pending, chunk[:cut]]) if pending else chunk[:cut]
        pending = [chunk[cut + 1 :]]
        yield block.split(b"\n")


def open_part(path: Path) -> BinaryIO:
    """``path`` open for reading, if it is a regular file: a FIFO put in a segment's place made
    every reader (verify, the API, the indexer) wait for a writer for ever.

    Raises:
        OSError: it cannot be opened, or it is not a regular file (EINVAL).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def write_json_atomically(path: Path, value: Any, *, sync: bool = True, mode: int = 0o640) -> None:
    """``path`` holds ``value`` as JSON, whole or not at all (a temporary file renamed over it)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    if sync:
        sync_directory(path.parent)


def sync_directory(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
