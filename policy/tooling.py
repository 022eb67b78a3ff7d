"""Tools for the people who write policy: coverage, explain, eval of any rule, bench, new, check.

- `coverage`: per file, which lines of the policy the Rego tests evaluated.
- `explain`: for one input, the decision as production makes it (`EmbeddedEngine.evaluate`),
  the interpreter's value or its error with the source snippet, every reason with the file and
  line of the rule body that produced it, the value of every rule of the entrypoint's package
  (the team's own included) and, for anything but allow, why not: the first failing condition
  of each allow rule, with its operands' values.
- `evaluate_rule`: any rule, on the RVM compiled for it and on the interpreter, compared.
- `bench`: decision latency on the production path, next to the latency of each rule area
  (one ``.rego`` file's rules, compiled as entry points on their own).
- `new_area`: a rule file adding to ``deny_reasons``, its test, and the reason's catalog entry.
- `check`: parse everything, compile every rule on the decision path's compiler, and report
  builtins regorus does not provide by name (OPA has about 2,000 conformance cases regorus does
  not pass, mostly crypto, JWT, GraphQL and networking builtins).
"""

from __future__ import annotations

import json
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import regorus

from policy.base import Outcome, PolicyInput
from policy.builtins import strict_interpreter
from policy.bundle import PolicyBundle, load_bundle
from policy.config import PolicySettings
from policy.embedded import EmbeddedEngine
from policy.errors import PolicyBundleError
from policy.testing import (
    Prober,
    _decoded,
    _head_name,
    _is_panic,
    _message,
    _static_prefix,
    test_rules,
    without_backtrace,
)

T = TypeVar("T")
_RULE_PATH = re.compile(r"^data(\.[A-Za-z_][A-Za-z0-9_]*)+$")


@dataclass(frozen=True, slots=True)
class FileCoverage:
    """Lines of one policy file the tests evaluated, and those they did not."""

    file: str
    covered: int
    not_covered: list[int]

    @property
    def percent(self) -> float:
        total = self.covered + len(self.not_covered)
        return 100.0 * self.covered / total if total else 100.0


def total_percent(files: Sequence[FileCoverage]) -> float:
    """Covered lines over all lines of every file (100 when there are none)."""
    covered = sum(f.covered for f in files)
    total = covered + sum(len(f.not_covered) for f in files)
    return 100.0 * covered / total if total else 100.0


def coverage(root: Path, *, max_bytes: int = 1 << 20, select: re.Pattern[str] | None = None) -> list[FileCoverage]:
    """Run the Rego tests (those ``select`` matches, as `run_rego_tests`) with coverage on;
    coverage of the non-test files."""
    bundle = load_bundle(root, max_bytes=max_bytes)
    engine = _engine(bundle, coverage=True)
    for path, name, rule in test_rules(bundle, engine):
        if select is not None and not (select.search(rule) or select.search(f"{path}::{name}")):
            continue
        try:
            engine.eval_rule(rule)
        except RuntimeError:
            continue
    engine.take_prints()
    report = json.loads(engine.get_coverage_report_as_json())
    return [
        FileCoverage(f["path"], len(f.get("covered", [])), list(f.get("not_covered", [])))
        for f in report.get("files", [])
        if not f["path"].endswith("_test.rego")
    ]


# -- explain -----------------------------------------------------------------------------------


