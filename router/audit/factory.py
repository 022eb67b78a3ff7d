"""The audit log the settings name, with its signing key, checkpoints, segments and masks."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import structlog

from router.audit.base import AuditLog
from router.audit.checkpoint import SigningKey
from router.audit.jsonl import JsonlAuditLog, LogOptions
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
        on_sealed=indexer, on_grown=indexer, on_close=indexer.stop if indexer is not None else None,
    )  # fmt: skip


class BackgroundIndexer:
    """One log's indexer: called after a seal, or as the active segment grows, it starts the
    indexer (which indexes sealed segments and snapshots the active one) in its own low-priority
    process, never this one. `stop`, when the log closes, waits for the processes it started.

    Why `stop` waits: a closed log's directory is its owner's again (to copy, to remove, as a
    temporary directory is at the end of a test); an indexer still writing there races with that.
    It waits at most ``grace_s`` and then ends the indexer: the index is written so that a killed
    run leaves nothing a reader uses (staging is wiped, a segment's marker comes last), and the
    next run, at the next seal or growth, does what it did not.
    """

    def __init__(self, grace_s: float = 10.0) -> None:
        self.grace_s = grace_s
        self._children: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()  # appends run in the event loop; `stop` in a worker thread

    def __call__(self, path: Path) -> None:
        from router.audit.index import spawn_indexer  # noqa: PLC0415  (only when a segment is sealed or grew)

        child = spawn_indexer(path)
        with self._lock:
            self._children = [c for c in self._children if c.poll() is None]
            if child is not None:
                self._children.append(child)

    def stop(self) -> None:
        """Wait for the indexers this log started, ``grace_s`` in all; end those still running."""
        with self._lock:
            children, self._children = self._children, []
        for child in children:
            try:
                child.wait(timeout=self.grace_s)
                continue
            except subprocess.TimeoutExpired:
                pass
            log.warning("audit_indexer_stopped", pid=child.pid, waited_s=self.grace_s)
            child.kill()
            child.wait()


def make_audit_log(settings: Settings) -> AuditLog:
    """The audit log ``settings`` name: the JSONL file, or the Redis stream of the store's server.

    Raises:
        AuditError: the Redis stream is chosen without a store URL, or the signing key is unusable.
    """
    options = log_options(settings)
    if settings.audit.backend == "redis":
        if settings.store.url is None:
            raise AuditError("STOCKADE_AUDIT__BACKEND=redis needs the store's Redis: set STOCKADE_STORE__URL")
        spool = settings.audit.spool_dir or settings.audit.path.parent / "audit-spool"
        return RedisAuditLog(
            settings.store.url, timeout_s=settings.store.timeout_s, spool_dir=spool, instance=settings.instance,
            options=options,
        )  # fmt: skip
    return JsonlAuditLog(settings.audit.path, durability=settings.audit.durability, options=options)
