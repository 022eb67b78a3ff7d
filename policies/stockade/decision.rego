# METADATA
# title: stockade decision
# description: >-
#   The entrypoint the router evaluates for every tool call. Default deny. Low and medium
#   risk tools are allowed unless a dangerous capability set, or the provenance of a value they
#   send, pay or set, says otherwise; high and critical risk, values with no trusted source
#   after untrusted content (or in any payment) need a human. Reason codes are stable and
#   documented in docs/policy.md.
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
	not is_approved
}

decision := {"outcome": "allow", "reasons": [], "obligations": obligations} if {
	count(deny_reasons) == 0
	count(approval_reasons) == 0
	is_auto_allowed
}

# METADATA
# description: >-
#   A human approved exactly this call (the router checks the binding) for every reason it
#   needs approval for now. An approval never lifts a deny.
decision := {"outcome": "allow", "reasons": [], "obligations": obligations} if {
	count(deny_reasons) == 0
	count(approval_reasons) > 0
	is_approved
}

is_approved if {
	input.approval.status == "approved"
	every reason in approval_reasons {
		reason.code in input.approval.reasons
	}
}

sorted_reasons(reasons) := [r | some r in reasons]

is_auto_allowed if input.tool.risk in catalog.auto_allow_risks

has_read_untrusted if "untrusted_content" in input.session.taint

# METADATA
# description: Reasons that deny the call outright.
deny_reasons contains {"code": "capability.unknown", "message": sprintf("unknown capability %q", [c])} if {
	some c in tool_capabilities
	not c in catalog.capabilities
}

# The message is built from values that are always defined: an undefined one would drop the
# reason on the interpreter but not on the RVM.
deny_reasons contains {
	"code": "risk.unknown",
	"message": sprintf("unknown risk level %v", [object.get(object.get(input, "tool", {}), "risk", null)]),
} if {
	not input.tool.risk in catalog.risks
}

# METADATA
# description: >-
#   A tool that holds, by itself, every capability of a set the catalog names dangerous (the
#   lethal trifecta in one tool: argument checks cannot split what one call does inside). Honest
#   descriptions are otherwise accepted: any other combination is decided call by call.
deny_reasons contains {
	"code": "capability.combination_denied",
	"message": sprintf("a tool with all of %v is refused: split it into tools that each do one of them", [sort(denied)]),
} if {
	some denied in catalog.denied_capability_sets
	every c in denied {
		c in tool_capabilities
	}
}

# METADATA
# description: Reasons that hold the call for a human.
approval_reasons contains {"code": "approval.high_risk", "message": sprintf("tool risk is %s", [input.tool.risk])} if {
	input.tool.risk in catalog.approval_risks
}

approval_reasons contains {
	"code": "approval.financial",
	"message": "a financial tool with no destination or amount argument to check needs a human",
} if {
	"financial" in tool_capabilities
	count(watched_args) == 0
}

approval_reasons contains {
	"code": "approval.external_after_untrusted",
	"message": "sending externally after untrusted content, with no destination argument to check",
} if {
	"sends_external" in tool_capabilities
	has_read_untrusted
	count(watched_args) == 0
}

deny_reasons contains {
	"code": "rate.exceeded",
	"message": sprintf("%d calls in the last minute (%s), over the limit of %d", [count_now, window, limit]),
} if {
	some window, limit in catalog.rate_limits
	count_now := object.get(object.get(input, "rate", {}), window, 0)
	count_now > limit
}

# METADATA
# description: >-
#   The lethal trifecta, value by value: a destination, amount or sensitive value of a
#   consequential call (every sensitive value, whatever the tool) that was seen only in untrusted
#   content is denied; each element of a list is its own value. Values the user gave, trusted
#   tools returned, or a human endorsed pass.
deny_reasons contains {
	"code": "provenance.untrusted_destination",
	"message": sprintf("argument %q (%s) came only from untrusted content: %v", [arg, item.path, item.sources]),
} if {
	some arg in checked_args
	some item in arg_values(arg)
	is_untrusted_only(item)
}

# METADATA
# description: >-
#   A link, address or account inside the text a consequential call sends (a phishing URL in a
#   message body) that was seen only in untrusted content.
deny_reasons contains {
	"code": "provenance.untrusted_content",
	"message": sprintf("argument %q carries %s, seen only in untrusted content: %v", [arg, item.key, item.sources]),
} if {
	is_consequential
	some arg in object.get(input.tool, "content_args", [])
	some item in arg_values(arg)
	is_untrusted_only(item)
}

