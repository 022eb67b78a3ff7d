"""`stockade policy check` on real regorus: the schemas of ``input`` and ``data``, and every silent
failure of the first day (issue 15) caught with its file and line.

The three first-day team policies (tests/policy/fixtures/first_day/) are placed beside a copy of
the shipped policy, as a team would add them; the broken variants reproduce each failure."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from policy.base import RATE_WINDOWS, PolicyInput
from policy.bundle import load_bundle
from policy.check import Problem, check_policy, known_builtins
from policy.schema import args_by_tool, data_schema, input_schema
from policy.testing import run_rego_tests
from policy.tooling import new_area
from tests.conftest import REPO

SHIPPED = REPO / "policies"
FIXTURES = Path(__file__).parent / "fixtures" / "first_day"
TOOLS: list[dict[str, Any]] = json.loads((FIXTURES / "tools.json").read_text())


def _deep_merge(into: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


def first_day(tmp_path: Path, *, rego: tuple[str, ...] = (), catalog: str | None = None) -> Path:
    """A copy of the shipped policy with the three first-day policies added (their rule files,
    tests, team data, catalog entries and reason codes), plus the broken variants named."""
    root = tmp_path / "policies"
    shutil.copytree(SHIPPED, root)
    for source in [*FIXTURES.glob("*.rego"), *(FIXTURES / "broken" / name for name in rego)]:
        shutil.copy(source, root / "stockade" / source.name)
    shutil.copytree(FIXTURES / "team", root / "team")
    data_file = root / "stockade" / "data.json"
    data = json.loads(data_file.read_text())
    _deep_merge(data["catalog"], json.loads((FIXTURES / "catalog.json").read_text()))
    if catalog:
        _deep_merge(data["catalog"], json.loads((FIXTURES / "broken" / catalog).read_text()))
    data_file.write_text(json.dumps(data, indent=2) + "\n")
    reasons_file = root / "stockade" / "reasons" / "data.json"
    if reasons_file.exists():  # the catalog is enforced once it exists: the team's codes go in it
        reasons = json.loads(reasons_file.read_text())
        reasons.update(json.loads((FIXTURES / "reasons.json").read_text()))
        reasons_file.write_text(json.dumps(reasons, indent=2) + "\n")
    return root


def errors(problems: list[Problem]) -> list[Problem]:
    return [p for p in problems if p.severity == "error"]


def line_of(path: Path, needle: str, occurrence: int = 0) -> int:
    """The 1-based line of the ``occurrence``-th line holding ``needle``."""
    return [n for n, line in enumerate(path.read_text().splitlines(), start=1) if needle in line][occurrence]


def only(problems: list[Problem], code: str) -> Problem:
    found = [p for p in problems if p.code == code]
    assert len(found) == 1, [str(p) for p in problems]
    return found[0]


def test_the_shipped_policy_checks_clean() -> None:
    """The policy stockade ships has no errors, and checking it is quick (printed, not asserted:
    the machine is shared)."""
    started = time.perf_counter()
    problems = check_policy(SHIPPED)
    elapsed = time.perf_counter() - started
    print(f"check_policy(policies/): {elapsed * 1000:.0f} ms, {len(problems)} warnings")
    assert errors(problems) == [], [str(p) for p in problems]


def test_the_first_day_policies_check_clean_and_their_tests_pass(tmp_path: Path) -> None:
    """The three policies a security team writes first are writable as stated: no errors with or
    without the tool specs, and every one of their Rego tests passes on both engines."""
    root = first_day(tmp_path)
    assert errors(check_policy(root)) == [], [str(p) for p in check_policy(root)]
    assert errors(check_policy(root, tools=TOOLS)) == [], [str(p) for p in check_policy(root, tools=TOOLS)]
    results = run_rego_tests(root)
    team = [r for r in results if Path(r.file).name in {"deploy_guard_test.rego", "destinations_test.rego",
                                                          "limits_test.rego"}]  # fmt: skip
    assert len(team) == 11
    assert [(r.name, r.error) for r in team if not r.passed] == []


def test_a_typo_in_an_input_path_is_caught_with_its_line(tmp_path: Path) -> None:
    root = first_day(tmp_path, rego=("typo_principal.rego",))
    problem = only(check_policy(root), "input.unknown_path")
    rule = root / "stockade" / "typo_principal.rego"
    assert problem.file == str(rule)
    assert problem.line == line_of(rule, "input.subject.princpal")
    assert "unknown path input.subject.princpal (did you mean input.subject.principal?)" in problem.message


def test_a_limit_written_as_a_string_is_caught_in_data_json(tmp_path: Path) -> None:
    """ "2" is not 2: Rego orders numbers before strings, so ``count > "2"`` is never true and 500
    calls a minute pass. The data.json value is the error, at its own line."""
    root = first_day(tmp_path, catalog="limit_string.json")
    problem = only(check_policy(root), "data.invalid")
    data_file = root / "stockade" / "data.json"
    assert problem.file == str(data_file)
    assert problem.line == line_of(data_file, '"agent_per_hour"')
    assert 'data.stockade.catalog.rate_limits.agent_per_hour is the string "2", not a number' in problem.message


def test_a_rate_window_the_router_never_sends_is_caught(tmp_path: Path) -> None:
    root = first_day(tmp_path, catalog="window_week.json")
    problem = only(check_policy(root), "data.invalid")
    data_file = root / "stockade" / "data.json"
    assert (problem.file, problem.line) == (str(data_file), line_of(data_file, '"agent_per_week"'))
    assert "never sends the window agent_per_week" in problem.message


def test_http_send_is_refused_naming_the_fix(tmp_path: Path) -> None:
    """regorus has http.send but leaves it undefined, and OPA would call out: either way the rule
    cannot do what it says."""
    root = first_day(tmp_path, rego=("http_send.rego",))
    problem = only(check_policy(root), "builtin.refused")
    rule = root / "stockade" / "http_send.rego"
    assert (problem.file, problem.line) == (str(rule), line_of(rule, "http.send("))
    assert "data.json" in problem.message
    assert "http.send" in known_builtins()  # refused by policy, not missing: the AST found it


def test_every_unsupported_builtin_call_is_reported_not_only_the_first(tmp_path: Path) -> None:
    root = first_day(tmp_path, rego=("two_builtins.rego",))
    rule = root / "stockade" / "two_builtins.rego"
    found = [(p.line, p.message.split()[1]) for p in check_policy(root) if p.code == "builtin.unsupported"]
    assert found == [
        (line_of(rule, "io.jwt.decode_verify("), "io.jwt.decode_verify"),
        (line_of(rule, "crypto.sha256("), "crypto.sha256"),
    ]
    assert all(p.file == str(rule) for p in check_policy(root) if p.code == "builtin.unsupported")


def test_iterating_a_string_is_caught(tmp_path: Path) -> None:
    """``some x in <a string>`` errors on the interpreter and is undefined on the compiled path."""
    root = first_day(tmp_path, rego=("iterate_string.rego",))
    problem = only(check_policy(root), "type.iterate_scalar")
    rule = root / "stockade" / "iterate_string.rego"
    assert (problem.file, problem.line) == (str(rule), line_of(rule, "some x in input.tool.name"))
    assert problem.message.startswith("input.tool.name is a string")


def test_argument_paths_are_checked_against_each_tool_schema(tmp_path: Path) -> None:
    """With the tool specs, ``input.args`` in a rule guarded by ``input.tool.name == "x"`` is x's
    argument schema; without them, arguments are open."""
    root = first_day(tmp_path, rego=("args_typo.rego",))
    assert errors(check_policy(root)) == []
    problem = only(check_policy(root, tools=TOOLS), "input.unknown_path")
    rule = root / "stockade" / "args_typo.rego"
    assert (problem.file, problem.line) == (str(rule), line_of(rule, "input.args.too"))
    assert "(did you mean input.args.to?)" in problem.message


def test_tool_names_no_registered_tool_has_are_warned_about(tmp_path: Path) -> None:
    root = first_day(tmp_path)
    (root / "stockade" / "named.rego").write_text('package stockade\n\nis_mailer if input.tool.name == "send_emial"\n')
    problem = only(check_policy(root, tools=TOOLS), "type.not_in_enum")
    assert (problem.line, problem.severity) == (3, "warning")
    assert "(did you mean send_email?)" in problem.message


def test_data_references_are_resolved_through_imports_and_against_data_json(tmp_path: Path) -> None:
    root = first_day(tmp_path)
    rule = root / "stockade" / "refs.rego"
    rule.write_text(
        "package stockade\n\nimport data.stockade.catalog\n\n"
        "too_many if input.rate.agent_per_minute > catalog.rate_limit.agent_per_minute\n\n"
        "too_many_today if input.rate.agent_per_day > catalog.rate_limits.agent_per_day\n\n"
        'is_partner if "partner.org" in data.team.mail.partner_domain\n'
    )
    problems = check_policy(root)
    assert [(p.line, p.code) for p in errors(problems)] == [
        (5, "data.unknown_path"),
        (7, "data.unset"),
        (9, "data.unknown_path"),
    ]
    messages = [p.message for p in errors(problems)]
    assert "(did you mean data.stockade.catalog.rate_limits?)" in messages[0]
    assert "agent_per_day is not set in any data.json" in messages[1]
    assert "(did you mean data.team.mail.partner_domains?)" in messages[2]


def test_static_type_mismatches_are_caught(tmp_path: Path) -> None:
    root = first_day(tmp_path)
    (root / "stockade" / "types.rego").write_text(
        "package stockade\n\n"
        'busy if input.session.call_count == "2"\n\n'
        "odd if count(input.session.call_count) > 1\n\n"
        "hosts contains egress.hots if some egress in input.tool.egress\n\n"
        'wide if { every c in input.tool.capabilities { c.name != "x" } }\n'
    )
    found = [(p.line, p.code) for p in errors(check_policy(root))]
    assert found == [(3, "type.mismatch"), (5, "type.mismatch"), (7, "input.unknown_path"), (9, "type.mismatch")]
    by_line = {p.line: p.message for p in check_policy(root)}
    assert "unknown path input.tool.egress[_].hots (did you mean input.tool.egress[_].host?)" in by_line[7]
    assert by_line[9].startswith("input.tool.capabilities[_] is a string")


def test_the_values_of_rules_and_functions_are_typed_where_they_are_used(tmp_path: Path) -> None:
    """A rule's value is the union of its definitions' (a rule without one is true; a literal is
    the one value it takes), a function's the same with its arguments unknown: a comparison that
    can never hold is caught where it is written, in the same package, through ``data.`` and
    through an import, and a value no definition gives is a warning with the values there are."""
    root = first_day(tmp_path)
    (root / "team" / "levels.rego").write_text(
        "package team.levels\n\n"
        'default level := "low"\n\n'
        'level := "high" if input.tool.risk == "critical"\n\n'
        'score(tool) := 3 if tool.risk == "high"\n\n'
        'score(tool) := input.session.call_count if tool.risk == "low"\n\n'
        'prod if input.subject.labels.env == "prod"\n'
    )
    (root / "stockade" / "uses_levels.rego").write_text(
        "package stockade\n\n"
        "import data.team.levels\n\n"
        'loud if data.team.levels.level == "hihg"\n\n'
        'scored if levels.score(input.tool) == "3"\n\n'
        'prodlike if data.team.levels.prod == "true"\n\n'
        'fine if data.team.levels.level == "high"\n\n'
        "counted if levels.score(input.tool) > 2\n\n"
        "local_value := 5\n\n"
        'mixed if local_value == "5"\n'
    )
    problems = [p for p in check_policy(root) if p.file.endswith("uses_levels.rego")]
    found = [(p.line, p.code, p.severity) for p in problems]
    assert found == [
        (5, "type.not_in_enum", "warning"),
        (7, "type.mismatch", "error"),
        (9, "type.mismatch", "error"),
        (17, "type.mismatch", "error"),
    ], [str(p) for p in problems]
    by_line = {p.line: p.message for p in problems}
    assert 'data.team.levels.level is never "hihg": it is one of "low", "high"' in by_line[5]
    assert 'is a number, compared with the string "3"' in by_line[7]
    assert "data.team.levels.prod is a boolean" in by_line[9]
    assert [p for p in check_policy(root) if p.file.endswith("levels.rego") and "uses" not in p.file] == []


def test_a_teams_own_data_is_typed_from_what_its_data_json_holds(tmp_path: Path) -> None:
    """Data with no declared schema (outside data.stockade) is typed from its data.json, through
    computed indexes and iteration too; a key some entries lack is not an error."""
    root = first_day(tmp_path)
    (root / "team" / "quota").mkdir()
    (root / "team" / "quota" / "data.json").write_text(json.dumps({
        "per_agent": {"agent-a": 5, "agent-b": 10},
        "owners": [{"name": "ana", "pager": True}, {"name": "bo"}],
    }))  # fmt: skip
    (root / "stockade" / "quota.rego").write_text(
        "package stockade\n\n"
        'capped if data.team.quota.per_agent[input.subject.agent] == "5"\n\n'
        "named if { some owner in data.team.quota.owners; owner.name == 7 }\n\n"
        "paged if data.team.quota.owners[_].pager == true\n\n"
        "domain_count if count(data.team.mail.internal_domains[0]) > 1\n\n"
        "fine if data.team.quota.per_agent[input.subject.agent] > 4\n"
    )
    problems = [p for p in check_policy(root) if p.file.endswith("quota.rego")]
    assert [(p.line, p.code) for p in problems] == [(3, "type.mismatch"), (5, "type.mismatch")], [
        str(p) for p in problems
    ]
    by_line = {p.line: p.message for p in problems}
    assert 'is a number, compared with the string "5"' in by_line[3]
    assert "is a string, compared with the number 7" in by_line[5]


def test_regals_conventions_are_checked_where_regal_cannot_run(tmp_path: Path) -> None:
    """The Regal rules a team's CI would run, as warnings (so --strict fails on them): a line over
    120 characters, a METADATA attribute OPA does not define, a scope that does not fit what the
    block precedes, and an entrypoint without ``entrypoint: true``. The shipped policy, the
    first-day policies and a scaffolded rule file follow them all."""
    root = first_day(tmp_path)
    new_area(root, "export_guard")
    assert [p for p in check_policy(root) if p.code.startswith(("style.", "metadata."))] == []
    decision = root / "stockade" / "decision.rego"
    decision.write_text(decision.read_text().replace("# entrypoint: true\n", "", 1))
    (root / "stockade" / "style.rego").write_text(
        "# METADATA\n"
        "# title: style\n"
        "# scope: document\n"
        "package stockade\n\n"
        "# METADATA\n"
        "# title: a rule\n"
        "# scope: rule\n"
        "# owner: sec-team\n"
        "# custom:\n"
        "#   owner: sec-team\n"
        "noisy if input.tool.name == " + '"' + "x" * 110 + '"' + "\n\n"
        "# METADATA\n"
        "# title: one of several\n"
        'deny_reasons contains {"code": "style.x", "message": "x"} if input.tool.name == "y"\n'
    )
    found = sorted((Path(p.file).name, p.line, p.code) for p in check_policy(root) if p.severity == "warning"
                   and p.code.startswith(("style.", "metadata.")))  # fmt: skip
    assert found == [
        ("decision.rego", line_of(decision, "default decision :="), "metadata.no_entrypoint"),
        ("style.rego", 3, "metadata.invalid_scope"),
        ("style.rego", 9, "metadata.invalid_attribute"),
        ("style.rego", 12, "style.line_length"),
        ("style.rego", 14, "metadata.ambiguous_scope"),
    ]
    by_code = {p.code: p.message for p in check_policy(root)}
    assert "scope 'document' does not fit the package clause" in by_code["metadata.invalid_scope"]
    assert "put your own under `custom:`" in by_code["metadata.invalid_attribute"]


def test_non_deterministic_builtins_are_warnings(tmp_path: Path) -> None:
    root = first_day(tmp_path)
    (root / "stockade" / "clock.rego").write_text("package stockade\n\nlate if time.now_ns() > 0\n")
    problem = only(check_policy(root), "builtin.nondeterministic")
    assert (problem.line, problem.severity) == (3, "warning")
    assert "input.now" in problem.message


def test_builtins_that_allocate_their_whole_result_from_input_are_warned_of(tmp_path: Path) -> None:
    """``numbers.range(1, input.args.n)`` with n = 10**12 makes regorus abort the whole router
    process on the failed allocation (no panic to catch: no deny, no audit record). A policy
    author is told, unless every argument is a literal."""
    root = first_day(tmp_path)
    (root / "stockade" / "ranges.rego").write_text(
        "package stockade\n\n"
        "many if count(numbers.range(1, input.args.n)) > 100\n\n"
        "fixed := numbers.range(1, 5)\n\n"
        "wide if count(net.cidr_expand(input.args.cidr)) > 10\n"
    )
    found = [p for p in check_policy(root) if p.code == "builtin.unbounded"]
    assert [(p.line, p.severity) for p in found] == [(3, "warning"), (7, "warning")]
    assert "aborts the router" in found[0].message
    assert "input.args.n <= 1000" in found[0].message


def _reasons_policy(tmp_path: Path) -> Path:
    """A small self-contained policy with a reason catalog: two codes emitted, one catalogued with
    another outcome, one missing, one catalogued and never emitted."""
    root = tmp_path / "p"
    (root / "stockade" / "reasons").mkdir(parents=True)
    (root / "stockade" / "rules.rego").write_text(
        "package stockade\n\n"
        'deny_reasons contains {"code": "team.missing", "message": "m"} if input.tool.name == "a"\n\n'
        'deny_reasons contains {"code": "team.held", "message": "m"} if input.tool.name == "b"\n\n'
        'approval_reasons contains {"code": "team.held", "message": "m"} if input.tool.name == "c"\n'
    )
    entry = {"message": "m", "runbook": "r"}
    (root / "stockade" / "reasons" / "data.json").write_text(json.dumps({
        "team.held": {"outcome": "require_approval", **entry},
        "team.unused": {"outcome": "deny", **entry},
        "policy.error": {"outcome": "deny", **entry},
    }, indent=2))  # fmt: skip
    return root


def test_reason_codes_must_be_in_the_catalog_with_their_outcome(tmp_path: Path) -> None:
    root = _reasons_policy(tmp_path)
    problems = check_policy(root)
    rules = str(root / "stockade" / "rules.rego")
    assert [(p.file, p.line, p.code) for p in errors(problems)] == [
        (rules, 3, "reason.uncatalogued"),
        (rules, 5, "reason.outcome_mismatch"),
    ]
    unused = only(problems, "reason.unused")  # policy.error is the router's own: not reported
    catalog = root / "stockade" / "reasons" / "data.json"
    assert (unused.file, unused.line, unused.severity) == (str(catalog), line_of(catalog, "team.unused"), "warning")


def test_a_reason_catalog_that_breaks_its_schema_is_an_error(tmp_path: Path) -> None:
    root = _reasons_policy(tmp_path)
    catalog = root / "stockade" / "reasons" / "data.json"
    catalog.write_text(json.dumps({"team.held": {"outcome": "maybe", "message": "m", "runbook": "r"}}, indent=2))
    problem = only(check_policy(root), "data.invalid")
    assert (problem.file, problem.line) == (str(catalog), line_of(catalog, '"outcome"'))
    assert problem.message.startswith("data.stockade.reasons.team.held.outcome")


def test_parse_errors_name_the_file_and_line_without_a_backtrace(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("RUST_BACKTRACE", "1")
    root = first_day(tmp_path)
    (root / "stockade" / "bad.rego").write_text("package stockade\n\nallow if {\n\tinput.x ==\n}\n")
    problem = only(check_policy(root), "parse")
    assert problem.file == str(root / "stockade" / "bad.rego")
    assert problem.line in (4, 5)
    assert "backtrace" not in problem.message.lower()
    assert "_start" not in problem.message


def test_invalid_json_is_a_problem_with_its_line(tmp_path: Path) -> None:
    root = first_day(tmp_path)
    (root / "team" / "data.json").write_text('{\n  "mail": {,\n}\n')
    [problem] = check_policy(root)
    assert (problem.file, problem.line, problem.code) == (str(root / "team" / "data.json"), 2, "load")


def test_a_problem_prints_as_file_line_col_and_serialises() -> None:
    problem = Problem("p/a.rego", 3, 5, "input.unknown_path", "unknown path input.x")
    assert str(problem) == "p/a.rego:3:5: unknown path input.x"
    assert json.loads(json.dumps(problem.as_json())) == {
        "file": "p/a.rego", "line": 3, "col": 5, "code": "input.unknown_path",
        "message": "unknown path input.x", "severity": "error",
    }  # fmt: skip


def test_the_input_schema_is_generated_from_policy_input_and_the_tools() -> None:
    schema = input_schema(TOOLS)
    assert set(schema["properties"]) == set(PolicyInput.model_fields)
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]["rate"]["properties"]) == set(RATE_WINDOWS)
    assert "$ref" not in json.dumps(schema)
    assert schema["properties"]["tool"]["properties"]["name"]["enum"] == ["deploy", "ledger", "send_email"]
    assert set(args_by_tool(schema)) == {"deploy", "ledger", "send_email"}
    example = {
        "subject": {"agent": "a", "principal": "p"}, "session": {"id": "s"},
        "tool": {"name": "send_email", "capabilities": [], "risk": "low"},
        "args": {"to": ["bob@example.com"]}, "now": "2026-11-23T10:00:00Z",
    }  # fmt: skip
    validator = Draft202012Validator(schema)
    assert list(validator.iter_errors(example)) == []
    assert list(validator.iter_errors({**example, "args": {"too": ["x"]}}))  # send_email's schema applies


@pytest.mark.parametrize(
    ("patch", "valid"),
    [({}, True), ({"agent_per_hour": 100}, True), ({"agent_per_hour": "2"}, False), ({"agent_per_week": 1}, False)],
)
def test_the_data_schema_accepts_the_shipped_data_and_refuses_silent_failures(
    patch: dict[str, Any], valid: bool
) -> None:
    bundle = load_bundle(SHIPPED)
    data = json.loads(json.dumps(bundle.data))
    data["stockade"]["catalog"]["rate_limits"].update(patch)
    schema = data_schema(bundle)
    assert "$ref" not in json.dumps(schema)
    assert Draft202012Validator(schema).is_valid(data) is valid


# A package written in two files, and a rule that reads it through `import data.team`: regorus
# 0.13's interpreter loads "areas.rego" first and then evaluates `team.decision` without the rules
# of "decision.rego" (the RVM sees both), so the engines disagree on it.
_SPLIT_TEAM = {
    "team/areas.rego": 'package team\n\nreasons contains "area" if input.args.x\n',
    "team/decision.rego": (
        'package team\n\ndecision := {"reasons": reasons}\n\nreasons contains "own" if input.args.x\n'
    ),
}
_BY_ALIAS = "package q\n\nimport data.team\n\nout := team.decision\n"
_BY_PATH = "package q\n\nout := data.team.decision\n"


def _split_package(tmp_path: Path, reader: str) -> Path:
    root = tmp_path / "split"
    for name, text in {**_SPLIT_TEAM, "q/q.rego": reader}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_split_package_read_through_an_import_alias_is_warned_about(tmp_path: Path) -> None:
    problem = only(check_policy(_split_package(tmp_path, _BY_ALIAS)), "import.split_package")
    assert (Path(problem.file).name, problem.line, problem.severity) == ("q.rego", 5, "warning")
    assert "written in 2 files" in problem.message
    assert problem.message.endswith("write data.team.decision")
    assert not check_policy(_split_package(tmp_path / "by-path", _BY_PATH))


@pytest.mark.parametrize(("reader", "expected"), [(_BY_ALIAS, "deny"), (_BY_PATH, "allow")])
def test_what_the_warning_warns_of_happens_in_production(tmp_path: Path, reader: str, expected: str) -> None:
    # The production engine decides on the RVM and confirms on the interpreter: through the alias
    # the two disagree, and the call is denied (policy.error); through the full path both agree.
    from policy import EmbeddedEngine, PolicyInput, PolicySettings  # noqa: PLC0415

    root = _split_package(tmp_path, reader)
    (root / "q" / "d.rego").write_text(
        'package q\n\ndecision := {"outcome": "allow", "reasons": [], "obligations": {}} if count(out.reasons) == 2\n'
    )
    engine = EmbeddedEngine(PolicySettings(dir=root, entrypoint="data.q.decision"))
    decision = engine.evaluate(PolicyInput.model_validate({
        "subject": {"agent": "a", "principal": "p"}, "session": {"id": "s"}, "args": {"x": True},
        "tool": {"name": "t", "capabilities": [], "risk": "low", "limits": {}}, "now": "2026-11-27T10:00:00Z",
    }))  # fmt: skip
    assert (decision.outcome.value, decision.reason_codes) == (expected, ["policy.error"] if expected == "deny" else [])


def test_a_regex_pattern_that_does_not_compile_is_an_error_in_the_rule_or_in_data(tmp_path: Path) -> None:
    """regorus leaves regex.replace undefined for a bad pattern, so the rule vanishes: written as a
    literal or in data.json, the pattern fails every call, and the check says where."""
    root = first_day(tmp_path)
    (root / "team" / "data.json").write_text(json.dumps({**json.loads((root / "team" / "data.json").read_text()),
                                                         "strip": "[\"'("}))  # fmt: skip
    rule = root / "stockade" / "normalise.rego"
    rule.write_text(
        "package stockade\n\n"
        'from_literal := regex.replace(input.args.cmd, "[\\"\'](", "")\n\n'
        'from_data := regex.replace(input.args.cmd, data.team.strip, "")\n\n'
        'fine := regex.replace(input.args.cmd, "[\\"\']", "")\n\n'
        'too_big if units.parse_bytes(input.args.size) > units.parse_bytes("100XB")\n'
    )
    found = [(p.file, p.line) for p in check_policy(root) if p.code == "builtin.bad_argument"]
    assert found == [(str(rule), 3), (str(rule), 5), (str(rule), 9)]
    assert all(p.severity == "error" for p in check_policy(root) if p.code == "builtin.bad_argument")
