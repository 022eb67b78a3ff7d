"""`run_rego_tests` and `stockade policy test` hold every decision a test feeds to what production
accepts: a decision the router would deny as malformed (``policy.error``) fails its test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from policy import EmbeddedEngine, PolicyInput, PolicySettings, run_rego_tests
from tests.conftest import copy_policies

STOCKADE = str(Path(sys.executable).parent / "stockade")

# The reviewer's rule: a label with a space, which `policy.base.SessionLabel` refuses.
LABELS = """package stockade

session_labels contains "customer records" if input.tool.name == "crm_lookup"
"""
LABELS_TEST = """package stockade_test

test_crm_lookup_labels_the_session if {
	tool := object.union(_tool(["reads_private"], "low"), {"name": "crm_lookup"})
	d := data.stockade.decision with input as _input(tool, [])
	d.outcome == "allow"
	d.obligations.session_labels == ["customer records"]
}
"""
CRM_CALL = {
    "subject": {"agent": "a", "principal": "p"}, "session": {"id": "s"}, "args": {}, "now": "2026-11-22T10:00:00Z",
    "tool": {"name": "crm_lookup", "capabilities": ["reads_private"], "risk": "low"},
}  # fmt: skip


def with_labels(tmp_path: Path) -> Path:
    root = copy_policies(tmp_path)
    (root / "stockade" / "labels.rego").write_text(LABELS)
    (root / "stockade" / "labels_test.rego").write_text(LABELS_TEST)
    return root


def test_a_test_feeding_a_decision_production_denies_as_malformed_fails(tmp_path: Path) -> None:
    root = with_labels(tmp_path)
    # What production does with it: every matching call is denied.
    decision = EmbeddedEngine(PolicySettings(dir=root)).evaluate(PolicyInput.model_validate(CRM_CALL))
    assert decision.reason_codes == ["policy.error"]
    results = {r.name: r for r in run_rego_tests(root)}
    failed = results["test_crm_lookup_labels_the_session"]
    assert failed.interpreter_passed is True  # every assertion of the test holds ...
    assert failed.disagreements == ()  # ... and both engines agree ...
    assert failed.passed is False  # ... yet the decision is malformed
    [malformed] = failed.malformed
    assert malformed.startswith("stockade/labels_test.rego:5: the decision is malformed")
    assert "obligations.session_labels.0" in malformed
    assert failed.error is not None
    assert "production denies this call with policy.error" in failed.error
    assert [name for name, r in results.items() if not r.passed] == ["test_crm_lookup_labels_the_session"]


def test_policy_test_exits_1_and_names_the_malformed_path(tmp_path: Path) -> None:
    root = with_labels(tmp_path)
    done = subprocess.run([STOCKADE, "policy", "test", "--dir", str(root)], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL stockade/labels_test.rego::test_crm_lookup_labels_the_session" in done.stdout
    assert "malformed decision at obligations.session_labels.0" in done.stdout
    done = subprocess.run([STOCKADE, "policy", "test", "--dir", str(root), "-r", "crm", "--json"],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    [entry] = json.loads(done.stdout)
    assert entry["passed"] is False
    assert "obligations.session_labels.0" in entry["error"]


def write(root: Path, decision: str, test: str) -> Path:
    (root / "stockade").mkdir(parents=True)
    (root / "stockade" / "decision.rego").write_text(f"package stockade\n\n{decision}\n")
    (root / "stockade" / "decision_test.rego").write_text(
        "package stockade_test\n\ntest_decision if {\n\td := data.stockade.decision with input as {}\n"
        f"\t{test}\n}}\n"
    )
    return root


def test_a_limit_production_refuses_fails_the_test(tmp_path: Path) -> None:
    root = write(tmp_path, 'decision := {"outcome": "allow", "obligations": {"limits": {"cpus": 0}}}',
                 'd.outcome == "allow"')  # fmt: skip
    [result] = run_rego_tests(root)
    assert result.passed is False
    [malformed] = result.malformed
    assert "obligations.limits.cpus" in malformed


def test_a_policy_denying_with_policy_error_itself_is_well_formed(tmp_path: Path) -> None:
    root = write(tmp_path, 'decision := {"outcome": "deny", "reasons": [{"code": "policy.error"}]}',
                 'd.outcome == "deny"')  # fmt: skip
    [result] = run_rego_tests(root)
    assert (result.passed, result.malformed, result.error) == (True, (), None)


def test_a_well_formed_decision_passes(tmp_path: Path) -> None:
    root = write(tmp_path, 'decision := {"outcome": "allow", "obligations": {"session_labels": ["customer_records"]}}',
                 'd.outcome == "allow"')  # fmt: skip
    [result] = run_rego_tests(root)
    assert (result.passed, result.replayed, result.malformed) == (True, 1, ())


def test_every_test_rule_runs_however_it_is_indented_and_whatever_its_file_is_named(tmp_path: Path) -> None:
    """`opa test` runs each ``test_*`` rule of every module: one the runner does not find is a
    failing test reported as success."""
    root = copy_policies(tmp_path)
    (root / "stockade" / "team_test.rego").write_text(
        "package stockade_test\n\n test_an_indented_failing_test if false\n\ntest_ok if true\n"
    )
    (root / "stockade" / "team_tests.rego").write_text("package stockade_test\n\ntest_in_a_tests_file if false\n")
    results = {r.name: r.passed for r in run_rego_tests(root) if r.file.startswith("stockade/team")}
    assert results == {"test_an_indented_failing_test": False, "test_ok": True, "test_in_a_tests_file": False}
    run = subprocess.run([STOCKADE, "policy", "test", "--dir", str(root)], capture_output=True, text=True, check=False)
    assert run.returncode == 1, run.stdout
