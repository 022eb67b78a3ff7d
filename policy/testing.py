"""Run the Rego unit tests (``test_*`` rules in ``*_test.rego``), and decide every input they feed
the decision on the compiled path too.

Tests need ``with``, which the compiled path (``regorus.Program`` + ``regorus.Rvm``, what decides
in production) rejects, so each test runs on the interpreter ``regorus.Engine`` and its verdict
comes from there. A policy bug that exists only on the RVM would pass every such test, so every
input a test feeds with ``with input as <expr>`` is also decided on both engines and compared:

1. Each test module is copied with every ``with`` modifier of a literal that sets the input
   made to record its value (found in the module's AST): ``with input as <expr>`` becomes
   ``with input as [v | v := <expr>; __stockade_replay(json.marshal(v), <site>, ...)][0]``, the
   same value, written down as JSON by the engine itself (numbers beyond 64 bits included). The
   copy runs each test once more on the interpreter, so the recorded values are exactly what the
   test fed, whatever ``<expr>`` is: a literal, a helper call, a variable bound earlier in the
   body, one per iteration of ``every`` or a comprehension.
2. Each distinct input (with the bundle's data, patched by the literal's ``with data.<path>``
   modifiers) is decided on an RVM compiled from the non-test modules for the entrypoint, and on
   the interpreter as production confirms decisions (``set_input_json`` + ``eval_rule_as_json``).
   Different values, or an error on one engine only, fail the test; both raising agrees (either
   way production denies with ``policy.error``).
3. A decision both engines agree on is validated as production validates it
   (`policy.base.to_decision`): one production would deny with ``policy.error`` (a session label
   with a space, a limit that is not positive, a field the decision does not have, an undefined
   decision) fails the test, naming the input and the path that is malformed, though every
   assertion of the test held.

What cannot be replayed (a literal that also mocks a function or replaces a rule with ``with``,
an input holding a set, a test module whose copy could not be made) is listed in
``RegoTestResult.not_replayed``, never passed silently. The entrypoint is decided on every
recorded input, even where the test itself looks at a helper rule: those inputs reach the same
rules in production.

A test that is undefined or false is explained (`first_failure`): prefixes of its body are
evaluated as rules of the same package, each on a copy of the interpreter, until one is
undefined; that statement is shown with its file:line and the values of its operands
(``d.outcome == "allow"`` → ``d.outcome = "deny"``). `explain` in `policy.tooling` uses the
same search to say which condition of an allow rule failed. ``print()`` output is gathered per
test, never written to stdout, where it would corrupt ``--json``.
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import regorus

from policy.base import POLICY_ERROR, to_decision
from policy.builtins import strict_interpreter
from policy.bundle import PolicyBundle, load_bundle
from policy.errors import PolicyBundleError
from policy.schema import validate_data

_ENTRYPOINT = "data.stockade.decision"
_UNDEFINED = "<undefined>"  # what both engines return (JSON-encoded) for an undefined rule
# The extension the instrumented copy of a test module calls: (json.marshal(value), site, whether
# the value survives JSON, json.marshal([input]) or "" ); returns true.
_RECORD = "__stockade_replay"
_VAR = "__stockade_v"  # + site: the comprehension variable that holds a modifier's value
# From the end of a modifier's target to its value: ` as `.
_AS = re.compile(rb"\s+as\b\s*")


@dataclass(frozen=True, slots=True)
class RvmDisagreement:
    """An input a test fed the decision on which the compiled path and the interpreter differ.

    ``rvm`` and ``interpreter`` are the decisions (None: undefined); ``*_error`` is set instead
    when that engine raised.
    """

    where: str
    input: Any
    rvm: Any
    interpreter: Any
    rvm_error: str | None = None
    interpreter_error: str | None = None

    def describe(self) -> str:
        """One line: where, both decisions and, when both are values, where they differ."""
        rvm, interpreter = _shown(self.rvm, self.rvm_error), _shown(self.interpreter, self.interpreter_error)
        where = ""
        if self.rvm_error is None and self.interpreter_error is None:
            paths = list(_differences(self.rvm, self.interpreter))
            where = f" (differs at {', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''})"
        return f"{self.where}: RVM decided {rvm}; interpreter decided {interpreter}{where}"


@dataclass(frozen=True, slots=True)
class RegoTestResult:
    """One Rego test.

    ``passed`` is true only when the rule evaluated to ``true`` on the interpreter
    (``interpreter_passed``; None: not recorded, read ``passed``) and every input it fed the
    decision was decided the same on the RVM. ``error`` is the interpreter's error (source
    snippet and message, no backtrace); ``failure`` the first statement that did not hold when
    the test was undefined or false; ``prints`` its ``print()`` lines (``file:line: text``);
    ``replayed`` counts the distinct inputs decided on both engines, ``disagreements`` those on
    which they differ, ``malformed`` (``file:line: why``) those on which both decide a value
    production would deny as malformed (``policy.error``); ``not_replayed`` says (``file:line:
    why``) what could not be replayed. A test whose only fault is a malformed decision has
    ``error`` set to say so, as ``policy test`` shows a test's error.
    """

    file: str
    name: str
    passed: bool
    duration_ms: float
    error: str | None = None
    replayed: int = 0
    disagreements: tuple[RvmDisagreement, ...] = ()
    not_replayed: tuple[str, ...] = ()
    malformed: tuple[str, ...] = ()
    interpreter_passed: bool | None = None
    failure: FailedStatement | None = None
    prints: tuple[str, ...] = ()
    rule: str = ""  # data.<package>.<name>, what `-r` matches as in OPA


@dataclass(frozen=True, slots=True)
class FailedStatement:
    """The first statement of a rule body that does not hold for the input it was given.

    ``where`` is ``file:line``; ``statement`` its source text (``with`` modifiers included);
    ``values`` each operand that is not a literal, as source text and JSON value (None:
    undefined); ``several``: operands with more than one value (the statement iterates).
    """

    where: str
    statement: str
    values: tuple[tuple[str, Any], ...] = ()
    several: tuple[str, ...] = ()
    note: str = ""

    def describe(self) -> list[str]:
        """The statement and one line per operand: ``d.outcome = "deny"``."""
        lines = [f"{self.where}: {self.statement}"]
        for operand, value in self.values:
            if value is None:
                lines.append(f"  {operand} is undefined")
            elif operand in self.several:
                lines.append(f"  {operand} is each of {_compact(value)}")
            else:
                lines.append(f"  {operand} = {_compact(value)}")
        if self.note:
            lines.append(f"  {self.note}")
        return lines

    def as_json(self) -> dict[str, Any]:
        """For ``--json``: where, the statement, and its operands' values."""
        return {
            "where": self.where,
            "statement": self.statement,
            "values": [{"operand": operand, "value": value, "defined": value is not None,
                        "each_of": operand in self.several} for operand, value in self.values],
            "note": self.note,
        }  # fmt: skip


