package stockade_test

_mailer := object.union(
	_tool(["sends_external"], "medium"),
	{"destination_args": ["to", "cc"], "content_args": ["body"]},
)

_v(path, sources) := {"path": path, "sources": sources}

# A send of `to` (one address), whose value was seen in `sources`, after untrusted content.
_send(to, sources) := object.union(_input(_mailer, ["untrusted_content"]), {
	"args": {"to": to},
	"provenance": {"to": sources},
	"values": {"to": [_v("to", sources)]},
})

test_sending_to_an_address_from_untrusted_content_is_denied if {
	d := data.stockade.decision with input as _send("evil@attacker.example", ["untrusted:get_webpage:c-5"])
	d.outcome == "deny"
	codes(d) == {"provenance.untrusted_destination"}
}

test_sending_to_the_address_the_user_gave_is_allowed if {
	d := data.stockade.decision with input as _send("bob@example.com", ["user"])
	d.outcome == "allow"
}

test_an_address_the_user_also_gave_is_allowed_even_if_a_page_repeats_it if {
	d := data.stockade.decision with input as _send("bob@example.com", ["untrusted:get_webpage:c-5", "user"])
	d.outcome == "allow"
}

test_an_address_from_a_trusted_tool_is_allowed if {
	d := data.stockade.decision with input as _send("ops@example.com", ["tool:directory_lookup:c-2"])
	d.outcome == "allow"
}

test_an_address_of_unknown_origin_after_untrusted_content_needs_approval if {
	d := data.stockade.decision with input as _send("who@where.example", [])
	d.outcome == "require_approval"
	codes(d) == {"approval.unverified_destination"}
}

test_an_absent_optional_destination_is_not_checked if {
	d := data.stockade.decision with input as _send("bob@example.com", ["user"])
	not "cc" in object.keys(d)
	d.outcome == "allow"
}

test_each_recipient_in_a_list_needs_its_own_trusted_source if {
	i := object.union(_send("bob@example.com", ["user"]), {
		"args": {"to": "bob@example.com", "cc": ["alice@example.com", "mallory@evil.example"]},
		"values": {
			"to": [_v("to", ["user"])],
			"cc": [_v("cc[0]", ["user"]), _v("cc[1]", ["untrusted:read_email:c-3"])],
		},
	})
	d := data.stockade.decision with input as i
	d.outcome == "deny"
	codes(d) == {"provenance.untrusted_destination"}
	every r in d.reasons {
		contains(r.message, "cc[1]")
	}
}

test_a_list_of_recipients_the_user_gave_is_allowed if {
	i := object.union(_send("bob@example.com", ["user"]), {
		"args": {"to": "bob@example.com", "cc": ["alice@example.com"]},
		"values": {"to": [_v("to", ["user"])], "cc": [_v("cc[0]", ["user", "untrusted:read_email:c-3"])]},
	})
	d := data.stockade.decision with input as i
	d.outcome == "allow"
}

test_an_empty_list_of_recipients_is_nothing_to_check if {
	i := object.union(_send("bob@example.com", ["user"]), {
		"args": {"to": "bob@example.com", "cc": []},
		"values": {"to": [_v("to", ["user"])], "cc": []},
	})
	d := data.stockade.decision with input as i
	d.outcome == "allow"
}

test_a_present_destination_the_router_did_not_trace_is_held if {
	i := object.union(_send("bob@example.com", ["user"]), {"args": {"to": "bob@example.com", "cc": "x@y.example"}})
	d := data.stockade.decision with input as i
	d.outcome == "require_approval"
	codes(d) == {"approval.unverified_destination"}
}

test_an_endorsed_source_counts_as_trusted if {
	base := _send("carol@example.com", ["untrusted:read_file:c-7"])
	i := object.union(base, {"session": object.union(base.session, {"endorsed": ["untrusted:read_file:c-7"]})})
	d := data.stockade.decision with input as i
	d.outcome == "allow"
}

