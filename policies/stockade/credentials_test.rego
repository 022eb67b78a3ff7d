package stockade_test

test_a_catalogued_credential_is_granted_with_the_catalogs_ttl if {
	tool := object.union(_tool([], "low"), {"credentials": [{"name": "github", "scopes": ["repo:read"]}]})
	d := data.stockade.decision with input as _input(tool, [])
		with data.stockade.catalog.credentials as {"github": {"scopes": ["repo:read", "repo:write"], "ttl_s": 30}}
	d.outcome == "allow"
	d.obligations.credentials == [{"name": "github", "scopes": ["repo:read"], "ttl_s": 30}]
}

test_tools_without_credentials_get_none if {
	d := data.stockade.decision with input as _input(_tool([], "low"), [])
	d.obligations.credentials == []
}

test_a_credential_not_in_the_catalog_is_denied if {
	tool := object.union(_tool([], "low"), {"credentials": [{"name": "prod-db", "scopes": []}]})
	d := data.stockade.decision with input as _input(tool, [])
	d.outcome == "deny"
	codes(d) == {"credential.not_allowlisted"}
}

test_a_scope_not_in_the_catalog_is_denied if {
	tool := object.union(_tool([], "low"), {"credentials": [{"name": "github", "scopes": ["admin:org"]}]})
	d := data.stockade.decision with input as _input(tool, [])
		with data.stockade.catalog.credentials as {"github": {"scopes": ["repo:read"]}}
	d.outcome == "deny"
	codes(d) == {"credential.scope_not_allowlisted"}
}
