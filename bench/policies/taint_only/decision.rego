# METADATA
# title: session-taint baseline (bench/injection.py)
# description: >-
#   The classic rule: once the session has read untrusted content, every call to a tool with a
#   consequential capability (sends_external, financial, mutates_state) needs a human; a call a
#   human approved goes ahead. Everything else is allowed. No provenance, no risk levels.
package stockade

consequential := {"sends_external", "financial", "mutates_state"}

obligations := {"limits": {}, "egress": [], "credentials": [], "sandbox": {}}

# A default must be a constant: the obligations are spelled out again.
default decision := {
	"outcome": "allow",
	"reasons": [],
	"obligations": {"limits": {}, "egress": [], "credentials": [], "sandbox": {}},
}

decision := {
	"outcome": "require_approval",
	"reasons": [{
		"code": "approval.consequential_after_untrusted",
		"message": "a consequential call after the session read untrusted content",
	}],
	"obligations": obligations,
} if {
	needs_human
	not approved
}

needs_human if {
	"untrusted_content" in input.session.taint
	some c in input.tool.capabilities
	c in consequential
}

approved if input.approval.status == "approved"
