"""`stockade policy replay`: decide the inputs recorded in the audit log again with a candidate policy."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from policy import EmbeddedEngine, PolicyBundleError
from router.audit import AuditFilter
from router.interfaces.cli_common import AuditPath, JsonFlag, audit_log, emit_json, fail, out, settings_of, when
from router.replay import replay


def policy_replay(
    ctx: typer.Context,
    candidate: Annotated[Path, typer.Option("--policy", help="The candidate policy directory.")],
    since: Annotated[str | None, typer.Option(help="Only decisions at or after this ISO 8601 time.")] = None,
    path: AuditPath = None,
    as_json: JsonFlag = False,
) -> None:
    """What-if: decide every input recorded in the audit log with a candidate policy and show
    each decision that would change, with counts by reason."""
    try:
        engine = EmbeddedEngine(settings_of(ctx).policy.model_copy(update={"dir": candidate}))
    except PolicyBundleError as exc:
        raise fail(str(exc)) from exc
    events = audit_log(ctx, path).query_sync(AuditFilter(since=when(since, "--since"), kind="decision"))
    report = replay(events, engine)
    if as_json:
        emit_json(report)
    else:
        for change in report["changed"]:
            out.print(f"{change['timestamp'][:19]} {change['tool']:<20} {change['was']:>16} -> {change['now']:<16} "
                      f"{', '.join(change['now_reasons'])}  {change['decision_id'][:8]}", markup=False)  # fmt: skip
        out.print(f"{report['replayed']} decisions replayed, {len(report['changed'])} would change, "
                  f"{report['skipped']} skipped")  # fmt: skip
        for code, count in report["by_reason"].items():
            out.print(f"  {code}: {count}")
    raise typer.Exit(0)
