# The credentials a tool asks for: each must be in catalog.credentials with every scope it
# asks for. Granted with the catalog's TTL (the router caps it again by the operator's
# configuration).
package stockade

import data.stockade.catalog

deny_reasons contains {
	"code": "credential.not_allowlisted",
	"message": sprintf("credential %s is not in the catalog's credentials", [request.name]),
} if {
	some request in requested_credentials
	not is_catalogued_credential(request.name)
}

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

is_catalogued_credential(name) if object.get(catalog.credentials, name, null) != null

requested_credentials := object.get(input.tool, "credentials", [])

# The catalog is iterated rather than indexed (`catalog.credentials[name]`): the RVM and the
# interpreter disagreed on the index when the object was empty (docs/design-notes.md).
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