def run_rego_tests(
    root: Path, *, max_bytes: int = 1 << 20, entrypoint: str = _ENTRYPOINT, select: re.Pattern[str] | None = None
) -> list[RegoTestResult]:
    """Run every ``test_*`` rule of every ``*_test.rego`` under ``root`` on the interpreter and
    decide every input each one feeds through ``with input as`` on the RVM too (module docstring).

    ``select``: run only the tests whose rule path (``data.<package>.<name>``) or
    ``file::name`` it matches (``re.search``), as ``opa test -r`` does.

    Raises:
        PolicyBundleError: the directory cannot be loaded or parsed.
    """
    bundle = load_bundle(root, max_bytes=max_bytes)
    try:
        reasons = validate_data(bundle)
    except PolicyBundleError:  # the engine refuses to load it, and `policy check` says where; the tests still run
        reasons = None
    engine = strict_interpreter()  # the interpreter production confirms decisions on (`policy.builtins`)
    engine.set_gather_prints(True)
    try:
        for path, text in bundle.modules:
            engine.add_policy(path, text)
        engine.add_data_json(bundle.data_json)
    except RuntimeError as exc:
        raise PolicyBundleError(f"policy in {root} does not parse: {without_backtrace(exc)}") from exc
    tests = [
        (path, name, rule)
        for path, name, rule in test_rules(bundle, engine)
        if select is None or select.search(rule) or select.search(f"{path}::{name}")
    ]
    if not tests:
        return []
    recorder = _Recorder()
    instrumented = _instrument(bundle, engine, recorder)
    replayer = _Replayer(bundle, engine, entrypoint, reasons)
    prober = Prober(engine)
    results: list[RegoTestResult] = []
    for path, name, rule in tests:
        engine.take_prints()
        started = time.perf_counter()
        error: str | None = None
        try:
            value = engine.eval_rule(rule)
        except RuntimeError as exc:
            value, error = None, without_backtrace(exc)
        elapsed = (time.perf_counter() - started) * 1000
        prints = tuple(engine.take_prints())
        failure = None if value is True or error is not None else prober.why_test_failed(path, name, value)
        replayed, disagreements, malformed, not_replayed = _replay(
            instrumented, recorder, replayer, path, rule, error is not None
        )
        if malformed and error is None and failure is None:
            error = "\n".join(f"{line} (production denies this call with {POLICY_ERROR})" for line in malformed)
        results.append(
            RegoTestResult(
                file=path,
                name=name,
                passed=value is True and not disagreements and not malformed,
                duration_ms=elapsed,
                error=error,
                replayed=replayed,
                disagreements=tuple(disagreements),
                malformed=tuple(malformed),
                not_replayed=tuple(not_replayed),
                interpreter_passed=value is True,
                failure=failure,
                prints=prints,
                rule=rule,
            )
        )
    return results


