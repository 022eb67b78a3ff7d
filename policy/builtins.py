"""Builtins regorus leaves undefined on bad input, even evaluating strictly: made to raise.

The embedded engine denies with ``policy.error`` when the strict interpreter raises, but a few
builtins never raise on an argument they cannot use, strict or not: they return undefined, as
OPA's non-strict mode does. ``units.parse_bytes("5000000000B")`` (a unit it does not know),
``regex.replace(s, "[(", "")`` (a pattern that does not compile), ``uuid.parse``, ``json.patch``
and the others in `UNDEFINED_ON_BAD_INPUT`. Undefined makes the rule that reached it undefined, so
``deny_reasons contains ... if units.parse_bytes(input.args.size) > limit`` loses its reason for
exactly the input an attacker picks, and the call is allowed. Upstream regorus does the same
(src/builtins/units.rs, regex.rs, uuid.rs, objects.rs ``json_patch``), so no upgrade fixes it.

Two defences, one at each depth:

- `strict_interpreter`: a ``regorus.Engine`` on which each of these builtins is an extension of
  the same name (regorus looks extensions up before builtins) that evaluates the real builtin and
  raises when it is undefined. The embedded engine confirms every decision that is not a deny on
  this interpreter, and ``stockade policy test`` runs tests on it, so bad input is an evaluation
  error and the call is denied with ``policy.error``; good input gets the builtin's own value.
  (An argument regorus cannot hand to Python, an integer past 64 bits inside an array given to
  ``array.slice``, makes that call an error too: denied, never allowed.)
  A rule that must tell bad input apart guards the call (``regex.match`` on the argument first,
  ``regex.is_valid`` on a pattern), so the builtin only ever sees what it can use.
- `argument_problems`: a call whose argument is a literal or a ``data`` value is checked when the
  policy loads (and by ``stockade policy check``): a regex pattern that does not compile, a size
  or UUID that does not parse. The load is refused, since every call reaching it would deny.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import regorus

UNDEFINED_ON_BAD_INPUT: Mapping[str, tuple[int, str]] = {
    "units.parse": (1, "has a unit it does not know, or no number"),
    "units.parse_bytes": (1, "has a unit it does not know (B, XB), or no number"),
    "regex.replace": (3, "has a pattern that does not compile"),
    "regex.template_match": (4, "has delimiters out of order"),
    "uuid.parse": (1, "is not a UUID"),
    "json.patch": (2, "has an operation that does not apply"),
    "time.add_date": (4, "goes past the dates it can represent"),
    "array.slice": (3, "has an index that is not an integer, or too large"),
    "bits.lsh": (2, "shifts by more than it can represent"),
    "bits.rsh": (2, "shifts by more than it can represent"),
    # An integer past 64 bits reaches regorus as a float: these give undefined for it.
    "bits.and": (2, "has an integer it cannot represent (past 64 bits)"),
    "bits.or": (2, "has an integer it cannot represent (past 64 bits)"),
    "bits.xor": (2, "has an integer it cannot represent (past 64 bits)"),
    "bits.negate": (1, "has an integer it cannot represent (past 64 bits)"),
}
"""Each builtin regorus (and upstream, as of this writing) leaves undefined on bad input in
strict mode too: its arity, and what is wrong with the input when it is undefined."""

# Which argument of each regex builtin is the pattern: checked when it is a literal or data.
REGEX_PATTERN_ARGUMENT: Mapping[str, int] = {
    "regex.match": 0,
    "regex.replace": 1,
    "regex.split": 0,
    "regex.find_n": 0,
    "regex.find_all_string_submatch_n": 0,
}

_PACKAGE = "stockade_builtins"


def _rule(name: str) -> str:
    return name.replace(".", "_")


@cache
def _provided() -> frozenset[str]:
    """The builtins this regorus has: an extension for one it lacks would add it on the
    interpreter only, and the compiled path would then refuse the policy for another reason."""
    probe = regorus.Engine()
    probe.add_policy("probe.rego", f"package {_PACKAGE}\n\nbuiltins := opa.runtime().builtins\n")
    return frozenset(str(name) for name in probe.eval_rule(f"data.{_PACKAGE}.builtins") or [])


class _Plain(threading.local):
    """This thread's interpreter without the extensions, one rule per builtin over ``input``:
    where the extensions evaluate the real builtin (regorus objects are unsendable, and an
    extension runs on the thread evaluating)."""

    def __init__(self) -> None:
        self.engine = regorus.Engine()
        rules = [f"{_rule(name)} := {name}({', '.join(f'input[{i}]' for i in range(arity))})"
                 for name, (arity, _) in UNDEFINED_ON_BAD_INPUT.items() if name in _provided()]  # fmt: skip
        rules.append("regex_is_valid := regex.is_valid(input[0])")
        self.engine.add_policy("builtins.rego", f"package {_PACKAGE}\n\n" + "\n".join(rules) + "\n")

    def evaluate(self, name: str, args: Sequence[Any]) -> Any:
        """The builtin's value for ``args`` (`UNDEFINED` if it has none). Raises what it raises."""
        self.engine.set_input(list(args))
        rule = f"data.{_PACKAGE}.{_rule(name)}"
        try:
            value = self.engine.eval_rule(rule)
        except RuntimeError as exc:
            if "not an i64" not in str(exc):
                raise
            # A number past 64 bits, which regorus cannot give Python as an int: its JSON has it.
            return _sendable(json.loads(self.engine.eval_rule_as_json(rule)))
        if value is None and self.engine.eval_rule_as_json(rule) != "null":
            return UNDEFINED  # (eval_rule gives None for undefined and for null alike)
        return value


