package stockade_test

test_high_risk_needs_approval if {
	d := data.stockade.decision with input as _input(_tool([], "high"), [])
	d.outcome == "require_approval"
	codes(d) == {"approval.high_risk"}
}

test_critical_risk_needs_approval if {
	d := data.stockade.decision with input as _input(_tool(["mutates_state"], "critical"), [])
	d.outcome == "require_approval"
	codes(d) == {"approval.high_risk"}
}

test_unknown_risk_is_denied if {
	d := data.stockade.decision with input as _input(_tool([], "extreme"), [])
	d.outcome == "deny"
	codes(d) == {"risk.unknown"}
}
