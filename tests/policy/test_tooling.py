"""Policy tooling on real regorus: coverage, explain, failing tests explained, check."""

from __future__ import annotations

import re
from pathlib import Path

from policy.check import check_policy
from policy.testing import run_rego_tests
from policy.tooling import coverage, explain
from tests.conftest import REPO
from tests.policy.test_embedded import make_input, trifecta_input


def test_coverage_reports_the_lines_tests_did_not_reach(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "rules.rego").write_text(
        "package p\n\nallow if input.a == 1\n\nblock if {\n\tinput.b == 2\n\tinput.c == 3\n}\n"
    )
    (tmp_path / "p" / "rules_test.rego").write_text(
        'package p_test\nimport data.p\ntest_allow if { p.allow with input as {"a": 1} }\n'
    )
    [report] = coverage(tmp_path)
    assert report.file == "p/rules.rego"
    assert report.not_covered  # the block rule's body never ran
    assert 0 < report.percent < 100


def test_the_shipped_policy_is_fully_covered_by_its_tests() -> None:
    assert all(c.percent == 100.0 for c in coverage(REPO / "policies"))


def test_explain_locates_each_reason_in_whichever_rule_area_file_produces_it() -> None:
    why = explain(REPO / "policies", trifecta_input(["untrusted:web:c-1"], ["untrusted_content"]))
    assert why.decision["outcome"] == "deny"
    assert "provenance.untrusted_destination" in {reason["code"] for reason in why.reasons}
    for reason in why.reasons:
        assert reason["defined_at"], reason
        assert all(re.fullmatch(r"stockade/[a-z_]+\.rego:\d+", place) for place in reason["defined_at"])
    assert why.rules["deny_reasons"]  # every rule of the package, not a fixed list
    assert why.why_not_allow
    assert all(entry["failed"] for entry in why.why_not_allow)


def test_explain_an_allowed_call() -> None:
    why = explain(REPO / "policies", make_input())
    assert (why.decision["outcome"], why.reasons, why.why_not_allow) == ("allow", [], [])
    assert why.interpreter["outcome"] == "allow"


def test_a_failing_test_names_its_first_failing_statement_and_the_values(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "rules.rego").write_text('package p\n\nlabel := "x[arg]" if input.a > 1\n')
    (tmp_path / "p" / "rules_test.rego").write_text(
        "package p_test\n\nimport data.p\n\n"
        "test_label if {\n"
        "\tsome n in [1, 2]\n"
        '\tprint("n is", n)\n'
        '\tp.label == "y" with input as {"a": n + 5}\n'
        "}\n"
    )
    [result] = run_rego_tests(tmp_path)
    assert (result.passed, result.error) == (False, None)
    assert result.failure is not None
    assert result.failure.where == "p/rules_test.rego:8"
    assert result.failure.statement == 'p.label == "y" with input as {"a": n + 5}'
    assert result.failure.values == (("p.label", "x[arg]"),)
    assert result.failure.describe()[1] == '  p.label = "x[arg]"'
    assert result.prints == ("p/rules_test.rego:7: n is 1", "p/rules_test.rego:7: n is 2")


def test_check_passes_the_shipped_policy() -> None:
    assert [p for p in check_policy(REPO / "policies") if p.severity == "error"] == []


def test_check_names_builtins_regorus_lacks(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "tokens.rego").write_text("package p\n\nclaims := io.jwt.decode(input.token)\n")
    (tmp_path / "p" / "ok.rego").write_text('package p\n\nfine := upper("x")\n')
    found = [p for p in check_policy(tmp_path) if p.code == "builtin.unsupported"]
    assert [(p.file, p.line) for p in found] == [(str(tmp_path / "p" / "tokens.rego"), 3)]
    assert "io.jwt.decode is not provided by regorus" in found[0].message


def test_check_reports_a_syntax_error(tmp_path: Path) -> None:
    (tmp_path / "bad.rego").write_text("package bad\n\nx := {\n")
    problems = check_policy(tmp_path)
    assert problems
    assert all(p.severity == "error" for p in problems)
    assert problems[0].file == str(tmp_path / "bad.rego")
