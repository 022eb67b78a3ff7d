# METADATA
# title: stockade decision
# description: >-
#   The entrypoint the router evaluates for every tool call. Default deny. Low and medium
#   risk tools with a known capability set are allowed; high and critical risk, financial
#   tools, and sending externally after the session read untrusted content need a human.
#   Reason codes are stable and documented in docs/policy.md.
package stockade

# The catalog is data (policies/stockade/data.json): security teams edit it, not this file.
import data.stockade.catalog

tool_capabilities := {c | some c in input.tool.capabilities}

# METADATA
# description: The safe answer when nothing below applies.
default decision := {
	"outcome": "deny",
	"reasons": [{"code": "policy.default_deny", "message": "no rule allows this call"}],
	"obligations": {},
}

decision := {"outcome": "deny", "reasons": sorted_reasons(deny_reasons), "obligations": {}} if {
	count(deny_reasons) > 0
}

decision := {
	"outcome": "require_approval",
	"reasons": sorted_reasons(approval_reasons),
	"obligations": obligations,
} if {
	count(deny_reasons) == 0
	count(approval_reasons) > 0
}

decision := {"outcome": "allow", "reasons": [], "obligations": obligations} if {
	count(deny_reasons) == 0
	count(approval_reasons) == 0
	is_auto_allowed
}

sorted_reasons(reasons) := [r | some r in reasons]

is_auto_allowed if input.tool.risk in catalog.auto_allow_risks

is_known_capability_set if {
	some allowed in catalog.capability_sets
	{c | some c in allowed} == tool_capabilities
}

has_read_untrusted if "untrusted_content" in input.session.taint

# METADATA
# description: Reasons that deny the call outright.
deny_reasons contains {"code": "capability.unknown", "message": sprintf("unknown capability %q", [c])} if {
	some c in tool_capabilities
	not c in catalog.capabilities
}

deny_reasons contains {"code": "risk.unknown", "message": sprintf("unknown risk level %q", [input.tool.risk])} if {
	not input.tool.risk in catalog.risks
}

deny_reasons contains {
	"code": "capability.combination_denied",
	"message": sprintf("capability set %v is not in the catalog", [sort(tool_capabilities)]),
} if {
	every c in tool_capabilities {
		c in catalog.capabilities
	}
	not is_known_capability_set
}

# METADATA
# description: Reasons that hold the call for a human.
approval_reasons contains {"code": "approval.high_risk", "message": sprintf("tool risk is %s", [input.tool.risk])} if {
	input.tool.risk in catalog.approval_risks
}

approval_reasons contains {"code": "approval.financial", "message": "financial tools need a human"} if {
	"financial" in tool_capabilities
}

approval_reasons contains {
	"code": "approval.external_after_untrusted",
	"message": "sending externally after the session read untrusted content",
} if {
	"sends_external" in tool_capabilities
	has_read_untrusted
}

# METADATA
# description: Limits are the tool's defaults (or the catalog's) capped by the catalog's maxima.
obligations := {"limits": limits, "egress": [], "credentials": []}

limits := {name: capped_limit(name, maximum) | some name, maximum in catalog.limits.max}

capped_limit(name, maximum) := min([object.get(input.tool.limits, name, catalog.limits.default[name]), maximum])