def test_rules(bundle: PolicyBundle, engine: Any) -> list[tuple[str, str, str]]:
    """(file, test name, rule path) of every test, in file order: each rule named ``test_*``
    (not a function) in any module ``engine`` holds, as ``opa test`` finds them. Read from the
    AST, so neither indentation nor the file's name hides one: a test not found is a test that
    never fails."""
    order = {path: index for index, (path, _) in enumerate(bundle.modules)}
    entries = sorted(json.loads(engine.get_ast_as_json()), key=lambda e: order.get(e["source"]["file"], len(order)))
    found: list[tuple[str, str, str]] = []
    for entry in entries:
        path, tree = str(entry["source"]["file"]), entry["ast"]
        package = _ref_path(tree["package"]["refr"])
        if package is None:
            raise PolicyBundleError(f"{path}: its package path is not static; name it a.b.c")
        names: dict[str, None] = {}
        for rule in tree.get("rules", []):
            kind, body = next(iter(rule.items()))
            heads: dict[str, dict[str, Any]] = (body.get("head") or {}) if kind == "Spec" else {}
            head_kind, head = next(iter(heads.items()), ("", {}))
            prefix = _static_prefix(head["refr"]) if head.get("refr") is not None else ()
            if head_kind != "Func" and len(prefix) == 1 and prefix[0].startswith("test_"):
                names[prefix[0]] = None
        found.extend((path, name, _rule_ref(("data", *package, name))) for name in names)
    return found


def _rule_ref(parts: tuple[str, ...]) -> str:
    """A rule path as Rego writes it: ``data.a.b``, a part that is no identifier as ``["a-b"]``."""
    return parts[0] + "".join(
        f".{part}" if _IDENTIFIER.fullmatch(part) else f"[{json.dumps(part)}]" for part in parts[1:]
    )


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# -- instrumenting the test modules -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Site:
    """A ``with input...`` or ``with data...`` modifier the instrumented copy records."""

    literal: int
    target: tuple[str, ...]  # ("input", ...) or ("data", ...)


@dataclass(frozen=True, slots=True)
class _Literal:
    """A literal that sets the input with ``with``: where it is, its recorded modifiers in order
    and, if the RVM cannot replay it, why."""

    where: str
    sites: tuple[int, ...]
    unreplayable: str | None


@dataclass(slots=True)
class _Instrumented:
    """The interpreter running instrumented copies of the test modules, what each site is, and
    for each test module that could not be instrumented, why."""

    engine: Any
    sites: list[_Site]
    literals: list[_Literal]
    failed: dict[str, str]


@dataclass(frozen=True, slots=True)
class _Record:
    """One modifier value as the test fed it: JSON text, whether JSON holds it exactly (not if it
    has a set or a non-string key) and, for ``with input.<path>``, the input it patches (JSON of
    ``[input]``, ``[]`` if none)."""

    site: int
    value: str
    exact: bool
    ambient: str


class _Recorder:
    """The extension's Python side: every record in call order."""

    def __init__(self) -> None:
        self.records: list[_Record] = []

    def __call__(self, value: Any, site: Any, exact: Any, ambient: Any) -> bool:
        self.records.append(_Record(int(site), str(value), exact is True, str(ambient)))
        return True


def _instrument(bundle: PolicyBundle, engine: Any, recorder: _Recorder) -> _Instrumented:
    """An interpreter with the decision modules as they are and each test module instrumented
    (module docstring); a test module that cannot be is left as it is and listed in ``failed``."""
    asts = {item["source"]["file"]: item["ast"] for item in json.loads(engine.get_ast_as_json())}
    virtual = [path for tree in asts.values() for path in _rule_paths(tree)]
    result = _Instrumented(engine=None, sites=[], literals=[], failed={})
    modules: list[tuple[str, str]] = []
    for path, text in bundle.modules:
        if not path.endswith("_test.rego") or path not in asts:
            modules.append((path, text))
            continue
        first_site, first_literal = len(result.sites), len(result.literals)
        try:
            rewritten = _rewrite(path, text, asts[path], virtual, result)
            _check_rewrite(path, asts[path], rewritten, list(range(first_site, len(result.sites))))
        except _CannotInstrument as exc:
            del result.sites[first_site:], result.literals[first_literal:]
            result.failed[path] = str(exc)
            rewritten = text
        modules.append((path, rewritten))
    instrumented = strict_interpreter()
    instrumented.set_gather_prints(True)  # the test's prints were shown from its first run
    instrumented.add_extension(_RECORD, 4, recorder)
    for path, text in modules:
        try:
            instrumented.add_policy(path, text)
        except RuntimeError as exc:  # parsed alone (_check_rewrite) but not with the others: leave it be
            result.failed[path] = f"{path}: the instrumented copy does not load: {_message(exc)}"
            instrumented.add_policy(path, dict(bundle.modules)[path])
    instrumented.add_data_json(bundle.data_json)
    result.engine = instrumented
    return result


class _CannotInstrument(Exception):
    """A test module's ``with`` modifiers could not be wrapped; its inputs are not replayed."""


