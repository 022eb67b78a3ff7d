# How the call runs: limits are the tool's defaults (or the catalog's) capped by the
# catalog's maxima; the sandbox tier is raised to the strongest one any of the tool's
# capabilities requires (catalog.min_tier_by_capability).
#
# Every limit in catalog.limits.max is granted. One absent from catalog.limits.default defaults
# to its maximum: left undefined, it would drop out of the obligation, and the call would run
# uncapped.
package stockade

import data.stockade.catalog

limits := {name: capped_limit(name, maximum) | some name, maximum in catalog.limits.max}

capped_limit(name, maximum) := min([
	object.get(input.tool.limits, name, object.get(catalog.limits.default, name, maximum)),
	maximum,
])

required_tiers contains tier if {
	some c in tool_capabilities
	tier := catalog.min_tier_by_capability[c]
}

default sandbox := {}

sandbox := {"min_tier": catalog.tiers[max({i | some i, tier in catalog.tiers; tier in required_tiers})]} if {
	count(required_tiers) > 0
}
