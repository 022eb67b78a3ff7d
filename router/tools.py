"""The tool registry: `ToolSpec` (what a framework registers) and argument validation.

Arguments are checked against the tool's JSON Schema (Draft 2020-12, formats checked) before
anything else happens; each problem is reported with the field's path (``args.to``). Before any
of that (and before anything recursive sees them) their nesting is checked, without recursion,
against `MAX_NESTING`: JSON's parser, the schema validator, the audit log and the policy engine
all recurse, and a value a thousand levels deep would stop each of them with a RecursionError.

Names are checked whole (``re.fullmatch``): ``$`` would also match before a final newline, and
``"lookup\n"`` would pass for a plain name.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Mapping
from itertools import accumulate
from typing import Any

import re2
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import ValidationError as SchemaError
from pydantic import ValidationError

from policy import ToolInfo
from policy.base import CredentialRequest, EgressRequest, unfaithful_value
from router.errors import DuplicateTool, FieldProblem, InvalidCall, InvalidToolSpec, ToolNotFound
from router.text import check_text, first_invalid_text
from router.wire import (
    MAX_NESTING,
    TOOL_NAME,
    Capability,
    CommandExecutor,
    CredentialRef,
    EgressSpec,
    Executor,
    ExternalExecutor,
    OutputSpec,
    PythonExecutor,
    Risk,
    SandboxDefaults,
    ToolLimits,
    ToolSpec,
    canonical_tool_name,
    nesting_depth,
    show,
)
from router.wire import PLACEHOLDER as _PLACEHOLDER

# The models are defined in router.wire (pydantic only, so the SDK can import them) and re-exported here.
__all__ = [
    "MAX_NESTING",
    "TOOL_NAME",
    "Capability",
    "CommandExecutor",
    "CredentialRef",
    "EgressSpec",
    "Executor",
    "ExternalExecutor",
    "OutputSpec",
    "PythonExecutor",
    "RegisteredTool",
    "Risk",
    "SandboxDefaults",
    "ToolLimits",
    "ToolRegistry",
    "ToolSpec",
    "check_nesting",
    "command_argv",
    "json_too_deep",
    "nesting_depth",
    "parse_args",
    "show",
    "validate_args",
]

_MAX_PROBLEMS = 10
# JSON text: a string (escapes included; an unterminated one runs to the end), or a bracket.
_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]++")
_SQUARE = str.maketrans("{}", "[]")
_BRACKET_STEP = {"[": 1, "]": -1}
_PEEL_ROUNDS = 8  # cheap passes (str.replace) before the exact, slower one (a running sum)


# A schema's regular expressions (`pattern`, `patternProperties`) are matched with RE2, in time
# linear in the text: with Python's backtracking re, a pattern like ^(a+)+$ and a 40-character
# argument would hold the router's event loop for hours. RE2 has no lookaround and no
# backreferences, so a schema using them is refused at registration, saying so. (ECMA-262, which
# JSON Schema names, agrees with RE2 where Python's re does not: \d and \w are ASCII, and $ does
# not match before a final newline.)
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a refused pattern is the caller's error, not a log line on stderr
# Keys whose values are data, not schemas: a {"pattern": ...} there is not a regular expression.
_SCHEMA_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})


@functools.lru_cache(maxsize=4096)
def _linear(pattern: str) -> Any:
    """``pattern`` compiled by RE2 (``re2.error`` if RE2 cannot match it in linear time)."""
    return re2.compile(pattern, _RE2_OPTIONS)


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[SchemaError]:
    if validator.is_type(instance, "string") and not _linear(pattern).search(instance):
        # The value cut short: a long one would push the reason past what an error message shows.
        yield SchemaError(f"{show(instance)} does not match {show(pattern, 120)}")


def _pattern_properties(validator: Any, patterns: dict[str, Any], instance: Any, schema: Any) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        regex = _linear(pattern)
        for key, value in instance.items():
            if regex.search(key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


_ADDITIONAL_PROPERTIES = Draft202012Validator.VALIDATORS["additionalProperties"]


def _additional_properties(validator: Any, additional: Any, instance: Any, schema: Any) -> Iterator[Any]:
    """jsonschema's own, given the instance without the properties `patternProperties` match (by
    RE2): it would match them with Python's re."""
    patterns = schema.get("patternProperties")
    if patterns and validator.is_type(instance, "object"):
        compiled = [_linear(pattern) for pattern in patterns]
        instance = {k: v for k, v in instance.items() if not any(regex.search(k) for regex in compiled)}
        schema = {k: v for k, v in schema.items() if k != "patternProperties"}
    yield from _ADDITIONAL_PROPERTIES(validator, additional, instance, schema)


