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

import json
import re
from collections.abc import Mapping
from itertools import accumulate
from typing import Annotated, Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from policy import ToolInfo
from policy.base import CredentialRequest, EgressRequest
from router.errors import DuplicateTool, FieldProblem, InvalidCall, InvalidToolSpec, ToolNotFound
from router.provenance import OUTPUT_PATH
from router.text import check_text

Capability = Literal[
    "reads_private", "reads_untrusted", "sends_external", "mutates_state", "financial", "executes_code"
]
Risk = Literal["low", "medium", "high", "critical"]

TOOL_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")  # use with fullmatch
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")  # use with fullmatch
_MAX_PROBLEMS = 10
# Lists and objects inside one another in a call's arguments (the arguments object is level 1),
# and in a tool's input_schema. Real tools stay far below it; the policy engine (serde_json,
# 128 levels) and Python's recursion limit stay far above it with the envelope they add.
MAX_NESTING = 64
# JSON text: a string (escapes included; an unterminated one runs to the end), or a bracket.
_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]++")
_SQUARE = str.maketrans("{}", "[]")
_BRACKET_STEP = {"[": 1, "]": -1}
_PEEL_ROUNDS = 8  # cheap passes (str.replace) before the exact, slower one (a running sum)
_MAX_SCHEMA_NODES = 1 << 20  # values in one input_schema: far past any real one


def show(value: object, limit: int = 60) -> str:
    """A value for an error message: repr'd (so newlines and control characters can't forge log
    lines) and cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CommandExecutor(_Frozen):
    """Run a program. Items of ``argv`` that are exactly ``{name}`` are replaced by that argument's
    value as one whole argv item (never through a shell); an absent optional argument drops its item."""

    kind: Literal["command"] = "command"
    argv: list[str] = Field(min_length=1)


class PythonExecutor(_Frozen):
    """Run ``entrypoint(**args)`` from ``source`` inside the sandbox; its JSON return value is the output."""

    kind: Literal["python"] = "python"
    source: str = Field(min_length=1, max_length=1 << 20)
    entrypoint: str = Field(default="main", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")


class ExternalExecutor(_Frozen):
    """The framework runs the tool itself and reports the output; the router decides and records."""

    kind: Literal["external"] = "external"


Executor = Annotated[CommandExecutor | PythonExecutor | ExternalExecutor, Field(discriminator="kind")]


class ToolLimits(_Frozen):
    """The tool's default limits; policy may lower them (it caps them by its maxima)."""

    timeout_s: float = Field(default=10.0, gt=0, le=3600)
    memory_mb: int = Field(default=256, gt=0)
    cpus: float = Field(default=1.0, gt=0)
    pids: int = Field(default=64, gt=0)
    output_bytes: int = Field(default=1 << 20, gt=0)


class EgressSpec(_Frozen):
    """A destination the tool needs. Policy decides whether a call gets it."""

    host: str = Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.-]+$")
    port: int = Field(ge=1, le=65535)
    methods: list[str] = Field(default_factory=list)


class OutputSpec(_Frozen):
    """The tool writes files under ``/out``; at most this many, this large in total, come back."""

    max_files: int = Field(default=64, ge=1, le=10_000)
    max_bytes: int = Field(default=16 << 20, ge=1)


class SandboxDefaults(_Frozen):
    """Where and how the tool runs unless policy says otherwise. ``mode="session"``: every call in
    a session runs in that session's own sandbox (container tiers), which the session's end destroys."""

    tier: Literal["bwrap", "docker", "gvisor"] = "bwrap"
    limits: ToolLimits = Field(default_factory=ToolLimits)
    egress: list[EgressSpec] = Field(default_factory=list)
    outputs: OutputSpec | None = None
    mode: Literal["fresh", "session"] = "fresh"


class CredentialRef(_Frozen):
    """A credential the tool may need; policy decides whether a call gets it."""

    name: str
    scopes: list[str] = Field(default_factory=list)


