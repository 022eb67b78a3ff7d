"""Policy tooling on real regorus: coverage, explain, check."""

from __future__ import annotations

from pathlib import Path

from policy.tooling import check, coverage, explain
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


def test_explain_locates_each_reason_and_shows_the_helpers() -> None:
    why = explain(REPO / "policies", trifecta_input(["untrusted:web:c-1"], ["untrusted_content"]))
    assert why.decision["outcome"] == "deny"
    [reason] = why.reasons
    assert reason["code"] == "provenance.untrusted_destination"
    assert reason["defined_at"][0].startswith("stockade/decision.rego:")
    assert why.helpers["is_consequential"] is True
    assert why.helpers["watched_args"] == ["amount", "to"]


def test_explain_an_allowed_call() -> None:
    why = explain(REPO / "policies", make_input())
    assert (why.decision["outcome"], why.reasons, why.helpers["is_auto_allowed"]) == ("allow", [], True)


def test_check_passes_the_shipped_policy() -> None:
    assert check(REPO / "policies") == []


def test_check_names_builtins_regorus_lacks(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "tokens.rego").write_text("package p\n\nclaims := io.jwt.decode(input.token)\n")
    (tmp_path / "p" / "ok.rego").write_text('package p\n\nfine := upper("x")\n')
    assert check(tmp_path) == ["p/tokens.rego: builtin io.jwt.decode is not provided by regorus"]


def test_check_reports_a_syntax_error(tmp_path: Path) -> None:
    (tmp_path / "bad.rego").write_text("package bad\n\nx := {\n")
    [problem] = check(tmp_path)
    assert "bad.rego" in problem