_LinearValidator = validators.extend(Draft202012Validator, {  # type: ignore[no-untyped-call]
    "pattern": _pattern, "patternProperties": _pattern_properties, "additionalProperties": _additional_properties,
})  # fmt: skip


def check_patterns(schema: Any) -> None:
    """Refuse a schema whose regular expressions RE2 cannot match (see `_linear`), or that lets
    `unevaluatedProperties` reach `patternProperties` (jsonschema would match those with Python's re).

    Raises:
        InvalidToolSpec: naming the pattern and why.
    """
    stack: list[tuple[Any, str]] = [(schema, "input_schema")]
    found: set[str] = set()
    while stack:
        node, where = stack.pop()
        if isinstance(node, list):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        patterns = [(node["pattern"], f"{where}.pattern")] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            found.add("patternProperties")
            patterns += [(key, f"{where}.patternProperties") for key in node["patternProperties"]]
        if "unevaluatedProperties" in node:
            found.add("unevaluatedProperties")
        for pattern, at in patterns:
            try:
                _linear(pattern)
            except re2.error as exc:
                why = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
                raise InvalidToolSpec(
                    f"invalid tool spec: {at}: {show(pattern)} cannot be matched in linear time ({why}): patterns "
                    "are matched with RE2, which has no lookaround or backreferences; rewrite it without them"
                ) from None
        stack.extend((child, f"{where}.{key}") for key, child in node.items() if key not in _SCHEMA_DATA_KEYS)
    if found == {"patternProperties", "unevaluatedProperties"}:
        raise InvalidToolSpec(
            "invalid tool spec: input_schema uses unevaluatedProperties with patternProperties, whose patterns "
            "would then be matched by a backtracking engine: use additionalProperties instead"
        )