@dataclass
class Explanation:
    """Why one input was decided the way it was.

    ``decision``: what production decided (`EmbeddedEngine.evaluate`, as JSON);
    ``interpreter``: the entrypoint's value on the interpreter, or ``interpreter_error`` (the
    whole message with its ``file:line:col`` and source snippet); ``reasons``: the decision's
    reasons, each with ``defined_at`` (``file:line`` of the rule bodies that produced its code);
    ``rules``: every other rule of the entrypoint's package by name (None: undefined), and
    ``rule_errors`` those that raised; ``why_not_allow``: for any outcome but allow, each
    allow rule of the entrypoint with its first failing condition.
    """

    decision: dict[str, Any]
    interpreter: Any = None
    interpreter_error: str | None = None
    reasons: list[dict[str, Any]] = field(default_factory=list)
    rules: dict[str, Any] = field(default_factory=dict)
    rule_errors: dict[str, str] = field(default_factory=dict)
    why_not_allow: list[dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        """The whole explanation, for ``--json``."""
        return {
            "decision": self.decision,
            "interpreter": {"value": self.interpreter, "error": self.interpreter_error},
            "reasons": self.reasons,
            "rules": self.rules,
            "rule_errors": self.rule_errors,
            "why_not_allow": self.why_not_allow,
        }


def explain(
    root: Path, policy_input: PolicyInput, entrypoint: str = "data.stockade.decision", *, max_bytes: int = 1 << 20
) -> Explanation:
    """Explain the decision for ``policy_input`` (see `Explanation`).

    Raises:
        PolicyBundleError: the policy does not load or does not compile for ``entrypoint``.
    """
    settings = PolicySettings(dir=root, entrypoint=entrypoint, max_policy_bytes=max_bytes)
    production = EmbeddedEngine(settings)
    decision = production.evaluate(policy_input)
    bundle = production.bundle
    input_json = policy_input.model_dump_json()
    engine = _engine(bundle)
    engine.set_input_json(input_json)
    why = Explanation(decision=decision.model_dump(mode="json"))
    try:
        why.interpreter = _decoded(engine.eval_rule_as_json(entrypoint))
    except BaseException as exc:
        if not (isinstance(exc, Exception) or _is_panic(exc)):
            raise
        why.interpreter_error = without_backtrace(exc)
        engine = _engine(bundle)  # an engine that raised is not used again
        engine.set_input_json(input_json)
    prober = Prober(engine, input_json)
    package, _, name = entrypoint.rpartition(".")
    decision_files = {path for path, _ in bundle.decision_modules}
    rules = [(file, rule) for file, rule in _package_rules(prober, package) if file in decision_files]
    for rule_name in dict.fromkeys(n for _, rule in rules if (n := _head_name(rule)) and n != name):
        if _is_function(rules, rule_name):
            continue
        try:
            why.rules[rule_name] = _decoded(engine.clone().eval_rule_as_json(f"{package}.{rule_name}"))
        except BaseException as exc:
            if not (isinstance(exc, Exception) or _is_panic(exc)):
                raise
            why.rule_errors[rule_name] = without_backtrace(exc)
    producers = _reason_producers(prober, rules)
    for reason in why.decision["reasons"]:
        places = producers.get(reason["code"]) or _where(bundle, reason["code"])
        why.reasons.append({**reason, "defined_at": places})
    if decision.outcome is not Outcome.ALLOW:
        for file, rule in rules:
            if _head_name(rule) != name or not _is_allow_head(rule):
                continue
            for body in rule.get("bodies", []):
                failure = prober.first_failure(file, body)
                where = f"{file}:{rule['span']['line']}"
                why.why_not_allow.append({"rule": name, "where": where,
                                          "failed": failure.as_json() if failure else None})  # fmt: skip
    return why


def _package_rules(prober: Prober, package: str) -> list[tuple[str, dict[str, Any]]]:
    """(file, rule) of every rule definition (``Spec`` or ``Default`` body) in ``package``."""
    found = []
    for file, tree in prober.modules.items():
        if "data." + ".".join(_static_prefix(tree["package"]["refr"])) != package:
            continue
        for rule in tree.get("rules", []):
            kind, body = next(iter(rule.items()))
            if kind == "Spec":
                found.append((file, body))
    return found


def _is_function(rules: list[tuple[str, dict[str, Any]]], name: str) -> bool:
    return any(_head_name(rule) == name and "Func" in (rule.get("head") or {}) for _, rule in rules)


def _is_allow_head(rule: dict[str, Any]) -> bool:
    """The rule's value is an object literal with ``"outcome": "allow"``."""
    heads: dict[str, dict[str, Any]] = rule.get("head") or {}
    head = next(iter(heads.values()), {})
    value = (head.get("assign") or {}).get("value") or {}
    for item in value.get("Object", {}).get("fields", []):
        key, item_value = item[-2], item[-1]
        if key.get("String", {}).get("value") == "outcome":
            return bool(item_value.get("String", {}).get("value") == Outcome.ALLOW.value)
    return False


def _reason_producers(prober: Prober, rules: list[tuple[str, dict[str, Any]]]) -> dict[str, list[str]]:
    """For each reason code the input produces, the ``file:line`` of the bodies of the
    ``contains`` rules (``deny_reasons``, ``approval_reasons``, ...) that produced it: each body
    is evaluated on its own as a probe rule of the same package."""
    found: dict[str, list[str]] = {}
    for file, rule in rules:
        head: dict[str, Any] | None = (rule.get("head") or {}).get("Set")
        if head is None or head.get("key") is None:
            continue
        # The head's span is reliable where an object key's is not: the key is what follows `contains`.
        key = re.sub(r"^\s*contains\b", "", prober.text(file, head)[len(prober.text(file, head["refr"])) :]).strip()
        for body in rule.get("bodies") or [{"query": {"stmts": []}, "span": rule["span"]}]:
            statements = [prober.text(file, statement) for statement in body["query"]["stmts"]] or ["true"]
            probe = "__stockade_probe contains " + key + " if {\n" + "\n".join(f"\t{s}" for s in statements) + "\n}"
            value, _ = prober.evaluate(file, probe)
            for item in value if isinstance(value, list) else []:
                code = item.get("code") if isinstance(item, dict) else None
                where = f"{file}:{rule['span']['line']}"
                if isinstance(code, str) and where not in found.setdefault(code, []):
                    found[code].append(where)
    return found


def _where(bundle: PolicyBundle, code: str) -> list[str]:
    needle = f'"code": "{code}"'
    places = []
    for path, text in bundle.decision_modules:
        for number, line in enumerate(text.splitlines(), start=1):
            if needle in line:
                places.append(f"{path}:{number}")
    return places


# -- eval of any rule ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RuleValue:
    """A rule's value for one input on both engines. ``value`` is None when undefined; an
    ``*_error`` is set when that engine raised; ``agree`` is false when they differ."""

    rule: str
    value: Any
    rvm: Any
    rvm_error: str | None = None
    interpreter_error: str | None = None

    @property
    def defined(self) -> bool:
        return self.value is not None

    @property
    def agree(self) -> bool:
        return self.rvm_error is None and self.interpreter_error is None and self.rvm == self.value


def rule_path(rule: str, entrypoint: str = "data.stockade.decision") -> str:
    """``data.stockade.x`` for ``data.stockade.x``, ``stockade.x`` or ``x`` (in the entrypoint's
    package).

    Raises:
        ValueError: not a rule path.
    """
    path = (
        rule
        if rule.startswith("data.")
        else f"data.{rule}"
        if "." in rule
        else f"{entrypoint.rpartition('.')[0]}.{rule}"
    )
    if not _RULE_PATH.match(path):
        raise ValueError(f"{rule!r} is not a rule path such as data.stockade.deny_reasons")
    return path


def evaluate_rule(root: Path, rule: str, policy_input: PolicyInput | None, *, max_bytes: int = 1 << 20) -> RuleValue:
    """``rule`` (a ``data.`` path) for ``policy_input`` on an RVM compiled with it as the entry
    point, as production compiles the decision, and on the interpreter.

    Raises:
        PolicyBundleError: the policy does not load, or ``rule`` is not a rule of it.
    """
    bundle = load_bundle(root, max_bytes=max_bytes)
    input_json = policy_input.model_dump_json() if policy_input is not None else None
    engine = _engine(bundle)
    value: Any = None
    interpreter_error: str | None = None
    try:
        if input_json is not None:
            engine.set_input_json(input_json)
        value = _decoded(engine.eval_rule_as_json(rule))
    except BaseException as exc:
        if not (isinstance(exc, Exception) or _is_panic(exc)):
            raise
        interpreter_error = without_backtrace(exc)
        if "not a valid rule path" in interpreter_error:
            raise PolicyBundleError(f"{rule} is not a rule of the policy in {root}") from exc
    rvm: Any = None
    rvm_error: str | None = None
    try:
        program = regorus.Program.compile_from_modules(bundle.data_json, bundle.decision_modules, [rule])
        vm = regorus.Rvm()
        vm.load_program(program)
        vm.set_data_json(bundle.data_json)
        if input_json is not None:
            vm.set_input_json(input_json)
        rvm = _decoded(vm.execute())
    except BaseException as exc:
        if not (isinstance(exc, Exception) or _is_panic(exc)):
            raise
        rvm_error = without_backtrace(exc)
    return RuleValue(rule, value, rvm, rvm_error, interpreter_error)


# -- bench ---------------------------------------------------------------------------------------

# Calls of the shipped tool catalog's shapes: an allowed read, a payment held for a human, a
# send denied for its untrusted destination, a forbidden capability set, a busy agent.
_BENCH_INPUTS: dict[str, dict[str, Any]] = {
    "allowed_read": {"tool": {"name": "read_file", "capabilities": ["reads_private"], "risk": "low"},
                     "args": {"path": "notes.txt"}},
    "payment_needs_approval": {"tool": {"name": "pay", "capabilities": ["financial"], "risk": "high",
                                        "amount_args": ["amount"], "destination_args": ["to"]},
                               "args": {"to": "acct-1", "amount": 120},
                               "values": {"to": [{"path": "to", "sources": ["user"]}],
                                          "amount": [{"path": "amount", "sources": ["user"]}]}},
    "untrusted_destination": {"tool": {"name": "send_email", "capabilities": ["sends_external"], "risk": "medium",
                                       "destination_args": ["to"], "content_args": ["body"]},
                              "args": {"to": "eve@attacker.example", "body": "see https://x.example"},
                              "session": {"id": "s-1", "taint": ["untrusted_content"]},
                              "values": {"to": [{"path": "to", "sources": ["untrusted:get_webpage:c-1"]}]}},
    "denied_capability_set": {"tool": {"name": "agent_do_all", "risk": "medium",
                                       "capabilities": ["reads_private", "reads_untrusted", "sends_external"]},
                              "args": {}},
    "busy_agent": {"tool": {"name": "search", "capabilities": ["reads_untrusted"], "risk": "low"},
                   "args": {"q": "weather"}, "rate": {"session_per_minute": 500}},
}  # fmt: skip


def bench_inputs() -> dict[str, PolicyInput]:
    """The representative inputs `bench` decides, by name."""
    common = {"subject": {"agent": "bench", "principal": "alice@example.com"}, "session": {"id": "s-1"},
              "now": "2026-11-22T10:00:00Z"}  # fmt: skip
    return {name: PolicyInput.model_validate({**common, **shape}) for name, shape in _BENCH_INPUTS.items()}


@dataclass(frozen=True, slots=True)
class Latency:
    """Latency of one thing benchmarked, in microseconds, over ``n`` evaluations."""

    name: str
    n: int
    p50_us: float
    p99_us: float
    mean_us: float
    rules: tuple[str, ...] = ()
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "n": self.n, "p50_us": round(self.p50_us, 2), "p99_us": round(self.p99_us, 2),
                "mean_us": round(self.mean_us, 2), "rules": list(self.rules), "error": self.error}  # fmt: skip