def _rewrite(path: str, text: str, tree: Any, virtual: list[tuple[str, ...]], into: _Instrumented) -> str:
    """``text`` with each ``with input...``/``with data...`` modifier of every literal that sets the
    input wrapped in a recording call; the sites and literals are appended to ``into``."""
    source = text.encode()
    inserts: list[tuple[int, int, bytes]] = []  # (offset, order for equal offsets, bytes)
    for statement in _with_statements(tree):
        modifiers = statement["with_mods"]
        targets = [_ref_path(modifier["refr"]) for modifier in modifiers]
        if not any(target and target[0] == "input" for target in targets):
            continue  # the decision sees the input the enclosing code set (none, in a test)
        literal = len(into.literals)
        sites: list[int] = []
        unreplayable: str | None = None
        where = ""
        for modifier, target in zip(modifiers, targets, strict=True):
            span = modifier["span"]
            if target and target[0] == "input":
                where = where or f"{path}:{span['line']}"
            if target is None or target[0] not in {"input", "data"}:
                shown = ".".join(target) if target else "a computed path"
                unreplayable = unreplayable or f"`with {shown}` replaces a function, which the RVM cannot"
                continue
            if target[0] == "data" and any(_overlaps(target, rule) for rule in virtual):
                unreplayable = unreplayable or f"`with {'.'.join(target)}` replaces a rule, which the RVM cannot"
                continue
            ref_end = _span(modifier["refr"])["end"]
            found = _AS.match(source, ref_end)
            if found is None or found.end() >= span["end"]:
                raise _CannotInstrument(f"{path}:{span['line']}: cannot find the value of this `with`")
            site = len(into.sites)
            into.sites.append(_Site(literal, target))
            sites.append(site)
            var = f"{_VAR}{site}"
            patches_input = target[0] == "input" and len(target) > 1
            ambient = f"json.marshal([{var}_in | {var}_in := input])" if patches_input else '""'
            exact = f"json.unmarshal(json.marshal({var})) == {var}"
            opening = f"[{var} | {var} := "
            closing = f"; {_RECORD}(json.marshal({var}), {site}, {exact}, {ambient})][0]"
            inserts.append((found.end(), 1, opening.encode()))
            inserts.append((span["end"], 0, closing.encode()))
        into.literals.append(_Literal(where, tuple(sites), unreplayable))
    for offset, _, piece in sorted(inserts, reverse=True):
        source = source[:offset] + piece + source[offset:]
    return source.decode()


def _check_rewrite(path: str, original: Any, text: str, sites: list[int]) -> None:
    """The rewritten module parses and each recording comprehension holds exactly the value the
    modifier had (same syntax tree), so the copy feeds what the test as written feeds."""
    probe = regorus.Engine()
    probe.add_extension(_RECORD, 4, lambda *_: True)
    try:
        probe.add_policy(path, text)
        tree = json.loads(probe.get_ast_as_json())[0]["ast"]
    except RuntimeError as exc:
        raise _CannotInstrument(f"{path}: the instrumented copy does not parse: {_message(exc)}") from exc
    before = [modifier for statement in _with_statements(original) for modifier in statement["with_mods"]]
    after = [modifier for statement in _with_statements(tree) for modifier in statement["with_mods"]]
    wrapped = [(old, _unwrapped(new["as"])) for old, new in zip(before, after, strict=False)]
    found = [(site, _shape(old["as"]) == _shape(value)) for old, (site, value) in wrapped if site is not None]
    if len(before) != len(after) or [site for site, _ in found] != sites or not all(same for _, same in found):
        raise _CannotInstrument(f"{path}: instrumenting its `with` modifiers changed what they feed")


def _unwrapped(node: dict[str, Any]) -> tuple[int | None, Any]:
    """(site, value expression) of a recording comprehension; (None, None) for anything else."""
    try:
        query = node["RefBrack"]["refr"]["ArrayCompr"]["query"]["stmts"]
        assign = query[0]["literal"]["Expr"]["expr"]["AssignExpr"]
        call = query[1]["literal"]["Expr"]["expr"]["Call"]
        site = call["params"][1]["Number"]["value"]
    except (KeyError, IndexError, TypeError):
        return None, None
    if _call_name({"Call": call}) != _RECORD or assign["lhs"]["Var"]["value"] != f"{_VAR}{site}" or len(query) != 2:
        return None, None
    return int(site), assign["rhs"]


def _shape(node: Any) -> Any:
    """A syntax tree without positions and indices, to compare two trees' meaning."""
    if isinstance(node, dict):
        return {key: _shape(value) for key, value in node.items() if key not in {"span", "eidx", "sidx", "qidx"}}
    if isinstance(node, list):
        return [_shape(value) for value in node if not (isinstance(value, dict) and set(value) == _POSITION)]
    return node


_POSITION = {"line", "col", "start", "end"}