test_an_endorsement_of_another_source_does_not if {
	base := _send("mallory@evil.example", ["untrusted:get_webpage:c-8"])
	i := object.union(base, {"session": object.union(base.session, {"endorsed": ["untrusted:read_file:c-7"]})})
	d := data.stockade.decision with input as i
	d.outcome == "deny"
	codes(d) == {"provenance.untrusted_destination"}
}

test_a_link_from_untrusted_content_in_a_message_body_is_denied if {
	i := object.union(_send("bob@example.com", ["user"]), {
		"args": {"to": "bob@example.com", "body": "please log in at https://evil.example/login"},
		"values": {"to": [_v("to", ["user"])], "body": [{
			"path": "body", "key": "u:https://evil.example/login",
			"sources": ["untrusted:read_email:c-4"],
		}]},
	})
	d := data.stockade.decision with input as i
	d.outcome == "deny"
	codes(d) == {"provenance.untrusted_content"}
}

# A link in a body, seen in `sources`, on the mailer after `taint` (to: the user's address).
_body_link(taint, sources) := object.union(_input(_mailer, taint), {
	"args": {"to": "bob@example.com", "body": "please log in at https://evil.example/login"},
	"provenance": {"to": ["user"]},
	"values": {"to": [_v("to", ["user"])], "body": [{
		"path": "body", "key": "u:https://evil.example/login",
		"sources": sources,
	}]},
})

# The page may have written it full-width, defanged or past the indexing bound: seen nowhere is
# not safe after untrusted content.
test_a_link_of_unknown_origin_in_a_message_body_after_untrusted_content_is_held if {
	d := data.stockade.decision with input as _body_link(["untrusted_content"], [])
	d.outcome == "require_approval"
	codes(d) == {"approval.unverified_content"}
}

test_a_bare_name_with_a_dot_of_unknown_origin_in_a_message_body_is_allowed if {
	base := _body_link(["untrusted_content"], [])
	i := object.union(base, {"values": object.union(base.values, {"body": [{
		"path": "body", "key": "h:changelog.md",
		"sources": [],
	}]})})
	d := data.stockade.decision with input as i
	d.outcome == "allow"
}

test_a_link_of_unknown_origin_in_a_message_body_on_a_clean_session_is_allowed if {
	d := data.stockade.decision with input as _body_link([], [])
	d.outcome == "allow"
}

test_a_link_only_a_derived_output_holds_is_held if {
	d := data.stockade.decision with input as _body_link(["untrusted_content"], ["derived:parse_contact:c-3"])
	d.outcome == "require_approval"
	codes(d) == {"approval.unverified_content"}
}

test_a_link_of_unknown_origin_from_an_endorsed_source_is_allowed if {
	base := _body_link(["untrusted_content"], ["derived:parse_contact:c-3"])
	i := object.union(base, {"session": object.union(base.session, {"endorsed": ["derived:parse_contact:c-3"]})})
	d := data.stockade.decision with input as i
	d.outcome == "allow"
}

test_a_link_a_trusted_tool_returned_in_a_message_body_is_allowed if {
	d := data.stockade.decision with input as _body_link(["untrusted_content"], ["tool:search_docs:c-2"])
	d.outcome == "allow"
}

test_a_link_of_unknown_origin_in_a_body_of_an_inconsequential_tool_is_allowed if {
	i := object.union(_body_link(["untrusted_content"], []), {"tool": object.union(
		_tool([], "low"),
		{"destination_args": ["to", "cc"], "content_args": ["body"]},
	)})
	d := data.stockade.decision with input as i
	d.outcome == "allow"
}

test_a_link_the_user_gave_in_a_message_body_is_allowed if {
	i := object.union(_send("bob@example.com", ["user"]), {
		"args": {"to": "bob@example.com", "body": "the doc: https://docs.example/q3"},
		"values": {
			"to": [_v("to", ["user"])],
			"body": [{"path": "body", "key": "u:https://docs.example/q3", "sources": ["user"]}],
		},
	})
	d := data.stockade.decision with input as i
	d.outcome == "allow"
}

