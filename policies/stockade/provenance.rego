# The lethal trifecta, value by value. The router tells policy where each value of a
# destination, amount, sensitive or content argument was seen before in the session
# (input.values); a value seen only in untrusted content is denied, one with no trusted
# source is held where one is needed (an identifier in a content argument: after untrusted
# content). Sources: user, tool:<name>:<call>, untrusted:<name>:<call>, derived:<name>:<call>
# (neither trusted nor untrusted: a trusted tool's output from an argument with no trusted source,
# after untrusted content), and any source a human endorsed for the session (input.session.endorsed).
package stockade

import data.stockade.catalog

# METADATA
# description: >-
#   A destination, amount or sensitive value of a consequential call (every sensitive value,
#   whatever the tool) that was seen only in untrusted content; each element of a list is its
#   own value. Values the user gave, trusted tools returned, or a human endorsed pass.
# scope: rule
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
# scope: rule
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
#   A link, address or account inside the text a consequential call sends after untrusted
#   content, with no trusted source and not seen only in untrusted content: the page may have
#   written it in a form no matcher reads (full-width, an HTML entity, defanged, encoded, in
#   pieces) or past the indexing bound, so "seen nowhere" is not "safe".
# scope: rule
approval_reasons contains {
	"code": "approval.unverified_content",
	"message": sprintf("argument %q carries %s, which has no trusted source", [arg, item.key]),
} if {
	is_consequential
	has_read_untrusted
	some arg in object.get(input.tool, "content_args", [])
	some item in arg_values(arg)
	not has_trusted_source(item)
	not is_untrusted_only(item)

	# A bare name with a dot ("see CHANGELOG.md", "Node.js") is most often a file or a product,
	# not a place: held, it would stop ordinary mail. A URL or address is never bare.
	not is_bare_name(item)
}

is_bare_name(item) if {
	key := object.get(item, "key", null)
	is_string(key)
	startswith(key, "h:")
}

# METADATA
# description: >-
#   A value with no trusted source, where one is needed: after untrusted content, or for any
#   payment (money moves only to what the user gave, a trusted tool returned, or a human endorsed).
# scope: rule
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

# METADATA
# description: A present argument the router did not trace is held, never passed.
# scope: rule
approval_reasons contains {
	"code": "approval.unverified_destination",
	"message": sprintf("argument %q was not traced (no value entry for it in input.values)", [arg]),
} if {
	needs_verified_values
	some arg in checked_args
	arg in object.keys(input.args)
	not arg in object.keys(object.get(input, "values", {}))
}

# METADATA
# description: >-
#   A present argument that is not empty, yet came with no value to check (nested empty
#   containers, or a shape the router could not take apart), is held, never passed: "nothing
#   was checked" is not "checked". Only an empty list or map itself names nothing.
# scope: rule
approval_reasons contains {
	"code": "approval.unverified_destination",
	"message": sprintf("argument %q has no value policy could check", [arg]),
} if {
	needs_verified_values
	some arg in checked_args
	arg in object.keys(object.get(input, "values", {}))
	count(arg_values(arg)) == 0
	not is_empty_container(object.get(input.args, arg, null))
}

# METADATA
# description: A payment tool that names no argument these rules could check.
# scope: rule
approval_reasons contains {
	"code": "approval.financial",
	"message": "a financial tool with no destination or amount argument to check needs a human",
} if {
	"financial" in tool_capabilities
	count(watched_args) == 0
}

# METADATA
# description: A send after untrusted content, by a tool that names no destination to check.
# scope: rule
approval_reasons contains {
	"code": "approval.external_after_untrusted",
	"message": "sending externally after untrusted content, with no destination argument to check",
} if {
	"sends_external" in tool_capabilities
	has_read_untrusted
	count(watched_args) == 0
}

has_read_untrusted if "untrusted_content" in input.session.taint

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

is_empty_container(value) if value == []

is_empty_container(value) if value == {}

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
