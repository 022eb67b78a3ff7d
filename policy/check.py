"""``stockade policy check``: every problem a policy directory has that would make a rule fail,
or silently do nothing, in production; each with its file, line and column.

Works from regorus's AST of each module (``Engine.get_ast_as_json``), not from the text:

- load, parse and compile errors (the compiled path, ``regorus.Program``, is what decides);
- every call of a builtin regorus does not provide, each call site (the compiler stops at the
  first); a literal or ``data`` argument that makes a builtin fail on every call (a regex
  pattern that does not compile, `policy.builtins`), which the engine refuses to load; and
  builtins refused here: ``http.send`` and network lookups (stockade decides offline;
  OPA would make the call), ``print`` outside tests (the compiled path lacks it); warnings for
  non-deterministic ones (``time.now_ns``: use ``input.now``, or replay cannot reproduce it);
- every ``input.*`` reference checked against `policy.schema.input_schema` (per tool when tool
  specs are given), every ``data.*`` reference against the rules and the ``data.json`` files'
  content and `policy.schema.data_schema`, following imports, ``some .. in`` and ``every``
  bindings, ``x := <ref>`` and ``object.get(<ref>, "<key>", ..)``;
- type mismatches visible statically: a number compared with a string, ``count`` of a scalar,
  iterating a string, arithmetic on a string;
- ``data.json`` values the schema refuses (a rate limit of ``"2"``, a window the router never
  sends), with the JSON path and the file and line;
- reason codes a rule emits that are not in ``data.stockade.reasons`` (or emitted with another
  outcome than the catalog's), and catalog entries no rule emits (warnings);
- the values rules and functions take (the union of their definitions'), and a team's own data
  typed from its data.json, so the checks above apply to them too;
- Regal's conventions, as warnings (Regal itself does not install here): line length, METADATA
  attributes and scopes, ambiguous scopes, the entrypoint annotation (`check_conventions`).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

import regorus
from pydantic import BaseModel, ValidationError

from policy.builtins import _kind, _start, _walk, _where, argument_problems  # the AST readers both use
from policy.bundle import PolicyBundle, load_bundle
from policy.errors import PolicyBundleError
from policy.schema import Catalog, ReasonCatalog, args_by_tool, data_schema, input_schema, rate_windows

Severity = Literal["error", "warning"]

# Builtins regorus provides but a decision must not use, and why (with the fix).
REFUSED_BUILTINS = {
    "http.send": "http.send makes a network call; stockade decides offline (regorus leaves it undefined, OPA "
    "would call out): put what the rule needs in data.json, or have a tool fetch it",
    "net.lookup_ip_addr": "net.lookup_ip_addr makes a DNS lookup; stockade decides offline: put the addresses in "
    "data.json",
}
NONDETERMINISTIC_BUILTINS = {
    "time.now_ns": "time.now_ns differs between the decision, its tests and replay: use input.now",
    "rand.intn": "rand.intn makes the decision non-deterministic: tests and replay cannot reproduce it",
    "uuid.rfc4122": "uuid.rfc4122 makes the decision non-deterministic: tests and replay cannot reproduce it",
    "opa.runtime": "opa.runtime describes the engine, not the call: decisions would differ between engines",
}
# Builtins that allocate their whole result at once. regorus aborts the process when an allocation
# fails (no panic to catch): numbers.range(1, input.args.n) with n = 10**12 kills the router, with
# no deny and no audit record. Warned of unless every argument is a literal.
UNBOUNDED_BUILTINS = {
    "numbers.range": "numbers.range allocates every number of its range at once",
    "numbers.range_step": "numbers.range_step allocates every number of its range at once",
    "net.cidr_expand": "net.cidr_expand allocates every address of its network at once (a /8 is 16M)",
}
_LITERALS = frozenset({"Number", "String", "Bool", "Null"})
# Codes the router gives itself (policy/base.py, router/): the catalog documents them, no rule emits them.
ROUTER_REASON_CODES = frozenset({
    "policy.error", "policy.unavailable", "sandbox.unavailable", "audit.unavailable", "store.unavailable",
    "router.error", "credential.unknown", "credential.scope_denied", "credential.unavailable", "credential.error",
})  # fmt: skip
_REASON_SETS = {"deny_reasons": "deny", "approval_reasons": "require_approval"}
_SCALARS = frozenset({"string", "number", "integer", "boolean", "null"})
_COMPARISONS = frozenset({"Eq", "Ne", "Lt", "Le", "Gt", "Ge"})
_LOCATION = re.compile(r"-->\s*(.+?):(\d+):(\d+)")
_ERROR_LINE = re.compile(r"^error:\s*(.+)$", re.MULTILINE)
_BUNDLE_JSON_ERROR = re.compile(r"^(.+?): invalid JSON at line (\d+) column (\d+): (.+)$")
ENTRYPOINT = "data.stockade.decision"
_ARGS = "\0args"  # the env key holding input.args narrowed by `input.tool.name == "x"`


@dataclass(frozen=True, slots=True)
class Problem:
    """One finding: where (``file`` as given under the policy root, 1-based ``line`` and ``col``;
    0 when unknown), a stable ``code``, the message naming the fix, and its severity."""

    file: str
    line: int
    col: int
    code: str
    message: str
    severity: Severity = "error"

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}: {self.message}"

    def as_json(self) -> dict[str, Any]:
        """The problem as a JSON object (``stockade policy check --json``)."""
        return {
            "file": self.file,
            "line": self.line,
            "col": self.col,
            "code": self.code,
            "message": self.message,
            "severity": self.severity,
        }


def check_policy(
    root: Path, *, tools: Sequence[Mapping[str, Any]] | None = None, max_bytes: int = 1 << 20
) -> list[Problem]:
    """Every problem of the policy directory ``root`` (module docstring), errors and warnings,
    sorted by file and line. ``tools``: registration specs; with them ``input.args`` and
    ``input.tool.name`` are checked per tool."""
    try:
        bundle = load_bundle(root, max_bytes=max_bytes)
    except PolicyBundleError as exc:
        return [_bundle_problem(root, str(exc))]
    checker = _Checker(root, bundle, tools)
    checker.run()
    seen: set[tuple[str, int, int, str]] = set()
    unique = []
    for problem in sorted(checker.problems, key=lambda p: (p.file, p.line, p.col, p.code)):
        key = (problem.file, problem.line, problem.col, problem.message)
        if key not in seen:
            seen.add(key)
            unique.append(problem)
    return unique


@cache
def known_builtins() -> frozenset[str]:
    """The builtins regorus provides, as it reports them (``opa.runtime().builtins``), plus ``print``
    (the interpreter's; the compiled path lacks it)."""
    engine = regorus.Engine()
    engine.add_policy("probe.rego", "package probe\n\nbuiltins := opa.runtime().builtins\n")
    names = engine.eval_rule("data.probe.builtins")
    return frozenset({*(str(name) for name in names or []), "print"})


def _bundle_problem(root: Path, message: str) -> Problem:
    found = _BUNDLE_JSON_ERROR.match(message)
    if found:
        return Problem(str(root / found[1]), int(found[2]), int(found[3]), "load", f"invalid JSON: {found[4]}")
    head, _, rest = message.partition(": ")
    if rest and (root / head).exists():
        return Problem(str(root / head), 0, 0, "load", rest)
    return Problem(str(root), 0, 0, "load", message)


def _engine_error(message: str) -> tuple[str | None, int, int, str]:
    """A regorus error as (file, line, col, message): the location and the ``error:`` line, the
    rest (the source excerpt, ``Caused by``, a Rust backtrace) dropped."""
    where = _LOCATION.search(message)
    said = _ERROR_LINE.search(message)
    text = said[1].strip() if said else next((ln.strip() for ln in message.splitlines() if ln.strip()), "error")
    if where:
        return where[1], int(where[2]), int(where[3]), text
    return None, 0, 0, text


# -- the AST ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Seg:
    """One step of a reference: a field or a literal index (``key``), or a computed one (None)."""

    key: str | int | None
    line: int
    col: int


@dataclass(slots=True)
class _Module:
    path: str
    source: bytes
    ast: dict[str, Any]
    package: tuple[str, ...] = ()
    imports: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def is_test(self) -> bool:
        return self.path.endswith("_test.rego")

    def text(self, span: Mapping[str, Any]) -> str:
        return self.source[int(span["start"]) : int(span["end"])].decode(errors="replace")


def _flatten(node: Any) -> tuple[str, int, int, list[_Seg], list[Any]] | None:
    """A reference as (root variable, its line, col, the steps, the computed index expressions)."""
    kind, body = _kind(node)
    if kind == "Var":
        line, col = _where(body)
        return str(body["value"]), line, col, [], []
    if kind == "RefDot":
        inner = _flatten(body["refr"])
        if inner is None:
            return None
        span, name = body["field"]
        return (*inner[:3], [*inner[3], _Seg(str(name), int(span["line"]), int(span["col"]))], inner[4])
    if kind == "RefBrack":
        inner = _flatten(body["refr"])
        if inner is None:
            return None
        index_kind, index = _kind(body["index"])
        line, col = _where(index)
        if index_kind == "String":
            seg = _Seg(str(index["value"]), line, col)
        elif index_kind == "Number" and isinstance(index["value"], int):
            seg = _Seg(int(index["value"]), line, col)
        else:
            return (*inner[:3], [*inner[3], _Seg(None, line, col)], [*inner[4], body["index"]])
        return (*inner[:3], [*inner[3], seg], inner[4])
    return None


def _static_path(refr: Any) -> tuple[str, ...] | None:
    flat = _flatten(refr)
    if flat is None or any(not isinstance(s.key, str) for s in flat[3]):
        return None
    return (flat[0], *(str(s.key) for s in flat[3]))


# -- schemas ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Missing:
    """A step that does not resolve: why, and the keys that would have."""

    why: str
    candidates: tuple[str, ...] = ()


_DYNAMIC = object()  # data content behind a computed index whose children are not known


@dataclass(frozen=True, slots=True)
class _Each:
    """Data content behind a computed index: each child it may be."""

    values: list[Any]

    def step(self, key: str | int | None) -> Any:
        """The children one step further down (those that have ``key``), or `_DYNAMIC`."""
        found = [child for value in self.values for child in _children_at(value, key)]
        return _Each(found) if found else _DYNAMIC


def _children_at(value: Any, key: str | int | None) -> list[Any]:
    """What ``value[key]`` may be (every child for a computed key); [] where it is undefined."""
    if key is None:
        return list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else []
    if isinstance(value, dict):
        return [value[key]] if key in value else []
    if isinstance(value, list) and isinstance(key, int):
        return [value[key]] if 0 <= key < len(value) else []
    return []


def _inferred(value: Any, depth: int = 0) -> Any:
    """A schema of what a team's own data.json holds where no schema is declared: its types, to
    the keys it has (open: a key it lacks is not an error, the reference is undefined), and an
    array's items as the union of its elements'. Bounded, so a large document costs little."""
    if isinstance(value, dict):
        if depth >= _INFER_DEPTH or len(value) > _INFER_WIDTH:
            return {"type": "object"}
        return {"type": "object", "properties": {k: _inferred(v, depth + 1) for k, v in value.items()}}
    if isinstance(value, list):
        if depth >= _INFER_DEPTH or not value or len(value) > _INFER_WIDTH:
            return {"type": "array"}
        return {"type": "array", "items": _union([_inferred(v, depth + 1) for v in value])}
    return {"type": _json_type(value)}


_INFER_DEPTH = 8
_INFER_WIDTH = 256


def _types(schema: Any) -> set[str] | None:
    """The JSON types a schema allows; None when it allows anything (or cannot be told)."""
    if not isinstance(schema, dict) or not schema:
        return None
    if "type" in schema:
        kind = schema["type"]
        found = set(kind) if isinstance(kind, list) else {kind}
        return found | ({"number"} if "integer" in found else set())
    if "const" in schema:
        return {_json_type(schema["const"])}
    if "enum" in schema:
        return {_json_type(v) for v in schema["enum"]}
    branches = schema.get("anyOf") or schema.get("oneOf")
    if branches:
        union: set[str] = set()
        for branch in branches:
            kinds = _types(branch)
            if kinds is None:
                return None
            union |= kinds
        return union
    if "properties" in schema or "additionalProperties" in schema:
        return {"object"}
    if "items" in schema:
        return {"array"}
    return None


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "array" if isinstance(value, list) else "object"


def _branches(schema: dict[str, Any]) -> list[dict[str, Any]]:
    options = schema.get("anyOf") or schema.get("oneOf")
    if not options:
        return [schema]
    real = [b for b in options if isinstance(b, dict) and _types(b) != {"null"}]
    return [part for branch in real for part in _branches(branch)] or [schema]


def _step(schema: Any, key: str | int | None) -> Any:
    """The schema one step below ``schema`` (None: anything), or a `_Missing`."""
    if not isinstance(schema, dict) or not schema:
        return None
    branches = _branches(schema)
    if len(branches) > 1:
        results = [_step(branch, key) for branch in branches]
        found = [r for r in results if not isinstance(r, _Missing)]
        if not found:
            missing = [r for r in results if isinstance(r, _Missing)]
            keys = tuple(dict.fromkeys(k for m in missing for k in m.candidates))
            return _Missing(missing[0].why, keys)
        if any(r is None for r in found):
            return None
        return found[0] if len(found) == 1 else {"anyOf": found}
    schema = branches[0]
    kinds = _types(schema)
    if kinds is None:
        return None
    if "object" in kinds:
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        if key is None:
            return extra if isinstance(extra, dict) and not properties else None
        if isinstance(key, str) and key in properties:
            return properties[key]
        if extra is False:
            return _Missing("unknown", tuple(properties))
        return extra if isinstance(extra, dict) else None
    if "array" in kinds:
        if isinstance(key, str):
            return _Missing("array")
        return schema.get("items") or None
    if kinds <= _SCALARS:
        return _Missing(sorted(kinds - {"integer"})[0] if kinds - {"integer"} else "integer")
    return None


def _elements(schema: Any) -> tuple[Any, Any]:
    """(key schema, value schema) of iterating ``schema``; None for either: anything."""
    if not isinstance(schema, dict):
        return None, None
    kinds = _types(schema)
    if kinds == {"array"}:
        return {"type": "integer"}, schema.get("items") or None
    if kinds == {"object"}:
        extra = schema.get("additionalProperties")
        return {"type": "string"}, extra if isinstance(extra, dict) and not schema.get("properties") else None
    return None, None


def _literal(kind: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
    if kind in ("String", "Number", "Bool", "Null"):
        return {"const": body["value"], "x-literal": True}
    return None


def _as_value(schema: Any) -> Any:
    """An expression's schema as a rule's value: a literal becomes the one value it can take."""
    if isinstance(schema, dict) and schema.get("x-literal"):
        return {"enum": [schema["const"]]}
    return schema


def _union(schemas: Sequence[Any]) -> Any:
    """A schema allowing what any of ``schemas`` allows (None if any allows anything)."""
    if any(not isinstance(schema, dict) or not schema for schema in schemas):
        return None
    if all(set(schema) == {"enum"} for schema in schemas):
        return {"enum": list(dict.fromkeys(v for schema in schemas for v in schema["enum"]))}
    unique = list({json.dumps(schema, sort_keys=True): schema for schema in schemas}.values())
    return unique[0] if len(unique) == 1 else {"anyOf": unique}


MAX_LINE = 120  # Regal's default
# The annotation attributes OPA defines (www.openpolicyagent.org/docs/policy-language#metadata).
_METADATA_KEYS = frozenset({
    "scope", "title", "description", "related_resources", "authors", "organizations", "schemas", "entrypoint",
    "custom", "compile",
})  # fmt: skip
_SCOPES_BEFORE_PACKAGE = frozenset({"package", "subpackages"})
_SCOPES_BEFORE_RULE = frozenset({"rule", "document"})
_METADATA_KEY = re.compile(r" ?([A-Za-z_][\w-]*):(?:\s+(\S.*?))?\s*$")
_RULE_NAME = re.compile(r"(?:default\s+)?([A-Za-z_]\w*)")


@dataclass(slots=True)
class _Metadata:
    """One ``# METADATA`` comment block: its line, its top-level attributes (with their lines)
    and scalar values, and what follows it (the package clause, or the rule named ``rule``)."""

    line: int
    keys: dict[str, int] = field(default_factory=dict)
    values: dict[str, str] = field(default_factory=dict)
    before_package: bool = False
    rule: str = ""


def _metadata_blocks(lines: list[str]) -> Iterator[_Metadata]:
    """The METADATA blocks of a module's lines. Only the top level of each block's YAML is read:
    attribute names, and the values of ``scope`` and ``entrypoint``."""
    index = 0
    while index < len(lines):
        if lines[index].strip() != "# METADATA":
            index += 1
            continue
        block = _Metadata(index + 1)
        index += 1
        while index < len(lines) and lines[index].lstrip().startswith("#"):
            # A top-level attribute: "# key: value" (one space); deeper YAML is indented further.
            found = _METADATA_KEY.match(lines[index].lstrip()[1:])
            if found is not None:
                block.keys.setdefault(found.group(1), index + 1)
                if found.group(2) is not None:
                    block.values.setdefault(found.group(1), found.group(2).strip("'\""))
            index += 1
        following = lines[index].strip() if index < len(lines) else ""
        block.before_package = following.startswith("package ")
        named = _RULE_NAME.match(following)
        block.rule = named.group(1) if named is not None and not block.before_package else ""
        yield block


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, str) else str(value)


def _child(shown: str, key: str | int | None) -> str:
    """The shown path one step down: ``a.b``, ``a[0]``, ``a[_]``."""
    return f"{shown}.{key}" if isinstance(key, str) else f"{shown}[{'_' if key is None else key}]"


# -- the checker -----------------------------------------------------------------------------


class _Checker:
    """One run of `check_policy` over a loaded bundle."""

    def __init__(self, root: Path, bundle: PolicyBundle, tools: Sequence[Mapping[str, Any]] | None) -> None:
        self.root = root
        self.bundle = bundle
        self.tools = bool(tools)
        self.input = input_schema(tools)
        self.by_tool = args_by_tool(self.input)
        self.data = data_schema(bundle)
        self.problems: list[Problem] = []
        self.modules: list[_Module] = []
        self.rules: dict[tuple[str, ...], set[str]] = {}
        self.functions: set[tuple[str, ...]] = set()
        self.package_files: dict[tuple[str, ...], set[str]] = {}
        self.emitted: list[tuple[str, str | None, str, int, int]] = []  # code, outcome, file, line, col
        self.json_files = _data_files(root)
        self.builtins = known_builtins()
        self.unsupported: set[str] = set()
        # Each rule's and function's definitions, and the schema of the value each takes (`value_of`).
        self.definitions: dict[tuple[str, ...], list[tuple[_Module, Any]]] = {}
        self.values: dict[tuple[str, ...], Any] = {}
        self.typing: set[tuple[str, ...]] = set()
        self.quiet = 0  # > 0 while a definition is walked again for its value: its problems are reported once

    def report(self, path: str, line: int, col: int, code: str, message: str, severity: Severity = "error") -> None:
        if self.quiet:
            return
        self.problems.append(Problem(str(self.root / path), line, col, code, message, severity))

    def run(self) -> None:
        self.parse()
        for module in self.modules:
            self.index(module)
        for module in self.modules:
            self.visit_module(module)
        self.compile()
        self.check_builtin_arguments()
        self.check_data()
        self.check_reasons()
        self.check_conventions()

    def check_builtin_arguments(self) -> None:
        """Calls in the rules whose literal or ``data`` argument makes them fail on every call (a
        regex pattern that does not compile, a size that does not parse): the engine refuses to
        load such a policy (`policy.builtins.argument_problems`)."""
        rules = [(module.path, module.ast) for module in self.modules if not module.is_test]
        for problem in argument_problems(rules, self.bundle.data):
            self.report(problem.file, problem.line, problem.col, "builtin.bad_argument",
                        f"{problem.message}; the engine refuses to load the policy")  # fmt: skip

    # Regal's conventions (the linter itself does not install here): metadata, entrypoint, lines

    def check_conventions(self) -> None:
        """Warnings where a file breaks the Regal rules a team's CI would run: lines over
        `MAX_LINE` characters (style/line-length), METADATA blocks with attributes OPA does not
        define or a scope that does not fit what follows them (bugs/invalid-metadata-attribute,
        the annotation scopes), a block on one definition of an incremental rule without a scope
        (style/ambiguous-scope), and the entrypoint rule without ``entrypoint: true``
        (idiomatic/no-defined-entrypoint)."""
        entrypoint = tuple(ENTRYPOINT.split(".")[1:])
        marked = False
        for path, text in self.bundle.modules:
            lines = text.splitlines()
            for number, written in enumerate(lines, start=1):
                width = len(written)  # characters, a tab one, as Regal counts them
                if width > MAX_LINE:
                    self.report(path, number, MAX_LINE + 1, "style.line_length",
                                f"line is {width} characters, over {MAX_LINE}: break it", "warning")  # fmt: skip
            for block in _metadata_blocks(lines):
                marked |= self.check_metadata(path, block, entrypoint)
        if not marked and entrypoint[:-1] in self.rules and entrypoint[-1] in self.rules[entrypoint[:-1]]:
            module, rule = self.definitions[entrypoint][0]
            line, col = _start(rule)
            self.report(module.path, line, col, "metadata.no_entrypoint",
                        f"{ENTRYPOINT}, the rule the router evaluates, has no METADATA block with `entrypoint: true`: "
                        "annotate it (scope: document)", "warning")  # fmt: skip

    def check_metadata(self, path: str, block: _Metadata, entrypoint: tuple[str, ...]) -> bool:
        """Report what is wrong with one METADATA block; whether it marks the entrypoint."""
        for key, at in block.keys.items():
            if key not in _METADATA_KEYS:
                known = ", ".join(sorted(_METADATA_KEYS))
                self.report(path, at, 3, "metadata.invalid_attribute",
                            f"METADATA attribute {key!r} is not one OPA defines ({known}): put your own under "
                            "`custom:`", "warning")  # fmt: skip
        scope = block.values.get("scope", "package" if block.before_package else "rule")
        fits = _SCOPES_BEFORE_PACKAGE if block.before_package else _SCOPES_BEFORE_RULE
        if scope not in fits:
            line = block.keys.get("scope", block.line)
            target = "the package clause" if block.before_package else "a rule"
            self.report(path, line, 1, "metadata.invalid_scope",
                        f"METADATA scope {scope!r} does not fit {target}, which the block precedes: "
                        f"use {' or '.join(sorted(fits))}", "warning")  # fmt: skip
        package = next((m.package for m in self.modules if m.path == path), ())
        if block.rule and "scope" not in block.keys and len(self.definitions.get((*package, block.rule), [])) > 1:
            self.report(path, block.line, 1, "metadata.ambiguous_scope",
                        f"METADATA before one definition of {block.rule}, which has several, without a scope: "
                        "say `scope: rule` (this one) or `scope: document` (all of them)", "warning")  # fmt: skip
        return block.values.get("entrypoint") == "true" and (*package, block.rule) == entrypoint

    # parsing and compiling

    def parse(self) -> None:
        engine = regorus.Engine()
        for path, text in self.bundle.modules:
            try:
                engine.add_policy(path, text)
            except RuntimeError as exc:
                file, line, col, message = _engine_error(str(exc))
                self.report(file or path, line, col, "parse", message)
                self.unsupported.add(path)
        by_path = dict(self.bundle.modules)
        for entry in json.loads(engine.get_ast_as_json()):
            path = str(entry["source"]["file"])
            module = _Module(path, by_path.get(path, entry["source"]["contents"]).encode(), entry["ast"])
            self.modules.append(module)

    def compile(self) -> None:
        """Compile every rule of the non-test modules on the production path; when that fails, one
        entry point at a time (the compiler stops at its first error, and a program of every rule
        at once can run out of registers). Modules already found calling a builtin regorus lacks
        are left out."""
        modules = [(p, t) for p, t in self.bundle.decision_modules if p not in self.unsupported]
        paths = {p for p, _ in modules}
        entry_points = sorted(
            {
                "data." + ".".join((*m.package, name))
                for m in self.modules
                if m.path in paths
                for name in self.rules.get(m.package, set())
                if (*m.package, name) not in self.functions
            },
            key=lambda rule: (rule != ENTRYPOINT, rule),
        )
        try:  # the common case, a policy that compiles, in one go
            regorus.Program.compile_from_modules(self.bundle.data_json, modules, entry_points)
        except BaseException as exc:  # a Rust panic (PanicException) too: then one entry point at a time
            if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
        else:
            return
        reported: set[tuple[str | None, int, str]] = set()
        for entry_point in entry_points:
            try:
                regorus.Program.compile_from_modules(self.bundle.data_json, modules, [entry_point])
            except BaseException as exc:  # RuntimeError; a Rust panic is pyo3's PanicException, a BaseException
                if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                    raise
                if not isinstance(exc, Exception) and entry_point != ENTRYPOINT:
                    continue  # a helper the compiler cannot take alone: production compiles only the entrypoint
                file, line, col, message = _engine_error(str(exc))
                if "Missing builtin function: print" in message or (file, line, message) in reported:
                    continue  # print is reported at each call site
                reported.add((file, line, message))
                where = file if file in paths else sorted(paths)[0]
                self.report(where, line, col, "compile", f"compiling {entry_point}: {message}")

    # symbols

    def index(self, module: _Module) -> None:
        package = _static_path(module.ast["package"]["refr"])
        module.package = package or ()
        rules = self.rules.setdefault(module.package, set())
        if module.ast.get("rules"):
            self.package_files.setdefault(module.package, set()).add(module.path)
        for rule in module.ast.get("rules", []):
            kind, body = _kind(rule)
            head = body.get("head") if kind == "Spec" else body
            head_kind, head_body = _kind(head) if kind == "Spec" else ("Default", body)
            flat = _flatten(head_body.get("refr"))
            if flat is None:
                continue
            rules.add(flat[0])
            if head_kind == "Func":
                self.functions.add((*module.package, flat[0]))
            self.definitions.setdefault((*module.package, flat[0]), []).append((module, rule))
        for item in module.ast.get("imports", []):
            path = _static_path(item["refr"])
            if path is None or path[0] not in ("data", "input"):
                continue
            alias = module.text(item["as"]) if item.get("as") else path[-1]
            module.imports[alias] = path

    # walking

    def visit_module(self, module: _Module) -> None:
        for item in module.ast.get("imports", []):
            path = _static_path(item["refr"])
            flat = _flatten(item["refr"])
            if path and flat and path[0] in ("data", "input"):
                self.resolve(module, path[0], flat[3], {}, flat[1], flat[2])
        for rule in module.ast.get("rules", []):
            kind, body = _kind(rule)
            if kind == "Default":
                self.expr(module, body["value"], {})
                continue
            if kind != "Spec":
                continue
            head_kind, head = _kind(body["head"])
            env: dict[str, Any] = {}
            for arg in head.get("args", []) if head_kind == "Func" else []:
                for name in _vars(arg):
                    env[name] = (None, None)
            for query_body in body.get("bodies", []):
                scope = self.query(module, query_body["query"], dict(env))
                if query_body.get("assign"):
                    self.expr(module, query_body["assign"]["value"], scope)
                self.head(module, head_kind, head, scope, query_body["query"])
            if not body.get("bodies"):
                self.head(module, head_kind, head, dict(env), None)

    def head(self, module: _Module, kind: str, head: dict[str, Any], env: dict[str, Any], query: Any) -> None:
        flat = _flatten(head.get("refr"))
        for index in flat[4] if flat else []:
            self.expr(module, index, env)
        if kind == "Set":
            self.expr(module, head["key"], env)
            if flat and not module.is_test and flat[0] in _REASON_SETS and not flat[3]:
                self.reason_term(module, head["key"], _REASON_SETS[flat[0]], query)
        elif head.get("assign"):
            self.expr(module, head["assign"]["value"], env)

    def query(self, module: _Module, query: Mapping[str, Any], env: dict[str, Any]) -> dict[str, Any]:
        """Walk a query's statements in order; returns the variables bound at its end."""
        env = dict(env)
        narrowed = self.narrowing(module, query, env)
        if narrowed is not None:
            env[_ARGS] = (narrowed, "input.args")
        for stmt in query.get("stmts", []):
            kind, literal = _kind(stmt["literal"])
            if kind in ("Expr", "NotExpr"):
                self.expr(module, literal["expr"], env)
            elif kind == "SomeVars":
                for span in literal.get("vars", []):
                    env[module.text(span)] = (None, None)
            elif kind == "SomeIn":
                key, value = self.iterate(module, literal["collection"], env)
                self.bind(literal.get("key"), key, env)
                self.bind(literal.get("value"), value, env)
            elif kind == "Every":
                key, value = self.iterate(module, literal["domain"], env)
                inner = dict(env)
                if literal.get("key"):
                    inner[module.text(literal["key"])] = key
                if literal.get("value"):
                    inner[module.text(literal["value"])] = value
                self.query(module, literal["query"], inner)
            for modifier in stmt.get("with_mods", []) or []:
                self.expr(module, modifier["as"], env)
        return env

    def bind(self, pattern: Any, bound: tuple[Any, str | None], env: dict[str, Any]) -> None:
        kind, body = _kind(pattern)
        if kind == "Var":
            env[str(body["value"])] = bound
        elif pattern is not None:
            for name in _vars(pattern):
                env[name] = (None, None)

    def iterate(
        self, module: _Module, collection: Any, env: dict[str, Any]
    ) -> tuple[tuple[Any, str | None], tuple[Any, str | None]]:
        """The key and the element (schema, shown path) of iterating ``collection``."""
        schema = self.expr(module, collection, env)
        kinds = _types(schema)
        if kinds and kinds <= _SCALARS:
            line, col = _start(collection)
            what = sorted(kinds - {"integer"})[0]
            self.report(
                module.path,
                line,
                col,
                "type.iterate_scalar",
                f"{self.describe(module, collection, env)} is a {what}: iterating it errors on the interpreter "
                "and is undefined on the compiled path (iterate an array, set or object)",
            )
            return (None, None), (None, None)
        key, value = _elements(schema)
        shown = self.describe(module, collection, env) if _flatten(collection) else None
        return (key, None), (value, f"{shown}[_]" if shown else None)

    def narrowing(self, module: _Module, query: Mapping[str, Any], env: dict[str, Any]) -> Any:
        """``input.args`` as the tools a query's ``input.tool.name == "x"`` (or ``in {..}``) pick."""
        if not self.by_tool:
            return None
        for stmt in query.get("stmts", []):
            kind, literal = _kind(stmt["literal"])
            expr_kind, expr = _kind(literal.get("expr")) if kind == "Expr" else ("", {})
            names: list[tuple[str, int, int]] = []
            if expr_kind == "BoolExpr" and expr["op"] == "Eq":
                for side, other in ((expr["lhs"], expr["rhs"]), (expr["rhs"], expr["lhs"])):
                    other_kind, other_body = _kind(other)
                    if self.is_tool_name(module, side, env) and other_kind == "String":
                        names.append((str(other_body["value"]), *_where(other_body)))
            elif expr_kind == "Membership" and self.is_tool_name(module, expr["value"], env):
                set_kind, items = _kind(expr["collection"])
                for item in items.get("items", []) if set_kind in ("Set", "Array") else []:
                    item_kind, item_body = _kind(item)
                    if item_kind == "String":
                        names.append((str(item_body["value"]), *_where(item_body)))
            known = [self.by_tool[name] for name, _, _ in names if name in self.by_tool]
            if names:
                return known[0] if len(known) == 1 else {"anyOf": known} if known else None
        return None

    def is_tool_name(self, module: _Module, node: Any, env: dict[str, Any]) -> bool:
        flat = _flatten(node)
        if flat is None or flat[0] in env:
            return False
        path = self.absolute(module, flat[0], [s.key for s in flat[3]])
        return path == ("input", "tool", "name")

    def absolute(self, module: _Module, root: str, keys: list[str | int | None]) -> tuple[Any, ...] | None:
        if root in ("input", "data"):
            return (root, *keys)
        if root in module.imports:
            return (*module.imports[root], *keys)
        return None

    def expr(self, module: _Module, node: Any, env: dict[str, Any]) -> Any:
        """Walk an expression; returns its schema when it can be told (None: anything)."""
        kind, body = _kind(node)
        if not kind:
            return None
        if (literal := _literal(kind, body)) is not None:
            return literal
        if kind in ("Var", "RefDot", "RefBrack"):
            flat = _flatten(node)
            if flat is None:
                self.expr(module, body.get("refr"), env)
                if kind == "RefBrack":
                    self.expr(module, body["index"], env)
                return None
            for index in flat[4]:
                self.expr(module, index, env)
            return self.resolve(module, flat[0], flat[3], env, flat[1], flat[2])
        if kind == "Call":
            return self.call(module, body, env)
        if kind == "BoolExpr":
            left, right = self.expr(module, body["lhs"], env), self.expr(module, body["rhs"], env)
            if body["op"] in _COMPARISONS:
                self.compare(module, body, left, right, env)
            return {"type": "boolean"}
        if kind == "ArithExpr":
            for side in ("lhs", "rhs"):
                if _types(self.expr(module, body[side], env)) == {"string"}:
                    line, col = _start(body[side])
                    shown = self.describe(module, body[side], env)
                    self.report(module.path, line, col, "type.mismatch", f"{shown} is a string: arithmetic on it fails")
            return None
        if kind == "AssignExpr":
            self.assign(module, body, env)
            return None
        if kind == "Membership":
            self.iterate(module, body["collection"], env)
            self.expr(module, body["value"], env)
            if body.get("key"):
                self.expr(module, body["key"], env)
            return {"type": "boolean"}
        if kind in ("ArrayCompr", "SetCompr"):
            inner = self.query(module, body["query"], env)
            self.expr(module, body["term"], inner)
            return {"type": "array"} if kind == "ArrayCompr" else None
        if kind == "ObjectCompr":
            inner = self.query(module, body["query"], env)
            self.expr(module, body["key"], inner)
            self.expr(module, body["value"], inner)
            return {"type": "object"}
        if kind == "Object":
            for _, key, value in body.get("fields", []):
                self.expr(module, key, env)
                self.expr(module, value, env)
            return {"type": "object"}
        if kind in ("Array", "Set"):
            for item in body.get("items", []):
                self.expr(module, item, env)
            return {"type": "array"} if kind == "Array" else None
        for child in _children(body):
            self.expr(module, child, env)
        return None

    def assign(self, module: _Module, body: dict[str, Any], env: dict[str, Any]) -> None:
        """``x := <expr>`` (or ``x = <expr>`` with ``x`` unbound): ``x`` takes the value's schema."""
        value = self.expr(module, body["rhs"], env)
        target_kind, target = _kind(body["lhs"])
        if target_kind == "Var" and (body["op"] == "ColEq" or str(target["value"]) not in env):
            shown = self.describe(module, body["rhs"], env) if _flatten(body["rhs"]) else None
            env[str(target["value"])] = (value, shown)
        else:
            self.expr(module, body["lhs"], env)

    def call(self, module: _Module, body: dict[str, Any], env: dict[str, Any]) -> Any:
        params = [self.expr(module, param, env) for param in body.get("params", [])]
        flat = _flatten(body["fcn"])
        if flat is None or any(not isinstance(s.key, str) for s in flat[3]) or flat[0] in env:
            return None
        name = ".".join((flat[0], *(str(s.key) for s in flat[3])))
        line, col = flat[1], flat[2]
        function = self.user_function(module, flat[0], [str(s.key) for s in flat[3]])
        if function is not None:
            return self.value_of(function)
        if name not in self.builtins:
            self.unsupported.add(module.path)
            self.report(
                module.path,
                line,
                col,
                "builtin.unsupported",
                f"builtin {name} is not provided by regorus (stockade's engine): the policy cannot load; "
                "write it with the builtins regorus has, or compute it into data.json",
            )
        elif name in REFUSED_BUILTINS:
            self.report(module.path, line, col, "builtin.refused", REFUSED_BUILTINS[name])
        elif name == "print" and not module.is_test:
            self.report(
                module.path,
                line,
                col,
                "builtin.refused",
                "print is not available on the compiled path that decides in production: use it in tests",
            )
        elif name in NONDETERMINISTIC_BUILTINS:
            self.report(module.path, line, col, "builtin.nondeterministic", NONDETERMINISTIC_BUILTINS[name], "warning")
        elif name in UNBOUNDED_BUILTINS and any(_kind(p)[0] not in _LITERALS for p in body.get("params", [])):
            self.report(module.path, line, col, "builtin.unbounded",
                        f"{UNBOUNDED_BUILTINS[name]}: an argument taken from input can exhaust memory, and the engine "
                        "then aborts the router (no deny, no audit record); bound it in the rule first "
                        "(input.args.n <= 1000), or compute the values into data.json", "warning")  # fmt: skip
        if name == "count" and params:
            kinds = _types(params[0])
            if kinds and kinds <= (_SCALARS - {"string"}):
                self.report(
                    module.path,
                    line,
                    col,
                    "type.mismatch",
                    f"count of {self.describe(module, body['params'][0], env)}, a "
                    f"{sorted(kinds - {'integer'})[0]}: count takes a collection or a string",
                )
        if name == "object.get" and len(params) == 3:
            key_kind, key = _kind(body["params"][1])
            if key_kind == "String" and params[0] is not None:
                step = _step(params[0], str(key["value"]))
                if isinstance(step, _Missing) and step.why == "unknown":
                    key_line, key_col = _where(key)
                    self.report(
                        module.path,
                        key_line,
                        key_col,
                        "input.unknown_path"
                        if self.describe(module, body["params"][0], env).startswith("input")
                        else "data.unknown_path",
                        f"object.get: {self.describe(module, body['params'][0], env)} has no key "
                        f"{json.dumps(key['value'])}{_suggest(str(key['value']), step.candidates)}: "
                        "the default is always used",
                    )
                    return None
                return None if isinstance(step, _Missing) else step
        return None

    def user_function(self, module: _Module, root: str, keys: list[str]) -> tuple[str, ...] | None:
        """The path (package and name) of the policy's own function a call names, or None for a
        builtin."""
        if not keys:
            own = (*module.package, root)
            return own if own in self.functions or root in self.rules.get(module.package, set()) else None
        path = self.absolute(module, root, list(keys))
        if path is None or path[0] != "data":
            return None
        return tuple(path[1:]) if tuple(path[1:]) in self.functions or tuple(path[1:-1]) in self.rules else None

    # the values rules and functions take

    def value_of(self, path: tuple[str, ...]) -> Any:
        """The schema of the value the rule or function ``path`` takes (None: anything, or not
        known): the union of its definitions', each value walked in its body's scope (a function's
        arguments are anything), so a comparison or a step on it is checked as one on ``input``.
        A rule without a value is ``true``; a partial set is not typed."""
        if path in self.values:
            return self.values[path]
        if path in self.typing:  # a rule that reaches itself: the compiler reports the recursion
            return None
        self.typing.add(path)
        self.quiet += 1
        try:
            found = [self.definition_value(module, rule) for module, rule in self.definitions.get(path, [])]
        finally:
            self.quiet -= 1
            self.typing.discard(path)
        value = _union(found) if found else None
        self.values[path] = value
        return value

    def definition_value(self, module: _Module, rule: Any) -> Any:
        kind, body = _kind(rule)
        if kind == "Default":
            return _as_value(self.expr(module, body["value"], {}))
        if kind != "Spec":
            return None
        head_kind, head = _kind(body["head"])
        flat = _flatten(head.get("refr"))
        if head_kind == "Set" or flat is None or flat[3]:
            return None  # a partial set, or a rule at a path below its name (a.b.c := ...)
        if flat[4]:
            return {"type": "object"}  # a partial object, obj[k] := v
        env: dict[str, Any] = {}
        for arg in head.get("args", []) if head_kind == "Func" else []:
            for name in _vars(arg):
                env[name] = (None, None)
        values = []
        for query_body in body.get("bodies", []) or [None]:
            scope = self.query(module, query_body["query"], dict(env)) if query_body is not None else dict(env)
            # An `else` carries its own value; the first body, the head's.
            assigned = (query_body or {}).get("assign") or head.get("assign")
            values.append(_as_value(self.expr(module, assigned["value"], scope)) if assigned else {"type": "boolean"})
        return _union(values)

    def compare(self, module: _Module, body: dict[str, Any], left: Any, right: Any, env: dict[str, Any]) -> None:
        for path_side, path_schema, lit_schema in (
            ("lhs", left, right),
            ("rhs", right, left),
        ):
            if not isinstance(lit_schema, dict) or not lit_schema.get("x-literal"):
                continue
            if isinstance(path_schema, dict) and path_schema.get("x-literal"):
                return
            kinds = _types(path_schema)
            literal = lit_schema["const"]
            if kinds is None:
                continue
            line, col = _start(body[path_side])
            shown = self.describe(module, body[path_side], env)
            if _json_type(literal) not in kinds:
                what = " or ".join(sorted(k for k in kinds if k != "integer" or "number" not in kinds))
                self.report(
                    module.path,
                    line,
                    col,
                    "type.mismatch",
                    f"{shown} is a {what}, compared with the {_json_type(literal)} {_shown(literal)}: "
                    "never equal; ordering across types is by type, not value",
                )
            elif body["op"] in ("Eq", "Ne") and literal not in (options := (path_schema or {}).get("enum", [literal])):
                self.report(
                    module.path,
                    line,
                    col,
                    "type.not_in_enum",
                    f"{shown} is never {_shown(literal)}: it is one of {', '.join(map(_shown, options))}"
                    f"{_suggest(str(literal), tuple(map(str, options)))}",
                    "warning",
                )
            return

    def describe(self, module: _Module, node: Any, env: Mapping[str, Any]) -> str:
        """An expression as the user knows it: a reference through an import or a bound variable
        spelt out from ``input``/``data`` (``input.tool.egress[_].host``), else its source text."""
        kind, body = _kind(node)
        flat = _flatten(node)
        if flat is not None:
            root, _, _, segs, _ = flat
            if root in env and env[root][1]:
                shown = str(env[root][1])
            elif root in module.imports and root not in self.rules.get(module.package, set()):
                shown = ".".join(module.imports[root])
            else:
                shown = root
            for seg in segs:
                shown = _child(shown, seg.key)
            return shown
        if body.get("span"):
            return module.text(body["span"])
        return kind.lower() or "expression"

    # references

    def resolve(self, module: _Module, root: str, segs: list[_Seg], env: dict[str, Any], line: int, col: int) -> Any:
        """The schema a reference leads to (None: anything), reporting steps that do not resolve."""
        if root in env:
            schema, shown = env[root]
            return self.walk_schema(module, shown or root, schema, segs)
        if root in self.rules.get(module.package, set()) and (*module.package, root) not in self.functions:
            return self.walk_schema(module, root, self.value_of((*module.package, root)), segs)
        if root in module.imports and root not in self.rules.get(module.package, set()):
            prefix = module.imports[root]
            if segs:
                self.split_package_alias(module, root, prefix, segs[0], line, col)
            segs = [*(_Seg(p, line, col) for p in prefix[1:]), *segs]
            root = prefix[0]
        if root == "input":
            if segs and segs[0].key == "args" and _ARGS in env:
                return self.walk_schema(module, "input.args", env[_ARGS][0], segs[1:])
            return self.walk_schema(module, "input", self.input, segs)
        if root == "data":
            return self.resolve_data(module, segs)
        return None

    def split_package_alias(
        self, module: _Module, alias: str, prefix: tuple[str, ...], seg: _Seg, line: int, col: int
    ) -> None:
        """Warn about ``alias.rule`` where ``alias`` imports a whole package written in several files.

        regorus 0.13's interpreter can evaluate such a reference with the rules of only some of the
        package's files (which ones depends on the order the files load in), while the RVM sees them
        all. The interpreter runs `policy test` and `explain`, and confirms every decision in
        production that is not a deny: there the engines disagree and the call is denied with
        policy.error. The full path, ``data.<package>.<rule>``, is evaluated whole by both."""
        package = prefix[1:]
        files = self.package_files.get(package, set())
        if prefix[0] != "data" or len(files) < 2 or seg.key not in self.rules.get(package, set()):
            return
        full = "data." + ".".join((*package, str(seg.key)))
        self.report(module.path, line, col, "import.split_package",
                    f"{alias}.{seg.key} reaches package data.{'.'.join(package)}, written in {len(files)} "
                    f"files, through `import {'.'.join(prefix)}`: regorus's interpreter can evaluate it with "
                    f"only some of those files (tests, explain and the production confirmation then see "
                    f"rules as undefined, and production denies with policy.error); write {full}",
                    "warning")  # fmt: skip

    def walk_schema(self, module: _Module, shown: str, schema: Any, segs: list[_Seg]) -> Any:
        for seg in segs:
            if schema is None:
                return None
            step = _step(schema, seg.key)
            if isinstance(step, _Missing):
                self.missing(module, shown, seg, step)
                return None
            shown = _child(shown, seg.key)
            schema = step
        return schema

    def missing(self, module: _Module, shown: str, seg: _Seg, step: _Missing) -> None:
        code = "data.unknown_path" if shown.startswith("data") else "input.unknown_path"
        if step.why == "unknown":
            message = f"unknown path {shown}.{seg.key}{_suggest(str(seg.key), step.candidates, shown)}"
        elif step.why == "array":
            message = f"{shown} is an array: .{seg.key} does not exist (index it with a number or iterate it)"
        else:
            message = f"{shown} is a {step.why}: it has no {_shown(seg.key) if seg.key is not None else 'element'}"
            code = "type.mismatch"
        self.report(module.path, seg.line, seg.col, code, message)

    def resolve_data(self, module: _Module, segs: list[_Seg]) -> Any:
        keys = [s.key for s in segs]
        for package, names in self.rules.items():
            depth = len(package)
            if tuple(keys[:depth]) == package:
                if len(keys) > depth and keys[depth] in names and (*package, keys[depth]) not in self.functions:
                    shown = "data." + ".".join((*package, str(keys[depth])))
                    return self.walk_schema(
                        module, shown, self.value_of((*package, str(keys[depth]))), segs[depth + 1 :]
                    )
                if len(keys) == depth or keys[depth] is None or keys[depth] in names:
                    return None
            elif len(keys) < depth and tuple(package[: len(keys)]) == tuple(keys):
                return None
        content: Any = self.bundle.data
        schema: Any = self.data
        shown = "data"
        for i, seg in enumerate(segs):
            step = _step(schema, seg.key) if schema is not None else None
            if isinstance(step, _Missing) and step.why != "unknown":
                self.missing(module, shown, seg, step)
                return None
            if isinstance(content, _Each):
                content = content.step(seg.key)
            elif content is not _DYNAMIC:
                if seg.key is None:
                    # Behind a computed index: any of the children, each as data.json holds it.
                    children = _children_at(content, None)
                    content = _Each(children) if children else _DYNAMIC
                elif isinstance(content, dict) and isinstance(seg.key, str) and seg.key in content:
                    content = content[seg.key]
                elif isinstance(content, list) and isinstance(seg.key, int):
                    content = content[seg.key] if 0 <= seg.key < len(content) else _DYNAMIC
                elif isinstance(content, dict):
                    rules = self.rules.get(tuple(str(k) for k in keys[:i]), set())
                    candidates = tuple(content) + tuple(sorted(rules))
                    if isinstance(step, _Missing) or (step is None and schema is None):
                        self.missing(module, shown, seg, _Missing("unknown", candidates))
                    else:
                        self.report(
                            module.path,
                            seg.line,
                            seg.col,
                            "data.unset",
                            f"{shown}.{seg.key} is not set in any data.json: the reference is undefined and "
                            f"every rule using it does nothing (set it in {self.data_file_for(keys[:i])})",
                        )
                    return None
                else:
                    self.missing(module, shown, seg, _Missing(_json_type(content)))
                    return None
            elif isinstance(step, _Missing):
                self.missing(module, shown, seg, step)
                return None
            shown = _child(shown, seg.key)
            schema = step
        if schema is None and isinstance(content, _Each):
            return _union([_inferred(child) for child in content.values])
        if schema is None and content is not _DYNAMIC:
            return _inferred(content)
        return schema

    def data_file_for(self, keys: Sequence[Any]) -> str:
        for mount, file, _ in self.json_files:
            if tuple(keys[: len(mount)]) == mount:
                return file
        return "a data.json"

    # reason codes

    def reason_term(self, module: _Module, term: Any, outcome: str, query: Any) -> None:
        kind, body = _kind(term)
        if kind == "Var" and query is not None:
            for stmt in query.get("stmts", []):
                literal_kind, literal = _kind(stmt["literal"])
                expr_kind, expr = _kind(literal.get("expr")) if literal_kind == "Expr" else ("", {})
                target_kind, target = _kind(expr.get("lhs"))
                if expr_kind == "AssignExpr" and target_kind == "Var" and target["value"] == body["value"]:
                    kind, body = _kind(expr["rhs"])
                    break
        if kind != "Object":
            return
        for _, key, value in body.get("fields", []):
            key_kind, key_body = _kind(key)
            value_kind, value_body = _kind(value)
            if key_kind == "String" and key_body["value"] == "code" and value_kind == "String":
                line, col = _where(value_body)
                self.emitted.append((str(value_body["value"]), outcome, module.path, line, col))

    def reason_literals(self) -> Iterator[tuple[str, str, int, int]]:
        """Every ``{"code": "<literal>", "message": ..}`` object in the non-test modules."""
        for module in self.modules:
            if module.is_test:
                continue
            for node in _walk(module.ast):
                kind, body = _kind(node)
                if kind != "Object":
                    continue
                fields = {
                    str(_kind(k)[1].get("value")): v for _, k, v in body.get("fields", []) if _kind(k)[0] == "String"
                }
                code_kind, code = _kind(fields.get("code"))
                if code_kind == "String" and "message" in fields:
                    yield str(code["value"]), module.path, *_where(code)

    def check_reasons(self) -> None:
        catalog = self.bundle.data.get("stockade", {}).get("reasons")
        if not isinstance(catalog, dict):
            return
        mount, file, positions = next(
            (
                (m, f, p)
                for m, f, p in self.json_files
                if _holds(m, ("stockade", "reasons")) and _has(p, ("stockade", "reasons")[len(m) :])
            ),
            ((), "", {}),
        )
        where = f" ({file})" if file else ""
        emitted: set[str] = set()
        for code, outcome, path, line, col in self.emitted:
            entry = catalog.get(code)
            if isinstance(entry, dict) and entry.get("outcome") not in (None, outcome):
                self.report(
                    path,
                    line,
                    col,
                    "reason.outcome_mismatch",
                    f"reason code {code} is given for {outcome} here, but data.stockade.reasons says "
                    f"{entry.get('outcome')}{where}",
                )
        for code, path, line, col in self.reason_literals():
            emitted.add(code)
            if code not in catalog:
                self.report(
                    path,
                    line,
                    col,
                    "reason.uncatalogued",
                    f"reason code {code} is not in data.stockade.reasons{where}: add it with its outcome, "
                    f"message and runbook{_suggest(code, tuple(catalog))}",
                )
        for code in catalog:
            if code not in emitted and code not in ROUTER_REASON_CODES:
                line, col = _line_col(file, positions, ("stockade", "reasons", code), mount)
                self.problems.append(
                    Problem(
                        str(self.root / file) if file else str(self.root),
                        line,
                        col,
                        "reason.unused",
                        f"reason code {code} is in the catalog but no rule gives it: remove it, or write the rule",
                        "warning",
                    )
                )

    # data.json

    def check_data(self) -> None:
        stockade = self.bundle.data.get("stockade")
        if not isinstance(stockade, dict):
            return
        for key in stockade:
            if key not in ("catalog", "reasons") and key not in self.rules.get(("stockade",), set()):
                self.data_problem(
                    ("stockade", key),
                    "data.invalid",
                    f"data.stockade.{key} is not part of the data contract (catalog, reasons): put a "
                    "team's own data outside data.stockade (policies/<team>/data.json)",
                )
        models: tuple[tuple[str, type[BaseModel]], ...] = (("catalog", Catalog), ("reasons", ReasonCatalog))
        for key, model in models:
            if key not in stockade:
                continue
            try:
                model.model_validate(stockade[key])
            except ValidationError as exc:
                for error in exc.errors():
                    loc = ("stockade", key, *(p for p in error["loc"] if p != "root"))
                    self.data_problem(loc, "data.invalid", _data_message(loc, error))
        catalog = stockade.get("catalog")
        if isinstance(catalog, dict):
            for loc, message in _catalog_consistency(catalog):
                self.data_problem(("stockade", "catalog", *loc), "data.invalid", message)

    def data_problem(self, loc: tuple[Any, ...], code: str, message: str) -> None:
        for mount, file, positions in self.json_files:
            if _holds(mount, loc) and _has(positions, loc[len(mount) :]):
                line, col = _line_col(file, positions, loc, mount)
                self.problems.append(Problem(str(self.root / file), line, col, code, message))
                return
        self.problems.append(Problem(str(self.root), 0, 0, code, message))


def _holds(mount: tuple[str, ...], loc: tuple[Any, ...]) -> bool:
    return tuple(loc[: len(mount)]) == mount


def _has(positions: Mapping[tuple[Any, ...], tuple[int, int]], rel: tuple[Any, ...]) -> bool:
    """Whether the file holds ``rel`` or its first key (the mount point itself: any file)."""
    return not rel or any(rel[:n] in positions for n in range(len(rel), 0, -1))


def _line_col(
    file: str, positions: Mapping[tuple[Any, ...], tuple[int, int]], loc: tuple[Any, ...], mount: tuple[str, ...]
) -> tuple[int, int]:
    rel = tuple(loc[len(mount) :])
    for n in range(len(rel), -1, -1):
        if rel[:n] in positions:
            return positions[rel[:n]]
    return (1, 1) if file else (0, 0)


def _data_message(loc: tuple[Any, ...], error: Any) -> str:
    path = "data." + ".".join(str(p) for p in loc)
    kind = error["type"]
    if kind == "extra_forbidden" and loc[-2:-1] == ("rate_limits",):
        windows = rate_windows()
        return (
            f"{path}: the router never sends the window {loc[-1]}, so this limit never fires"
            f"{_suggest(str(loc[-1]), windows)} (windows: <scope>_per_<minute|hour|day>, "
            f"scope one of session, agent, principal, tool, agent_tool)"
        )
    if kind == "extra_forbidden":
        return f"{path} is not a known key{_suggest(str(loc[-1]), ())}: remove it or fix its name"
    if kind in ("int_type", "float_type") and isinstance(error.get("input"), str):
        return (
            f"{path} is the string {json.dumps(error['input'])}, not a number: Rego compares a number with a "
            "string by type, so the rule never fires; write it without quotes"
        )
    return f"{path}: {error['msg']} (got {json.dumps(error.get('input'), default=str)[:80]})"


def _catalog_consistency(catalog: Mapping[str, Any]) -> Iterator[tuple[tuple[Any, ...], str]]:
    """Catalog values that name something the catalog does not define."""
    defined = {key: set(catalog.get(key) or []) for key in ("capabilities", "risks", "tiers")}
    subsets = (
        ("auto_allow_risks", "risks"),
        ("approval_risks", "risks"),
        ("consequential_capabilities", "capabilities"),
    )
    for key, source in subsets:
        for i, value in enumerate(catalog.get(key) or []):
            if isinstance(value, str) and value not in defined[source]:
                yield (key, i), f"data.stockade.catalog.{key}[{i}]: {value!r} is not in catalog.{source}"
    for i, group in enumerate(catalog.get("denied_capability_sets") or []):
        for j, value in enumerate(group if isinstance(group, list) else []):
            if isinstance(value, str) and value not in defined["capabilities"]:
                yield (
                    ("denied_capability_sets", i, j),
                    f"data.stockade.catalog.denied_capability_sets[{i}][{j}]: {value!r} is not in "
                    "catalog.capabilities (the set can never match)",
                )
    tiers = catalog.get("min_tier_by_capability")
    for capability, tier in tiers.items() if isinstance(tiers, dict) else []:
        if capability not in defined["capabilities"]:
            yield (
                ("min_tier_by_capability", capability),
                f"data.stockade.catalog.min_tier_by_capability: {capability!r} is not in catalog.capabilities",
            )
        if tier not in defined["tiers"]:
            yield (
                ("min_tier_by_capability", capability),
                f"data.stockade.catalog.min_tier_by_capability.{capability}: {tier!r} is not in catalog.tiers",
            )


def _suggest(key: str, candidates: Sequence[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(key, [c for c in candidates if isinstance(c, str)], n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {prefix + '.' if prefix else ''}{close[0]}?)"


def _children(body: Mapping[str, Any]) -> Iterator[Any]:
    for key, value in body.items():
        if key in ("span", "eidx"):
            continue
        for item in value if isinstance(value, list) else [value]:
            if _kind(item)[0]:
                yield item


def _vars(node: Any) -> Iterator[str]:
    for item in _walk(node):
        kind, body = _kind(item)
        if kind == "Var":
            yield str(body["value"])


def _data_files(root: Path) -> list[tuple[tuple[str, ...], str, dict[tuple[Any, ...], tuple[int, int]]]]:
    """Each ``data.json`` under ``root``: its mount point, its path, and where each value is."""
    found = []
    for path in sorted(root.rglob("data.json")):
        rel = path.relative_to(root)
        try:
            positions = _json_positions(path.read_text())
        except (OSError, ValueError, IndexError):
            positions = {}
        found.append((tuple(rel.parent.parts), rel.as_posix(), positions))
    return found


_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _json_positions(text: str) -> dict[tuple[Any, ...], tuple[int, int]]:
    """(line, col) of every value of a JSON document by its path; an object member's is its key's."""
    offsets: dict[tuple[Any, ...], int] = {}
    decoder = json.JSONDecoder()

    def skip(i: int) -> int:
        found = _WHITESPACE.match(text, i)
        return found.end() if found else i

    def value(i: int, path: tuple[Any, ...]) -> int:
        i = skip(i)
        offsets.setdefault(path, i)
        if text[i] == "{":
            i = skip(i + 1)
            if text[i] == "}":
                return i + 1
            while True:
                i = skip(i)
                key, after = decoder.raw_decode(text, i)
                offsets[(*path, key)] = i
                i = value(skip(after) + 1, (*path, key))
                i = skip(i)
                if text[i] == ",":
                    i += 1
                    continue
                return i + 1
        if text[i] == "[":
            i = skip(i + 1)
            if text[i] == "]":
                return i + 1
            index = 0
            while True:
                i = skip(value(i, (*path, index)))
                index += 1
                if text[i] == ",":
                    i += 1
                    continue
                return i + 1
        return int(decoder.raw_decode(text, i)[1])

    value(0, ())
    starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
    positions = {}
    for path, offset in offsets.items():
        line = _bisect(starts, offset)
        positions[path] = (line + 1, offset - starts[line] + 1)
    return positions


def _bisect(starts: list[int], offset: int) -> int:
    low, high = 0, len(starts) - 1
    while low < high:
        middle = (low + high + 1) // 2
        if starts[middle] <= offset:
            low = middle
        else:
            high = middle - 1
    return low
