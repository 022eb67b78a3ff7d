# What a tool says it can do: capabilities the catalog does not know, and a dangerous set in
# one tool. (A capability held for a human because the tool names nothing to check is in
# provenance.rego, with the checks it stands in for.)
package stockade

import data.stockade.catalog

tool_capabilities := {c | some c in input.tool.capabilities}

deny_reasons contains {"code": "capability.unknown", "message": sprintf("unknown capability %q", [c])} if {
	some c in tool_capabilities
	not c in catalog.capabilities
}

# METADATA
# description: >-
#   A tool that holds, by itself, every capability of a set the catalog names dangerous (the
#   lethal trifecta in one tool: argument checks cannot split what one call does inside). Honest
#   descriptions are otherwise accepted: any other combination is decided call by call.
# scope: rule
deny_reasons contains {
	"code": "capability.combination_denied",
	"message": sprintf(
		"a tool with all of %v is refused: split it into tools that each do one of them",
		[sort(denied)],
	),
} if {
	some denied in catalog.denied_capability_sets
	every c in denied {
		c in tool_capabilities
	}
}
