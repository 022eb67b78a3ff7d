"""Tables for people: how audit events and approvals look in a terminal."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from rich.table import Table
from rich.text import Text

from router.approvals import Approval
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


def _when(epoch: float | None) -> str:
    return "" if epoch is None else datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def approvals_table(approvals: list[Approval]) -> Table:
    """Approvals, one row each. Agent-supplied text is shown as text, never as markup."""
    table = Table(show_lines=False, pad_edge=False)
    for column in ("id", "status", "tool", "agent", "expires", "decided by"):
        table.add_column(column, no_wrap=True)
    table.add_column("reasons", overflow="fold", min_width=20)
    for a in approvals:
        table.add_row(
            Text(a.id), Text(a.status.value), Text(a.tool[:24]), Text(a.agent[:24]), _when(a.expires_at),
            Text(a.approver or ""), Text(", ".join(r["code"] for r in a.reasons)),
        )  # fmt: skip
    return table


def approval_panel(approval: Approval) -> Table:
    """One approval in full: what exactly would run, for whom, why it was held."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    rows = [
        ("approval", approval.id), ("status", approval.status.value), ("tool", approval.tool),
        ("arguments", json.dumps(json.loads(approval.args), indent=2, ensure_ascii=False)),
        ("input files", "\n".join(f"/in/{i['name']}  {i['size']} bytes  sha256 {i['sha256']}"
                                   for i in approval.inputs)),
        ("agent", approval.agent), ("principal", approval.principal), ("session", approval.session_id),
        ("reasons", "\n".join(f"{r['code']}: {r.get('message', '')}" for r in approval.reasons)),
        ("requested", _when(approval.created_at)), ("expires", _when(approval.expires_at)),
        ("decided by", approval.approver or ""), ("decided", _when(approval.decided_at)), ("note", approval.note),
        ("decision id", approval.decision_id), ("binding", approval.binding),
    ]  # fmt: skip
    for name, value in rows:
        if value:
            table.add_row(name, Text(value))
    return table
