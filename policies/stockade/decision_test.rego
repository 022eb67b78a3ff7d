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

test_a_financial_tool_with_nothing_to_check_needs_approval if {
	d := stockade.decision with input as _input(_tool(["financial"], "low"), [])
	d.outcome == "require_approval"
	d.reasons[0].code == "approval.financial"
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

_mailer := object.union(_tool(["sends_external"], "medium"), {"destination_args": ["to", "cc"], "content_args": ["body"]})

_v(path, sources) := {"path": path, "sources": sources}

# A send of `to` (one address), whose value was seen in `sources`, after untrusted content.
_send(to, sources) := object.union(_input(_mailer, ["untrusted_content"]), {
	"args": {"to": to},
	"provenance": {"to": sources},
	"values": {"to": [_v("to", sources)]},
})

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
	d := stockade.decision with input as _send("who@where.example", [])
	d.outcome == "require_approval"
	d.reasons[0].code == "approval.unverified_destination"
}

test_an_absent_optional_destination_is_not_checked if {
	d := stockade.decision with input as _send("bob@example.com", ["user"])
	not "cc" in object.keys(d)
	d.outcome == "allow"
}

test_each_recipient_in_a_list_needs_its_own_trusted_source if {
	i := object.union(_send("bob@example.com", ["user"]), {
		"args": {"to": "bob@example.com", "cc": ["alice@example.com", "mallory@evil.example"]},
		"values": {"to": [_v("to", ["user"])], "cc": [_v("cc[0]", ["user"]), _v("cc[1]", ["untrusted:read_email:c-3"])]},
	})
	d := stockade.decision with input as i
	d.outcome == "deny"
	d.reasons[0].code == "provenance.untrusted_destination"
	contains(d.reasons[0].message, "cc[1]")
}

test_a_list_of_recipients_the_user_gave_is_allowed if {
	i := object.union(_send("bob@example.com", ["user"]), {
		"args": {"to": "bob@example.com", "cc": ["alice@example.com"]},
		"values": {"to": [_v("to", ["user"])], "cc": [_v("cc[0]", ["user", "untrusted:read_email:c-3"])]},
	})
	d := stockade.decision with input as i
	d.outcome == "allow"
}

test_an_empty_list_of_recipients_is_nothing_to_check if {
	i := object.union(_send("bob@example.com", ["user"]), {
		"args": {"to": "bob@example.com", "cc": []},
		"values": {"to": [_v("to", ["user"])], "cc": []},
	})
	d := stockade.decision with input as i
	d.outcome == "allow"
}

test_a_present_destination_the_router_did_not_trace_is_held if {
	i := object.union(_send("bob@example.com", ["user"]), {"args": {"to": "bob@example.com", "cc": "x@y.example"}})
	d := stockade.decision with input as i
	d.outcome == "require_approval"
	d.reasons[0].code == "approval.unverified_destination"
}

test_an_endorsed_source_counts_as_trusted if {
	base := _send("carol@example.com", ["untrusted:read_file:c-7"])
	i := object.union(base, {"session": object.union(base.session, {"endorsed": ["untrusted:read_file:c-7"]})})
	d := stockade.decision with input as i
	d.outcome == "allow"
}

test_an_endorsement_of_another_source_does_not if {
	base := _send("mallory@evil.example", ["untrusted:get_webpage:c-8"])
	i := object.union(base, {"session": object.union(base.session, {"endorsed": ["untrusted:read_file:c-7"]})})
	d := stockade.decision with input as i
	d.outcome == "deny"
}

test_a_link_from_untrusted_content_in_a_message_body_is_denied if {
	i := object.union(_send("bob@example.com", ["user"]), {
		"args": {"to": "bob@example.com", "body": "please log in at https://evil.example/login"},
		"values": {"to": [_v("to", ["user"])], "body": [{
			"path": "body", "key": "u:https://evil.example/login",
			"sources": ["untrusted:read_email:c-4"],
		}]},
	})
	d := stockade.decision with input as i
	d.outcome == "deny"
	d.reasons[0].code == "provenance.untrusted_content"
}

test_a_link_the_user_gave_in_a_message_body_is_allowed if {
	i := object.union(_send("bob@example.com", ["user"]), {
		"args": {"to": "bob@example.com", "body": "the doc: https://docs.example/q3"},
		"values": {"to": [_v("to", ["user"])], "body": [{"path": "body", "key": "u:https://docs.example/q3", "sources": ["user"]}]},
	})
	d := stockade.decision with input as i
	d.outcome == "allow"
}

_password_tool := object.union(_tool(["mutates_state"], "medium"), {"sensitive_args": ["new_password"]})

test_a_sensitive_value_from_untrusted_content_is_denied_on_any_tool if {
	i := object.union(_input(_password_tool, ["untrusted_content"]), {
		"args": {"new_password": "hunter2-from-the-mail"},
		"values": {"new_password": [_v("new_password", ["untrusted:read_email:c-2"])]},
	})
	d := stockade.decision with input as i
	d.outcome == "deny"
	d.reasons[0].code == "provenance.untrusted_destination"
}

_payer := object.union(
	_tool(["financial", "mutates_state", "sends_external"], "medium"),
	{"destination_args": ["iban"], "amount_args": ["amount"]},
)

_pay(taint, iban_sources, amount_sources) := object.union(_input(_payer, taint), {
	"args": {"iban": "DE89370400440532013000", "amount": 100},
	"values": {"iban": [_v("iban", iban_sources)], "amount": [_v("amount", amount_sources)]},
})

test_a_payment_to_an_untrusted_iban_is_denied if {
	d := stockade.decision with input as _pay(["untrusted_content"], ["untrusted:read_file:c-9"], ["user"])
	d.outcome == "deny"
	d.reasons[0].code == "provenance.untrusted_destination"
}

test_a_payment_the_user_gave_is_allowed_without_a_human if {
	d := stockade.decision with input as _pay(["untrusted_content"], ["user"], ["user"])
	d.outcome == "allow"
}

test_a_payment_of_an_amount_nobody_gave_is_held_even_in_a_clean_session if {
	d := stockade.decision with input as _pay([], ["user"], [])
	d.outcome == "require_approval"
	d.reasons[0].code == "approval.unverified_destination"
}

test_a_payment_from_an_endorsed_bill_is_allowed if {
	base := _pay(["untrusted_content"], ["untrusted:read_file:c-9"], ["untrusted:read_file:c-9"])
	i := object.union(base, {"session": object.union(base.session, {"endorsed": ["untrusted:read_file:c-9"]})})
	d := stockade.decision with input as i
	d.outcome == "allow"
}

test_honest_readers_and_writers_are_accepted if {
	every caps in [
		["reads_private", "reads_untrusted"],
		["reads_untrusted", "sends_external"],
		["executes_code", "reads_private"],
		["mutates_state", "reads_private", "sends_external"],
	] {
		d := stockade.decision with input as _input(_tool(caps, "low"), [])
		d.outcome == "allow"
	}
}

test_unknown_capability_is_denied if {
	d := stockade.decision with input as _input(_tool(["teleports"], "low"), [])
	d.outcome == "deny"
	d.reasons[0].code == "capability.unknown"
}

test_the_lethal_trifecta_in_one_tool_is_denied if {
	tool := _tool(["reads_private", "reads_untrusted", "sends_external", "mutates_state"], "low")
	d := stockade.decision with input as _input(tool, [])
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

test_an_empty_input_is_denied_with_a_reason if {
	d := stockade.decision with input as {}
	d.outcome == "deny"
	[r.code | some r in d.reasons] == ["risk.unknown"]
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
