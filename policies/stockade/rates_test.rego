package stockade_test

test_calls_within_the_rate_limits_are_allowed if {
	i := object.union(_input(_tool([], "low"), []), {"rate": {"session_per_minute": 120, "agent_tool_per_minute": 60}})
	d := data.stockade.decision with input as i
	d.outcome == "allow"
}

test_a_call_over_a_rate_limit_is_denied if {
	i := object.union(_input(_tool([], "low"), []), {"rate": {"agent_tool_per_minute": 61}})
	d := data.stockade.decision with input as i
	d.outcome == "deny"
	codes(d) == {"rate.exceeded"}
}

test_rate_limits_are_data if {
	i := object.union(_input(_tool([], "low"), []), {"rate": {"session_per_minute": 3}})
	d := data.stockade.decision with input as i with data.stockade.catalog.rate_limits as {"session_per_minute": 2}
	d.outcome == "deny"
}

test_an_hourly_window_is_limited_like_a_minute if {
	i := object.union(_input(_tool([], "low"), []), {"rate": {"principal_per_hour": 11}})
	d := data.stockade.decision with input as i with data.stockade.catalog.rate_limits as {"principal_per_hour": 10}
	d.outcome == "deny"
	[r.message | some r in d.reasons] == ["11 calls in the last hour (principal_per_hour), over the limit of 10"]
}