@dataclass(frozen=True, slots=True)
class BenchReport:
    """Decision latency of the whole policy on the production path, of a trivial one-rule policy
    on the same path (the baseline), and of each rule area."""

    decision: Latency
    baseline: Latency
    areas: list[Latency]
    inputs: list[str]
    outcomes: dict[str, str]

    def as_json(self) -> dict[str, Any]:
        return {
            "decision": self.decision.as_json(),
            "baseline": self.baseline.as_json(),
            "areas": [a.as_json() for a in self.areas],
            "inputs": self.inputs,
            "outcomes": self.outcomes,
        }


_BASELINE = 'package stockade\n\ndecision := {"outcome": "deny", "reasons": [{"code": "bench.baseline"}]}\n'


def bench(
    root: Path,
    inputs: dict[str, PolicyInput] | None = None,
    *,
    iterations: int = 200,
    entrypoint: str = "data.stockade.decision",
    max_bytes: int = 1 << 20,
) -> BenchReport:
    """Measure decision latency for ``inputs`` (default: `bench_inputs`), ``iterations`` rounds.

    The decision runs through `EmbeddedEngine.evaluate` (RVM, confirmed on the interpreter
    unless it denies). Each rule area is one ``.rego`` file: an RVM program compiled with that
    file's rules as entry points, the other files' definitions of the same rules (the shared
    ``deny_reasons``, ``approval_reasons``) cut out, so it costs what that file adds.

    Raises:
        PolicyBundleError: the policy does not load or compile.
    """
    chosen = inputs or bench_inputs()
    settings = PolicySettings(dir=root, entrypoint=entrypoint, max_policy_bytes=max_bytes)
    production = EmbeddedEngine(settings)
    outcomes = {name: production.evaluate(policy_input).outcome.value for name, policy_input in chosen.items()}
    decision = _time("decision (production path)", production.evaluate, list(chosen.values()), iterations)
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "baseline.rego").write_text(_BASELINE)
        trivial = EmbeddedEngine(PolicySettings(dir=Path(scratch), entrypoint="data.stockade.decision"))
        baseline = _time("baseline: one-rule policy", trivial.evaluate, list(chosen.values()), iterations)
    bundle = production.bundle
    areas = [_area(bundle, file, chosen, iterations) for file, _ in bundle.decision_modules]
    return BenchReport(decision, baseline, areas, list(chosen), outcomes)


