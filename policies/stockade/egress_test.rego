package stockade_test

test_allowlisted_egress_is_granted if {
	tool := object.union(_tool([], "low"), {"egress": [{"host": "api.example.com", "port": 443, "methods": []}]})
	d := data.stockade.decision with input as _input(tool, [])
		with data.stockade.catalog.egress_allowlist as ["api.example.com"]
	d.outcome == "allow"
	d.obligations.egress == [{"host": "api.example.com", "port": 443, "methods": []}]
}

test_egress_to_a_host_not_allowlisted_is_denied if {
	tool := object.union(_tool([], "low"), {"egress": [{"host": "evil.test", "port": 443, "methods": []}]})
	d := data.stockade.decision with input as _input(tool, [])
	d.outcome == "deny"
	codes(d) == {"egress.not_allowlisted"}
}