_invite := object.union(
	_tool(["mutates_state", "sends_external"], "medium"),
	{"destination_args": ["participants"], "content_args": ["title"]},
)

# An invite with no participants still has its content checked: the title an injection wrote
# carries a link only untrusted content gave.
test_a_link_in_the_title_of_an_invite_without_participants_is_denied if {
	i := object.union(_input(_invite, ["untrusted_content"]), {
		"args": {"title": "Verify your account at https://evil.example/sso before Friday"},
		"values": {"title": [{
			"path": "title", "key": "u:https://evil.example/sso",
			"sources": ["untrusted:read_email:c-4"],
		}]},
	})
	d := data.stockade.decision with input as i
	d.outcome == "deny"
	codes(d) == {"provenance.untrusted_content"}
}

_password_tool := object.union(_tool(["mutates_state"], "medium"), {"sensitive_args": ["new_password"]})

test_a_sensitive_value_from_untrusted_content_is_denied_on_any_tool if {
	i := object.union(_input(_password_tool, ["untrusted_content"]), {
		"args": {"new_password": "hunter2-from-the-mail"},
		"values": {"new_password": [_v("new_password", ["untrusted:read_email:c-2"])]},
	})
	d := data.stockade.decision with input as i
	d.outcome == "deny"
	codes(d) == {"provenance.untrusted_destination"}
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
	d := data.stockade.decision with input as _pay(["untrusted_content"], ["untrusted:read_file:c-9"], ["user"])
	d.outcome == "deny"
	codes(d) == {"provenance.untrusted_destination"}
}

test_a_payment_the_user_gave_is_allowed_without_a_human if {
	d := data.stockade.decision with input as _pay(["untrusted_content"], ["user"], ["user"])
	d.outcome == "allow"
}

test_a_payment_of_an_amount_nobody_gave_is_held_even_in_a_clean_session if {
	d := data.stockade.decision with input as _pay([], ["user"], [])
	d.outcome == "require_approval"
	codes(d) == {"approval.unverified_destination"}
}

test_a_payment_from_an_endorsed_bill_is_allowed if {
	base := _pay(["untrusted_content"], ["untrusted:read_file:c-9"], ["untrusted:read_file:c-9"])
	i := object.union(base, {"session": object.union(base.session, {"endorsed": ["untrusted:read_file:c-9"]})})
	d := data.stockade.decision with input as i
	d.outcome == "allow"
}

test_a_financial_tool_with_nothing_to_check_needs_approval if {
	d := data.stockade.decision with input as _input(_tool(["financial"], "low"), [])
	d.outcome == "require_approval"
	codes(d) == {"approval.financial"}
}

test_send_external_on_clean_session_is_allowed if {
	d := data.stockade.decision with input as _input(_tool(["sends_external"], "medium"), [])
	d.outcome == "allow"
}

test_send_external_after_untrusted_without_destination_args_needs_approval if {
	d := data.stockade.decision with input as _input(_tool(["sends_external"], "medium"), ["untrusted_content"])
	d.outcome == "require_approval"
	codes(d) == {"approval.external_after_untrusted"}
}

test_a_present_destination_with_no_value_to_check_after_untrusted_content_is_held if {
	every to in [[[]], [{}], {"x": []}, null] {
		i := object.union(_send("bob@example.com", ["user"]), {"args": {"to": to}, "values": {"to": []}})
		d := data.stockade.decision with input as i
		d.outcome == "require_approval"
		codes(d) == {"approval.unverified_destination"}
	}
}

test_an_empty_content_argument_is_not_held if {
	i := object.union(_send("bob@example.com", ["user"]), {
		"args": {"to": "bob@example.com", "body": ""},
		"values": {"to": [_v("to", ["user"])], "body": []},
	})
	d := data.stockade.decision with input as i
	d.outcome == "allow"
}