def _with_statements(tree: Any) -> Iterator[dict[str, Any]]:
    """Every statement with ``with`` modifiers, nested ones (comprehensions, ``every``) included,
    in source order."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "with_mods" in node:
                yield node
            stack.extend(value for value in reversed(node.values()) if isinstance(value, dict | list))
        elif isinstance(node, list):
            stack.extend(value for value in reversed(node) if isinstance(value, dict | list))


def _span(node: dict[str, Any]) -> dict[str, int]:
    body: dict[str, Any] = next(iter(node.values()))
    span: dict[str, int] = body["span"]
    return span


def _call_name(node: dict[str, Any]) -> str | None:
    call = node.get("Call")
    if call is None:
        return None
    path = _ref_path(call["fcn"])
    return ".".join(path) if path else None


def _ref_path(node: dict[str, Any]) -> tuple[str, ...] | None:
    """``input.a["b"]`` as ("input", "a", "b"); None for anything but a static path."""
    kind, body = next(iter(node.items()))
    if kind == "Var":
        return (str(body["value"]),)
    if kind == "RefDot":
        base = _ref_path(body["refr"])
        return None if base is None else (*base, str(body["field"][1]))
    if kind == "RefBrack":
        base = _ref_path(body["refr"])
        index = body["index"]
        if base is None or "String" not in index:
            return None
        return (*base, str(index["String"]["value"]))
    return None


def _rule_paths(tree: dict[str, Any]) -> Iterator[tuple[str, ...]]:
    """The ``data`` path of every rule a module defines (as far as it is static)."""
    package = _ref_path(tree["package"]["refr"]) or ()
    for rule in tree.get("rules", []):
        kind, body = next(iter(rule.items()))
        if kind == "Default":
            head = body.get("refr")
        else:
            heads: dict[str, dict[str, Any]] = body.get("head") or {}
            head = next(iter(heads.values()), {}).get("refr")
        if head is not None:
            yield ("data", *package, *_static_prefix(head))


def _static_prefix(node: dict[str, Any]) -> tuple[str, ...]:
    kind, body = next(iter(node.items()))
    if kind == "Var":
        return (str(body["value"]),)
    if kind == "RefDot":
        return (*_static_prefix(body["refr"]), str(body["field"][1]))
    if kind == "RefBrack":
        base = _static_prefix(body["refr"])
        index = body["index"]
        return (*base, str(index["String"]["value"])) if "String" in index else base
    return ()


def _overlaps(target: tuple[str, ...], rule: tuple[str, ...]) -> bool:
    shorter = min(len(target), len(rule))
    return target[:shorter] == rule[:shorter]


# -- explaining a failure --------------------------------------------------------------------

_PROBE = "__stockade_probe"
_PROBE_VAR = "__stockade_value"
_LITERALS = {"String", "RawString", "Number", "Bool", "Null"}


class Prober:
    """Finds the first statement of a rule body that does not hold, on copies of an interpreter.

    Each prefix of the body (its statements' source text, ``with`` modifiers included) becomes
    a rule ``__stockade_probe`` in a module of its own in the same package, with the original
    module's imports, added to a clone of ``engine`` (an unsafe prefix poisons only its own
    clone). The first prefix that is undefined ends with the failing statement; its operands
    are then evaluated after the statements before it, each as ``[v | v := <operand> <with>]``.
    """

    def __init__(self, engine: Any, input_json: str | None = None) -> None:
        self._engine = engine
        self._input_json = input_json
        tree = json.loads(engine.get_ast_as_json())
        self.modules: dict[str, Any] = {item["source"]["file"]: item["ast"] for item in tree}
        self._sources = {item["source"]["file"]: item["source"]["contents"].encode() for item in tree}
        self._probes = 0

    def rules(self, file: str, name: str) -> list[dict[str, Any]]:
        """The definitions (``Spec`` bodies) of rule ``name`` in ``file``."""
        found = []
        for rule in self.modules.get(file, {}).get("rules", []):
            kind, body = next(iter(rule.items()))
            if kind == "Spec" and _head_name(body) == name:
                found.append(body)
        return found

    def why_test_failed(self, file: str, name: str, value: Any) -> FailedStatement | None:
        """The first failing statement of the test's first body that fails; None if none found."""
        for rule in self.rules(file, name):
            for body in rule.get("bodies", []):
                failure = self.first_failure(file, body)
                if failure is not None:
                    return failure
            if value is not None:  # every statement holds: the rule's value is what is wrong
                note = f"the body holds, but the test's value is {_compact(value)}, not true"
                return FailedStatement(f"{file}:{rule['span']['line']}", self.text(file, rule["head"]), note=note)
        return None

    def first_failure(self, file: str, body: dict[str, Any]) -> FailedStatement | None:
        """The first statement of ``body`` (a rule body from the AST) that does not hold, with
        its operands' values; None when every prefix holds or none could be evaluated."""
        statements = body["query"]["stmts"]
        texts = [self.text(file, statement) for statement in statements]
        for k, statement in enumerate(statements):
            holds, error = self.evaluate(file, f"{_PROBE} if {{\n{_lines(texts[: k + 1])}\n}}")
            if holds is not None or error is not None:  # an error: this prefix alone is unsafe, try the next
                continue
            return self._failed(file, statement, texts[:k])
        return None

    def _failed(self, file: str, statement: dict[str, Any], before: list[str]) -> FailedStatement:
        kind, literal = next(iter(statement["literal"].items()))
        mods = statement.get("with_mods") or []
        with_text = ""
        if mods:
            with_text = " " + self._slice(file, mods[0]["span"]["start"], mods[-1]["span"]["end"])
        values: list[tuple[str, Any]] = []
        several: list[str] = []
        for operand in _operands(kind, literal):
            text = self.text(file, operand)
            if any(text == shown for shown, _ in values):
                continue
            collect = f"[{_PROBE_VAR} | {_PROBE_VAR} := {text}{with_text}]"
            found, error = self.evaluate(file, f"{_PROBE} contains {collect} if {{\n{_lines(before or ['true'])}\n}}")
            if error is not None or not isinstance(found, list) or not found:
                continue  # an operand the statement itself binds (`some x in ...`) has no value before it
            first = found[0]
            if _literal(text) == first[:1]:
                continue  # [1, 2, 3] = [1,2,3] says nothing
            if len(first) == 1:
                values.append((text, first[0]))
            elif not first:
                values.append((text, None))
            else:
                values.append((text, first))
                several.append(text)
        line = statement["span"]["line"]
        return FailedStatement(f"{file}:{line}", self.text(file, statement), tuple(values), tuple(several))

    def evaluate(self, file: str, rule: str) -> tuple[Any, str | None]:
        """The value of ``rule`` (named ``__stockade_probe``) added in a module of ``file``'s
        package: (value or None if undefined, error)."""
        tree = self.modules[file]
        package = self.text(file, tree["package"]["refr"])
        imports = [self._slice(file, item["span"]["start"], item["span"]["end"]) for item in tree.get("imports", [])]
        self._probes += 1
        module = f"package {package}\n\n" + "".join(f"{line}\n" for line in imports) + "\n" + rule + "\n"
        engine = self._engine.clone()
        engine.set_gather_prints(True)
        try:
            if self._input_json is not None:
                engine.set_input_json(self._input_json)
            engine.add_policy(f"{file}#probe{self._probes}", module)
            raw = engine.eval_rule_as_json(f"data.{package}.{_PROBE}")
        except BaseException as exc:
            if not (isinstance(exc, Exception) or _is_panic(exc)):
                raise
            return None, _message(exc)
        return _decoded(raw), None

    def text(self, file: str, node: dict[str, Any]) -> str:
        """The source text of an AST node (a tagged node, or one with a ``span``)."""
        span = node.get("span") or _span(node)
        return self._slice(file, span["start"], span["end"])

    def _slice(self, file: str, start: int, end: int) -> str:
        source = self._sources[file]
        # A string literal's span leaves out its quotes: a node that starts or ends with one does too.
        if start > 0 and source[start - 1 : start] in _QUOTES:
            start -= 1
        if source[end : end + 1] in _QUOTES:
            end += 1
        return str(source[start:end].decode())


