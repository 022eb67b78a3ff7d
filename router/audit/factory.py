"""The audit log the settings name, with its signing key, checkpoints, segments and masks."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from router.audit.base import AuditLog
from router.audit.checkpoint import SigningKey
from router.audit.jsonl import JsonlAuditLog, LogOptions
from router.audit.masking import load_or_create_key
from router.audit.redis import RedisAuditLog
from router.errors import AuditError
from router.settings import Settings

log = structlog.get_logger(__name__)


def log_options(settings: Settings, *, index: bool = True) -> LogOptions:
    """`LogOptions` from ``settings.audit``: loads (or makes, on first use) the signing key.

    Raises:
        AuditError: the key cannot be read or made, or is not a private Ed25519 key of mode 0600.
    """
    audit = settings.audit
    indexer = BackgroundIndexer() if index else None
    try:
        signer = SigningKey.load_or_create(audit.signing_key)
    except (OSError, ValueError) as exc:
        raise AuditError(f"the audit signing key {audit.signing_key} cannot be used: {exc}") from exc
    return LogOptions(
        signer=signer, log_name=audit.log_name, checkpoint_interval_s=audit.checkpoint_interval_s,
        checkpoint_every=audit.checkpoint_every, publish_dir=audit.publish_dir,
        segment_max_bytes=audit.segment_max_bytes, rotate_daily=audit.rotate_daily,
        retention_days=audit.retention_days, masks=tuple((rule.path, rule.hash) for rule in audit.mask),
        mask_key=_mask_key(settings, create=True),
        on_sealed=indexer, on_grown=indexer, on_close=indexer.stop if indexer is not None else None,
        anchor=anchor_path(audit.signing_key, audit.path),
    )  # fmt: skip


def make_side_log(settings: Settings) -> AuditLog:
    """The log ``settings`` name, for a process that adds a few events beside the routers that
    write it (`stockade approvals`): the same backend and masking rules, but it signs nothing,
    seals nothing and starts no indexer. The routers checkpoint its events with theirs; a key
    this process made (another user's config directory) would sign with a key no auditor holds.

    Raises:
        AuditError: the Redis stream is chosen without a store URL, or the masking rules hash
            values and their key is not there to read (it is never made here: a new key would
            hash the same value differently from the routers).
    """
    audit = settings.audit
    options = LogOptions(masks=tuple((rule.path, rule.hash) for rule in audit.mask),
                         mask_key=_mask_key(settings, create=False), log_name=audit.log_name,
                         segment_max_bytes=None)  # fmt: skip
    return _backend(settings, options)


def _mask_key(settings: Settings, *, create: bool) -> bytes | None:
    """The masking key, if a masking rule hashes values; made on first use only if ``create``.

    Raises:
        AuditError: it cannot be read (or made), or is not there and may not be made.
    """
    audit = settings.audit
    if not any(rule.hash for rule in audit.mask):
        return None
    if not create and not audit.mask_key.exists():
        raise AuditError(f"the audit masking key {audit.mask_key} is not there: run this as the routers' user, "
                         "with their STOCKADE_AUDIT__MASK_KEY")  # fmt: skip
    try:
        return load_or_create_key(audit.mask_key)
    except (OSError, ValueError) as exc:
        raise AuditError(f"the audit masking key {audit.mask_key} cannot be used: {exc}") from exc


def redis_anchor_path(signing_key: Path, url: str) -> Path:
    """Where a router keeps the last checkpoint it signed of the Redis stream at ``url``: beside the
    signing key, one file per stream, never the JSONL log's (a router moved from one backend to
    the other must not hold the new log to the old one's size)."""
    key = hashlib.sha256(f"redis-stream {url}".encode()).hexdigest()[:16]
    return signing_key.parent / "audit-anchors" / f"redis-{key}.json"


def _backend(settings: Settings, options: LogOptions) -> AuditLog:
    if settings.audit.backend == "redis":
        if settings.store.url is None:
            raise AuditError("STOCKADE_AUDIT__BACKEND=redis needs the store's Redis: set STOCKADE_STORE__URL")
        if options.anchor is not None:
            options = dataclasses.replace(options, anchor=redis_anchor_path(settings.audit.signing_key,
                                                                            settings.store.url))  # fmt: skip
        spool = settings.audit.spool_dir or settings.audit.path.parent / "audit-spool"
        return RedisAuditLog(
            settings.store.url, timeout_s=settings.store.timeout_s, spool_dir=spool, instance=settings.instance,
            options=options,
        )  # fmt: skip
    return JsonlAuditLog(settings.audit.path, durability=settings.audit.durability, options=options)


def anchor_path(signing_key: Path, log_path: Path) -> Path:
    """Where the writer of the log at ``log_path`` keeps the last checkpoint it signed: beside the
    signing key (off the log's volume, as the key is), one file per log, named after the log's
    path as configured (made absolute, symlinks not followed: a log swapped for a symlink to a
    forged copy is held to the same anchor)."""
    key = hashlib.sha256(os.path.abspath(log_path).encode()).hexdigest()[:16]
    return signing_key.parent / "audit-anchors" / f"{key}.json"


class BackgroundIndexer:
    """One log's indexer: called after a seal, or as the active segment grows, it starts the
    indexer (which indexes sealed segments and snapshots the active one) in its own low-priority
    process, never this one. `stop`, when the log closes, waits for the processes it started.

    Why `stop` waits: a closed log's directory is its owner's again (to copy, to remove, as a
    temporary directory is at the end of a test); an indexer still writing there races with that.
    It waits ``grace_s`` in all and then ends those still at work: the index is written so that a
    killed run leaves nothing a reader uses (staging is wiped, a segment's marker comes last), and
    the next run (the next process's, at a seal or growth) does what it did not. Once stopped it
    starts no other.
    """

    def __init__(self, grace_s: float = 10.0) -> None:
        self.grace_s = grace_s
        self._children: list[_Child] = []
        self._closed = False
        self._lock = threading.Lock()  # appends run in the event loop; `stop` in a worker thread

    def __call__(self, path: Path) -> None:
        from router.audit.index import spawn_indexer  # noqa: PLC0415  (only when a segment is sealed or grew)

        with self._lock:  # so `stop` never misses a process started as it runs
            if self._closed:
                return
            for gone in [c for c in self._children if not c.reaper.is_alive()]:
                gone.release()
                self._children.remove(gone)
            process = spawn_indexer(path)
            if process is not None:
                self._children.append(_Child.watch(process))

    def stop(self) -> None:
        """Wait for the indexers this log started, ``grace_s`` in all; end those still at work."""
        with self._lock:
            self._closed = True
            children, self._children = self._children, []
        deadline = time.monotonic() + self.grace_s
        for child in children:
            child.reaper.join(max(0.0, deadline - time.monotonic()))
            if child.reaper.is_alive():
                log.warning("audit_indexer_stopped", pid=child.process.pid, grace_s=self.grace_s)
                child.kill()
                child.reaper.join(_KILLED_WAIT_S)
            child.release()


_KILLED_WAIT_S = 5.0  # for a killed indexer to be gone (longer only in an uninterruptible wait)


@dataclass(slots=True)
class _Child:
    """An indexer process, the thread that reaps it (so no zombie is left in a long-lived router),
    and a pidfd, which names that very process: a signal sent through it never reaches another
    process that took the pid after it was reaped."""

    process: subprocess.Popen[bytes]
    reaper: threading.Thread
    pidfd: int | None

    @classmethod
    def watch(cls, process: subprocess.Popen[bytes]) -> _Child:
        pidfd = None
        with contextlib.suppress(OSError):  # no pidfds (Linux < 5.3): `kill` falls back to the pid
            pidfd = os.pidfd_open(process.pid)  # before the reaper starts: the pid is still this one's
        reaper = threading.Thread(target=process.wait, name="audit-indexer-reaper", daemon=True)
        reaper.start()
        return cls(process, reaper, pidfd)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            else:
                self.process.kill()

    def release(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def make_audit_log(settings: Settings) -> AuditLog:
    """The audit log ``settings`` name: the JSONL file, or the Redis stream of the store's server.

    Raises:
        AuditError: the Redis stream is chosen without a store URL, or the signing key is unusable.
    """
    return _backend(settings, log_options(settings))
