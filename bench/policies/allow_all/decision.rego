# METADATA
# title: allow-all baseline (bench/injection.py)
# description: >-
#   No policy at all: every call is allowed, with empty obligations (the tool's own limits, no
#   egress, no credentials, the tool's own sandbox tier). The lower bound of protection.
package stockade

decision := {
	"outcome": "allow",
	"reasons": [],
	"obligations": {"limits": {}, "egress": [], "credentials": [], "sandbox": {}},
}
