"""States the wire names, as plain enums: the CLI builds its options from them without loading
the pydantic models of `router.wire`, which re-exports them."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ApprovalStatus"]


class ApprovalStatus(StrEnum):
    """Where an approval is in its life: asked, decided, redeemed by the call, or timed out."""

    PENDING = "pending"
    APPROVED = "approved"
    DENIED = "denied"
    USED = "used"
    EXPIRED = "expired"