class RegisteredTool:
    """A registered `ToolSpec` with its compiled validator and what policy sees of it (built once,
    not per call)."""

    __slots__ = ("policy_view", "spec", "validator")

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.validator = _LinearValidator(spec.input_schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
        self.policy_view = ToolInfo(
            name=spec.name, capabilities=list(spec.capabilities), risk=spec.risk,
            limits=spec.sandbox.limits.model_dump(), executor=spec.executor.kind, tier=spec.sandbox.tier,
            egress=[EgressRequest.model_validate(e.model_dump()) for e in spec.sandbox.egress],
            credentials=[CredentialRequest.model_validate(c.model_dump()) for c in spec.credentials],
            destination_args=spec.destination_args, amount_args=spec.amount_args,
            content_args=spec.content_args, sensitive_args=spec.sensitive_args,
        )  # fmt: skip


class ToolRegistry:
    """The tools this router knows, by name; at most one per canonical name (`canonical_tool_name`)."""

    def __init__(self) -> None:
        self._tools: dict[str, RegisteredTool] = {}
        self._canonical: dict[str, str] = {}  # canonical name -> the registered name

    def register(self, spec: ToolSpec | Mapping[str, Any]) -> ToolSpec:
        """Add a tool.

        Raises:
            InvalidToolSpec: the spec is malformed (the message lists each field).
            DuplicateTool: a tool of that name, or of a name differing only in case or ``-``/``_``
                (``Send_Email`` when ``send_email`` is registered), is already registered.
        """
        tool = self.prepare(spec)
        self.add(tool)
        return tool.spec

    def prepare(self, spec: ToolSpec | Mapping[str, Any]) -> RegisteredTool:
        """A tool validated and compiled, not yet added (so policy can look at it first). Raises as
        `register`."""
        # Text UTF-8 cannot hold (a lone surrogate) anywhere in the spec, a schema's property name
        # or pattern too: no store, audit record or policy input could take the tool.
        where = first_invalid_text(spec.model_dump() if isinstance(spec, ToolSpec) else dict(spec), "spec")
        if where is not None:
            raise InvalidToolSpec(f"invalid tool spec: {where} holds a lone surrogate, which is not Unicode text: "
                                  "send valid UTF-8")  # fmt: skip
        if not isinstance(spec, ToolSpec):
            try:
                spec = ToolSpec.model_validate(spec)
            except ValidationError as exc:
                problems = [
                    f"{'.'.join(str(p) for p in e['loc']) or '(spec)'}: {e['msg']}"
                    for e in exc.errors()[:_MAX_PROBLEMS]
                ]
                raise InvalidToolSpec("invalid tool spec: " + "; ".join(problems)) from exc
        check_patterns(spec.input_schema)
        self._check_free(spec.name)
        return RegisteredTool(spec)

    def add(self, tool: RegisteredTool) -> None:
        """Add a `prepare`d tool. Raises `DuplicateTool`."""
        self._check_free(tool.spec.name)
        self._tools[tool.spec.name] = tool
        self._canonical[canonical_tool_name(tool.spec.name)] = tool.spec.name

    def _check_free(self, name: str) -> None:
        if name in self._tools:
            raise DuplicateTool(f"tool {name!r} is already registered; pick another name or unregister it first")
        taken = self._canonical.get(canonical_tool_name(name))
        if taken is not None:
            raise DuplicateTool(
                f"tool {name!r} differs from the registered tool {taken!r} only in case or '-'/'_', which a model "
                "or a reader would take for the same tool; pick a distinct name"
            )

    def unregister(self, name: str) -> None:
        """Remove a tool; unknown names raise `ToolNotFound`."""
        if self._tools.pop(name, None) is None:
            raise ToolNotFound(f"no tool named {show(name)} is registered")
        self._canonical.pop(canonical_tool_name(name), None)

    def get(self, name: object) -> RegisteredTool:
        """The tool called ``name``.

        Raises:
            InvalidCall: ``name`` is not a plain tool name (path characters, wrong type).
            ToolNotFound: no such tool.
        """
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise InvalidCall(
                f"tool name {show(name)} is not a valid tool name: use letters, digits, '_' or '-' only",
                [FieldProblem("tool", "not a valid tool name")],
            )
        tool = self._tools.get(name)
        if tool is None:
            known = ", ".join(sorted(self._tools)[:20]) or "none"
            raise ToolNotFound(f"no tool named {name!r} is registered (registered: {known})")
        return tool

    def list(self) -> list[ToolSpec]:
        return [t.spec for t in self._tools.values()]

    def names(self) -> set[str]:
        return set(self._tools)


def parse_args(tool: str, raw: Mapping[str, Any] | str | bytes, max_bytes: int) -> tuple[dict[str, Any], str]:
    """Arguments as a JSON object, and their canonical JSON text.

    Raises:
        InvalidCall: not JSON, not an object, not JSON-serialisable, over ``max_bytes``, or nested
            deeper than `MAX_NESTING` (checked before anything recursive sees the value).
    """
    if isinstance(raw, str | bytes):
        if len(raw) > max_bytes:
            raise _too_big(tool, len(raw), max_bytes)
        try:
            # As json.loads reads bytes, so the depth is measured on the text it will parse.
            text = raw.decode(json.detect_encoding(raw), "surrogatepass") if isinstance(raw, bytes) else raw
            if json_too_deep(text):
                raise _too_deep(tool)
            value = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            where = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
            raise InvalidCall(
                f'arguments for {tool!r} are not valid JSON{where}: send a JSON object such as {{"x": 1}}',
                [FieldProblem("args", "not valid JSON")],
            ) from exc
        except ValueError as exc:  # an integer over Python's 4300-digit limit, and the like
            raise InvalidCall(
                f"arguments for {tool!r} cannot be read ({exc}): send a JSON object of ordinary values",
                [FieldProblem("args", "not readable JSON")],
            ) from exc
    else:
        value = raw
        # Each value costs at least a byte of the canonical text: more than max_bytes of them is
        # too big, however they are shared (and the walk stops there).
        depth = nesting_depth(value, MAX_NESTING, max_nodes=max_bytes)
        if depth > MAX_NESTING:
            raise _too_deep(tool)
        if depth < 0:
            raise InvalidCall(
                f"arguments for {tool!r} hold more than {max_bytes} values, over the {max_bytes}-byte cap: "
                "send less, or raise STOCKADE_MAX_ARGS_BYTES",
                [FieldProblem("args", "over the cap")],
            )
    if not isinstance(value, Mapping):
        raise InvalidCall(
            f"arguments for {tool!r} must be a JSON object, not {type(value).__name__}",
            [FieldProblem("args", "not an object")],
        )
    try:
        canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidCall(
            f"arguments for {tool!r} are not JSON-serialisable ({exc}): use strings, numbers, booleans, "
            "null, lists and objects only",
            [FieldProblem("args", "not JSON-serialisable")],
        ) from exc
    try:
        size = len(canonical.encode())
    except UnicodeEncodeError:
        check_text(value, "args")  # names the field that holds the lone surrogate
        raise
    if size > max_bytes:
        raise _too_big(tool, size, max_bytes)
    found = unfaithful_value(value)
    if found is not None:
        raise InvalidCall(f"{found[0]} for {tool!r} holds {found[1]}", [FieldProblem(*found)])
    return dict(value), canonical


def json_too_deep(text: str, limit: int = MAX_NESTING) -> bool:
    """Whether the lists and objects of JSON ``text`` nest deeper than ``limit``, read without
    parsing it (so without recursion), in linear time. Brackets inside strings do not count; for
    text that is not JSON the answer holds for as far as any parser reads before it fails."""
    if text.count("[") + text.count("{") <= limit:  # the common case: too few to nest that deep
        return False
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text)).translate(_SQUARE)
    peeled = 0
    while brackets.count("[") > limit - peeled:  # fewer opening brackets than that: not deeper
        if "[" * (limit + 1 - peeled) in brackets:  # that many opened in a row: deeper
            return True
        if peeled == _PEEL_ROUNDS:
            break
        # Each pass drops the innermost lists (values are gone: they read "[]"), one level each.
        shorter = brackets.replace("[]", "")
        if len(shorter) == len(brackets):
            break
        brackets, peeled = shorter, peeled + 1
    else:
        return False
    return peeled + max(accumulate(map(_BRACKET_STEP.__getitem__, brackets)), default=0) > limit