def _time(
    name: str, run: Callable[[T], object], items: Sequence[T], iterations: int, rules: tuple[str, ...] = ()
) -> Latency:
    """``run`` on each item, ``iterations`` rounds after one to warm up (lazily made VMs)."""
    for item in items:
        run(item)
    samples: list[float] = []
    for _ in range(iterations):
        for item in items:
            started = time.perf_counter()
            run(item)
            samples.append(time.perf_counter() - started)
    samples.sort()
    n = len(samples)
    return Latency(name, n, samples[n // 2] * 1e6, samples[min(n - 1, int(n * 0.99))] * 1e6,
                   statistics.fmean(samples) * 1e6, rules)  # fmt: skip


def _area(bundle: PolicyBundle, file: str, inputs: dict[str, PolicyInput], iterations: int) -> Latency:
    """One rule area's latency: its rules as the entry points of an RVM program of their own."""
    probe = regorus.Engine()
    try:
        for path, text in bundle.decision_modules:
            probe.add_policy(path, text)
        trees = {item["source"]["file"]: item["ast"] for item in json.loads(probe.get_ast_as_json())}
    except RuntimeError as exc:
        return Latency(file, 0, 0, 0, 0, error=_message(exc))
    tree = trees[file]
    package = ".".join(_static_prefix(tree["package"]["refr"]))
    names = {n for rule in tree.get("rules", []) if (n := _rule_name(rule)) is not None}
    functions = {_rule_name(rule) for rule in tree.get("rules", []) if "Func" in _rule_head(rule)}
    entry_points = sorted(f"data.{package}.{n}" for n in names - functions)
    if not entry_points:
        return Latency(file, 0, 0, 0, 0, error="defines functions only")
    modules = [(path, text if path == file else _without_rules(text, trees[path], package, names))
               for path, text in bundle.decision_modules]  # fmt: skip
    try:
        program = regorus.Program.compile_from_modules(bundle.data_json, modules, entry_points)
        vm = regorus.Rvm()
        vm.load_program(program)
        vm.set_data_json(bundle.data_json)
    except BaseException as exc:
        if not (isinstance(exc, Exception) or _is_panic(exc)):
            raise
        return Latency(file, 0, 0, 0, 0, tuple(entry_points), error=_message(exc))

    def run(input_json: str) -> None:
        vm.set_input_json(input_json)
        for entry_point in entry_points:
            vm.execute_entry_point(entry_point)

    encoded = [policy_input.model_dump_json() for policy_input in inputs.values()]
    try:
        return _time(file, run, encoded, iterations, tuple(entry_points))
    except BaseException as exc:
        if not (isinstance(exc, Exception) or _is_panic(exc)):
            raise
        return Latency(file, 0, 0, 0, 0, tuple(entry_points), error=_message(exc))


def _rule_head(rule: dict[str, Any]) -> dict[str, Any]:
    kind, body = next(iter(rule.items()))
    return {} if kind == "Default" else dict(body.get("head") or {})


def _rule_name(rule: dict[str, Any]) -> str | None:
    kind, body = next(iter(rule.items()))
    if kind == "Default":
        prefix = _static_prefix(body["refr"])
        return prefix[0] if prefix else None
    return _head_name(body)


def _without_rules(text: str, tree: dict[str, Any], package: str, names: set[str]) -> str:
    """``text`` with the definitions of ``names`` blanked (lines kept), if in ``package``."""
    if ".".join(_static_prefix(tree["package"]["refr"])) != package:
        return text
    source = bytearray(text.encode())
    for rule in tree.get("rules", []):
        if _rule_name(rule) in names:
            span = next(iter(rule.values()))["span"]
            end = span["end"] + (bytes(source[span["end"] : span["end"] + 1]) in (b'"', b"`"))  # a closing quote
            for i in range(span["start"], end):
                if source[i] != ord("\n"):
                    source[i] = ord(" ")
    return source.decode()


# -- new ------------------------------------------------------------------------------------------

_AREA = re.compile(r"^[a-z][a-z0-9_]{0,40}$")


@dataclass(frozen=True, slots=True)
class NewArea:
    """What `new_area` wrote: the rule file, its test, and the catalog entry (``catalog`` is the
    file it was added to; None: the caller shows it for the team to add)."""

    rule_file: Path
    test_file: Path
    code: str
    entry: dict[str, str]
    catalog: Path | None


def new_area(root: Path, area: str, package: str = "stockade") -> NewArea:
    """Write ``<root>/<package>/<area>.rego`` (a rule adding to ``deny_reasons``, with Regal's
    METADATA) and ``<area>_test.rego`` (tests that pass as written), and add the reason code to
    ``<root>/<package>/reasons/data.json`` if that catalog exists.

    Raises:
        ValueError: ``area`` is not a lower-case Rego name.
        FileExistsError: either file, or the code in the catalog, exists already.
    """
    if not _AREA.match(area) or area.endswith("_test"):
        raise ValueError(f"{area!r} is not a rule area name: use lower case letters, digits and _, e.g. deploy_guard")
    directory = root / package.replace(".", "/")
    rule_file, test_file = directory / f"{area}.rego", directory / f"{area}_test.rego"
    for path in (rule_file, test_file):
        if path.exists():
            raise FileExistsError(f"{path} exists already; choose another area name or edit it")
    code = f"{area}.example"
    entry = {
        "outcome": "deny",
        "message": f"what {area} refuses, in one sentence",
        "runbook": f"what an operator or agent does about {code}",
    }
    catalog = directory / "reasons" / "data.json"
    reasons: dict[str, Any] | None = None
    if catalog.exists():
        reasons = json.loads(catalog.read_text())
        if code in reasons:
            raise FileExistsError(f"{catalog} already holds {code}")
    directory.mkdir(parents=True, exist_ok=True)
    rule_file.write_text(_RULE_TEMPLATE.format(area=area, code=code, package=package))
    test_file.write_text(_TEST_TEMPLATE.format(area=area, code=code, package=package))
    if reasons is not None:
        reasons[code] = entry
        catalog.write_text(json.dumps(reasons, indent=2) + "\n")
    return NewArea(rule_file, test_file, code, entry, catalog if reasons is not None else None)


_RULE_TEMPLATE = """\
# {area}: what this rule area refuses, and why. Each rule adds a reason to deny_reasons (or to
# approval_reasons, to hold the call for a human); data.stockade.decision aggregates them.
# (The package's METADATA is decision.rego's: a package takes one package-scoped block.)
package {package}

# METADATA
# title: {code}
# description: >-
#   Replace the condition with yours. The code is in the reason catalog
#   (reasons/data.json) with its outcome, message and runbook.
# scope: rule
# custom:
#   reason: {code}
deny_reasons contains {{"code": "{code}", "message": sprintf("tool %s is refused", [input.tool.name])}} if {{
	input.tool.name == "{area}_example_tool"
}}
"""

_TEST_TEMPLATE = """\
package {package}_test

# The full path, not `import data.{package}`: regorus 0.13's interpreter can evaluate an imported
# package file by file, and a rule area's reasons would then read as undefined.
example_call := {{
	"subject": {{"agent": "agent-1", "principal": "alice@example.com"}},
	"session": {{"id": "s-1"}},
	"tool": {{"name": "{area}_example_tool", "capabilities": [], "risk": "low", "limits": {{}}}},
	"args": {{}},
	"now": "2026-11-22T10:00:00Z",
}}

test_{area}_example_is_denied if {{
	reasons := data.{package}.deny_reasons with input as example_call
	"{code}" in {{reason.code | some reason in reasons}}
}}

test_{area}_other_tools_are_not_denied_by_it if {{
	other := object.union(example_call, {{"tool": {{"name": "another_tool"}}}})
	reasons := data.{package}.deny_reasons with input as other
	not "{code}" in {{reason.code | some reason in reasons}}
}}
"""


def _engine(bundle: PolicyBundle, *, coverage: bool = False) -> Any:
    engine = strict_interpreter()  # as production's: builtins undefined on bad input raise (`policy.builtins`)
    engine.set_gather_prints(True)  # print() in the policy must not land on stdout (--json)
    if coverage:
        engine.set_enable_coverage(True)
    for path, text in bundle.modules:
        engine.add_policy(path, text)
    engine.add_data_json(bundle.data_json)
    return engine
