"""Where a router keeps sessions, provenance, approvals and rate windows (`Store`), chosen by
settings: in this process by default, in Redis when ``store.url`` is set."""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.store.base import PendingExternal, SessionRecord, Store
from router.store.memory import MemoryStore
from router.store.redis import RedisStore

if TYPE_CHECKING:  # router.settings imports the credentials, which import this package
    from router.settings import Settings


def make_store(settings: Settings) -> Store:
    """The store ``settings`` name. Raises `StoreError` for a malformed URL."""
    if settings.store.url is None:
        return MemoryStore(settings.session_idle_ttl_s)
    return RedisStore(settings.store.url, session_ttl_s=settings.session_idle_ttl_s, timeout_s=settings.store.timeout_s)


__all__ = ["MemoryStore", "PendingExternal", "RedisStore", "SessionRecord", "Store", "make_store"]
