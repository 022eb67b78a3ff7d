"""The records stockade's API sends and receives: `ToolSpec` and its parts, `Approval`, `AuditEvent`.

They import pydantic and the standard library only, so the SDK (`router.client`) reads and writes
them without loading the server (the policy engine, the sandboxes, the store). The modules that own
their behaviour re-export them (`router.tools`, `router.approvals`, `router.audit`); with
`router.results` and `router.errors`, which were light already, and `router.states` (the enums,
which the CLI reads without pydantic), they are the whole wire.

Two of `ToolSpec`'s checks need more than the standard library: JSON Schema (jsonschema) and the
output-path syntax (`router.provenance`). Each is imported where it is used, on the first spec
validated, and is a small pure-Python module.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.states import ApprovalStatus as ApprovalStatus  # noqa: PLC0414  (re-exported: part of the wire)

Capability = Literal[
    "reads_private", "reads_untrusted", "sends_external", "mutates_state", "financial", "executes_code"
]
Risk = Literal["low", "medium", "high", "critical"]
EventKind = Literal["decision", "approval", "credential", "execution", "egress", "error", "policy", "endorsement"]

TOOL_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")  # use with fullmatch


def canonical_tool_name(name: str) -> str:
    """The form two tool names must not share: lower case, ``-`` read as ``_``. ``Send_Email``
    and ``send-email`` are ``send_email``: a model, a policy or a human reading one may take it
    for the other, so a registry holds at most one tool per canonical name."""
    return name.lower().replace("-", "_")


PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")  # an argv item naming an argument; use with fullmatch
# Lists and objects inside one another in a call's arguments (the arguments object is level 1),
# and in a tool's input_schema. Real tools stay far below it; the policy engine (serde_json,
# 128 levels) and Python's recursion limit stay far above it with the envelope they add.
MAX_NESTING = 64
_MAX_SCHEMA_NODES = 1 << 20  # values in one input_schema: far past any real one


def show(value: object, limit: int = 60) -> str:
    """A value for an error message: repr'd (so newlines and control characters can't forge log
    lines) and cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


class _Frozen(BaseModel):
    # defer_build: each model's validator is built on its first use, not at import. A client uses a
    # few of these models, and building all of them made up a third of `import router.client`.
    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True)


# -- tools ---------------------------------------------------------------------------------


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
    """The tool's default limits; policy may lower them (it caps them by its maxima).

    Finite and bounded: JSON's ``Infinity`` reaches Rego as null (``min([null, 2])`` is null, so
    the cap is lost), and no sandbox can honour more than these bounds anyway.
    """

    # allow_inf_nan=False: pydantic accepts inf and NaN for a float by default (NaN > 0 is False,
    # but inf passes gt=0).
    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True, allow_inf_nan=False)

    timeout_s: float = Field(default=10.0, gt=0, le=3600)
    memory_mb: int = Field(default=256, gt=0, le=1 << 20)  # 1 TiB
    cpus: float = Field(default=1.0, gt=0, le=1024)
    pids: int = Field(default=64, gt=0, le=1 << 22)  # Linux's pid_max ceiling
    output_bytes: int = Field(default=1 << 20, gt=0, le=1 << 40)


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
        from jsonschema import Draft202012Validator  # noqa: PLC0415  (off the SDK's import path)
        from jsonschema.exceptions import SchemaError  # noqa: PLC0415

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
        from router.provenance import OUTPUT_PATH  # noqa: PLC0415  (off the SDK's import path)

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
                match = PLACEHOLDER.fullmatch(item)
                if match and match.group(1) not in properties:
                    raise ValueError(f"argv placeholder {item} names no property of input_schema")
        return self


# -- approvals -------------------------------------------------------------------------------


class Approval(BaseModel):
    """One request for a human decision, and its outcome."""

    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True)

    id: str
    decision_id: str
    session_id: str
    agent: str
    principal: str
    tool: str
    args: str = Field(description="the canonical JSON arguments the approver is asked about")
    inputs: list[dict[str, Any]] = Field(
        default_factory=list,
        description="the files passed in with the call (name, sha256, size), approved with it: a retry with other "
        "files is another call",
    )
    binding: str = Field(description="sha256 of (tool, canonical args, session, inputs)")
    reasons: list[dict[str, str]]
    created_at: float
    expires_at: float
    status: ApprovalStatus = ApprovalStatus.PENDING
    approver: str | None = None
    note: str = ""
    decided_at: float | None = None


# -- audit -----------------------------------------------------------------------------------


class AuditEvent(BaseModel):
    """One audit record. OPA's fields (``decision_id`` … ``metrics``) so OPA tooling reads it,
    plus stockade's, plus the chain (``seq``, ``prev_hash``, ``hash``), which the log fills in."""

    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True)

    decision_id: str
    timestamp: str
    path: str = "stockade/decision"
    input: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    bundles: dict[str, dict[str, str]] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    metrics: dict[str, float] = Field(default_factory=dict)
    kind: EventKind
    session_id: str | None = None
    call_id: str | None = None
    tool: str | None = None
    agent: str | None = None
    outcome: str
    escaped: list[str] | None = Field(default=None, exclude_if=lambda value: value is None)
    """Where a string held code points no UTF-8 text can (lone surrogates, such as an undecodable
    file name): JSON paths whose strings are recorded with those escaped (``\\udc80`` and the
    like). Absent when nothing was escaped."""
    seq: int = 0
    prev_hash: str = ""
    hash: str = ""
