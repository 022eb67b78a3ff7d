"""Tools for the people who write policy: coverage, explain, check.

- `coverage`: per file, which lines of the policy the Rego tests evaluated.
- `explain`: for one input, the decision, every reason with the file and line that produces its
  code, and the values of the helper rules the decision rests on.
- `check`: parse everything, compile every rule on the decision path's compiler, and report
  builtins regorus does not provide by name (OPA has about 2,000 conformance cases regorus does
  not pass, mostly crypto, JWT, GraphQL and networking builtins).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import regorus

from policy.base import PolicyInput
from policy.bundle import PolicyBundle, load_bundle
from policy.errors import PolicyBundleError
from policy.testing import _PACKAGE, _TEST_RULE

_RULE_HEAD = re.compile(r"^([a-z_][A-Za-z0-9_]*)\s*(?:\(|:=|=|contains\b|if\b|\{|\[)", re.MULTILINE)
_UNKNOWN_FN = re.compile(r"Unknown function: '([^']+)'|could not find function ([\w.]+)")
# Helper rules of the shipped decision policy worth showing when explaining a decision.
EXPLAIN_RULES = (
    "tool_capabilities", "is_auto_allowed", "is_known_capability_set", "has_read_untrusted", "is_consequential",
    "watched_args", "is_approved", "requested_egress", "sandbox", "limits",
)  # fmt: skip


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


def coverage(root: Path) -> list[FileCoverage]:
    """Run every Rego test with coverage on; coverage of the non-test files."""
    bundle = load_bundle(root)
    engine = _engine(bundle, coverage=True)
    for path, text in bundle.modules:
        if path.endswith("_test.rego") and (package := _PACKAGE.search(text)):
            for name in dict.fromkeys(_TEST_RULE.findall(text)):
                try:
                    engine.eval_rule(f"data.{package.group(1)}.{name}")
                except RuntimeError:
                    continue
    report = json.loads(engine.get_coverage_report_as_json())
    return [
        FileCoverage(f["path"], len(f.get("covered", [])), list(f.get("not_covered", [])))
        for f in report.get("files", [])
        if not f["path"].endswith("_test.rego")
    ]


@dataclass
class Explanation:
    """Why one input was decided the way it was."""

    decision: Any
    reasons: list[dict[str, Any]] = field(default_factory=list)
    helpers: dict[str, Any] = field(default_factory=dict)


def explain(root: Path, policy_input: PolicyInput, entrypoint: str = "data.stockade.decision") -> Explanation:
    """The decision for ``policy_input``, each reason located in the source, and the helper values."""
    bundle = load_bundle(root)
    engine = _engine(bundle)
    engine.set_input_json(policy_input.model_dump_json())
    decision = json.loads(engine.eval_rule_as_json(entrypoint))
    package = entrypoint.rsplit(".", 1)[0]
    helpers: dict[str, Any] = {}
    for rule in EXPLAIN_RULES:
        try:
            helpers[rule] = json.loads(engine.eval_rule_as_json(f"{package}.{rule}"))
        except RuntimeError as exc:
            helpers[rule] = f"error: {str(exc).strip().splitlines()[-1]}"
    reasons = []
    for reason in (decision or {}).get("reasons", []) if isinstance(decision, dict) else []:
        reasons.append({**reason, "defined_at": _where(bundle, reason.get("code", ""))})
    return Explanation(decision, reasons, helpers)


def _where(bundle: PolicyBundle, code: str) -> list[str]:
    needle = f'"code": "{code}"'
    places = []
    for path, text in bundle.decision_modules:
        for number, line in enumerate(text.splitlines(), start=1):
            if needle in line:
                places.append(f"{path}:{number}")
    return places


def check(root: Path) -> list[str]:
    """Problems that would stop the policy loading or evaluating here; empty if none.

    Compiles every rule of every non-test module as an entry point, so a builtin regorus lacks
    is found even in a rule the decision does not reach yet.
    """
    try:
        bundle = load_bundle(root)
        _engine(bundle)
    except (PolicyBundleError, RuntimeError) as exc:
        return [str(exc).strip()]
    problems: list[str] = []
    entry_points = _all_rules(bundle)
    # The compiler stops at its first error: take out the module at fault and go again.
    remaining = list(bundle.decision_modules)
    while remaining and entry_points:
        try:
            regorus.Program.compile_from_modules(bundle.data_json, remaining, sorted(entry_points))
            break
        except RuntimeError as exc:
            message = str(exc).strip()
            match = _UNKNOWN_FN.search(message)
            culprit = _module_calling(remaining, match.group(1) or match.group(2)) if match else None
            if match and culprit:
                problems.append(f"{culprit}: builtin {match.group(1) or match.group(2)} is not provided by regorus")
                remaining = [m for m in remaining if m[0] != culprit]
                entry_points = _all_rules_of(remaining)
            else:
                problems.append(message.splitlines()[-1] if message else "compile failed")
                break
    return problems


def _module_calling(modules: list[tuple[str, str]], function: str) -> str | None:
    return next((path for path, text in modules if f"{function}(" in text), None)


def _all_rules(bundle: PolicyBundle) -> set[str]:
    return _all_rules_of(bundle.decision_modules)


def _all_rules_of(modules: list[tuple[str, str]]) -> set[str]:
    rules: set[str] = set()
    for _, text in modules:
        package = _PACKAGE.search(text)
        if package:
            rules.update(f"data.{package.group(1)}.{name}" for name in _RULE_HEAD.findall(text)
                         if name not in ("package", "import", "default"))  # fmt: skip
    return rules


def _engine(bundle: PolicyBundle, *, coverage: bool = False) -> Any:
    engine = regorus.Engine()
    if coverage:
        engine.set_enable_coverage(True)
    for path, text in bundle.modules:
        engine.add_policy(path, text)
    engine.add_data_json(bundle.data_json)
    return engine
