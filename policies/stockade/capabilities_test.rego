package stockade_test

test_honest_readers_and_writers_are_accepted if {
	every caps in [
		["reads_private", "reads_untrusted"],
		["reads_untrusted", "sends_external"],
		["executes_code", "reads_private"],
		["mutates_state", "reads_private", "sends_external"],
	] {
		d := data.stockade.decision with input as _input(_tool(caps, "low"), [])
		d.outcome == "allow"
	}
}

test_unknown_capability_is_denied if {
	d := data.stockade.decision with input as _input(_tool(["teleports"], "low"), [])
	d.outcome == "deny"
	codes(d) == {"capability.unknown"}
}

test_the_lethal_trifecta_in_one_tool_is_denied if {
	tool := _tool(["reads_private", "reads_untrusted", "sends_external", "mutates_state"], "low")
	d := data.stockade.decision with input as _input(tool, [])
	d.outcome == "deny"
	codes(d) == {"capability.combination_denied"}
}