_QUOTES = (b'"', b"`")


def _head_name(rule: dict[str, Any]) -> str | None:
    heads: dict[str, dict[str, Any]] = rule.get("head") or {}
    head = next(iter(heads.values()), {}).get("refr")
    prefix = _static_prefix(head) if head is not None else ()
    return prefix[0] if prefix else None


def _operands(kind: str, literal: dict[str, Any]) -> list[dict[str, Any]]:
    """The sub-expressions of a statement worth showing the value of (not literals)."""
    if kind == "NotExpr":
        return _operands("Expr", {"expr": literal["expr"]})
    if kind == "SomeIn":
        found = [literal["collection"]]
    elif kind == "Every":
        found = [literal["domain"]]
    elif kind == "Expr":
        expr_kind, expr = next(iter(literal["expr"].items()))
        if expr_kind in {"BoolExpr", "ArithExpr", "BinExpr"}:
            found = [expr["lhs"], expr["rhs"]]
        elif expr_kind == "AssignExpr":
            found = [expr["rhs"]] if expr["op"] == "ColEq" else [expr["lhs"], expr["rhs"]]
        elif expr_kind == "Membership":
            found = [node for node in (expr.get("key"), expr["value"], expr["collection"]) if node]
        elif expr_kind == "Call":
            found = [literal["expr"], *expr["params"]]
        else:
            found = [literal["expr"]]
    else:
        found = []
    return [node for node in found if next(iter(node)) not in _LITERALS]


def _literal(text: str) -> list[Any] | None:
    """``[value]`` if ``text`` is a JSON literal (an array or object of constants)."""
    try:
        return [json.loads(text)]
    except ValueError:
        return None


def _lines(statements: list[str]) -> str:
    return "\n".join(f"\t{statement}" for statement in statements)


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def without_backtrace(exc: BaseException) -> str:
    """A regorus error's whole text (``--> file:line:col``, the source snippet and the message)
    without the Rust backtrace ``RUST_BACKTRACE`` adds."""
    return str(exc).split("Stack backtrace:", 1)[0].strip() or type(exc).__name__


