package stockade_test

import data.stockade

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

test_low_risk_tool_is_allowed if {
	d := stockade.decision with input as _input(_tool([], "low"), [])
	d.outcome == "allow"
	d.reasons == []
}

test_medium_risk_read_is_allowed if {
	d := stockade.decision with input as _input(_tool(["reads_untrusted"], "medium"), [])
	d.outcome == "allow"
}

test_high_risk_needs_approval if {
	d := stockade.decision with input as _input(_tool([], "high"), [])
	d.outcome == "require_approval"
	d.reasons[0].code == "approval.high_risk"
}

test_critical_risk_needs_approval if {
	d := stockade.decision with input as _input(_tool(["mutates_state"], "critical"), [])
	d.outcome == "require_approval"
}

test_financial_needs_approval_even_at_low_risk if {
	d := stockade.decision with input as _input(_tool(["financial"], "low"), [])
	d.outcome == "require_approval"
	d.reasons == [{"code": "approval.financial", "message": "financial tools need a human"}]
}

test_send_external_on_clean_session_is_allowed if {
	d := stockade.decision with input as _input(_tool(["sends_external"], "medium"), [])
	d.outcome == "allow"
}

test_send_external_after_untrusted_without_destination_args_needs_approval if {
	d := stockade.decision with input as _input(_tool(["sends_external"], "medium"), ["untrusted_content"])
	d.outcome == "require_approval"
	d.reasons[0].code == "approval.external_after_untrusted"
}

_mailer := object.union(_tool(["sends_external"], "medium"), {"destination_args": ["to"]})

_send(to, sources) := object.union(_input(_mailer, ["untrusted_content"]), {"args": {"to": to}, "provenance": {"to": sources}})

test_sending_to_an_address_from_untrusted_content_is_denied if {
	d := stockade.decision with input as _send("evil@attacker.example", ["untrusted:get_webpage:c-5"])
	d.outcome == "deny"
	d.reasons[0].code == "provenance.untrusted_destination"
}

test_sending_to_the_address_the_user_gave_is_allowed if {
	d := stockade.decision with input as _send("bob@example.com", ["user"])
	d.outcome == "allow"
}

test_an_address_the_user_also_gave_is_allowed_even_if_a_page_repeats_it if {
	d := stockade.decision with input as _send("bob@example.com", ["untrusted:get_webpage:c-5", "user"])
	d.outcome == "allow"
}

test_an_address_from_a_trusted_tool_is_allowed if {
	d := stockade.decision with input as _send("ops@example.com", ["tool:directory_lookup:c-2"])
	d.outcome == "allow"
}

test_an_address_of_unknown_origin_after_untrusted_content_needs_approval if {
	d := stockade.decision with input as object.union(_send("who@where.example", []), {"provenance": {}})
	d.outcome == "require_approval"
	d.reasons[0].code == "approval.unverified_destination"
}

test_a_payment_to_an_untrusted_iban_is_denied if {
	payer := object.union(_tool(["financial"], "high"), {"destination_args": ["iban"], "amount_args": ["amount"]})
	i := object.union(_input(payer, ["untrusted_content"]), {
		"args": {"iban": "DE89370400440532013000", "amount": 100},
		"provenance": {"iban": ["untrusted:read_file:c-9"], "amount": ["user"]},
	})
	d := stockade.decision with input as i
	d.outcome == "deny"
	d.reasons[0].code == "provenance.untrusted_destination"
}

test_unknown_capability_is_denied if {
	d := stockade.decision with input as _input(_tool(["teleports"], "low"), [])
	d.outcome == "deny"
	d.reasons[0].code == "capability.unknown"
}

test_unknown_capability_combination_is_denied if {
	d := stockade.decision with input as _input(_tool(["reads_private", "sends_external"], "low"), [])
	d.outcome == "deny"
	d.reasons[0].code == "capability.combination_denied"
}

test_unknown_risk_is_denied if {
	d := stockade.decision with input as _input(_tool([], "extreme"), [])
	d.outcome == "deny"
	d.reasons[0].code == "risk.unknown"
}

test_deny_wins_over_approval if {
	d := stockade.decision with input as _input(_tool(["financial", "teleports"], "critical"), [])
	d.outcome == "deny"
}

test_missing_tool_is_default_deny if {
	d := stockade.decision with input as {}
	d.outcome == "deny"
	d.reasons[0].code == "policy.default_deny"
}

test_limits_default_from_catalog if {
	d := stockade.decision with input as _input(_tool([], "low"), [])
	d.obligations.limits.timeout_s == 10
	d.obligations.limits.memory_mb == 256
}