class ToolSpec(_Frozen):
    """A tool as registered by an agent framework (DESIGN.md §4)."""

    name: str
    description: str = Field(min_length=1, max_length=4096)
    input_schema: dict[str, Any]
    capabilities: list[Capability] = Field(default_factory=list)
    risk: Risk
    executor: Executor
    sandbox: SandboxDefaults = Field(default_factory=SandboxDefaults)
    credentials: list[CredentialRef] = Field(default_factory=list)
    # Arguments naming where the call sends something (recipient, url, account) or how much it
    # moves: policy checks where their values came from, so it needs no per-tool code.
    destination_args: list[str] = Field(default_factory=list)
    amount_args: list[str] = Field(default_factory=list)
    # Free text the call sends or stores (a message body, an event title): each URL, host, e-mail,
    # IBAN or account inside is checked by where it came from.
    content_args: list[str] = Field(default_factory=list)
    # Security-relevant values (a new password, a forwarding address, an API key's scope): checked
    # by value as destinations are.
    sensitive_args: list[str] = Field(default_factory=list)
    # For a reads_untrusted tool whose output mixes the platform's own data with third-party
    # content (a chat reader: channel names and senders, and message bodies): JSON paths of the
    # third-party parts (``$.messages[*].body``). Only those are untrusted content; without it,
    # all of the output is.
    untrusted_output: list[str] = Field(default_factory=list)

    @field_validator("name")
    @classmethod
    def _name_is_plain(cls, name: str) -> str:
        if not TOOL_NAME.fullmatch(name):
            raise ValueError(
                f"tool name {show(name)} must start with a letter and use only letters, digits, '_' or '-' "
                "(at most 64; no '/', '.', whitespace, line breaks, invisible or other path characters)"
            )
        return name

    @field_validator("input_schema")
    @classmethod
    def _schema_is_valid(cls, schema: dict[str, Any]) -> dict[str, Any]:
        depth = nesting_depth(schema, MAX_NESTING, max_nodes=_MAX_SCHEMA_NODES)
        if depth > MAX_NESTING:
            raise ValueError(
                f"input_schema is nested more than {MAX_NESTING} levels deep: flatten it (use $defs and $ref)"
            )
        if depth < 0:
            raise ValueError(f"input_schema holds more than {_MAX_SCHEMA_NODES} values: describe the arguments briefly")
        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as exc:
            where = "/".join(str(p) for p in exc.path) or "(root)"
            raise ValueError(f"input_schema is not valid JSON Schema at {where}: {exc.message}") from exc
        if schema.get("type") != "object":
            raise ValueError('input_schema must describe an object: set "type": "object"')
        return schema

    @field_validator("capabilities")
    @classmethod
    def _capabilities_are_a_set(cls, caps: list[str]) -> list[str]:
        return sorted(set(caps))

    @model_validator(mode="after")
    def _watched_args_are_arguments(self) -> ToolSpec:
        properties = self.input_schema.get("properties", {})
        for kind in ("destination_args", "amount_args", "content_args", "sensitive_args"):
            for name in getattr(self, kind):
                if name not in properties:
                    raise ValueError(
                        f"{kind} names {name!r}, which is not a property of input_schema: add it under "
                        "input_schema.properties, or drop it from the list"
                    )
        return self

    @field_validator("untrusted_output")
    @classmethod
    def _paths_are_paths(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if not OUTPUT_PATH.fullmatch(path):
                raise ValueError(
                    f"untrusted_output path {show(path)} is not supported: write it as $ followed by .name, "
                    ".*, [*] or [n] steps (e.g. $.messages[*].body)"
                )
        return paths

    @model_validator(mode="after")
    def _untrusted_output_needs_untrusted_reads(self) -> ToolSpec:
        if self.untrusted_output and "reads_untrusted" not in self.capabilities:
            raise ValueError(
                "untrusted_output is for tools with the reads_untrusted capability: add it, or drop the paths"
            )
        return self

    @model_validator(mode="after")
    def _placeholders_are_arguments(self) -> ToolSpec:
        if isinstance(self.executor, CommandExecutor):
            properties = self.input_schema.get("properties", {})
            for item in self.executor.argv:
                match = _PLACEHOLDER.fullmatch(item)
                if match and match.group(1) not in properties:
                    raise ValueError(f"argv placeholder {item} names no property of input_schema")
        return self


class RegisteredTool:
    """A registered `ToolSpec` with its compiled validator and what policy sees of it (built once,
    not per call)."""

    __slots__ = ("policy_view", "spec", "validator")

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.validator = Draft202012Validator(spec.input_schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
        self.policy_view = ToolInfo(
            name=spec.name, capabilities=list(spec.capabilities), risk=spec.risk,
            limits=spec.sandbox.limits.model_dump(), executor=spec.executor.kind, tier=spec.sandbox.tier,
            egress=[EgressRequest.model_validate(e.model_dump()) for e in spec.sandbox.egress],
            credentials=[CredentialRequest.model_validate(c.model_dump()) for c in spec.credentials],
            destination_args=spec.destination_args, amount_args=spec.amount_args,
            content_args=spec.content_args, sensitive_args=spec.sensitive_args,
        )  # fmt: skip


class ToolRegistry:
    """The tools this router knows, by name."""

    def __init__(self) -> None:
        self._tools: dict[str, RegisteredTool] = {}

    def register(self, spec: ToolSpec | Mapping[str, Any]) -> ToolSpec:
        """Add a tool.

        Raises:
            InvalidToolSpec: the spec is malformed (the message lists each field).
            DuplicateTool: a tool of that name is already registered.
        """
        tool = self.prepare(spec)
        self.add(tool)
        return tool.spec

    def prepare(self, spec: ToolSpec | Mapping[str, Any]) -> RegisteredTool:
        """A tool validated and compiled, not yet added (so policy can look at it first). Raises as
        `register`."""
        if not isinstance(spec, ToolSpec):
            try:
                spec = ToolSpec.model_validate(spec)
            except ValidationError as exc:
                problems = [
                    f"{'.'.join(str(p) for p in e['loc']) or '(spec)'}: {e['msg']}"
                    for e in exc.errors()[:_MAX_PROBLEMS]
                ]
                raise InvalidToolSpec("invalid tool spec: " + "; ".join(problems)) from exc
        self._check_free(spec.name)
        return RegisteredTool(spec)

    def add(self, tool: RegisteredTool) -> None:
        """Add a `prepare`d tool. Raises `DuplicateTool`."""
        self._check_free(tool.spec.name)
        self._tools[tool.spec.name] = tool

    def _check_free(self, name: str) -> None:
        if name in self._tools:
            raise DuplicateTool(f"tool {name!r} is already registered; pick another name or unregister it first")

    def unregister(self, name: str) -> None:
        """Remove a tool; unknown names raise `ToolNotFound`."""
        if self._tools.pop(name, None) is None:
            raise ToolNotFound(f"no tool named {show(name)} is registered")

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
    return dict(value), canonical


def nesting_depth(value: object, limit: int, *, max_nodes: int | None = None) -> int:
    """How many lists, tuples and dicts ``value`` holds inside one another (a scalar is 0, ``[]``
    is 1), found without recursion; as soon as it passes ``limit``, ``limit + 1``. With
    ``max_nodes``: -1 if the value has more values than that, counted as a tree (a shared or
    cyclic part counts each time it is reached, as JSON would write it out)."""
    if not isinstance(value, dict | list | tuple):
        return 0
    deepest, nodes = 0, 1
    stack: list[tuple[dict[Any, Any] | list[Any] | tuple[Any, ...], int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if level > limit:
            return limit + 1
        deepest = max(deepest, level)
        children = item.values() if isinstance(item, dict) else item
        nodes += len(children)
        if max_nodes is not None and nodes > max_nodes:
            return -1
        stack.extend([(child, level + 1) for child in children if isinstance(child, dict | list | tuple)])
    return deepest


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
        problems.append(FieldProblem(f"args{path}", message))
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