def check_nesting(value: object, field: str, limit: int = MAX_NESTING) -> None:
    """Refuse ``value`` (a call's ``field``: ``output``, say) if nested deeper than ``limit``.

    Raises:
        InvalidCall: naming ``field``, the limit and the fix.
    """
    if nesting_depth(value, limit) > limit:
        raise InvalidCall(
            f"{field} is nested more than {limit} levels deep (lists and objects inside one another): flatten it",
            [FieldProblem(field, f"nested more than {limit} levels deep")],
        )


def _too_deep(tool: str) -> InvalidCall:
    return InvalidCall(
        f"arguments for {tool!r} are nested more than {MAX_NESTING} levels deep (lists and objects inside "
        "one another): flatten them",
        [FieldProblem("args", f"nested more than {MAX_NESTING} levels deep")],
    )


def _too_big(tool: str, size: int, max_bytes: int) -> InvalidCall:
    return InvalidCall(
        f"arguments for {tool!r} are {size} bytes, over the {max_bytes}-byte cap: send less, "
        "or raise STOCKADE_MAX_ARGS_BYTES",
        [FieldProblem("args", f"{size} bytes, over the cap")],
    )


def validate_args(tool: RegisteredTool, args: dict[str, Any]) -> None:
    """Check ``args`` against the tool's schema.

    Raises:
        InvalidCall: listing each failing field (``args.to: 5 is not of type 'string'``).
    """
    errors = sorted(tool.validator.iter_errors(args), key=lambda e: (list(map(str, e.absolute_path)), e.message))
    if not errors:
        return
    problems = []
    for error in errors[:_MAX_PROBLEMS]:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        message = error.message if len(error.message) <= 200 else error.message[:197] + "..."
        problems.append(FieldProblem(f"args{path}", message, tuple(error.absolute_path)))
    more = f" (and {len(errors) - _MAX_PROBLEMS} more)" if len(errors) > _MAX_PROBLEMS else ""
    raise InvalidCall(
        f"invalid arguments for tool {tool.spec.name!r}: "
        + "; ".join(map(str, problems))
        + more
        + " — fix them to match the tool's input_schema",
        problems,
    )


def command_argv(executor: CommandExecutor, args: dict[str, Any]) -> tuple[str, ...]:
    """``executor.argv`` with each ``{name}`` item replaced by that argument, as one argv item.

    Raises:
        InvalidCall: an argument used in argv is an object or a list.
    """
    argv: list[str] = []
    for item in executor.argv:
        match = _PLACEHOLDER.fullmatch(item)
        if not match:
            argv.append(item)
            continue
        name = match.group(1)
        if name not in args or args[name] is None:
            continue
        value = args[name]
        if isinstance(value, dict | list):
            raise InvalidCall(
                f"argument {name!r} is used as a command-line item and must be a string, number or boolean",
                [FieldProblem(f"args.{name}", "must be a scalar")],
            )
        argv.append(json.dumps(value) if isinstance(value, bool) else str(value))
    return tuple(argv)
