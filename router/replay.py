"""What-if: decide the inputs recorded in the audit log again, with a candidate policy."""

from __future__ import annotations

from collections import Counter
from typing import Any

from pydantic import ValidationError

from policy import EmbeddedEngine, PolicyInput
from router.audit import AuditEvent


def replay(events: list[AuditEvent], engine: EmbeddedEngine) -> dict[str, Any]:
    """Every recorded decision whose outcome or reason codes the candidate would change, and
    counts of the candidate's reasons among them. Events whose input no longer validates are skipped."""
    changed: list[dict[str, Any]] = []
    skipped = 0
    replayed = 0
    for event in events:
        if event.kind != "decision" or event.input is None or event.result is None:
            continue
        try:
            policy_input = PolicyInput.model_validate(event.input)
        except ValidationError:
            skipped += 1
            continue
        replayed += 1
        now = engine.evaluate(policy_input)
        was_reasons = sorted(r.get("code", "") for r in event.result.get("reasons", []))
        if now.outcome.value != event.outcome or sorted(now.reason_codes) != was_reasons:
            changed.append({
                "decision_id": event.decision_id, "timestamp": event.timestamp, "tool": event.tool,
                "session_id": event.session_id, "was": event.outcome, "now": now.outcome.value,
                "was_reasons": was_reasons, "now_reasons": sorted(now.reason_codes),
            })  # fmt: skip
    by_reason = Counter(code for change in changed for code in change["now_reasons"] or ["(none)"])
    return {"replayed": replayed, "skipped": skipped, "changed": changed, "by_reason": dict(by_reason.most_common())}