_plain = _Plain()

UNDEFINED: Any = object()
"""What `_Plain.evaluate` gives for a builtin with no value."""


class UndefinedBuiltin(ValueError):
    """A builtin was undefined for its arguments: an evaluation error, never "no value"."""


_I64 = range(-(1 << 63), 1 << 63)


def _sendable(value: Any) -> Any:
    """``value`` as an extension may return it: regorus takes integers of 64 bits only, and gives
    a larger one as a float itself (``units.parse("100E")`` is 1e+20), so the same goes back."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if value in _I64 else float(value)
    if isinstance(value, list):
        return [_sendable(item) for item in value]
    if isinstance(value, dict):
        return {_sendable(key): _sendable(item) for key, item in value.items()}
    if isinstance(value, set | frozenset):
        return {_sendable(item) for item in value}
    return value


def _raising(name: str, why: str) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        value = _plain.evaluate(name, args)
        if value is UNDEFINED:
            shown = ", ".join(json.dumps(arg, default=str)[:60] for arg in args)
            raise UndefinedBuiltin(f"{name}({shown}) {why}: the builtin is undefined")
        return _sendable(value)

    return call


def strict_interpreter() -> Any:
    """A ``regorus.Engine`` on which the builtins of `UNDEFINED_ON_BAD_INPUT` raise where they
    would be undefined (module docstring); its clones keep that."""
    engine = regorus.Engine()
    for name, (arity, why) in UNDEFINED_ON_BAD_INPUT.items():
        if name in _provided():
            engine.add_extension(name, arity, _raising(name, why))
    return engine


@dataclass(frozen=True, slots=True)
class ArgumentProblem:
    """A builtin call that can only fail: its file, 1-based line and column, and why."""

    file: str
    line: int
    col: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}: {self.message}"


_NOT_STATIC = object()


def argument_problems(asts: Sequence[tuple[str, Any]], data: Mapping[str, Any]) -> list[ArgumentProblem]:
    """Every call in the modules ``asts`` (path and ``get_ast_as_json`` tree) whose literal or
    ``data`` argument makes it fail whatever the input: a regex pattern that does not compile; a
    builtin of `UNDEFINED_ON_BAD_INPUT` undefined (or raising) for arguments all known now."""
    problems: list[ArgumentProblem] = []
    for path, tree in asts:
        for call in _calls(tree):
            name = _name(call.get("fcn"))
            params = call.get("params") or []
            if name is None:
                continue
            line, col = _start(call.get("fcn"))
            values = [_static(param, data) for param in params]
            index = REGEX_PATTERN_ARGUMENT.get(name)
            if index is not None and index < len(values) and values[index] is not _NOT_STATIC:
                pattern = values[index]
                if not isinstance(pattern, str) or _plain.evaluate("regex.is_valid", [pattern]) is not True:
                    problems.append(ArgumentProblem(path, line, col, f"{name}: the pattern {json.dumps(pattern)[:80]} "
                                                    "does not compile, so every call fails"))  # fmt: skip
                    continue
            if name not in UNDEFINED_ON_BAD_INPUT or name not in _provided() or _NOT_STATIC in values:
                continue
            try:
                value = _plain.evaluate(name, values)
            except Exception:  # a builtin error here is the problem being reported
                value = UNDEFINED
            if value is UNDEFINED:
                shown = ", ".join(json.dumps(v)[:60] for v in values)
                problems.append(ArgumentProblem(path, line, col, f"{name}({shown}) {UNDEFINED_ON_BAD_INPUT[name][1]}: "
                                                "it is undefined, so every call fails"))  # fmt: skip
    return problems


def _kind(node: Any) -> tuple[str, dict[str, Any]]:
    """A regorus AST node's kind (``Call``, ``RefDot``, ...) and body; ``("", {})`` for anything else."""
    if isinstance(node, dict) and len(node) == 1:
        kind, body = next(iter(node.items()))
        if isinstance(body, dict):
            return kind, body
    return "", {}


