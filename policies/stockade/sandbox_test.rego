package stockade_test

test_limits_default_from_catalog if {
	d := data.stockade.decision with input as _input(_tool([], "low"), [])
	d.obligations.limits.timeout_s == 10
	d.obligations.limits.memory_mb == 256
}

test_limits_take_tool_defaults_capped_by_maxima if {
	tool := object.union(_tool([], "low"), {"limits": {"timeout_s": 5, "memory_mb": 99999}})
	d := data.stockade.decision with input as _input(tool, [])
	d.obligations.limits.timeout_s == 5
	d.obligations.limits.memory_mb == 1024
}

test_code_execution_needs_the_strongest_tier if {
	d := data.stockade.decision with input as _input(_tool(["executes_code"], "low"), [])
	d.outcome == "allow"
	d.obligations.sandbox.min_tier == "gvisor"
}

test_other_tools_get_no_minimum_tier if {
	d := data.stockade.decision with input as _input(_tool([], "low"), [])
	d.obligations.sandbox == {}
}

test_limit_without_a_catalog_default_defaults_to_its_maximum if {
	d := data.stockade.decision with input as _input(_tool([], "low"), [])
		with data.stockade.catalog.limits.default as {"timeout_s": 10}
	d.obligations.limits.timeout_s == 10
	d.obligations.limits.cpus == 2
	d.obligations.limits.memory_mb == 1024
}

test_limit_without_a_catalog_default_still_caps_the_tool if {
	tool := object.union(_tool([], "low"), {"limits": {"cpus": 64, "memory_mb": 65536}})
	d := data.stockade.decision with input as _input(tool, []) with data.stockade.catalog.limits.default as {}
	d.obligations.limits.cpus == 2
	d.obligations.limits.memory_mb == 1024
}