# -- replaying the recorded inputs --------------------------------------------------------


class _NotReplayable(Exception):
    """A recorded input cannot be decided on the RVM; the message says why."""


def _replay(
    instrumented: _Instrumented, recorder: _Recorder, replayer: _Replayer, path: str, rule: str, errored: bool
) -> tuple[int, list[RvmDisagreement], list[str], list[str]]:
    """Run one test on the instrumented copy and decide what it fed the decision on both engines:
    (inputs decided, disagreements, malformed decisions, what was not replayed and why).
    ``errored``: the test as written raised (then so may the copy: what it recorded before counts)."""
    not_replayed: list[str] = []
    if path in instrumented.failed:
        not_replayed.append(instrumented.failed[path])
    recorder.records.clear()
    try:
        instrumented.engine.eval_rule(rule)
        instrumented.engine.take_prints()
    except RuntimeError as exc:
        instrumented.engine.take_prints()
        if not errored:
            not_replayed.append(f"{path}: the instrumented copy of the test raised ({_message(exc)}); "
                                "what it feeds after that is not replayed")  # fmt: skip
    feeds: dict[tuple[str, str | None], str] = {}
    for literal, group in _groups(recorder.records, instrumented):
        where = instrumented.literals[literal].where
        reason = instrumented.literals[literal].unreplayable
        try:
            if reason is not None:
                raise _NotReplayable(reason)
            feeds.setdefault(_feed(group, instrumented, replayer.bundle), where)
        except _NotReplayable as exc:
            line = f"{where}: {exc}"
            if line not in not_replayed:
                not_replayed.append(line)
    disagreements: list[RvmDisagreement] = []
    malformed: list[str] = []
    for (input_json, data_json), where in feeds.items():
        disagreement, agreed = replayer.compare(where, input_json, data_json)
        if disagreement is not None:
            disagreements.append(disagreement)
        elif agreed is not _BOTH_FAILED and (why := _malformed(agreed, replayer.reasons)) is not None:
            malformed.append(f"{where}: {why}")
    return len(feeds), disagreements, malformed, not_replayed


_BOTH_FAILED = object()  # `_Replayer.compare`'s agreed value when both engines raised


def _malformed(value: Any, reasons: Mapping[str, str] | None = None) -> str | None:
    """Why production would deny a decision both engines agree on with ``policy.error``
    (`policy.base.to_decision`, with the reason catalog), or None when it would take it as it is."""
    decision = to_decision(value, "", reasons)
    if decision.reason_codes != [POLICY_ERROR]:
        return None
    if isinstance(value, dict) and value.get("outcome") == "deny":
        said = [r.get("code") for r in value.get("reasons") or [] if isinstance(r, dict)]
        if said and all(code == POLICY_ERROR for code in said):
            return None  # the policy itself denies with policy.error: well-formed
    return f"the decision is malformed: {decision.reasons[0].message}"


def _groups(records: list[_Record], instrumented: _Instrumented) -> Iterator[tuple[int, dict[int, _Record]]]:
    """The records of each evaluation of a literal: all its recorded modifiers, in order. A literal
    whose later modifier was undefined was not evaluated: its partial group is dropped."""
    pending: dict[int, dict[int, _Record]] = {}
    for record in records:
        literal = instrumented.sites[record.site].literal
        group = pending.setdefault(literal, {})
        if record.site in group:
            group = pending[literal] = {}
        group[record.site] = record
        if len(group) == len(instrumented.literals[literal].sites):
            del pending[literal]
            yield literal, group


def _feed(group: dict[int, _Record], instrumented: _Instrumented, bundle: PolicyBundle) -> tuple[str, str | None]:
    """The input (JSON) one evaluation of a literal fed the decision, and the data (JSON) it saw
    if its ``with data`` modifiers changed it (None: the bundle's)."""
    unset = object()
    policy_input: Any = unset
    data: Any = None
    for site, record in group.items():
        target = instrumented.sites[site].target
        if not record.exact:
            raise _NotReplayable(
                f"`with {'.'.join(target)}` is given a set or an object with non-string keys, which JSON "
                "(and so no production call) cannot carry"
            )
        value = json.loads(record.value)
        if target[0] == "input":
            if len(target) == 1:
                policy_input = value
                continue
            if policy_input is unset:  # patches the input the enclosing code set, if any
                ambient = json.loads(record.ambient)
                policy_input = ambient[0] if ambient else {}
            policy_input = _patched(policy_input, target[1:], value, "input")
        else:
            data = _patched(bundle.data if data is None else data, target[1:], value, "data")
    return _json(policy_input), None if data is None else _json(data)


