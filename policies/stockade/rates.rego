# Rate limits are data: catalog.rate_limits maps a window of input.rate
# (<scope>_per_<minute|hour|day>) to the most calls it may count, the call itself included.
package stockade

import data.stockade.catalog

deny_reasons contains {
	"code": "rate.exceeded",
	"message": sprintf(
		"%d calls in the last %s (%s), over the limit of %d",
		[count_now, window_period(window), window, limit],
	),
} if {
	some window, limit in catalog.rate_limits
	count_now := object.get(object.get(input, "rate", {}), window, 0)
	count_now > limit
}

# The period a window looks back over: `agent_per_hour` is an hour.
window_period(window) := period if {
	parts := split(window, "_per_")
	period := parts[count(parts) - 1]
}
