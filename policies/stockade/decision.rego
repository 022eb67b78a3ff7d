# METADATA
# title: stockade
# description: >-
#   The shipped policy. Default deny. Low and medium risk tools are allowed unless a dangerous
#   capability set, or the provenance of a value they send, pay or set, says otherwise; high and
#   critical risk, values with no trusted source after untrusted content (or in any payment)
#   need a human. Each rule area is a file of this package that adds to deny_reasons,
#   approval_reasons or session_labels; this file only aggregates them. Every reason code is
#   in data.stockade.reasons (policies/stockade/reasons/data.json); docs/policy-authoring.md
#   says how to add a rule.
# scope: package
package stockade

# The catalog is data (policies/stockade/data.json): security teams edit it, not the rules.
import data.stockade.catalog

# METADATA
# title: decision
# description: >-
#   The entrypoint the router evaluates for every tool call. Any deny reason denies; else any
#   approval reason holds the call for a human, unless an approval covers every one of them;
#   else a risk the catalog auto-allows is allowed; else the default deny.
# scope: document
# entrypoint: true
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

# A human approved exactly this call (the router checks the binding) for every reason it needs
# approval for now. An approval never lifts a deny.
decision := {"outcome": "allow", "reasons": [], "obligations": obligations} if {
	count(deny_reasons) == 0
	count(approval_reasons) > 0
	is_approved
}

# METADATA
# description: Every reason the call needs approval for now is one the human approved.
is_approved if {
	input.approval.status == "approved"
	every reason in approval_reasons {
		reason.code in input.approval.reasons
	}
}

sorted_reasons(reasons) := [r | some r in reasons]

# METADATA
# description: >-
#   What the router must enforce if the call runs. Limits, the sandbox tier, egress and
#   credentials come from sandbox.rego, egress.rego and credentials.rego; session_labels
#   from every rule area that adds to it.
obligations := {
	"limits": limits,
	"egress": requested_egress,
	"credentials": granted_credentials,
	"sandbox": sandbox,
	"session_labels": sort(session_labels),
}

# The three sets below are declared here, adding nothing, so the entrypoint reads them whatever
# rule areas there are.

# METADATA
# title: deny_reasons
# description: >-
#   Reasons that deny the call outright: {"code", "message"}, each code in data.stockade.reasons
#   with outcome deny. Rule areas add to it.
# scope: document
deny_reasons contains reason if some reason in set()

# METADATA
# title: approval_reasons
# description: >-
#   Reasons that hold the call for a human: {"code", "message"}, each code in
#   data.stockade.reasons with outcome require_approval. Rule areas add to it.
# scope: document
approval_reasons contains reason if some reason in set()

# METADATA
# title: session_labels
# description: >-
#   Labels the router adds to the session once the call is allowed; later decisions see them
#   in input.session.labels. Rule areas add to it; the shipped policy adds none.
# scope: document
session_labels contains label if some label in set()