# METADATA
# description: >-
#   A value with no trusted source, where one is needed: after untrusted content, or for any
#   payment (money moves only to what the user gave, a trusted tool returned, or a human endorsed).
approval_reasons contains {
	"code": "approval.unverified_destination",
	"message": sprintf("argument %q (%s) has no trusted source", [arg, item.path]),
} if {
	needs_verified_values
	some arg in checked_args
	some item in arg_values(arg)
	not has_trusted_source(item)
	not is_untrusted_only(item)
}

approval_reasons contains {
	"code": "approval.unverified_destination",
	"message": sprintf("argument %q was not traced (no value entry for it in input.values)", [arg]),
} if {
	needs_verified_values
	some arg in checked_args
	arg in object.keys(input.args)
	not arg in object.keys(object.get(input, "values", {}))
}

needs_verified_values if has_read_untrusted

needs_verified_values if "financial" in tool_capabilities

is_consequential if {
	some c in tool_capabilities
	c in catalog.consequential_capabilities
}

watched_args contains arg if some arg in object.get(input.tool, "destination_args", [])

watched_args contains arg if some arg in object.get(input.tool, "amount_args", [])

watched_args contains arg if some arg in object.get(input.tool, "sensitive_args", [])

checked_args contains arg if {
	is_consequential
	some arg in watched_args
}

checked_args contains arg if some arg in object.get(input.tool, "sensitive_args", [])

arg_values(arg) := object.get(object.get(input, "values", {}), arg, [])

has_trusted_source(item) if {
	some source in item.sources
	is_trusted_source(source)
}

is_trusted_source(source) if source == "user"

is_trusted_source(source) if startswith(source, "tool:")

is_trusted_source(source) if source in object.get(input.session, "endorsed", [])

is_untrusted_only(item) if {
	some source in item.sources
	startswith(source, "untrusted:")
	not has_trusted_source(item)
}

deny_reasons contains {
	"code": "egress.not_allowlisted",
	"message": sprintf("egress to %s:%v is not in the catalog's egress_allowlist", [rule.host, rule.port]),
} if {
	some rule in requested_egress
	not is_allowlisted_host(rule.host)
}

deny_reasons contains {
	"code": "credential.not_allowlisted",
	"message": sprintf("credential %s is not in the catalog's credentials", [request.name]),
} if {
	some request in requested_credentials
	not is_catalogued_credential(request.name)
}

is_catalogued_credential(name) if object.get(catalog.credentials, name, null) != null

deny_reasons contains {
	"code": "credential.scope_not_allowlisted",
	"message": sprintf("scope %s of credential %s is not in the catalog", [scope, request.name]),
} if {
	some request in requested_credentials
	some name, allowed in catalog.credentials
	name == request.name
	some scope in object.get(request, "scopes", [])
	not scope in object.get(allowed, "scopes", [])
}

# METADATA
# description: >-
#   Limits are the tool's defaults (or the catalog's) capped by the catalog's maxima. Egress is
#   what the tool asked for, every host of it allowlisted. Credentials are what the tool asked
#   for, each with the catalog's TTL (the router caps it again by the operator's configuration).
#   The sandbox tier is raised to the strongest one any of the tool's capabilities requires.
obligations := {"limits": limits, "egress": requested_egress, "credentials": granted_credentials, "sandbox": sandbox}

requested_credentials := object.get(input.tool, "credentials", [])

granted_credentials := [grant |
	some request in requested_credentials
	some name, allowed in catalog.credentials
	name == request.name
	grant := {
		"name": request.name,
		"scopes": object.get(request, "scopes", []),
		"ttl_s": object.get(allowed, "ttl_s", 60),
	}
]

requested_egress := object.get(input.tool, "egress", [])

is_allowlisted_host(host) if lower(host) in catalog.egress_allowlist

required_tiers contains tier if {
	some c in tool_capabilities
	tier := catalog.min_tier_by_capability[c]
}

default sandbox := {}

sandbox := {"min_tier": catalog.tiers[max({i | some i, tier in catalog.tiers; tier in required_tiers})]} if {
	count(required_tiers) > 0
}

limits := {name: capped_limit(name, maximum) | some name, maximum in catalog.limits.max}

capped_limit(name, maximum) := min([object.get(input.tool.limits, name, catalog.limits.default[name]), maximum])