test_limits_take_tool_defaults_capped_by_maxima if {
	tool := object.union(_tool([], "low"), {"limits": {"timeout_s": 5, "memory_mb": 99999}})
	d := stockade.decision with input as _input(tool, [])
	d.obligations.limits.timeout_s == 5
	d.obligations.limits.memory_mb == 1024
}

test_code_execution_needs_the_strongest_tier if {
	d := stockade.decision with input as _input(_tool(["executes_code"], "low"), [])
	d.outcome == "allow"
	d.obligations.sandbox.min_tier == "gvisor"
}

test_other_tools_get_no_minimum_tier if {
	d := stockade.decision with input as _input(_tool([], "low"), [])
	d.obligations.sandbox == {}
}

test_allowlisted_egress_is_granted if {
	tool := object.union(_tool([], "low"), {"egress": [{"host": "api.example.com", "port": 443, "methods": []}]})
	d := stockade.decision with input as _input(tool, [])
		with data.stockade.catalog.egress_allowlist as ["api.example.com"]
	d.outcome == "allow"
	d.obligations.egress == [{"host": "api.example.com", "port": 443, "methods": []}]
}

test_egress_to_a_host_not_allowlisted_is_denied if {
	tool := object.union(_tool([], "low"), {"egress": [{"host": "evil.test", "port": 443, "methods": []}]})
	d := stockade.decision with input as _input(tool, [])
	d.outcome == "deny"
	d.reasons[0].code == "egress.not_allowlisted"
}

test_a_catalogued_credential_is_granted_with_the_catalogs_ttl if {
	tool := object.union(_tool([], "low"), {"credentials": [{"name": "github", "scopes": ["repo:read"]}]})
	d := stockade.decision with input as _input(tool, [])
		with data.stockade.catalog.credentials as {"github": {"scopes": ["repo:read", "repo:write"], "ttl_s": 30}}
	d.outcome == "allow"
	d.obligations.credentials == [{"name": "github", "scopes": ["repo:read"], "ttl_s": 30}]
}

test_tools_without_credentials_get_none if {
	d := stockade.decision with input as _input(_tool([], "low"), [])
	d.obligations.credentials == []
}

test_a_credential_not_in_the_catalog_is_denied if {
	tool := object.union(_tool([], "low"), {"credentials": [{"name": "prod-db", "scopes": []}]})
	d := stockade.decision with input as _input(tool, [])
	d.outcome == "deny"
	[r.code | some r in d.reasons] == ["credential.not_allowlisted"]
}

test_a_scope_not_in_the_catalog_is_denied if {
	tool := object.union(_tool([], "low"), {"credentials": [{"name": "github", "scopes": ["admin:org"]}]})
	d := stockade.decision with input as _input(tool, [])
		with data.stockade.catalog.credentials as {"github": {"scopes": ["repo:read"]}}
	d.outcome == "deny"
	[r.code | some r in d.reasons] == ["credential.scope_not_allowlisted"]
}

test_calls_within_the_rate_limits_are_allowed if {
	i := object.union(_input(_tool([], "low"), []), {"rate": {"session_per_minute": 120, "agent_tool_per_minute": 60}})
	d := stockade.decision with input as i
	d.outcome == "allow"
}

test_a_call_over_a_rate_limit_is_denied if {
	i := object.union(_input(_tool([], "low"), []), {"rate": {"agent_tool_per_minute": 61}})
	d := stockade.decision with input as i
	d.outcome == "deny"
	d.reasons[0].code == "rate.exceeded"
}

test_rate_limits_are_data if {
	i := object.union(_input(_tool([], "low"), []), {"rate": {"session_per_minute": 3}})
	d := stockade.decision with input as i with data.stockade.catalog.rate_limits as {"session_per_minute": 2}
	d.outcome == "deny"
}

_approved(codes) := {"id": "a-1", "status": "approved", "approver": "oncall@example.com", "reasons": codes}

test_an_approval_for_the_reasons_releases_the_call if {
	i := object.union(_input(_tool([], "high"), []), {"approval": _approved(["approval.high_risk"])})
	d := stockade.decision with input as i
	d.outcome == "allow"
}

test_an_approval_for_other_reasons_does_not if {
	i := object.union(_input(_tool(["financial"], "high"), []), {"approval": _approved(["approval.high_risk"])})
	d := stockade.decision with input as i
	d.outcome == "require_approval"
}

test_an_approval_never_lifts_a_deny if {
	i := object.union(_input(_tool(["teleports"], "high"), []), {"approval": _approved(["approval.high_risk"])})
	d := stockade.decision with input as i
	d.outcome == "deny"
}

test_a_denied_approval_releases_nothing if {
	denied := object.union(_approved(["approval.high_risk"]), {"status": "denied"})
	i := object.union(_input(_tool([], "high"), []), {"approval": denied})
	d := stockade.decision with input as i
	d.outcome == "require_approval"
}
