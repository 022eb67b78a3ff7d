"""The embedded audit log: one canonical JSON event per line, hash-chained, fsynced per append.

Appends are serialised across processes by ``flock`` on the file, and the head is re-read when
another process appended since, so several processes can share one file and the chain stays one
chain. In the default ``fsync`` durability no append returns before an fsync covering its bytes
has completed. An append after a quiet spell fsyncs inline; under load, appends share one fsync
run in a thread, off the event loop, and appends arriving while it runs share the next (group
commit): a busy router pays one fsync per batch rather than per event.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import structlog

from router.audit.base import GENESIS_HASH, AuditEvent, AuditFilter, VerifyReport, as_written, matches, timestamp
from router.audit.chain import Unsealed, check_link, sha256_hex
from router.errors import AuditError

log = structlog.get_logger(__name__)

_TAIL_CHUNK = 1 << 16
_PROBE_BYTES = 1 << 16  # room for a large event: the readiness probe reserves this much
_FALLOC_FL_KEEP_SIZE = 1
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def _fallocate(fd: int, mode: int, offset: int, length: int) -> int:
    return int(_libc.fallocate(fd, mode, offset, length))


# Appends further apart than this fsync inline; closer ones share fsyncs run in a thread, so the
# event loop is not blocked while requests are waiting.
_QUIET_S = 0.001


class JsonlAuditLog:
    """`AuditLog` on an append-only JSONL file."""

    def __init__(self, path: Path, *, durability: Literal["fsync", "relaxed"] = "fsync") -> None:
        self.path = path
        self.durability = durability
        self._fd: int | None = None
        self._seq = 0
        self._head = GENESIS_HASH
        self._known_size = -1  # file size after our last append; differs if another process wrote
        self._synced = 0  # bytes of the file known durable
        self._last_busy = 0.0  # when the last append was made or the last shared fsync ended
        self._sync_task: asyncio.Task[None] | None = None
        self.failed: str | None = None  # why the last append failed; None after a good one

    def _open(self) -> int:
        if self._fd is None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                # Read-write: another process's last line is read back through this descriptor.
                self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
            except OSError as exc:
                raise AuditError(f"cannot open audit log {self.path}: {exc.strerror}; fix its permissions") from exc
        return self._fd

    def _reload_head(self, fd: int) -> AuditEvent | None:
        """Catch up with the file (another process may have appended); if it ends in a torn line,
        set that aside and return the event that records it, to be chained first."""
        size = os.fstat(fd).st_size
        if size == self._known_size:
            return None
        torn = None
        if size and os.pread(fd, 1, size - 1) != b"\n":
            size, torn = self._set_aside_torn_tail(fd, size)
        last = _last_line(fd, size)
        if last is None:
            self._seq, self._head = 0, GENESIS_HASH
        else:
            try:
                document = json.loads(last)
                self._seq, self._head = int(document["seq"]), str(document["hash"])
            except (ValueError, KeyError, TypeError) as exc:
                raise AuditError(
                    f"the last event in {self.path} is unreadable; run `stockade audit verify` before appending"
                ) from exc
        self._known_size = size
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

    def _write(self, event: AuditEvent) -> AuditEvent:
        fd = self._open()
        event, unsealed = as_written(event)  # serialised before the lock: other processes wait on it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                torn = self._reload_head(fd)
                if torn is not None:
                    self._write_locked(fd, as_written(torn)[1])
                chain = self._write_locked(fd, unsealed)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as exc:
            self._known_size = -1  # re-read the head next time
            self.failed = f"cannot append to audit log {self.path}: {exc.strerror or exc}"
            raise AuditError(self.failed) from exc
        self.failed = None
        # The event was validated when it was built; only the chain fields are new.
        return event.model_copy(update=chain)

    def _write_locked(self, fd: int, unsealed: Unsealed) -> dict[str, Any]:
        """Chain and write one event under the lock; its chain fields. Raises `OSError`, with the
        file left exactly as it was."""
        before = self._known_size
        chain: dict[str, Any] = {"seq": self._seq + 1, "prev_hash": self._head}
        chain["hash"], text = unsealed.seal(self._seq + 1, self._head)
        line = (text + "\n").encode()
        try:
            written = os.write(fd, line)
            if written != len(line):
                raise OSError(errno.ENOSPC, f"short write ({written} of {len(line)} bytes)")
        except OSError:
            # A failed append leaves the file exactly as it was: no half line for the next
            # append (or the next process) to chain onto. Shrinking needs no free space.
            os.ftruncate(fd, before)
            raise
        self._seq, self._head = self._seq + 1, chain["hash"]
        self._known_size += written  # under the lock nobody else wrote: no second fstat
        return chain

    async def check(self) -> str | None:
        # On the loop, not in a thread: it shares the descriptor with appends (one syscall, no I/O wait).
        return self.check_sync()

    def check_sync(self) -> str | None:
        """Whether the next append can be written: the file opens read-write and the disk can hold
        another event. Space is reserved past the end without changing the file's size
        (``fallocate`` with ``FALLOC_FL_KEEP_SIZE``), so the probe writes nothing into the log."""
        try:
            fd = self._open()
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
        if self.durability == "relaxed":
            return chained
        end = self._known_size
        now = time.monotonic()
        quiet, self._last_busy = now - self._last_busy > _QUIET_S, now
        if quiet and self._sync_task is None:
            # Appends are rare: an inline fsync (~0.1 ms here) is cheaper than a thread hop (~0.3 ms).
            try:
                os.fsync(self._open())
            except OSError as exc:
                raise AuditError(f"cannot sync audit log {self.path}: {exc.strerror or exc}") from exc
            self._synced = max(self._synced, end)
        await self._synced_to(end)  # none returns before its bytes are synced
        return chained

    async def _synced_to(self, end: int) -> None:
        while self._synced < end:
            if self._sync_task is None:
                self._sync_task = asyncio.get_running_loop().create_task(self._fsync())
            try:
                await asyncio.shield(self._sync_task)
            except OSError as exc:
                raise AuditError(f"cannot sync audit log {self.path}: {exc.strerror or exc}") from exc

    async def _fsync(self) -> None:
        """One fsync covering every line written so far; appends arriving meanwhile wait for the next."""
        try:
            target, fd = self._known_size, self._open()
            # In a thread: the event loop goes on serving requests, whose appends the next fsync covers.
            await asyncio.get_running_loop().run_in_executor(None, os.fsync, fd)
            self._synced = max(self._synced, target)
            self._last_busy = time.monotonic()  # its waiters' next requests are still load
        finally:
            self._sync_task = None

    async def query(self, where: AuditFilter) -> list[AuditEvent]:
        return await asyncio.to_thread(self.query_sync, where)

    def query_sync(self, where: AuditFilter) -> list[AuditEvent]:
        """`query` without the event loop, for the CLI."""
        found: list[AuditEvent] = []
        for _, document in self._documents():
            if document is None or not matches(document, where):
                continue
            found.append(AuditEvent.model_validate(document))
            if where.limit is not None and len(found) >= where.limit:
                break
        return found

    async def verify(self) -> VerifyReport:
        return await asyncio.to_thread(self.verify_sync)

    def verify_sync(self) -> VerifyReport:
        """`verify` without the event loop, for the CLI."""
        expected_seq, prev = 1, GENESIS_HASH
        for line_no, document in self._documents():
            problem, seq = check_link(document, expected_seq, prev)
            if problem or document is None:
                return VerifyReport(False, expected_seq - 1, expected_seq - 1, prev, seq, line_no, problem)
            prev, expected_seq = document["hash"], expected_seq + 1
        return VerifyReport(True, expected_seq - 1, expected_seq - 1, prev)

    def _documents(self) -> Iterator[tuple[int, dict[str, Any] | None]]:
        try:
            handle = self.path.open("rb")
        except FileNotFoundError:
            return
        except OSError as exc:
            raise AuditError(f"cannot read audit log {self.path}: {exc.strerror}") from exc
        with handle:
            for line_no, raw in enumerate(handle, start=1):
                try:
                    value = json.loads(raw)
                except (ValueError, UnicodeDecodeError):
                    yield line_no, None
                    continue
                yield line_no, value if isinstance(value, dict) else None

    async def aclose(self) -> None:
        if self._sync_task is not None:
            with contextlib.suppress(OSError):
                await self._sync_task
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _last_line(fd: int, size: int) -> bytes | None:
    """The last complete line of the file, read from the end (the log can be large)."""
    end = size
    buffer = b""
    while end > 0:
        start = max(0, end - _TAIL_CHUNK)
        buffer = os.pread(fd, end - start, start) + buffer
        stripped = buffer.rstrip(b"\n")
        cut = stripped.rfind(b"\n")
        if cut != -1:
            return stripped[cut + 1 :]
        if start == 0:
            return stripped or None
        end = start
    return None
