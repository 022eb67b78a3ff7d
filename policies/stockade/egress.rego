# The network a tool asks for: every host must be in catalog.egress_allowlist. What it asked
# for is what the egress obligation grants.
package stockade

import data.stockade.catalog

deny_reasons contains {
	"code": "egress.not_allowlisted",
	"message": sprintf("egress to %s:%v is not in the catalog's egress_allowlist", [rule.host, rule.port]),
} if {
	some rule in requested_egress
	not is_allowlisted_host(rule.host)
}

requested_egress := object.get(input.tool, "egress", [])

is_allowlisted_host(host) if lower(host) in catalog.egress_allowlist
