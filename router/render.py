"""Tables for people: how audit events look in a terminal."""

from __future__ import annotations

from rich.table import Table

from router.audit import AuditEvent


def audit_table(events: list[AuditEvent]) -> Table:
    """The audit events as a table, one row per event."""
    table = Table(show_lines=False, pad_edge=False)
    for column in ("seq", "time", "kind", "tool", "outcome", "decision"):
        table.add_column(column, no_wrap=True)
    table.add_column("reasons / detail", overflow="fold", min_width=24)
    for e in events:
        result = e.result or {}
        detail = (
            ", ".join(r["code"] for r in result.get("reasons", [])) or result.get("code") or result.get("detail", "")
        )
        table.add_row(
            str(e.seq),
            e.timestamp[11:19],
            e.kind,
            (e.tool or "")[:16],
            e.outcome,
            e.decision_id[:8],
            str(detail)[:80],
        )
    return table