def _where(body: Mapping[str, Any]) -> tuple[int, int]:
    """The line and column of a node's body."""
    span = body.get("span") or {}
    return int(span.get("line", 0)), int(span.get("col", 0))


def _start(node: Any) -> tuple[int, int]:
    """Where an expression begins (a reference's span is its last step's)."""
    kind, body = _kind(node)
    if kind in ("RefDot", "RefBrack"):
        return _start(body["refr"])
    if kind == "Call":
        return _start(body["fcn"])
    return _where(body)


def _walk(node: Any) -> Iterator[Any]:
    """Every AST node (a one-key dict of a kind) under ``node``, ``node`` first."""
    if isinstance(node, dict):
        if _kind(node)[0]:
            yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item)


def _calls(node: Any) -> Iterator[dict[str, Any]]:
    """The body of every ``Call`` node under ``node``."""
    for item in _walk(node):
        kind, body = _kind(item)
        if kind == "Call":
            yield body


def _path(node: Any) -> list[str] | None:
    """A reference of plain names (``a.b["c"]``) as its names; None for anything else."""
    kind, body = _kind(node)
    if kind == "Var":
        return [str(body["value"])]
    if kind == "RefDot":
        inner = _path(body["refr"])
        return None if inner is None else [*inner, str(body["field"][1])]
    if kind == "RefBrack":
        inner = _path(body["refr"])
        index_kind, index = _kind(body["index"])
        return None if inner is None or index_kind != "String" else [*inner, str(index["value"])]
    return None


def _name(fcn: Any) -> str | None:
    path = _path(fcn)
    return ".".join(path) if path else None


def _static(node: Any, data: Mapping[str, Any]) -> Any:
    """The value of a literal scalar, or of a ``data.<path>`` the data.json files hold;
    `_NOT_STATIC` for anything known only when a call is decided."""
    kind, body = _kind(node)
    if kind in ("String", "RawString", "Number", "Bool"):
        return body["value"]
    if kind == "Null":
        return None
    path = _path(node)
    if not path or path[0] != "data":
        return _NOT_STATIC
    value: Any = data
    for key in path[1:]:
        if not isinstance(value, dict) or key not in value:
            return _NOT_STATIC
        value = value[key]
    return value