def _patched(base: Any, path: tuple[str, ...], value: Any, name: str) -> Any:
    """A copy of ``base`` with ``value`` at ``path``, making objects on the way."""
    if not isinstance(base, dict):
        raise _NotReplayable(f"`with {name}.{'.'.join(path)}` patches a {type(base).__name__}, not an object")
    result = copy.deepcopy(base)
    node = result
    for i, key in enumerate(path[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise _NotReplayable(f"`with {name}.{'.'.join(path)}`: {name}.{'.'.join(path[: i + 1])} is not an object")
        node = child
    node[path[-1]] = value
    return result


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


class _Replayer:
    """Decides inputs on the RVM and on the interpreter as the embedded engine does in production."""

    def __init__(
        self, bundle: PolicyBundle, engine: Any, entrypoint: str, reasons: Mapping[str, str] | None = None
    ) -> None:
        self.bundle = bundle
        self.reasons = reasons  # the reason catalog production checks decisions against
        self._engine = engine  # every module and the data: what production's interpreter holds
        self._entrypoint = entrypoint
        self._program: Any = None
        self._compile_error: str | None = None
        self._vm: Any = None
        self._vm_data: str | None = None
        self._interpreter: Any = None
        self._interpreter_data: str | None = None

    def compare(self, where: str, input_json: str, data_json: str | None) -> tuple[RvmDisagreement | None, Any]:
        """Decide the input on both engines: (how they disagree, None if they do not; the decision
        they agree on: None for undefined, `_BOTH_FAILED` when both raised)."""
        data = data_json or self.bundle.data_json
        rvm, rvm_error = self._on_rvm(input_json, data)
        interpreter, interpreter_error = self._on_interpreter(input_json, data)
        if rvm_error is not None and interpreter_error is not None:
            return None, _BOTH_FAILED  # production denies with policy.error either way
        if rvm_error is None and interpreter_error is None and rvm == interpreter:
            return None, rvm
        return RvmDisagreement(where, json.loads(input_json), rvm, interpreter, rvm_error, interpreter_error), None

    def _on_rvm(self, input_json: str, data_json: str) -> tuple[Any, str | None]:
        if self._program is None and self._compile_error is None:
            try:
                self._program = regorus.Program.compile_from_modules(
                    self.bundle.data_json, self.bundle.decision_modules, [self._entrypoint]
                )
            except BaseException as exc:
                if not (isinstance(exc, Exception) or _is_panic(exc)):
                    raise
                self._compile_error = f"the policy does not compile for {self._entrypoint}: {_message(exc)}"
        if self._compile_error is not None:
            return None, self._compile_error
        try:
            if self._vm is None:
                self._vm = regorus.Rvm()
                self._vm.load_program(self._program)
                self._vm_data = None
            if self._vm_data != data_json:
                self._vm.set_data_json(data_json)
                self._vm_data = data_json
            self._vm.set_input_json(input_json)
            raw = self._vm.execute()
        except BaseException as exc:
            if not (isinstance(exc, Exception) or _is_panic(exc)):
                raise
            self._vm = None  # as in production: a VM that failed mid-run is not used again
            return None, _message(exc)
        return _decoded(raw), None

    def _on_interpreter(self, input_json: str, data_json: str) -> tuple[Any, str | None]:
        try:
            if self._interpreter is None:
                self._interpreter = self._engine.clone()
                self._interpreter.set_gather_prints(True)
                self._interpreter_data = self.bundle.data_json
            if self._interpreter_data != data_json:
                self._interpreter.clear_data()
                self._interpreter.add_data_json(data_json)
                self._interpreter_data = data_json
            self._interpreter.set_input_json(input_json)
            raw = self._interpreter.eval_rule_as_json(self._entrypoint)
            self._interpreter.take_prints()
        except BaseException as exc:
            if not (isinstance(exc, Exception) or _is_panic(exc)):
                raise
            self._interpreter = None
            return None, _message(exc)
        return _decoded(raw), None


def _decoded(raw: str | None) -> Any:
    """An engine's JSON text as a value; None for undefined."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return None if value == _UNDEFINED else value


def _is_panic(exc: BaseException) -> bool:
    # pyo3_runtime.PanicException derives from BaseException and is not importable by name.
    return type(exc).__name__ == "PanicException"


def _message(exc: BaseException) -> str:
    """A regorus error's message (``error: ...`` line, else its first line), without the source
    snippet and backtrace."""
    lines = [line.strip() for line in str(exc).split("Stack backtrace:", 1)[0].splitlines() if line.strip()]
    for line in lines:
        if line.startswith("error:"):
            return line.removeprefix("error:").strip()
    return lines[0] if lines else type(exc).__name__


def _shown(value: Any, error: str | None) -> str:
    if error is not None:
        return f"an error ({error})"
    if value is None:
        return "undefined"
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def _differences(a: Any, b: Any, path: str = "") -> Iterator[str]:
    """The paths (``obligations.limits``) at which two JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() | b.keys()):
            if key not in a or key not in b or a[key] != b[key]:
                yield from _differences(a.get(key), b.get(key), f"{path}.{key}" if path else str(key))
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                yield from _differences(x, y, f"{path}[{i}]")
    elif a != b:
        yield path or "the top level"
