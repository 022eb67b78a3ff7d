# METADATA
# description: >-
#   The entrypoint's precedence (deny, then approval, then auto-allow, then the default deny),
#   approvals, the obligations it assembles, and the input builders every area's tests use.
#   Tests compare sets of reason codes (codes(d)), never positions in d.reasons.
package stockade_test

_input(tool, taint) := {
	"subject": {"agent": "a", "principal": "p@example.com", "labels": {}},
	"session": {"id": "s-1", "taint": taint, "call_count": 0, "trusted_context": []},
	"tool": tool,
	"args": {},
	"provenance": {},
	"rate": {},
	"approval": null,
	"now": "2026-11-22T10:00:00Z",
}

_tool(caps, risk) := {"name": "t", "capabilities": caps, "risk": risk, "limits": {}, "executor": "python"}

# The set of reason codes of a decision: what tests compare, whatever the order of d.reasons.
codes(d) := {r.code | some r in d.reasons}

test_low_risk_tool_is_allowed if {
	d := data.stockade.decision with input as _input(_tool([], "low"), [])
	d.outcome == "allow"
	d.reasons == []
}

test_medium_risk_read_is_allowed if {
	d := data.stockade.decision with input as _input(_tool(["reads_untrusted"], "medium"), [])
	d.outcome == "allow"
}

test_a_risk_neither_allowed_nor_held_is_denied_by_default if {
	d := data.stockade.decision with input as _input(_tool([], "medium"), [])
		with data.stockade.catalog.auto_allow_risks as ["low"]
	d.outcome == "deny"
	codes(d) == {"policy.default_deny"}
}

test_deny_wins_over_approval if {
	d := data.stockade.decision with input as _input(_tool(["financial", "teleports"], "critical"), [])
	d.outcome == "deny"
	codes(d) == {"capability.unknown"}
}

test_every_deny_reason_is_given if {
	egress := [{"host": "evil.test", "port": 443, "methods": []}]
	tool := object.union(_tool(["teleports"], "extreme"), {"egress": egress})
	d := data.stockade.decision with input as _input(tool, [])
	d.outcome == "deny"
	codes(d) == {"capability.unknown", "risk.unknown", "egress.not_allowlisted"}
}

test_every_approval_reason_is_given if {
	d := data.stockade.decision with input as _input(_tool(["financial"], "high"), [])
	d.outcome == "require_approval"
	codes(d) == {"approval.high_risk", "approval.financial"}
}

test_an_empty_input_is_denied_with_a_reason if {
	d := data.stockade.decision with input as {}
	d.outcome == "deny"
	codes(d) == {"risk.unknown"}
}

_approved(approved_codes) := {
	"id": "a-1",
	"status": "approved",
	"approver": "oncall@example.com",
	"reasons": approved_codes,
}

test_an_approval_for_the_reasons_releases_the_call if {
	i := object.union(_input(_tool([], "high"), []), {"approval": _approved(["approval.high_risk"])})
	d := data.stockade.decision with input as i
	d.outcome == "allow"
	d.reasons == []
}

test_an_approval_for_other_reasons_does_not if {
	i := object.union(_input(_tool(["financial"], "high"), []), {"approval": _approved(["approval.high_risk"])})
	d := data.stockade.decision with input as i
	d.outcome == "require_approval"
	codes(d) == {"approval.high_risk", "approval.financial"}
}

test_an_approval_never_lifts_a_deny if {
	i := object.union(_input(_tool(["teleports"], "high"), []), {"approval": _approved(["approval.high_risk"])})
	d := data.stockade.decision with input as i
	d.outcome == "deny"
	codes(d) == {"capability.unknown"}
}

test_a_denied_approval_releases_nothing if {
	denied := object.union(_approved(["approval.high_risk"]), {"status": "denied"})
	i := object.union(_input(_tool([], "high"), []), {"approval": denied})
	d := data.stockade.decision with input as i
	d.outcome == "require_approval"
}

test_the_shipped_policy_sets_no_session_labels if {
	d := data.stockade.decision with input as _input(_tool(["reads_private", "executes_code"], "low"), [])
	d.outcome == "allow"
	d.obligations.session_labels == []
}

test_a_held_call_carries_its_obligations if {
	d := data.stockade.decision with input as _input(_tool(["executes_code"], "high"), [])
	d.outcome == "require_approval"
	d.obligations.sandbox.min_tier == "gvisor"
}

test_a_denied_call_carries_no_obligations if {
	d := data.stockade.decision with input as _input(_tool(["teleports"], "low"), [])
	d.obligations == {}
}
