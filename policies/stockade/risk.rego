# The risk a tool declares: unknown levels are denied, the catalog's approval risks need a
# human, and only the catalog's auto-allow risks pass with no reason at all.
package stockade

import data.stockade.catalog

# The message is built from values that are always defined: an undefined one would drop the
# reason on the interpreter but not on the RVM.
deny_reasons contains {
	"code": "risk.unknown",
	"message": sprintf("unknown risk level %v", [object.get(object.get(input, "tool", {}), "risk", null)]),
} if {
	not input.tool.risk in catalog.risks
}

approval_reasons contains {"code": "approval.high_risk", "message": sprintf("tool risk is %s", [input.tool.risk])} if {
	input.tool.risk in catalog.approval_risks
}

is_auto_allowed if input.tool.risk in catalog.auto_allow_risks
